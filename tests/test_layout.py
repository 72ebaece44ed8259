"""The package's layout holds: no import cycles, small files, one home per job, docs the code can cite.

The import graph is read from the source (every ``import`` statement, function-level ones
included), so a cycle hidden behind a lazy import is found too.
"""
import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# package directory -> import name (the kernels are installed as fastcredit.kernels)
PACKAGES = {"fastcredit": "fastcredit", "kernels": "fastcredit.kernels"}


def _modules() -> dict:
    """``{module name: file path}`` of every module of fastcredit and its kernels."""
    out = {}
    for folder, name in PACKAGES.items():
        for root, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(root, f), os.path.join(ROOT, folder))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join([name, *rel])] = os.path.join(root, f)
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> set:
    """The fastcredit modules ``module`` imports, anywhere in its file."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # A package's __init__ that only names its modules lazily is not an edge back into them.
    assert _cycles(GRAPH) == []


def test_the_graph_sees_imports():
    """The reader above is not vacuous: known edges are found, lazy (function-level) ones included."""
    assert "fastcredit.credit.types" in GRAPH["fastcredit.credit.registry"]
    assert "fastcredit.distributed.deepspeed_engine" in GRAPH["fastcredit.distributed.build"]  # imported lazily
    assert "fastcredit.kernels._dispatch" in GRAPH["fastcredit.kernels.linear_logprob.triton"]  # relative import
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_imports_on_its_own():
    """Each module imported first, in a fresh set of fastcredit modules: no order-dependent import."""
    script = (
        "import sys, importlib\n"
        f"mods = {sorted(MODULES)!r}\n"
        "failed = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k == 'fastcredit' or k.startswith('fastcredit.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{m}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ""


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("fastcredit.") or m == "fastcredit"))
def test_files_stay_small(module):
    lines = sum(1 for _ in open(MODULES[module], encoding="utf-8"))
    assert lines <= 500, f"{MODULES[module]} has {lines} lines; split it where its jobs part (files stay under 500)"


def test_models_losses_and_estimators_never_import_torch_distributed():
    pure = [m for m in MODULES if m.startswith(("fastcredit.credit", "fastcredit.kernels", "fastcredit.models"))]
    pure += ["fastcredit.trainer.loss", "fastcredit.trainer.update"]
    for m in pure:
        src = open(MODULES[m], encoding="utf-8").read()
        assert not re.search(r"^\s*(import|from)\s+(torch\.distributed|deepspeed)\b", src, re.M), m


def _room(module: str) -> str:
    """The room a module lives in: ``fastcredit.<folder>`` (a top-level module is a room of its own)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["fastcredit", "kernels"] else ".".join(parts[:2])


def test_rooms_import_one_way():
    """Between the package's rooms (its folders and top-level modules) no circle either: a room that imports
    another is never imported back by it, directly or around a loop (once judges <-> prm)."""
    rooms = {}
    for m, deps in GRAPH.items():
        rooms.setdefault(_room(m), set()).update(_room(d) for d in deps if _room(d) != _room(m))
    assert _cycles(rooms) == []


def _private_names(module: str, path: str) -> list:
    """``file:line name`` of every underscore name ``module`` takes from another fastcredit module."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    aliases, found = {}, []
    for node in ast.walk(tree):  # module objects bound by `import fastcredit.x as y` / `from fastcredit import x`
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" in MODULES})
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            source, names = aliases[node.value.id], [node.attr]
        else:
            continue
        if not (source.startswith("fastcredit") or getattr(node, "level", 0)):
            continue
        found += [f"{os.path.relpath(path, ROOT)}:{node.lineno} {n}" for n in names
                  if n.startswith("_") and not n.startswith("__") and f"{source}.{n}" not in MODULES]
    return found


def test_no_module_takes_another_modules_private_names():
    hits = [h for m, p in MODULES.items() for h in _private_names(m, p)]
    assert hits == []


def test_the_private_name_reader_finds_both_forms(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from fastcredit.trainer.parts import _x, y\nimport fastcredit.runtime.tracking as t\nt._z()\n")
    assert [h.split()[-1] for h in _private_names("m", str(src))] == ["_x", "_z"]


def test_the_old_public_paths_still_import():
    """Names users import in scripts keep their paths across the move into rooms; the trainer package still loads
    no torch until its Trainer is asked for."""
    code = ("import sys, fastcredit.trainer; assert 'torch' not in sys.modules; "
            "from fastcredit.trainer import Trainer, CollapseError; "
            "from fastcredit.config import TrainConfig, load_config; "
            "from fastcredit.credit import compute_advantages, CreditInputs; "
            "from fastcredit.credit.registry import register_estimator, estimator_needs, get_estimator; "
            "assert Trainer.__module__ == 'fastcredit.trainer.loop' and issubclass(CollapseError, RuntimeError)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_top_level_holds_commands_only():
    """Every module at the package's top level runs as ``python -m fastcredit.<name>`` (the build and extension
    helpers aside); the library lives in rooms."""
    top = [m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in ("_build", "_ext", "kernels")]
    not_commands = [m for m in top if os.path.basename(MODULES[m]) != "__init__.py"
                    and 'if __name__ == "__main__":' not in open(MODULES[m], encoding="utf-8").read()]
    assert top and not_commands == []


def test_the_linter_passes():
    """ruff (ruff.toml: pycodestyle with lines under 120 characters, pyflakes) over the package, kernels, bench,
    tools and tests; `make test` runs it first."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: it is in the dev extra (pip install -e '.[cpu,dev]')"
    proc = subprocess.run([ruff, "check", "--no-cache", "."], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]


def _tracked_text_files() -> list:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True, cwd=ROOT)
    return [f for f in out.stdout.split() if os.path.isfile(os.path.join(ROOT, f))  # not one deleted, uncommitted
            and (f.endswith((".py", ".md", ".yaml", ".cu", ".cpp", ".h")) or f == "Makefile")]


def test_nothing_cites_a_file_outside_the_repository():
    """The methods are documented in docs/methods.md; the specs and papers beside the repository are not cited."""
    pattern = re.compile(r"METHODS\.md|DESIGN\.md|ENV-NOTES\.md|STYLE\.md|papers/")
    hits = [f"{f}:{i}" for f in _tracked_text_files() if not f.startswith("docs/") and f != "tests/test_layout.py"
            for i, line in enumerate(open(os.path.join(ROOT, f), encoding="utf-8"), 1) if pattern.search(line)]
    assert hits == []


def test_citations_of_docs_methods_name_existing_sections():
    """``docs/methods.md §N`` resolves: the index lists section N with its page, and that page holds it."""
    index = open(os.path.join(ROOT, "docs", "methods.md"), encoding="utf-8").read()
    listed = dict(re.findall(r"^\| (\d+) \| \[[^]]+\]\((methods/[\w-]+\.md)#", index, re.M))
    assert {str(n) for n in range(12)} <= set(listed)
    for n, page in listed.items():
        assert re.search(rf"^## {n}\. ", open(os.path.join(ROOT, "docs", page), encoding="utf-8").read(), re.M), n
    cited = set()
    for f in _tracked_text_files():
        for m in re.finditer(r"docs/methods\.md (?:§|sections? )(\d+)(?:-(\d+))?", open(os.path.join(ROOT, f)).read()):
            cited.update(str(n) for n in range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    assert cited and cited <= set(listed), cited - set(listed)


def test_no_doc_page_passes_500_lines():
    """The methods were one page of 1,146 lines; a page that grows past 500 is split, with an index."""
    long = [f for f in _tracked_text_files() if f.startswith("docs/") and f.endswith(".md")
            and len(open(os.path.join(ROOT, f), encoding="utf-8").readlines()) > 500]
    assert long == []


README = os.path.join(ROOT, "README.md")
LAYOUT = os.path.join(ROOT, "docs", "layout.md")


def _tree(text: str) -> dict:
    """``{path: description}`` of the tree in docs/layout.md: the ```text block under "## The tree".

    One entry a line: two spaces of indent per level below the folder above, then the name (a folder's
    ends in ``/``), then its description.
    """
    block = text[re.search(r"^## The tree$", text, re.MULTILINE).end():]
    block = block[block.index("```text\n") + len("```text\n"):]
    entries, folders = {}, []
    for n, line in enumerate(block[: block.index("```")].splitlines(), 1):
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0 and indent // 2 <= len(folders), f"tree line {n} is indented under no folder: {line!r}"
        del folders[indent // 2:]
        name, _, description = line.strip().partition(" ")
        entries["".join(folders) + name] = description.strip()
        if name.endswith("/"):
            folders.append(name)
    return entries


def test_the_tree_reader_reads_nesting():
    sample = "## The tree\n\n```text\na/    top\n  b.py  one\n  c/    two\n    d.py\n  e.md  three\nf     four\n```\n"
    assert _tree(sample) == {"a/": "top", "a/b.py": "one", "a/c/": "two", "a/c/d.py": "", "a/e.md": "three",
                             "f": "four"}
    with pytest.raises(AssertionError, match="indented under no folder"):
        _tree("## The tree\n```text\na.py  x\n    b.py  y\n```\n")


def test_the_layout_tree_names_every_module_and_nothing_else():
    """docs/layout.md's tree can neither miss a module of fastcredit/ or kernels/ nor name a file that is not there."""
    tree = _tree(open(LAYOUT, encoding="utf-8").read())
    assert "fastcredit/trainer/memory/gpu.py" in tree and "kernels/turn_surrogate/naive.py" in tree
    missing = sorted(rel for rel in (os.path.relpath(p, ROOT) for p in MODULES.values())
                     if os.path.basename(rel) != "__init__.py" and rel not in tree)
    invented = sorted(path for path in tree if not os.path.exists(os.path.join(ROOT, path)))
    unexplained = sorted(path for path, description in tree.items() if not description)
    assert missing == [], f"modules docs/layout.md's tree does not name: {missing}"
    assert invented == [], f"docs/layout.md's tree names what is not there: {invented}"
    assert unexplained == [], f"tree entries without their line of description: {unexplained}"


def test_the_readme_is_a_front_door():
    """Short (the annotated tree, results and checklists live in docs/), and both commands on its first screen."""
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move the detail into docs/"
    head = "\n".join(lines[:20])
    assert re.search(r"^ {4}make demo\b", head, re.M) and re.search(r"^ {4}make test\b", head, re.M)


def _commands() -> set:
    """Every ``python -m`` command of the package: a module run as ``__main__``, or a package's ``__main__.py``."""
    out = set()
    for module, path in MODULES.items():
        if path.endswith("__main__.py"):
            out.add(module.rsplit(".", 1)[0])
        elif re.search(r"^if __name__ == .__main__.:", open(path, encoding="utf-8").read(), re.M):
            out.add(module)
    return out


def test_the_readme_lists_every_command_and_make_target():
    readme = open(README, encoding="utf-8").read()
    table = readme[readme.index("\n## Commands"):]
    table = table[: table.index("\n## ", 4)]
    named = set(re.findall(r"^\| `python -m (fastcredit[\w.]*)[` ]", table, re.M))
    assert {"fastcredit.train", "fastcredit.compare"} <= _commands()
    assert named == _commands()
    phony = re.search(r"^\.PHONY:(.*)$", open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read(), re.M)
    assert set(phony.group(1).split()) == set(re.findall(r"^\| `make ([\w-]+)`", table, re.M))


def _anchors(path: str) -> set:
    """GitHub's heading anchors of a markdown file (headings inside fenced code ignored; repeats get -1, -2, ...)."""
    out, fenced = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = 0
            while (slug if n == 0 else f"{slug}-{n}") in out:
                n += 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_in_the_readme_and_docs_resolve():
    docs = os.path.join(ROOT, "docs")
    pages = [README] + sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    broken, checked = [], 0
    for page in pages:
        text = re.sub(r"^```.*?^```", "", open(page, encoding="utf-8").read(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            checked += 1
            if not os.path.exists(file) or (anchor and file.endswith(".md") and anchor not in _anchors(file)):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert checked >= 20 and broken == []
