"""bench/ holds the benchmarks and tools/ the rest (the GPU check, the preflight, a lent machine's kit): both are
packages run from the checkout (``python -m bench.<name>``, ``python -m tools.gpu.<name>``, pytest with the
checkout on its path), so no file edits ``sys.path``; and every script there is run by something."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# runs a command's main in the test's process and puts back the sys.path it found: that is its job
SETS_UP_A_PROCESS = {"tests/commands.py"}
EDITS_SYS_PATH = re.compile(r"sys\.path\s*(\.insert|\.append|\.extend|\[[^\]]*\]\s*=|\+=|=)")


def _files(*folders: str) -> list:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *folders], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return [f for f in out.stdout.split() if os.path.isfile(os.path.join(ROOT, f))
            and not f.startswith("bench/results/")]


def _text(path: str) -> str:
    return open(os.path.join(ROOT, path), encoding="utf-8").read()


def test_bench_and_tools_are_packages():
    assert all(os.path.isfile(os.path.join(ROOT, d, "__init__.py")) for d in ("bench", "tools", "tools/gpu"))
    assert not os.path.exists(os.path.join(ROOT, "bench", "gpu")), "the GPU check lives in tools/gpu/"


def test_no_file_edits_sys_path():
    hits = [f"{f}:{n}" for f in _files("bench", "tools", "tests") if f.endswith(".py") and f not in SETS_UP_A_PROCESS
            for n, line in enumerate(_text(f).splitlines(), 1) if EDITS_SYS_PATH.search(line.split("#")[0])]
    assert hits == [], "import bench.* / tools.* from the checkout instead (pytest.ini's pythonpath, python -m)"


def test_every_script_is_run_by_a_target_a_test_a_doc_or_another_script():
    """A script (a ``__main__`` block, or a shell script) is named by its path or module somewhere else; a module
    without one is imported by another file."""
    readers = [f for f in _files() if f.endswith((".py", ".sh", ".md", ".yaml", ".ini")) or f == "Makefile"]
    texts = {f: _text(f) for f in readers}
    unused = []
    for path in _files("bench", "tools"):
        name = os.path.basename(path)
        if not path.endswith((".py", ".sh")) or name in ("__init__.py", "conftest.py"):
            continue
        module = path[:-3].replace("/", ".")
        package, _, leaf = module.rpartition(".")
        script = path.endswith(".sh") or 'if __name__ == "__main__":' in texts[path]
        named = (re.compile(rf"{re.escape(path)}|{re.escape(module)}\b") if script else
                 re.compile(rf"\b(from {re.escape(module)} import|import {re.escape(module)}\b|"
                            rf"from {re.escape(package)} import [\w, ]*\b{leaf}\b)"))
        if not any(named.search(text) for f, text in texts.items() if f != path):
            unused.append(path)
    assert unused == [], f"named by no Makefile target, test, doc or script: {unused}"
