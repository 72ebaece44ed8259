"""``criticsearch``: retrospective frozen critic, turn credit mixed with GRPO (docs/methods.md §3).

Legend: S turns, B trajectories.

    r^a_{i,t} ∈ {0, 1}                                   critic label of search turn t (Eq. 6)
    A^a_{i,t} = r^a_{i,t} / (Σ_u r^a_{i,u} + εc)          (Eq. 7)
    Ã_{i,t}  = α·A^a_{i,t} + (1 − α)·Â_i                  (Eq. 8)

Answer, invalid and truncated turns are not scored (``A^a = 0``, so ``Ã = (1 − α)·Â``).
A trajectory whose critic answer failed (``critic_ok_B = False`` after the retries) is
handled by ``credit.critic.on_failure``: ``outcome`` labels every search turn with the
trajectory's EM; ``skip`` sets ``A^a = 0`` for the whole trajectory.
"""
from __future__ import annotations

import torch

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.grpo import group_metrics
from fastcredit.credit.registry import register_estimator
from fastcredit.credit.segments import group_advantage, seg_sum
from fastcredit.credit.types import CreditInputs, CreditResult, Needs, TurnKind, as_result_tensor


def criticsearch_labels(inputs: CreditInputs, cfg: CreditConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_S, scored_S)``: float64 labels after the failure policy, and which turns are scored.

    A label counts as Good when it is > 0.5 (NaN is Bad). Scored turns are the search
    turns of trajectories whose labels are used (all of them under ``outcome``).
    """
    traj_S = inputs.seg_traj_S
    search_S = inputs.seg_kind_S.long() == TurnKind.SEARCH
    ok_B = inputs.critic_ok_B.bool() if inputs.critic_ok_B is not None else \
        torch.ones(inputs.B, dtype=torch.bool, device=traj_S.device)
    good_S = (inputs.critic_label_S.to(torch.float64) > 0.5).to(torch.float64)
    fallback_S = (inputs.em_B.to(torch.float64) > 0.5).to(torch.float64)[traj_S]
    policy = cfg.critic.on_failure
    if policy == "outcome":
        label_S = torch.where(ok_B[traj_S], good_S, fallback_S)
        scored_S = search_S
    elif policy == "skip":
        label_S = good_S
        scored_S = search_S & ok_B[traj_S]
    else:
        raise ValueError(f"unknown credit.critic.on_failure {policy!r}; valid: outcome, skip")
    return torch.where(scored_S, label_S, torch.zeros_like(label_S)), scored_S


@register_estimator("criticsearch", needs=Needs(judge="critic", inputs=("critic_label_S",)))
def compute_criticsearch_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult:
    """Eqs. 7-8 per turn: ``adv_S = α·A^a_S + (1 − α)·Â[seg_traj_S]`` ([S])."""
    c = cfg.criticsearch
    adv_B = group_advantage(inputs.reward_B, inputs.group_id_B, cfg.norm_by_std, cfg.eps)
    r_S, scored_S = criticsearch_labels(inputs, cfg)
    total_B = seg_sum(r_S, inputs.seg_traj_S, inputs.B)
    turn_adv_S = r_S / (total_B + c.eps_c)[inputs.seg_traj_S]
    adv_S = c.alpha * turn_adv_S + (1.0 - c.alpha) * adv_B[inputs.seg_traj_S]
    metrics = group_metrics(inputs)
    n_scored = int(scored_S.sum())
    if n_scored:  # of the scored search turns, the share labelled Good (the labels Eq. 7 used)
        metrics["good_turn_frac"] = float(r_S.sum()) / n_scored
    if inputs.critic_ok_B is not None and inputs.B:
        metrics["critic_failure_rate"] = float((~inputs.critic_ok_B.bool()).double().mean())
    return CreditResult(adv_S=as_result_tensor(adv_S), turn_S={"label": r_S, "turn_adv": turn_adv_S},
                        metrics=metrics)
