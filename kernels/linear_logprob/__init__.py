"""Fused linear log-prob: ``(hidden_NH @ weight_VHᵀ) / T`` → per-token target log-prob and entropy.

:func:`linear_logprob` dispatches: the Triton kernels for CUDA tensors, the torch reference
elsewhere; ``impl`` or the environment variable ``FASTCREDIT_LOSS_IMPL=auto|triton|torch``
(shared with the turn-surrogate loss) forces either.
"""
from typing import Optional

import torch

from ..turn_surrogate import IMPL_ENV, impl_choice
from .naive import linear_logprob_naive
from .triton import (LinearLogprobFunction, LogprobConfig, default_config, linear_logprob_bwd, linear_logprob_fwd,
                     linear_logprob_triton)


def linear_logprob(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, target_N: torch.Tensor,
                   temperature: float = 1.0, impl: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_N, entropy_N)`` in fp32 of ``softmax(hidden_NH @ weight_VHᵀ / temperature)`` at ``target_N``.

    hidden [N, H], weight [V, H] (an LM head, or a tied embedding: autograd adds the two
    gradients), target [N] int; a target outside ``[0, V)`` gives logp 0. Differentiable
    in hidden and weight. ``impl``: auto | triton | torch (default: ``$FASTCREDIT_LOSS_IMPL``, else auto).
    """
    choice = impl_choice() if impl is None else impl
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown impl {choice!r}; valid: auto, triton, torch")
    if choice == "triton" or (choice == "auto" and hidden_NH.is_cuda):
        return linear_logprob_triton(hidden_NH, weight_VH, target_N, temperature)
    return linear_logprob_naive(hidden_NH, weight_VH, target_N, temperature)


__all__ = ["IMPL_ENV", "LinearLogprobFunction", "LogprobConfig", "default_config", "linear_logprob",
           "linear_logprob_bwd", "linear_logprob_fwd", "linear_logprob_naive", "linear_logprob_triton"]
