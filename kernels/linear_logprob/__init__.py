"""Fused linear log-prob: ``(hidden_NH @ weight_VHᵀ) / T`` → per-token target log-prob and entropy.

``linear_logprob_triton`` always runs the Triton kernels and ``linear_logprob_naive`` is the
torch reference; ``fastcredit.models.logprob.linear_logprob`` chooses between the two
(``fastcredit.kernels._dispatch``).
"""
from .naive import linear_logprob_naive
from .triton import (BWD_VARIANTS, VARIANTS, LinearLogprobFunction, LogprobConfig, default_config, linear_logprob_bwd,
                     linear_logprob_fwd, linear_logprob_triton, variant_config)

__all__ = ["BWD_VARIANTS", "VARIANTS", "LinearLogprobFunction", "LogprobConfig", "default_config",
           "linear_logprob_bwd", "linear_logprob_fwd", "linear_logprob_naive", "linear_logprob_triton",
           "variant_config"]
