"""Hidden states times the LM head, then log-softmax, gather and entropy, written out plainly.

Legend (shape suffixes): N tokens, H hidden size, V vocabulary.

The ground truth of the fused kernel. It materialises the full ``[N, V]`` logits, so it
is only for tests, for tiny models on the CPU, and as the "unfused" benchmark baseline.
The matmul runs in the inputs' dtype (as a model's LM head does); everything after it
runs in at least float32 (float64 when the inputs are float64).
"""
from __future__ import annotations

import torch


def linear_logprob_naive(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, target_N: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_N, entropy_N)`` of ``softmax(hidden_NH @ weight_VHᵀ / temperature)``.

    ``logp_N[n]`` is the log-probability of ``target_N[n]``; a target outside ``[0, V)``
    (e.g. -100) gives 0 there. ``entropy_N[n] = -Σ_v p log p``. Differentiable in
    ``hidden_NH`` and ``weight_VH``.
    """
    V = weight_VH.shape[0]
    out_dtype = torch.promote_types(hidden_NH.dtype, torch.float32)
    logits_NV = (hidden_NH @ weight_VH.t()).to(out_dtype) / temperature
    logsm_NV = torch.log_softmax(logits_NV, dim=-1)
    valid_N = (target_N >= 0) & (target_N < V)
    picked_N = logsm_NV.gather(1, target_N.long().clamp(0, V - 1)[:, None])[:, 0]
    logp_N = torch.where(valid_N, picked_N, torch.zeros_like(picked_N))
    entropy_N = -(logsm_NV.exp() * logsm_NV).sum(-1)
    return logp_N, entropy_N
