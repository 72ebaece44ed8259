"""``fastcredit.config`` imports nothing else of fastcredit: every command reads its config first, and loading one
loads no torch."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "fastcredit", "config")


def _imports(src: str, package: str) -> set:
    """The absolute names a module of ``package`` imports anywhere in its source (function-level imports too;
    ``from a import b`` gives ``a.b``), relative imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _outside(names: set) -> list:
    """The names of ``names`` in fastcredit but not in fastcredit.config."""
    return sorted(n for n in names if n.split(".")[0] == "fastcredit"
                  and n != "fastcredit.config" and not n.startswith("fastcredit.config."))


def _modules() -> dict:
    """``{path: package}`` of every module under fastcredit/config/."""
    out = {}
    for folder, _, files in os.walk(CONFIG):
        package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        out.update((os.path.join(folder, f), package) for f in files if f.endswith(".py"))
    return out


def test_config_modules_import_nothing_else_of_fastcredit():
    modules = _modules()
    assert {os.path.basename(p) for p in modules} >= {"__init__.py", "load.py", "checks.py", "ranges.py"}
    found = {os.path.relpath(p, ROOT): _outside(_imports(open(p, encoding="utf-8").read(), package))
             for p, package in modules.items()}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_import_reader_sees_every_form():
    src = ("import fastcredit.credit.registry\nimport fastcredit\nfrom fastcredit.config import load\n"
           "from . import ranges\nfrom .fields import opt\nfrom ..data import toyworld\n\n"
           "def f():\n    from fastcredit.credit.needs import check_needs\n")
    names = _imports(src, "fastcredit.config")
    assert {"fastcredit.config.load", "fastcredit.config.ranges", "fastcredit.config.fields.opt"} <= names
    assert _outside(names) == ["fastcredit", "fastcredit.credit.needs.check_needs", "fastcredit.credit.registry",
                               "fastcredit.data.toyworld"]


def test_loading_a_config_loads_no_other_fastcredit_module_and_no_torch():
    code = ("import sys\nfrom fastcredit.config import load_config\nfrom fastcredit.config.help import describe\n"
            "load_config('configs/debug.yaml', ['data.toy.num_cities=40'])\ndescribe()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fastcredit'"
            " and m.split('.')[:2] != ['fastcredit', 'config'] and m != 'fastcredit'), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "False"]
