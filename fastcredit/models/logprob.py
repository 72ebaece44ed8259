"""The LM head's log-prob of the sampled tokens: ``linear_logprob`` picks the fused Triton kernel
(``fastcredit.kernels.linear_logprob``, never writing the ``[N, V]`` logits) or its torch reference."""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit.kernels._dispatch import pick_kernel, resolve

LOGPROB_MODULE, LOGPROB_FN = "fastcredit.kernels.linear_logprob", "linear_logprob_triton"
# Rows per block of the torch reference on a CPU: a block's [rows, V] logits stay in the cache instead of streaming
# the whole [N, V] through memory three times (22k rows x V 6,000, hidden 128 on 2 cores: forward + backward 2.3 s
# whole, 0.93 s in blocks of 1,024). Each row's values are its own; the LM head's gradient adds the blocks' up.
CPU_BLOCK_ROWS = 1024


def linear_logprob(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, target_N: torch.Tensor,
                   temperature: float = 1.0, impl: Optional[str] = None,
                   configured: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_N, entropy_N)`` in fp32 of ``softmax(hidden_NH @ weight_VHᵀ / temperature)`` at ``target_N``.

    hidden [N, H], weight [V, H] (an LM head, or a tied embedding: autograd adds the two
    gradients), target [N] int; a target outside ``[0, V)`` gives logp 0. Differentiable
    in hidden and weight. The fused kernel never writes the ``[N, V]`` logits; the torch
    reference (``linear_logprob_naive``) does, on a CPU ``CPU_BLOCK_ROWS`` rows at a time. ``impl`` /
    ``configured`` (``loss.impl``): as for ``fastcredit.trainer.loss.policy_loss``.
    """
    from fastcredit.kernels.linear_logprob.naive import linear_logprob_naive

    kernel = pick_kernel(resolve(impl, configured), hidden_NH, LOGPROB_MODULE, LOGPROB_FN)
    if kernel is not None:
        return kernel(hidden_NH, weight_VH, target_N, temperature)
    N = hidden_NH.shape[0]
    if hidden_NH.device.type != "cpu" or N <= CPU_BLOCK_ROWS:  # on a GPU the reference is the unfused baseline
        return linear_logprob_naive(hidden_NH, weight_VH, target_N, temperature)
    blocks = [linear_logprob_naive(hidden_NH[i:i + CPU_BLOCK_ROWS], weight_VH, target_N[i:i + CPU_BLOCK_ROWS],
                                   temperature) for i in range(0, N, CPU_BLOCK_ROWS)]
    return torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks])
