"""Config section of the policy and value losses (``loss.*``), read by ``fastcredit.trainer.loss``.

Equations: docs/methods.md §7. No torch import here: the config loader stays light.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from fastcredit.config.fields import NONNEG, POS, opt


@dataclass
class LossConfig:
    clip_low: float = opt(0.2, "ratio lower clip: 1 - clip_low", range="[0, 1)")
    clip_high: float = opt(0.2, "ratio upper clip: 1 + clip_high (DAPO: 0.28)", range=NONNEG)
    dual_clip: Optional[float] = opt(None, "dual-clip constant c for negative advantages (e.g. 3.0); null: off",
                                     range="(1, inf)", note="null: off")
    kl_coef: float = opt(1e-3, "beta of the k3 KL to the reference policy", range=NONNEG)
    kl_clamp: float = opt(10.0, "k3 KL is clamped to [-kl_clamp, kl_clamp]", range=POS)
    entropy_coef: float = opt(0.0, "eta of the entropy bonus -eta * H", range=NONNEG)
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "turn-mean"] = opt(
        "token-mean", "how token losses are averaged over the global batch")
    value_clip: float = opt(0.2, "clip range of the value loss (ppo, pica)", range=POS)
    vf_coef: float = opt(0.5, "value-loss weight", range=NONNEG)
    behaviour_weight_cap: float = opt(
        5.0, "decoupled PPO: bound C of the importance weight pi_prox / pi_behav on tokens of turns an older policy "
             "generated (fastcredit.trainer.offpolicy)", range="(1, inf)")
    behaviour_weight_mode: Literal["truncate", "mask"] = opt(
        "truncate", "how C bounds it: truncate min(w, C); mask drops tokens with w > C (AReaL's behav_imp_weight_cap)")
    old_logprobs: Literal["auto", "recompute", "rollout"] = opt(
        "auto", "where pi_old's log-probs come from: recompute runs the policy over the batch (veRL's "
                "compute_log_prob); rollout takes the ones the engine sampled with (same weights, the same tokens); "
                "auto: rollout's on the HF engine computing in float32 (a CPU, or model.dtype=float32) for a batch "
                "whose turns the current policy generated (none refined by ProCeed), else recompute (vLLM's and "
                "half precision's numerics differ from training's)")
    impl: Literal["auto", "triton", "torch"] = opt(
        "auto", "fused ops (turn-surrogate loss, linear log-prob): Triton kernels on CUDA tensors, torch elsewhere; "
                "$FASTCREDIT_LOSS_IMPL overrides")
