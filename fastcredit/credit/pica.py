"""``pica``: pivot-based PRM step rewards + PPO (docs/methods.md §6).

Legend: N packed tokens, A action tokens, S turns, B trajectories.

    step reward   log_ratio: r_t = log f(t) − log f(t − 1),  f clamped to [f_clamp, 1 − f_clamp]
                  linear:    r_t = 1 − h_t − b                (released code, b = hazard_bias)
    penalty       r_t −= λp · αp^(t − 3)   for t ≥ penalty_from_turn (= 3)           (Eq. 11)
    turn reward   R_t = s_step·r_t,   R_{T_i} = s_step·r_{T_i} + s_out·r_out           (Eq. 12)

``r_out`` is the outcome reward ``reward_B`` (F1 + format for the paper). Every turn,
the final one included, gets a step reward (Eq. 12 uses ``r_step,T``; ``f(T)`` is the
PRM's output after the last turn) and the penalty applies to every turn with
``t ≥ 3`` (Eq. 11 makes no exception for the last). The switch of step reward leaves
the penalty and the scales unchanged.

Advantages (``credit.gamma``, ``credit.lam``):

* ``pica.gae_level = token``: ``R_t`` sits on turn ``t``'s last action token (a turn
  without action tokens pays on the nearest earlier action token of its trajectory),
  then the GAE of ``ppo`` over the action tokens. Returns ``adv_N``.
* ``pica.gae_level = turn`` (Eq. 13): ``δ_t = R_t + γ·V(s_{t+1}) − V(s_t)`` with
  ``V(s_t)`` the value at turn ``t``'s first action token (0 for a turn without
  action tokens, and after the last turn), ``Ã_t = Σ_l (γλ)^l δ_{t+l}``; returns
  ``adv_S``, and every action token of turn ``t`` gets the value target ``Ã_t + V(s_t)``.

With ``credit.kl_in_reward = β``, the per-token ``−β·(logπold − logπref)`` is added to
the token rewards (token level) or summed over each turn's tokens into ``R_t`` (turn level).
"""
from __future__ import annotations

import torch

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.ppo import kl_reward_N, outcome_on_final_turn, token_level_gae, turns_per_trajectory
from fastcredit.credit.registry import register_estimator
from fastcredit.credit.segments import (
    discounted_suffix_sum,
    gather_turns,
    next_in_row,
    seg_sum,
    turn_first_action_value,
    turn_layout,
    whiten,
)
from fastcredit.credit.types import CreditInputs, CreditResult, Needs, as_result_tensor


def pica_step_rewards(inputs: CreditInputs, cfg: CreditConfig) -> torch.Tensor:
    """float64 ``[S]``: step reward ``r_t`` of every turn, step penalty included (before ``s_step``)."""
    pc = cfg.pica
    _, _, t_S, _ = turn_layout(inputs.seg_traj_S, inputs.B)
    if pc.step_reward == "log_ratio":
        inputs.require("prm_f0_B", "prm_f_S", who="pica (step_reward=log_ratio)")
        lo, hi = pc.f_clamp, 1.0 - pc.f_clamp
        f_S = inputs.prm_f_S.to(torch.float64).clamp(lo, hi)
        f0_B = inputs.prm_f0_B.to(torch.float64).clamp(lo, hi)
        prev_S = torch.where(t_S == 1, f0_B[inputs.seg_traj_S], torch.roll(f_S, 1))
        r_S = torch.log(f_S) - torch.log(prev_S)
    elif pc.step_reward == "linear":
        inputs.require("prm_hazard_S", who="pica (step_reward=linear)")
        r_S = 1.0 - inputs.prm_hazard_S.to(torch.float64) - pc.hazard_bias
    else:
        raise ValueError(f"unknown credit.pica.step_reward {pc.step_reward!r}; valid: log_ratio, linear")
    penalty_S = pc.lambda_p * torch.pow(pc.alpha_p, (t_S - pc.penalty_from_turn).to(torch.float64))
    return torch.where(t_S >= pc.penalty_from_turn, r_S - penalty_S, r_S)


def pica_turn_rewards(inputs: CreditInputs, cfg: CreditConfig, step_S: torch.Tensor) -> torch.Tensor:
    """float64 ``[S]``: ``R_t = s_step·r_t (+ s_out·r_out on the final turn)`` (Eq. 12)."""
    return cfg.pica.s_step * step_S + cfg.pica.s_out * outcome_on_final_turn(inputs, inputs.reward_B)


def _turn_level(inputs: CreditInputs, cfg: CreditConfig, R_S: torch.Tensor, metrics: dict) -> CreditResult:
    """Eq. 13: GAE over the turns of each trajectory, values read at turn starts."""
    v_S = turn_first_action_value(inputs.values_N, inputs.seg_start_S, inputs.seg_action_len_S)
    T_B = turns_per_trajectory(inputs)
    delta_S = R_S + cfg.gamma * next_in_row(v_S, T_B) - v_S
    adv_S = discounted_suffix_sum(delta_S, T_B, cfg.gamma * cfg.lam)
    ret_N = gather_turns((adv_S + v_S).to(torch.float32), inputs.seg_id_N)
    if cfg.whiten_advantages:
        adv_S = whiten(adv_S, inputs.seg_action_len_S, inputs.sum_over_ranks)
    return CreditResult(adv_S=as_result_tensor(adv_S), returns_N=as_result_tensor(ret_N),
                        turn_S={"turn_reward": R_S, "delta": delta_S}, metrics=metrics)


@register_estimator("pica", needs=Needs(judge="prm", value_model=True, inputs=("values_N",)))
def compute_pica_advantage(inputs: CreditInputs, cfg: CreditConfig) -> CreditResult:
    """PPO with PiCA turn rewards; token-level GAE (``adv_N``) or turn-level GAE (``adv_S``)."""
    step_S = pica_step_rewards(inputs, cfg)
    R_S = pica_turn_rewards(inputs, cfg, step_S)
    metrics = {"step_reward_mean": float(step_S.mean())} if inputs.S else {}
    level = cfg.pica.gae_level
    if level not in ("token", "turn"):
        raise ValueError(f"unknown credit.pica.gae_level {level!r}; valid: token, turn")
    if level == "turn":
        action_N = inputs.seg_id_N >= 0
        kl_N = kl_reward_N(inputs, cfg, action_N)
        if kl_N is not None:
            # A turn is one step of the turn-level MDP: its KL penalty is the sum over its tokens.
            R_S = R_S + seg_sum(kl_N[action_N], inputs.seg_id_N[action_N].long(), inputs.S)
        return _turn_level(inputs, cfg, R_S, metrics)
    return token_level_gae(inputs, cfg, R_S, {"turn_reward": R_S}, metrics)
