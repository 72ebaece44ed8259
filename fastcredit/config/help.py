"""What ``--help`` shows: a command's prose and examples from its docstring, and the config keys on request.

    python -m fastcredit.train --help                 # usage, flags, examples
    python -m fastcredit.train --help rollout         # the rollout.* keys: type, default, documentation
    python -m fastcredit.train --help optim.lr
    python -m fastcredit.train --help all             # every config key

The parser that reads a command's line and answers its help is ``fastcredit.config.command_line``'s.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import textwrap
import typing
from typing import Literal, Optional

from fastcredit.config.errors import ConfigError

KEYS_POINTER = "config keys: --help <prefix> (e.g. --help rollout, --help optim.lr), --help all for every key"


def _plain(text: str) -> str:
    """RST markup shown plain: ``:class:`x``` and ````x```` become ``x``."""
    return re.sub(r":\w+:`([^`]+)`", r"\1", text).replace("``", "")


def doc_parts(doc: str) -> tuple[str, str]:
    """``(prose, examples)`` of a module docstring: its indented paragraphs are the examples (dedented), the
    rest is the prose (its first paragraph the one-line summary)."""
    prose, examples = [], []
    for para in textwrap.dedent("\n" + (doc or "").strip("\n")).strip().split("\n\n"):
        lines = [ln for ln in para.splitlines() if ln.strip()]
        if lines and all(ln.startswith("    ") for ln in lines):
            examples.append(textwrap.dedent(para).strip("\n"))
        elif lines:
            prose.append(_plain(para.strip()))
    return "\n\n".join(prose), "\n".join(examples)


def _sections(keys: list[str]) -> list[str]:
    return sorted({k.rsplit(".", n)[0] for k in keys for n in range(1, k.count(".") + 1)})


def matching_keys(prefix: str, root: Optional[type] = None) -> list[str]:
    """The config keys under ``prefix``: the key itself and those below it (``rollout`` → ``rollout.*``), else
    those whose name starts with it (``optim.warm`` → ``optim.warmup_ratio``); ``all``: every key. ``root``: the
    config tree (default the training config's). Raises ConfigError naming the closest keys and sections when none
    matches."""
    from fastcredit.config.load import all_keys

    keys = all_keys(root) if root is not None else all_keys()
    if prefix == "all":
        return keys
    found = [k for k in keys if k == prefix or k.startswith(prefix + ".")] or [k for k in keys if k.startswith(prefix)]
    if found:
        return found
    names = keys + _sections(keys)
    close = [n for n in names if any(part.startswith(prefix) for part in n.split("."))]  # 'lr' → 'optim.lr'
    close += [n for n in difflib.get_close_matches(prefix, names, n=5, cutoff=0.5) if n not in close]
    hint = f"; did you mean {', '.join(close[:5])}?" if close else f"; sections: {', '.join(_sections(keys)[:20])}"
    raise ConfigError(f"no config key starts with '{prefix}'{hint} (--help all lists every key)")


def config_help(prefix: str, root: Optional[type] = None) -> str:
    """The listing of the keys of the config tree ``root`` (default the training config's) under ``prefix``
    (:func:`matching_keys`) with type, default and documentation."""
    keys = matching_keys(prefix, root)
    head = "every config key" if prefix == "all" else f"config keys under '{prefix}'"
    return f"{head} (set them in the YAML or as key=value):\n" + describe(root, keys=set(keys)).lstrip("\n")


def describe(cls=None, prefix: str = "", keys: Optional[typing.Collection[str]] = None) -> str:
    """One line per key: name, type, default and documentation (``--help all``); with ``keys`` (dotted), only
    those keys and the headers of the sections that hold them (``--help rollout``)."""
    from fastcredit.config.load import field_types
    from fastcredit.config.schema import TrainConfig

    cls = TrainConfig if cls is None else cls
    lines, defaults = [], cls()
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            inner = describe(tp, f"{prefix}{f.name}.", keys)
            if inner or keys is None:
                lines += [f"\n[{prefix}{f.name}]  {f.metadata.get('help', '')}", inner]
            continue
        if keys is not None and prefix + f.name not in keys:
            continue
        default = getattr(defaults, f.name)
        shown = "inf" if isinstance(default, float) and math.isinf(default) else repr(default)
        lines.append(f"  {prefix}{f.name} = {shown}  ({_type_name(tp)})  {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        # YAML's spelling of a bool (offload_state: auto | true | false)
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Union:
        return "optional " + " | ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    return getattr(tp, "__name__", str(tp))
