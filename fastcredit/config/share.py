"""A key two commands' config trees both hold, declared once: another tree's section takes the field of the same
name from a section of the schema (its type, help and range) and gives it a default of its own.

    @section
    class PRMOptimConfig:
        lr = shared(OptimConfig, 5e-6, why="PiCA's Table 4")     # optim.lr's declaration, another default
        epochs: int = opt(1, "passes over the training trajectories", range=COUNT)

``--help`` shows the section's own default (and ``why``, where it comes from); a key's documentation
and range change in one place, ``fastcredit/config/schema.py``. No torch here.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass

from fastcredit.config.fields import opt

__all__ = ["section", "shared"]


@dataclass(frozen=True)
class _Shared:
    """Stands in a class body for the field of the same name declared in ``source``, until :func:`section`."""
    source: type
    default: typing.Any
    why: str


def shared(source: type, default=MISSING, why: str = "") -> typing.Any:
    """The key of this name declared in section ``source`` (a schema dataclass): its type, help and range, with
    ``default`` (none given: ``source``'s); ``why`` says where that default comes from, shown in ``--help``.
    Only inside a class decorated with :func:`section`."""
    return _Shared(source, default, why)


def _declaration(name: str, spec: _Shared) -> tuple[type, dataclasses.Field]:
    """``(type, field)`` of ``name`` as ``spec.source`` declares it, with ``spec``'s default and note."""
    declared = {f.name: f for f in dataclasses.fields(spec.source)}
    if name not in declared:
        raise TypeError(f"shared: {spec.source.__name__} declares no key {name!r}; valid: {', '.join(declared)}")
    f = declared[name]
    default = spec.default
    if default is MISSING:
        default = f.default if f.default is not MISSING else f.default_factory()
    help_text = f.metadata["help"] + (f" (default: {spec.why})" if spec.why else "")
    return typing.get_type_hints(spec.source)[name], opt(default, help_text, range=f.metadata.get("range"))


def section(cls: type) -> type:
    """``@dataclass`` for a config section that holds :func:`shared` keys: each becomes a field with its
    declaration's type, help and range, in the place the class body gives it."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    annotations = {}
    for name, value in list(vars(cls).items()):
        if isinstance(value, _Shared):
            annotations[name], field = _declaration(name, value)
            setattr(cls, name, field)
        elif name in own:
            annotations[name] = own.pop(name)
    annotations.update(own)  # declared without a default: dataclass places (or refuses) them as it does
    cls.__annotations__ = annotations
    return dataclass(cls)
