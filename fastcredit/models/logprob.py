"""The LM head's log-prob of the sampled tokens: ``linear_logprob`` picks the fused Triton kernel
(``fastcredit.kernels.linear_logprob``, never writing the ``[N, V]`` logits) or its torch reference."""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit.kernels._dispatch import pick_kernel, resolve

LOGPROB_MODULE, LOGPROB_FN = "fastcredit.kernels.linear_logprob", "linear_logprob_triton"


def linear_logprob(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, target_N: torch.Tensor,
                   temperature: float = 1.0, impl: Optional[str] = None,
                   configured: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_N, entropy_N)`` in fp32 of ``softmax(hidden_NH @ weight_VHᵀ / temperature)`` at ``target_N``.

    hidden [N, H], weight [V, H] (an LM head, or a tied embedding: autograd adds the two
    gradients), target [N] int; a target outside ``[0, V)`` gives logp 0. Differentiable
    in hidden and weight. The fused kernel never writes the ``[N, V]`` logits; the torch
    reference (``linear_logprob_naive``) does. ``impl`` / ``configured`` (``loss.impl``):
    as for ``fastcredit.trainer.loss.policy_loss``.
    """
    from fastcredit.kernels.linear_logprob.naive import linear_logprob_naive

    kernel = pick_kernel(resolve(impl, configured), hidden_NH, LOGPROB_MODULE, LOGPROB_FN)
    fn = linear_logprob_naive if kernel is None else kernel
    return fn(hidden_NH, weight_VH, target_N, temperature)
