"""Every command's line, read once: one argparse parser per command, one Namespace out.

    p = command_parser("python -m fastcredit.prepare", __doc__, config="the run's YAML (values only)")
    p.add_argument("--resume", action="store_true", help="...")   # the command's own flags: plain argparse
    args = p.parse_args(argv)             # argv None: sys.argv[1:]
    cfg = load_config(args.config or DEFAULT, args.overrides)

What every command shares: ``--help`` shows the usage line, the module docstring's prose, the flags and its
examples (indented paragraphs); a bad flag or value exits 2 with the usage and a message naming the word. A command
that takes a config (``config=...``) also reads ``--config X.yaml`` (more than once: overlays applied in order) and
``key=value`` overrides anywhere on the line, and ``--help PREFIX`` lists the config keys under PREFIX (``--help
rollout``, ``--help optim.lr``, ``--help all``). A help request is answered before anything else on the line is
read.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional, Sequence

from fastcredit.config.errors import ConfigError
from fastcredit.config.help import KEYS_POINTER, config_help, doc_parts

HELP_FLAGS = ("-h", "--help")
HELP_WIDTH = 118  # --help's lines, whatever the terminal: the width of the docstrings it shows


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


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring's line breaks kept; a documented flag shows its default when it has one; lines of
    ``HELP_WIDTH``."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: Optional[int] = None):
        super().__init__(prog, indent_increment, max_help_position, width or HELP_WIDTH)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, "", False, [], argparse.SUPPRESS) and action.option_strings and text \
                and "(default" not in text:
            text += " (default: %(default)s)"
        return text


class CommandParser(argparse.ArgumentParser):
    """A command's parser (build it with :func:`command_parser`): argparse's, with help answered first and, for a
    command with a config, ``--config`` and ``key=value`` overrides read anywhere on the line."""

    def __init__(self, prog: str, doc: str, *, usage: Optional[str] = None, config: Optional[str] = None,
                 config_default: Optional[str] = None, keys: Optional[type] = None, help_prefixes: str = ""):
        prose, examples = doc_parts(doc)
        epilog = ["examples:\n" + textwrap.indent(examples, "  ")] if examples else []
        if config is not None:
            epilog.append(KEYS_POINTER)
        super().__init__(prog=prog, usage=usage, description=prose, epilog="\n\n".join(epilog) or None,
                         formatter_class=HelpFormatter, add_help=False, allow_abbrev=False)
        self.takes_config = config is not None
        self.config_default, self.keys = config_default, keys
        if self.takes_config:  # a group of their own, after the command's flags
            group = self.add_argument_group("config")
            group.add_argument("--config", action="append", metavar="X.yaml", help=config)
            group.add_argument("overrides", nargs="*", metavar="key=value",
                               help="config overrides, applied after the YAML (e.g. optim.lr=3e-4)")
            shown = f" ({help_prefixes}, all)" if help_prefixes else ""
            group.add_argument("-h", "--help", nargs="?", metavar="PREFIX",
                               help=f"this help; with PREFIX the config keys under it{shown}")
        else:
            self.add_argument("-h", "--help", action="store_true", help="show this help message and exit")

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None) -> argparse.Namespace:
        """``args`` (default ``sys.argv[1:]``) as one Namespace: help answered first (and the process left), then
        the flags and, for a command with a config, ``args.config`` (the ``--config`` path, a list of them in order
        when given more than once, else ``config_default``, else None) and ``args.overrides``. An unknown flag or a
        word that is not ``key=value`` exits 2 naming it."""
        args = list(sys.argv[1:] if args is None else args)
        asked = help_request(args)
        if asked is not None:
            self.answer_help(asked)
        if not self.takes_config:
            ns, unknown = self.parse_known_args(args, namespace)
            if unknown:
                self.error(f"unknown flag {' '.join(unknown)}" if unknown[0].startswith("-") else
                           f"unexpected word {' '.join(unknown)}")
            del ns.help
            return ns
        ns, unknown = self.parse_known_intermixed_args(args, namespace)
        if unknown:
            self.error(f"unknown flag {' '.join(unknown)}; overrides are written key=value without dashes")
        for word in ns.overrides:
            if "=" not in word or word.startswith("="):
                self.error(f"{word!r} is neither a flag nor a key=value override")
        if ns.config is None and self.config_default is not None:
            ns.config = [self.config_default]
        if ns.config is not None and len(ns.config) == 1:
            ns.config = ns.config[0]
        del ns.help
        return ns

    def answer_help(self, prefix: str) -> None:
        """Print the help asked for and exit 0: the usage for a plain ``--help`` (or any ``--help`` of a command
        without a config), else the config keys under ``prefix``; an unknown prefix names the closest keys and
        exits 2."""
        if not prefix or not self.takes_config:
            self.print_help()
            self.exit(0)
        try:
            text = config_help(prefix, self.keys)
        except ConfigError as exc:
            print(f"--help: {exc}", file=sys.stderr)
            self.exit(2)
        print(text)
        self.exit(0)


def command_parser(prog: str, doc: str, *, usage: Optional[str] = None, config: Optional[str] = None,
                   config_default: Optional[str] = None, keys: Optional[type] = None,
                   help_prefixes: str = "") -> CommandParser:
    """The parser of the command ``prog`` (``python -m fastcredit.eval``). ``doc``: its module docstring (the prose
    and the indented examples of ``--help``); ``usage``: a synopsis in place of argparse's; ``config``: the help of
    ``--config`` for a command that takes a config (None: it takes none); ``config_default``: the path used when no
    ``--config`` is given; ``keys``: the config tree ``--help PREFIX`` lists (default the training config's);
    ``help_prefixes``: example prefixes named in ``--help``'s own help (``rollout, optim.lr``)."""
    return CommandParser(prog, doc, usage=usage, config=config, config_default=config_default, keys=keys,
                         help_prefixes=help_prefixes)
