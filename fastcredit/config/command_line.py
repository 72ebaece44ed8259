"""A command's arguments, read once into one object that the rest of the command reads.

    args = parse_command(argv, {"--resume": None, "--gpus": int})   # None: a switch; a type: a flag with a value
    answer_help(args.help, USAGE)                                    # fastcredit.config.help: exits when asked
    cfg = load_config(args.config or DEFAULT, args.overrides)
    if args.has("--resume"): ...

The words a command reads: ``-h`` / ``--help [PREFIX]`` (help wins over everything else on the line), ``--config
X.yaml`` (more than once: overlays applied in order), the command's own flags, and ``key=value`` overrides. Any
other ``--word`` is an error that names it.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from fastcredit.config.errors import ConfigError

HELP_FLAGS = ("-h", "--help")


@dataclass
class CommandLine:
    """What the command line asked for. ``help``: None when no help was asked, ``""`` for a plain ``--help``, else
    the key prefix (``--help rollout``); the other fields are empty then. ``config``: the ``--config`` path (a list
    when given more than once; None without one); ``overrides``: the ``key=value`` words in order; ``flags``: the
    command's own flags given, ``{flag: value}`` (True for a switch), in the order first given."""

    help: Optional[str] = None
    config: Union[str, list, None] = None
    overrides: list = field(default_factory=list)
    flags: dict = field(default_factory=dict)

    def has(self, flag: str) -> bool:
        """Whether ``flag`` was given."""
        return flag in self.flags


def help_request(argv: Sequence[str]) -> Optional[str]:
    """None when ``argv`` asks for no help; ``""`` for a plain ``-h`` / ``--help``; else the key prefix asked
    for (``--help rollout``, ``--help=rollout``). A word after ``--help`` is a prefix unless it is a flag
    (``-…``) or an override (``key=value``)."""
    args = list(argv)
    for i, a in enumerate(args):
        if a.startswith("--help="):
            return a.split("=", 1)[1]
        if a in HELP_FLAGS:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            return "" if nxt.startswith("-") or "=" in nxt else nxt
    return None


def parse_command(argv: Sequence[str], flags: Optional[dict] = None) -> CommandLine:
    """``argv`` (a command's arguments, ``sys.argv[1:]``) as one :class:`CommandLine`. ``flags``: the command's
    own, ``{flag: None}`` for a switch, ``{flag: type}`` for ``--flag value`` / ``--flag=value`` (the value read
    with ``type``). A help request is answered first: nothing else is read then. A missing or unreadable value,
    a value given to a switch and an unknown ``--flag`` are ConfigErrors that name the word."""
    args = list(argv)
    asked = help_request(args)
    if asked is not None:
        return CommandLine(help=asked)
    flags = flags or {}
    paths: list = []
    got = CommandLine()
    while args:
        a = args.pop(0)
        name, eq, value = a.partition("=")
        if name in flags:
            if flags[name] is None:
                if eq:
                    raise ConfigError(f"{name} takes no value")
                got.flags[name] = True
                continue
            if not eq:
                value = _value(name, args)
            got.flags[name] = _read(name, value, flags[name])
        elif name == "--config":
            paths.append(value if eq else _value(name, args, "a YAML path"))
        elif a.startswith("--"):
            raise ConfigError(f"unknown flag {a!r}; overrides are written key=value without dashes")
        else:
            got.overrides.append(a)
    got.config = paths[0] if len(paths) == 1 else paths or None
    return got


def _value(name: str, args: list, what: str = "a value") -> str:
    """The word after flag ``name`` (taken from ``args``): its value, unless there is none or it is a flag."""
    if not args or args[0].startswith("--"):
        raise ConfigError(f"{name} needs {what}")
    return args.pop(0)


def _read(name: str, value: str, kind: typing.Callable):
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{name}: {value!r} is not a valid value") from None


def parse_cli(argv: Sequence[str]) -> tuple[Union[str, list[str], None], list[str]]:
    """Split ``[--config X.yaml [--config OVERLAY.yaml …]] [key=value …]``: the path (a list when ``--config``
    is given more than once, applied in order by :func:`load_config`) and the overrides, for a command whose
    help was answered already (``fastcredit.config.help.handle_help``); a command with flags of its own reads
    its whole line with :func:`parse_command`."""
    for a in argv:
        if a in HELP_FLAGS or a.startswith("--help="):
            raise ConfigError(f"{a} reached the config parser; "
                              "call fastcredit.config.help.handle_help(argv, ...) first")
    got = parse_command(argv)
    return got.config, got.overrides
