"""``ppo``: the Search-R1 PPO baseline, GAE over action tokens only (docs/methods.md §2).

Legend: N packed tokens, A action tokens (observations removed), S turns, B trajectories.

    r_j   = r_i on the trajectory's last action token, else 0;  − β·(logπold − logπref)_j
            on every action token when ``credit.kl_in_reward = β > 0``
    δ_j   = r_j + γ·V_{next(j)} − V_j        next(j): the next action token of the trajectory
    A_j   = δ_j + γλ·A_{next(j)}             (0 past the trajectory's last action token)
    R_j   = A_j + V_j                        value targets (returns)

Observation tokens are skipped by the recursion: the successor of a turn's last action
token is the next turn's first action token. ``values_N[j]`` is the value of the state
in which token ``j`` is generated (veRL's convention). Where the papers are silent:
the KL in the reward is veRL's default ``kl`` estimator, ``logπold − logπref`` per token
(k1); ``credit.whiten_advantages`` (default off) whitens the advantages over the batch's
action tokens as veRL's GAE does (the returns stay unwhitened).

With ``γ = λ = 1`` (the default of Search-R1 and PiCA) the sum telescopes:
``A_j = Σ_{k ≥ j} r_k − V_j`` and ``R_j = Σ_{k ≥ j} r_k``, computed without any scan over
tokens (turn rewards are summed per turn, then gathered per token). Otherwise the
action tokens are gathered last-first and :func:`~fastcredit.credit.segments.discounted_prefix_sum_`
runs the blocked scan on them in place.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.registry import register_estimator
from fastcredit.credit.segments import (
    action_positions_last_first,
    add_prev_in_row_,
    discounted_prefix_sum_,
    discounted_suffix_sum,
    gather_turns,
    scratch,
    to_tokens,
    turn_last_action,
    turn_layout,
    whiten,
)
from fastcredit.credit.types import CreditInputs, CreditResult, Needs, as_result_tensor


def outcome_on_final_turn(inputs: CreditInputs, value_B: torch.Tensor) -> torch.Tensor:
    """float64 ``[S]``: ``value_B`` of the trajectory on its final turn, 0 on the others."""
    _, _, _, final_S = turn_layout(inputs.seg_traj_S, inputs.B)
    v_S = value_B.to(torch.float64)[inputs.seg_traj_S]
    return torch.where(final_S, v_S, torch.zeros_like(v_S))


def kl_reward_N(inputs: CreditInputs, cfg: CreditConfig, action_N: torch.Tensor) -> Optional[torch.Tensor]:
    """float64 ``[N]``: ``−β·(logπold − logπref)`` on action tokens, 0 elsewhere; None when β = 0."""
    beta = cfg.kl_in_reward
    if not beta:
        return None
    inputs.require("old_logp_N", "ref_logp_N", who="ppo / pica with credit.kl_in_reward")
    kl_N = inputs.old_logp_N.to(torch.float64) - inputs.ref_logp_N.to(torch.float64)
    return torch.where(action_N, -beta * kl_N, 0.0)


def _kl_to_go(inputs: CreditInputs, kl_N: torch.Tensor) -> torch.Tensor:
    """float64 ``[N]``: ``Σ_{k ≥ j, same trajectory} kl_k`` from one cumsum (kl is 0 on observations)."""
    C_pad = torch.cat([kl_N.new_zeros(1), torch.cumsum(kl_N, 0)])
    _, _, _, final_S = turn_layout(inputs.seg_traj_S, inputs.B)
    # A final turn has no observation, so its action's end is the trajectory's end.
    end_B = (inputs.seg_start_S + inputs.seg_action_len_S)[final_S]
    total_S = C_pad[end_B][inputs.seg_traj_S]
    return gather_turns(total_S, inputs.seg_id_N) - C_pad[1:] + kl_N


def turns_per_trajectory(inputs: CreditInputs) -> torch.Tensor:
    """int64 ``[B]``: the number of turns of each trajectory (the rows of the turn stream)."""
    return torch.bincount(inputs.seg_traj_S, minlength=inputs.B)


def gae_closed_form(inputs: CreditInputs, R_S: torch.Tensor, kl_N: Optional[torch.Tensor],
                    action_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """γ = λ = 1: ``(adv_N, returns_N)`` with ``R_j = Σ_{k ≥ j} r_k`` and ``A_j = R_j − V_j``.

    The turn rewards sit on each turn's last action token (or the nearest earlier one),
    so every action token of turn ``t`` sees exactly the rewards of turns ``t' ≥ t``.
    """
    togo_S = discounted_suffix_sum(R_S, turns_per_trajectory(inputs), 1.0)
    if kl_N is None:
        ret_N = gather_turns(togo_S.to(torch.float32), inputs.seg_id_N)
    else:
        ret_N = (gather_turns(togo_S, inputs.seg_id_N) + _kl_to_go(inputs, kl_N)).to(torch.float32)
        ret_N = torch.where(action_N, ret_N, 0.0)
    adv_N = torch.where(action_N, ret_N - inputs.values_N.to(torch.float32), 0.0)
    return adv_N, ret_N


def gae_scan(inputs: CreditInputs, cfg: CreditConfig, R_S: torch.Tensor,
             kl_N: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """General ``γ, λ``: GAE on the compacted action stream; ``(adv_N, returns_N)`` float32 (the result's dtype).

    The action stream is gathered last token first (positions from the turns' spans, no scan
    of the ``[N]`` mask), so GAE's suffix recursion is the in-place prefix scan with no flips;
    a token's successor is its predecessor in that stream. Everything between the gather and
    the two scatters back runs on the ``A`` action tokens in float64; ``credit.whiten_advantages``
    whitens there too (over exactly the action tokens).
    """
    dev = inputs.seg_id_N.device
    A = int(inputs.seg_action_len_S.sum())
    idx_A = action_positions_last_first(inputs.seg_start_S, inputs.seg_action_len_S,
                                        out=scratch("gae_idx", A, torch.int64, dev))
    # The rows of the reversed action stream: each trajectory's action tokens, last trajectory first.
    acts_B = torch.zeros(inputs.B, dtype=torch.int64, device=dev).index_add_(0, inputs.seg_traj_S,
                                                                             inputs.seg_action_len_S)
    rows_B = acts_B.flip(0)
    at_S = turn_last_action(inputs.seg_action_len_S, inputs.seg_traj_S, inputs.B)
    keep_S = at_S >= 0
    # One float64 work buffer, updated in place: r, then δ = r + γ·V_next − V, then A (the scan).
    work_A = scratch("gae_work", A, torch.float64, dev).zero_()
    work_A.index_add_(0, A - 1 - at_S[keep_S], R_S.to(torch.float64)[keep_S])
    if kl_N is not None:
        work_A += kl_N.take(idx_A)
    out_A = torch.take(inputs.values_N.to(torch.float32), idx_A, out=scratch("gae_out", A, torch.float32, dev))
    v_A = scratch("gae_v", A, torch.float64, dev).copy_(out_A)  # mixed-dtype in-place ops copy behind the scenes
    add_prev_in_row_(work_A, v_A, rows_B, cfg.gamma)
    work_A.sub_(v_A)
    discounted_prefix_sum_(work_A, rows_B, cfg.gamma * cfg.lam)
    white_A = whiten(work_A, sum_over_ranks=inputs.sum_over_ranks) if cfg.whiten_advantages else work_A
    adv_N = to_tokens(out_A.copy_(white_A), idx_A, inputs.N)
    ret_N = to_tokens(out_A.copy_(work_A.add_(v_A)), idx_A, inputs.N)  # R = A + V in float64
    return adv_N, ret_N


def token_level_gae(inputs: CreditInputs, cfg: CreditConfig, R_S: torch.Tensor, turn_S: dict,
                    metrics: dict) -> CreditResult:
    """Turn rewards ``R_S`` on the turns' last action tokens (+ KL in reward), GAE over action tokens."""
    closed = cfg.gamma == 1.0 and cfg.lam == 1.0
    action_N = inputs.seg_id_N >= 0 if closed or cfg.kl_in_reward else None  # the scan needs no [N] mask
    kl_N = kl_reward_N(inputs, cfg, action_N)
    if closed:
        adv_N, ret_N = gae_closed_form(inputs, R_S, kl_N, action_N)
        if cfg.whiten_advantages:
            adv_N = torch.where(action_N, whiten(adv_N.to(torch.float64), action_N, inputs.sum_over_ranks), 0.0)
    else:
        adv_N, ret_N = gae_scan(inputs, cfg, R_S, kl_N)
    return CreditResult(adv_N=as_result_tensor(adv_N), returns_N=as_result_tensor(ret_N), turn_S=turn_S,
                        metrics=metrics)


@register_estimator("ppo", needs=Needs(value_model=True, inputs=("values_N",)))
def compute_ppo_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult:
    """Outcome on the last action token (optionally − β·KL per token); GAE over action tokens ([N])."""
    return token_level_gae(inputs, cfg, outcome_on_final_turn(inputs, inputs.reward_B), {}, {})
