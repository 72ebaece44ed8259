"""The allowed values of every number of a config tree, declared beside its field and checked when it loads.

    grad_clip: float = opt(1.0, "max global gradient norm", range="(0, inf]", note="inf: no clipping")
    top_k: int = opt(-1, "top-k sampling (-1: off)", range=COUNT, also=(-1,), note="-1: off")
    check_ranges(cfg, origins)   # "x.yaml line 4: optim.grad_clip must lie in (0, inf] (inf: no clipping), got -1.0"

Ranges use the usual interval notation; a closed end at inf (``"(0, inf]"``) is the one way
to allow inf, so NaN and inf are refused everywhere else. ``also`` lists values outside the
interval that mean something (``rollout.top_k=-1``: off); ``note`` says what they, or an
allowed inf, mean. Every int / float field declares a range (``fastcredit.config.fields.opt``):
``tests/config/test_config_hardening.py`` fails for a new field without one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

from fastcredit.config.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Allowed values of one key: an interval such as ``"[0, 1)"`` plus the special values in ``also``."""
    spec: str
    note: str = ""  # what the special values (or an allowed inf) mean, shown in the error
    also: tuple = ()

    def __post_init__(self) -> None:
        _parse(self.spec)  # a malformed spec fails where the field is declared

    @property
    def bounds(self) -> tuple[bool, float, float, bool]:
        """``(low end closed, low, high, high end closed)`` of the interval."""
        return _parse(self.spec)

    def __contains__(self, x) -> bool:
        if x in self.also:
            return True
        lo_closed, lo, hi, hi_closed = self.bounds
        if math.isnan(x):
            return False
        return (x > lo or (lo_closed and x == lo)) and (x < hi or (hi_closed and x == hi))

    def describe(self) -> str:
        return f"must lie in {self.spec}" + (f" ({self.note})" if self.note else "")


@functools.lru_cache(maxsize=None)
def _parse(spec: str) -> tuple[bool, float, float, bool]:
    ends = spec[1:-1].split(",")
    if spec[:1] not in "[(" or spec[-1:] not in "])" or len(ends) != 2:
        raise ValueError(f"range {spec!r} is not an interval such as '[0, 1)'")
    lo, hi = (float(s) for s in ends)
    return spec[0] == "[", lo, hi, spec[-1] == "]"


# The intervals most numbers share; a field may spell any other.
POS, NONNEG, COUNT, UNIT = "(0, inf)", "[0, inf)", "[1, inf)", "[0, 1]"
SEED = Range("[0, 4294967296)", "numpy seeds are 32-bit")
_INT64 = 2 ** 63  # ints end up in tensors and numpy arrays


def _number_type(tp) -> Optional[type]:
    """int or float for a number field (Optional ones and lists of numbers too: each element in the range)."""
    if typing.get_origin(tp) is typing.Union:  # Optional[float]
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return tp if tp in (int, float) else None


def _walk(cls, prefix: str = ""):
    """``(dotted key, field, type)`` of every leaf field of the config tree ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _walk(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, hints[f.name]


@functools.lru_cache(maxsize=None)
def numeric_keys(cls) -> Mapping[str, type]:
    """``{dotted key: int or float}`` of every number in the config tree (Optional ones and lists of numbers too)."""
    return MappingProxyType({key: tp for key, _, hint in _walk(cls) if (tp := _number_type(hint)) is not None})


@functools.lru_cache(maxsize=None)
def field_ranges(cls) -> Mapping[str, Range]:
    """``{dotted key: Range}`` of every field of the config tree that declares one."""
    return MappingProxyType({key: f.metadata["range"] for key, f, _ in _walk(cls) if "range" in f.metadata})


def key_value(cfg, key: str):
    """The value at dotted ``key`` of a config tree (``key_value(cfg, "optim.lr")``)."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg, origins: Optional[Mapping[str, str]] = None, label: str = "") -> None:
    """Every number of the config tree ``cfg`` lies in its field's range; the error names the key and where it was
    set (``origins``: dotted key → file and line, or the command line), else ``label`` (``"toy world"``)."""
    origins = origins or {}
    for key, rng in field_ranges(type(cfg)).items():
        value = key_value(cfg, key)
        if value is None:
            continue
        where = f"{origins[key]}: " if key in origins else f"{label}: " if label else ""
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ConfigError(f"{where}{key} must hold numbers, got {value!r}")
            if isinstance(x, int) and not -_INT64 <= x < _INT64:
                raise ConfigError(f"{where}{key}={x} does not fit in 64 bits; {key} {rng.describe()}")
            if x not in rng:
                raise ConfigError(f"{where}{key} {rng.describe()}, got {value!r}")
