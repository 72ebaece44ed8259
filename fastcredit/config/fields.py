"""One documented dataclass field for every config section (``--help`` and error messages show the help).

    lr: float = opt(1e-6, "policy learning rate")

No torch here: the config loader stays light.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field


def opt(default, help: str, **kw):
    """A field with ``help`` in its metadata; a dataclass type, list or dict default becomes a fresh copy per instance."""
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return field(default_factory=default, metadata={"help": help}, **kw)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)
