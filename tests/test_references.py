"""What the package names exists, and what it defines is used: every lazy export imports, every ``Class.attr`` and
``fastcredit.x.y`` a docstring or a doc cites is there, no public function or class is left unused, and only the
command-line parser reads ``sys.argv``.

Read from the source (as tests/test_layout.py reads imports), so a name that moved or went is found without running
the code that cites it.
"""
import ast
import collections
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where the package's code lives, and where else its names are used (the build, benchmarks, tools)
PACKAGE = ("fastcredit", "kernels")
USERS = (*PACKAGE, "bench", "tools")
# public names the package defines that only the tests use, each with why it stays
TESTED_ONLY = {
    "to_turns": "the inverse of from_turns: what the trajectory tests and a debugging session read a batch back with",
    "behaviour_weights": "the decoupled correction's weights as one formula, the spec behaviour_correction is "
                         "tested against",
    "load_split": "the Search-R1 / FlashRAG / toy loader by data.source, tested for its refusals",
    "fact_recall": "the share of a toy question's gold facts retrieved, the toy world's tests' measure",
}


def _files(folders, ext=".py") -> dict:
    out = {}
    for folder in folders:
        for where, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(ext):
                    path = os.path.join(where, f)
                    out[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    return out


CODE = _files(PACKAGE)


def _lazy_packages() -> list:
    """Packages whose ``__init__`` exports names lazily (a module-level ``__getattr__`` and an ``__all__``)."""
    found = []
    for path, text in CODE.items():
        if path.endswith("__init__.py") and path.startswith("fastcredit"):
            tree = ast.parse(text)
            if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
                found.append(os.path.dirname(path).replace(os.sep, "."))
    return sorted(found)


@pytest.mark.parametrize("package", _lazy_packages())
def test_every_lazy_export_imports(package):
    """Each name in a lazy package's ``__all__`` loads (``fastcredit.credit.CreditConfig`` once named a module that
    had moved), and ``__all__`` names every export."""
    mod = importlib.import_module(package)
    assert mod.__all__, package
    missing = [name for name in mod.__all__ if getattr(mod, name, None) is None]
    assert missing == []


def _class_attributes() -> dict:
    """``{class name: names it defines}`` over the package: methods, class attributes, fields, ``self.x`` set."""
    classes = collections.defaultdict(set)
    for text in CODE.values():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            names = classes[node.name]
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                    names.add(item.id)
                elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and \
                        item.value.id in ("self", "cls"):
                    names.add(item.attr)
    return classes


def test_every_class_attribute_a_docstring_cites_exists():
    """``Trainer._build_models`` was cited by two docstrings long after the method had gone."""
    classes = _class_attributes()
    stale = [f"{path}: {m.group(0)}" for path, text in CODE.items()
             for m in re.finditer(r"[`~]([A-Z]\w*)\.(_?[a-z]\w*)", text)
             if m.group(1) in classes and m.group(2) not in classes[m.group(1)]]
    assert stale == []


def _top_names(path: str) -> set:
    names = set()
    for node in ast.parse(CODE[path]).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Dict) or isinstance(node, ast.Expr):
            continue
    init = CODE[path]
    lazy = re.search(r"^_(?:EXPORTS|MOVED) = \{(.*?)^\}", init, re.S | re.M)
    if lazy:
        names.update(re.findall(r'"(\w+)":', lazy.group(1)))
    return names


def _module_file(parts: list):
    """The file of the longest module prefix of ``parts`` (``fastcredit.a.b.name``) and how many parts it takes."""
    for i in range(len(parts), 0, -1):
        base = os.path.join(*parts[:i])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if path in CODE:
                return path, i
    return None, 0


def test_every_dotted_path_the_code_and_docs_cite_exists():
    """``fastcredit.rollout.padded`` and the like: a dotted path in a docstring, a comment or a doc names a module
    that is there, and its next part a name that module defines."""
    texts = {**CODE, **_files(("docs", "bench", "tools"), ".md"), **_files(("bench", "tools"))}
    texts["README.md"] = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    stale = []
    for path, text in texts.items():
        for m in re.finditer(r"(?<![\w/.])fastcredit((?:\.\w+)+)", text):
            parts = ["fastcredit", *m.group(1)[1:].split(".")]
            if parts[1] in ("kernels", "_C"):  # installed under another folder name, or built
                continue
            path_, used = _module_file(parts)
            rest = parts[used:]
            if path_ is None:
                stale.append(f"{path}: {m.group(0)}")
            elif rest and rest[0] not in ("py", "md") and rest[0] not in _top_names(path_):
                stale.append(f"{path}: {m.group(0)}")
    assert stale == []


def test_no_public_function_or_class_is_left_unused():
    """A public function or class of the package is used somewhere outside its own definition (the package, the
    build, a benchmark, a tool), or registered by a decorator; ``rollout/padded.py``, ``tag_token_ids``,
    ``broadcast_module`` and ``log_gains`` were kept for nothing. The few only tests use are named, with why."""
    texts = {**_files(USERS), "setup.py": open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()}
    words = collections.Counter(w for text in texts.values() for w in re.findall(r"[A-Za-z_]\w*", text))
    unused = sorted(f"{path}: {node.name}" for path, text in CODE.items() for node in ast.parse(text).body
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and not node.name.startswith("_") and not node.decorator_list and words[node.name] <= 1
                    and node.name not in TESTED_ONLY)
    assert unused == []
    assert all(words[name] == 1 for name in TESTED_ONLY), "used now: take it off TESTED_ONLY"


def test_only_the_command_line_parser_reads_sys_argv():
    """Every command hands its ``argv`` (None: the process's) to its parser, once; no other module reads the line."""
    readers = sorted(path for path, text in CODE.items() if re.search(r"\bsys\.argv\b", text))
    assert readers == [os.path.join("fastcredit", "config", "command_line.py")]
