"""The implementation choice of every fused op: torch reference or Triton kernel.

    choice = resolve(impl, configured=cfg.loss.impl)            # explicit > $FASTCREDIT_LOSS_IMPL > config
    kernel = pick_kernel(choice, x, "fastcredit.kernels.turn_surrogate", "turn_surrogate_loss")
    out = reference(...) if kernel is None else kernel(...)

``auto`` runs a kernel for CUDA tensors when its module imports, the torch reference
elsewhere; ``triton`` insists on the kernel (on CPU tensors too: the interpreter runs it
when ``TRITON_INTERPRET=1``); ``torch`` never runs it. The kernels' host code asks
:func:`interpreted` to pick configurations the interpreter can afford. Every op is
dispatched the same way from ``fastcredit.trainer.loss`` (docs/extending.md, "Add a kernel").
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Optional

IMPL_ENV = "FASTCREDIT_LOSS_IMPL"
IMPLS = ("auto", "triton", "torch")


def interpreted() -> bool:
    """Whether Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(impl: Optional[str] = None, configured: str = "auto", key: str = "loss.impl") -> str:
    """``auto``, ``triton`` or ``torch``: ``impl`` if given, else ``$FASTCREDIT_LOSS_IMPL`` if set, else
    ``configured`` (the config key ``key``). An unknown value names where it came from."""
    env = os.environ.get(IMPL_ENV)
    value, origin = (impl, "impl") if impl else (env, IMPL_ENV) if env else (configured, key)
    if value not in IMPLS:
        raise ValueError(f"unknown {origin} {value!r}; valid: {', '.join(IMPLS)}")
    return value


def pick_kernel(choice: str, x, module: str, name: str) -> Optional[Callable]:
    """The kernel function ``module.name`` when ``choice`` runs it on tensor ``x``, else None (the torch reference).

    ``auto`` falls back to None when the kernel module cannot be imported (no Triton);
    ``triton`` raises a RuntimeError naming it.
    """
    if choice == "torch" or (choice == "auto" and not x.is_cuda):
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        if choice == "triton":
            raise RuntimeError(f"{IMPL_ENV} / loss.impl = triton but {module}.{name} is unavailable: {exc}") from exc
        return None
