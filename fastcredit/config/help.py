"""Command-line help shared by every ``python -m fastcredit.<command>``: a usage section per command, and the
config keys on request.

    python -m fastcredit.train --help                 # usage, flags, examples
    python -m fastcredit.train --help rollout         # the rollout.* keys: type, default, documentation
    python -m fastcredit.train --help optim.lr
    python -m fastcredit.train --help all             # every config key

A command with config keys reads its line once (``fastcredit.config.command_line.parse_command``) and passes the
help it asked for to :func:`answer_help` (or calls :func:`handle_help` on its arguments first thing in its
``main``), with a usage section built by :func:`format_usage` from its module docstring; an argparse command builds
its parser with :func:`argparser`.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import sys
import textwrap
import typing
from typing import Literal, Optional, Sequence

from fastcredit.config import ConfigError
from fastcredit.config.command_line import help_request

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


def format_usage(synopsis: str, doc: str, flags: str = "") -> str:
    """A command's usage section: ``usage: <synopsis>``, what it does (``doc``'s prose), ``flags`` (preformatted
    ``--flag  meaning`` lines) and examples (``doc``'s indented lines). ``doc`` is the module's docstring."""
    prose, examples = doc_parts(doc)
    parts = [f"usage: {synopsis}", prose]
    if flags.strip():
        parts.append("flags:\n" + textwrap.indent(textwrap.dedent(flags).strip("\n"), "  "))
    if examples:
        parts.append("examples:\n" + textwrap.indent(examples, "  "))
    return "\n\n".join(p for p in parts if p)


def argparser(prog: str, doc: str, **kw) -> argparse.ArgumentParser:
    """An ArgumentParser whose ``--help`` shows the usage line, ``doc``'s prose and its examples (``doc``: the
    module docstring, as for :func:`format_usage`)."""
    prose, examples = doc_parts(doc)
    return argparse.ArgumentParser(prog=prog, description=prose, epilog="examples:\n" + textwrap.indent(examples, "  ")
                                   if examples else None, formatter_class=_Formatter, **kw)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The docstring's line breaks kept; a documented option shows its default when it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, "", False, argparse.SUPPRESS) and action.option_strings and text:
            text += " (default: %(default)s)"
        return text


def take_flags(argv: Sequence[str], names: dict) -> tuple[dict, list]:
    """Take a command's own flags out of ``argv``: ``({flag: value}, the rest)``. ``names``: ``{flag: type}``
    for ``--flag value`` / ``--flag=value`` (the value read with ``type``), ``{flag: None}`` for a switch (True).
    A missing or unreadable value is a ConfigError naming the flag."""
    opts, rest, args = {}, [], list(argv)
    while args:
        a = args.pop(0)
        name, eq, value = a.partition("=")
        if name in names and names[name] is None:
            opts[name] = True
        elif name in names:
            if not eq:
                if not args or args[0].startswith("--"):
                    raise ConfigError(f"{name} needs a value")
                value = args.pop(0)
            try:
                opts[name] = names[name](value)
            except ValueError:
                raise ConfigError(f"{name}: {value!r} is not a valid value") from None
        else:
            rest.append(a)
    return opts, rest


def _sections(keys: list[str]) -> list[str]:
    return sorted({k.rsplit(".", n)[0] for k in keys for n in range(1, k.count(".") + 1)})


def matching_keys(prefix: str) -> list[str]:
    """The config keys under ``prefix``: the key itself and those below it (``rollout`` → ``rollout.*``), else
    those whose name starts with it (``optim.warm`` → ``optim.warmup_ratio``); ``all``: every key. Raises
    ConfigError naming the closest keys and sections when none matches."""
    from fastcredit.config import all_keys

    keys = all_keys()
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


def config_help(prefix: str) -> str:
    """The listing of the keys under ``prefix`` (:func:`matching_keys`) with type, default and documentation."""
    keys = matching_keys(prefix)
    head = "every config key" if prefix == "all" else f"config keys under '{prefix}'"
    return f"{head} (set them in the YAML or as key=value):\n" + describe(keys=set(keys)).lstrip("\n")


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


def handle_help(argv: Sequence[str], usage: str, config_keys: bool = True) -> None:
    """Print help and exit 0 when ``argv`` asks for it (:func:`help_request`); return (printing nothing)
    otherwise. A command that reads its line with :func:`~fastcredit.config.command_line.parse_command` passes
    what it found to :func:`answer_help` instead."""
    answer_help(help_request(argv), usage, config_keys)


def answer_help(prefix: Optional[str], usage: str, config_keys: bool = True) -> None:
    """Print the help asked for and exit 0; return (printing nothing) when ``prefix`` is None (none asked).

    ``prefix``: ``""`` for a plain ``--help``, else the key prefix after it (``CommandLine.help``). ``usage``: the
    command's usage section, e.g. ``format_usage("python -m fastcredit.eval [--config X.yaml] [key=value ...]",
    __doc__, FLAGS)``. ``config_keys``: the command takes config overrides, so ``--help`` ends with a pointer to the
    key listing, ``--help PREFIX`` prints only the keys under PREFIX (``rollout``, ``rollout.proceed``,
    ``optim.lr``) and ``--help all`` every key; an unknown PREFIX prints an error naming the closest keys and exits
    2. Without config keys a word after ``--help`` is ignored and the usage is printed.
    """
    if prefix is None:
        return
    if not prefix or not config_keys:
        print(usage + (f"\n\n{KEYS_POINTER}" if config_keys else ""))
        raise SystemExit(0)
    try:
        text = config_help(prefix)
    except ConfigError as exc:
        print(f"--help: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(text)
    raise SystemExit(0)
