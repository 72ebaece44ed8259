"""``grpo``: the Search-R1 GRPO baseline (docs/methods.md §1).

Legend: S turns, B trajectories.
"""
from __future__ import annotations

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.registry import register_estimator
from fastcredit.credit.types import CreditInputs, CreditResult, as_result_tensor
from fastcredit.credit.segments import degenerate_groups, group_advantage


def group_metrics(inputs: CreditInputs) -> dict:
    """Share of trajectories whose group has all rewards equal (they get Â = 0; DAPO drops them)."""
    if inputs.B == 0:
        return {}
    return {"degenerate_group_frac": float(degenerate_groups(inputs.reward_B, inputs.group_id_B).double().mean())}


@register_estimator("grpo")
def compute_grpo_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult:
    """Every action token of trajectory ``i`` gets ``Â_i``; returns ``adv_S = Â[seg_traj_S]`` ([S])."""
    adv_B = group_advantage(inputs.reward_B, inputs.group_id_B, cfg.norm_by_std, cfg.eps)
    return CreditResult(adv_S=as_result_tensor(adv_B[inputs.seg_traj_S]), metrics=group_metrics(inputs))
