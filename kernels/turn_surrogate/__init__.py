"""Fused turn-level clipped surrogate loss (``turn_surrogate_loss``) and its float64 ground truth.

``turn_surrogate_loss`` has the signature and outputs of ``fastcredit.trainer.loss.policy_loss_torch``
and always runs the Triton kernels; ``fastcredit.trainer.loss.policy_loss`` chooses between the two
(``fastcredit.kernels._dispatch``).
"""
from .launch import VARIANTS, SurrogateLaunch
from .naive import AGG_MODES, turn_surrogate_naive
from .triton import (TurnSurrogateFunction, segment_counts, turn_counts, turn_surrogate_bwd, turn_surrogate_fwd,
                     turn_surrogate_loss)

__all__ = ["AGG_MODES", "VARIANTS", "SurrogateLaunch", "TurnSurrogateFunction", "segment_counts", "turn_counts",
           "turn_surrogate_bwd", "turn_surrogate_fwd", "turn_surrogate_loss", "turn_surrogate_naive"]
