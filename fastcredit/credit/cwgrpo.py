"""``cwgrpo``: contribution-weighted GRPO (docs/methods.md §4).

Legend: S turns (rounds), B trajectories.

    p_{i,t} = u_{i,t} · v_{i,t}                                     t < T_i
    success:  c_{i,t} = softmax_t(α·p_{i,t}) over t < T_i           (Eq. 3)
              α = ∞: c_{i,t} = p_{i,t} / Σ_u p_{i,u}
    failure:  c_{i,t} = 1 / (T_i − 1)                               (Eq. 4)
    A_{i,t}   = Â_i · c_{i,t} · (T_i − 1)   for t < T_i             (Eq. 5)
    A_{i,T_i} = Â_i

Switches: ``cwgrpo.alpha`` (``inf`` allowed), ``cwgrpo.all_zero`` (α = ∞ and every
``p = 0`` in a success: ``uniform`` weights, the paper's limit, or ``zero``, the
released code's ``p / max(Σp, 1e-6)``), ``cwgrpo.success_by`` (``reward``: ``R_i = 1``,
taken as ``r_i ≥ 1``; ``advantage``: ``Â_i ≥ 0``, the released code).

Who is judged: :func:`cwgrpo_success`, the trajectories whose rounds Eq. 3 weights; the judge
phase (``fastcredit.judges.phase``) asks about exactly these, so no verdict goes unread.

Where the papers are silent: a success whose judge failed (``judge_ok_B = False``, or a
NaN score on one of its non-final rounds) gets the uniform weights of Eq. 4, i.e. plain
GRPO for that trajectory. The final round is the trajectory's last turn whatever its
kind (an answer, or a truncated turn); invalid turns are rounds like search turns.
"""
from __future__ import annotations

import math

import torch

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.grpo import group_metrics
from fastcredit.credit.registry import register_estimator
from fastcredit.credit.segments import group_advantage, seg_max, seg_sum, turn_layout
from fastcredit.credit.types import CreditInputs, CreditResult, Needs, as_result_tensor


def cwgrpo_success(reward_B: torch.Tensor, group_id_B: torch.Tensor, cfg: CreditConfig) -> torch.Tensor:
    """bool ``[B]``: the successes, whose non-final rounds get the judge's weights (Eq. 3); every other
    trajectory gets the uniform weights of Eq. 4 and its verdicts are never read.

    The one definition of who is judged: the estimator weights these trajectories and the judge phase
    asks the judge about these only. ``success_by``: ``reward``, ``R_i = 1`` taken as ``r_i ≥ 1`` (a
    format-only or partial reward is no success); ``advantage``, ``Â_i ≥ 0`` (the released code).
    """
    by = cfg.cwgrpo.success_by
    if by == "reward":
        return reward_B.to(torch.float64) >= 1.0
    if by == "advantage":
        return group_advantage(reward_B, group_id_B, cfg.norm_by_std, cfg.eps) >= 0
    raise ValueError(f"unknown credit.cwgrpo.success_by {by!r}; valid: reward, advantage")


def _judged_weights(p_S: torch.Tensor, nonfinal_S: torch.Tensor, uniform_S: torch.Tensor, traj_S: torch.Tensor,
                    B: int, cfg: CreditConfig) -> torch.Tensor:
    """Eq. 3 weights over the non-final rounds of every trajectory (0 on final rounds)."""
    alpha, all_zero = cfg.cwgrpo.alpha, cfg.cwgrpo.all_zero
    if not alpha >= 0:
        raise ValueError(f"credit.cwgrpo.alpha must be >= 0 (inf allowed), got {alpha}")
    if all_zero not in ("uniform", "zero"):
        raise ValueError(f"unknown credit.cwgrpo.all_zero {all_zero!r}; valid: uniform, zero")
    if math.isinf(alpha):
        total_B = seg_sum(p_S, traj_S, B)
        fill_S = uniform_S if all_zero == "uniform" else torch.zeros_like(uniform_S)
        zero_S = total_B[traj_S] <= 0
        c_S = torch.where(zero_S, fill_S, p_S / torch.where(zero_S, torch.ones_like(p_S), total_B[traj_S]))
    else:
        logit_S = torch.where(nonfinal_S, alpha * p_S, torch.full_like(p_S, -math.inf))
        # Subtract each trajectory's max so exp never overflows, even for a very large finite α.
        max_B = seg_max(logit_S, traj_S, B)
        shift_S = torch.where(nonfinal_S, max_B[traj_S], torch.zeros_like(p_S))
        e_S = torch.where(nonfinal_S, torch.exp(logit_S - shift_S), torch.zeros_like(p_S))
        c_S = e_S / seg_sum(e_S, traj_S, B).clamp(min=1e-300)[traj_S]
    return torch.where(nonfinal_S, c_S, torch.zeros_like(c_S))


def cwgrpo_weights(inputs: CreditInputs, cfg: CreditConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c_S, judged_B)``: contribution weights (0 on final rounds), and which trajectories used the judge."""
    B, traj_S = inputs.B, inputs.seg_traj_S
    T_B, _, _, final_S = turn_layout(traj_S, B)
    nonfinal_S = ~final_S
    p_raw = inputs.judge_u_S.to(torch.float64) * inputs.judge_v_S.to(torch.float64)
    nan_B = seg_sum((torch.isnan(p_raw) & nonfinal_S).to(torch.float64), traj_S, B) > 0
    ok_B = ~nan_B if inputs.judge_ok_B is None else inputs.judge_ok_B.bool() & ~nan_B
    judged_B = cwgrpo_success(inputs.reward_B, inputs.group_id_B, cfg) & ok_B & (T_B > 1)
    p_S = torch.where(nonfinal_S & judged_B[traj_S], torch.nan_to_num(p_raw, nan=0.0), torch.zeros_like(p_raw))
    uniform_S = 1.0 / (T_B - 1).clamp(min=1).to(torch.float64)[traj_S]
    c_S = torch.where(judged_B[traj_S], _judged_weights(p_S, nonfinal_S, uniform_S, traj_S, B, cfg), uniform_S)
    return torch.where(nonfinal_S, c_S, torch.zeros_like(c_S)), judged_B


def _cwgrpo_metrics(inputs: CreditInputs, cfg: CreditConfig, c_S: torch.Tensor, judged_B: torch.Tensor) -> dict:
    """``contributive_round_frac``: of the judged rounds (non-final rounds of successes whose judge answered),
    the share with ``p = u·v = 1`` (> 0.5), i.e. both bits set; ``weight_entropy``: mean entropy of ``c`` over
    those trajectories; ``judge_failure_rate``: of the successes with a round to judge, the share whose judge
    failed."""
    metrics = group_metrics(inputs)
    traj_S = inputs.seg_traj_S
    T_B, _, _, final_S = turn_layout(traj_S, inputs.B)
    judged_S = judged_B[traj_S] & ~final_S
    if bool(judged_S.any()):
        p_S = (inputs.judge_u_S.to(torch.float64) * inputs.judge_v_S.to(torch.float64))[judged_S]
        metrics["contributive_round_frac"] = float((p_S > 0.5).double().mean())
        ent_B = seg_sum(-torch.special.xlogy(c_S, c_S), traj_S, inputs.B)
        metrics["weight_entropy"] = float(ent_B[judged_B].mean())
    need_B = cwgrpo_success(inputs.reward_B, inputs.group_id_B, cfg) & (T_B > 1)
    if inputs.judge_ok_B is not None and bool(need_B.any()):
        metrics["judge_failure_rate"] = float((~inputs.judge_ok_B.bool())[need_B].double().mean())
    return metrics


@register_estimator("cwgrpo", needs=Needs(judge="round_judge", inputs=("judge_u_S", "judge_v_S")))
def compute_cwgrpo_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult:
    """Eq. 5 per round: ``Â·c·(T − 1)`` on non-final rounds, ``Â`` on the final one ([S])."""
    adv_B = group_advantage(inputs.reward_B, inputs.group_id_B, cfg.norm_by_std, cfg.eps)
    traj_S = inputs.seg_traj_S
    T_B, _, _, final_S = turn_layout(traj_S, inputs.B)
    c_S, judged_B = cwgrpo_weights(inputs, cfg)
    a_S = adv_B[traj_S]
    adv_S = torch.where(final_S, a_S, a_S * c_S * (T_B[traj_S] - 1).to(torch.float64))
    return CreditResult(adv_S=as_result_tensor(adv_S), turn_S={"weight": c_S},
                        metrics=_cwgrpo_metrics(inputs, cfg, c_S, judged_B))
