"""One documented dataclass field for every config section; a number's allowed values are declared with it.

    lr: float = opt(1e-6, "policy learning rate", range=POS)
    top_k: int = opt(-1, "top-k sampling (-1: off)", range=COUNT, also=(-1,), note="-1: off")
    seed: int = opt(0, "global seed", range=SEED)

``--help`` and error messages show the help; ``fastcredit.config.ranges.check_ranges`` checks
the range. No torch here: the config loader stays light.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional, Union

from fastcredit.config.ranges import COUNT, NONNEG, POS, SEED, UNIT, Range

__all__ = ["COUNT", "NONNEG", "POS", "SEED", "UNIT", "Range", "opt"]


def opt(default, help: str, *, range: Optional[Union[str, Range]] = None, note: str = "", also: tuple = (), **kw):
    """A field with ``help`` in its metadata and, for a number, its ``range``: an interval (``"[0, 1)"``, ``POS``
    …) with the values ``also`` allowed outside it and a ``note`` on what they mean, or a whole :class:`Range`
    (``SEED``). A dataclass type, list or dict default becomes a fresh copy per instance."""
    metadata = {"help": help}
    if isinstance(range, Range) and (note or also):
        raise TypeError("opt: give note and also in the Range, or range as an interval text")
    if range is not None:
        metadata["range"] = range if isinstance(range, Range) else Range(range, note, tuple(also))
    elif note or also:
        raise TypeError("opt: note and also describe a range; give range too")
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return field(default_factory=default, metadata=metadata, **kw)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)
