"""Fused turn-level clipped surrogate loss (``turn_surrogate_loss``) and its torch reference.

``turn_surrogate_loss`` has the signature and outputs of ``fastcredit.loss.policy_loss_torch``
and always runs the Triton kernels; ``fastcredit.loss`` chooses between the two. The
environment variable named by ``IMPL_ENV`` (``FASTCREDIT_LOSS_IMPL=auto|triton|torch``)
forces a choice for the fused ops of this package; :func:`impl_choice` reads it.
"""
import os
from typing import Optional

from .naive import AGG_MODES, turn_surrogate_naive
from .triton import (TurnSurrogateFunction, segment_counts, turn_counts, turn_surrogate_bwd, turn_surrogate_fwd,
                     turn_surrogate_loss)

IMPL_ENV = "FASTCREDIT_LOSS_IMPL"
IMPLS = ("auto", "triton", "torch")


def impl_choice(default: str = "auto") -> str:
    """``auto``, ``triton`` or ``torch``: the environment variable ``IMPL_ENV`` if set, else ``default``."""
    value: Optional[str] = os.environ.get(IMPL_ENV) or default
    if value not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={value!r} is not one of {', '.join(IMPLS)}")
    return value


__all__ = ["AGG_MODES", "IMPL_ENV", "IMPLS", "TurnSurrogateFunction", "impl_choice", "segment_counts", "turn_counts",
           "turn_surrogate_bwd", "turn_surrogate_fwd", "turn_surrogate_loss", "turn_surrogate_naive"]
