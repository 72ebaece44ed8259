"""Loop-based references of the six estimators: the equations of docs/methods.md, line by line.

Legend: N packed tokens, S turns, B trajectories.

Slow on purpose: Python loops over trajectories, turns and tokens on plain floats
(float64), sharing no code with the vectorised estimators (only the config and the
result type). The turn layout is read from ``seg_start_S`` / ``seg_action_len_S``,
not from ``seg_id_N``, so the two paths also cross-check the data model. Each
reference fills ``adv_N`` (the per-token broadcast) as well as ``adv_S`` where the
method is turn-level. Registered as ``get_estimator(name, reference=True)``.
"""
from __future__ import annotations

import math

import torch

from fastcredit.config.credit import CreditConfig
from fastcredit.credit.registry import REFERENCES, register_estimator
from fastcredit.credit.types import CreditInputs, CreditResult, TurnKind


def _f32(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def _turns(inp: CreditInputs) -> list[list[int]]:
    """Turn indices of every trajectory, in order."""
    turns = [[] for _ in range(inp.B)]
    for s, b in enumerate(inp.seg_traj_S.tolist()):
        turns[b].append(s)
    return turns


def _action_tokens(inp: CreditInputs, s: int) -> list[int]:
    start, length = int(inp.seg_start_S[s]), int(inp.seg_action_len_S[s])
    return list(range(start, start + length))


def group_advantage_reference(rewards: list, groups: list, norm_by_std: bool, eps: float) -> list:
    """``Â_i = (r_i − mean_g r) / (std_g r + ε)`` (unbiased std); a group of one gets 0."""
    out = []
    for i in range(len(rewards)):
        members = [float(rewards[j]) for j in range(len(rewards)) if groups[j] == groups[i]]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1))
        out.append((float(rewards[i]) - mean) / (std + eps) if norm_by_std else float(rewards[i]) - mean)
    return out


def _group_adv(inp: CreditInputs, cfg: CreditConfig) -> list:
    return group_advantage_reference(inp.reward_B.tolist(), inp.group_id_B.tolist(), cfg.norm_by_std, cfg.eps)


def _turn_result(inp: CreditInputs, adv_S: list, **kw) -> CreditResult:
    """Every action token of turn ``s`` gets ``adv_S[s]``."""
    adv_N = [0.0] * inp.N
    for s in range(inp.S):
        for j in _action_tokens(inp, s):
            adv_N[j] = adv_S[s]
    return CreditResult(adv_S=_f32(adv_S), adv_N=_f32(adv_N), **kw)


@register_estimator("grpo", REFERENCES)
def grpo_reference(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    adv = _group_adv(inp, cfg)
    return _turn_result(inp, [adv[b] for b in inp.seg_traj_S.tolist()])


@register_estimator("criticsearch", REFERENCES)
def criticsearch_reference(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    adv = _group_adv(inp, cfg)
    alpha, eps_c = cfg.criticsearch.alpha, cfg.criticsearch.eps_c
    out = [0.0] * inp.S
    for i, turns in enumerate(_turns(inp)):
        ok = True if inp.critic_ok_B is None else bool(inp.critic_ok_B[i])
        r = {}
        for s in turns:
            if int(inp.seg_kind_S[s]) != TurnKind.SEARCH:
                r[s] = 0.0  # answer, invalid and truncated turns are not scored
            elif ok:
                r[s] = 1.0 if float(inp.critic_label_S[s]) > 0.5 else 0.0  # Eq. 6
            elif cfg.critic.on_failure == "outcome":
                r[s] = 1.0 if float(inp.em_B[i]) > 0.5 else 0.0
            else:  # skip: A^a = 0 for the whole trajectory
                r[s] = 0.0
        total = sum(r.values())
        for s in turns:
            turn_adv = r[s] / (total + eps_c)  # Eq. 7
            out[s] = alpha * turn_adv + (1 - alpha) * adv[i]  # Eq. 8
    return _turn_result(inp, out)


def _cw_weights(p: list, alpha: float, all_zero: str) -> list:
    """Eq. 3 over the non-final rounds of one successful trajectory."""
    if math.isinf(alpha):
        total = sum(p)
        if total <= 0:
            return [1.0 / len(p)] * len(p) if all_zero == "uniform" else [0.0] * len(p)
        return [x / total for x in p]
    top = max(alpha * x for x in p)
    e = [math.exp(alpha * x - top) for x in p]
    return [x / sum(e) for x in e]


@register_estimator("cwgrpo", REFERENCES)
def cwgrpo_reference(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    adv = _group_adv(inp, cfg)
    w = cfg.cwgrpo
    out = [0.0] * inp.S
    for i, turns in enumerate(_turns(inp)):
        T = len(turns)
        out[turns[-1]] = adv[i]  # the final round
        if T == 1:
            continue
        rounds = turns[:-1]
        p = [float(inp.judge_u_S[s]) * float(inp.judge_v_S[s]) for s in rounds]
        ok = (inp.judge_ok_B is None or bool(inp.judge_ok_B[i])) and not any(math.isnan(x) for x in p)
        success = float(inp.reward_B[i]) >= 1.0 if w.success_by == "reward" else adv[i] >= 0
        if success and ok:
            c = _cw_weights(p, w.alpha, w.all_zero)  # Eq. 3
        else:
            c = [1.0 / (T - 1)] * (T - 1)  # Eq. 4 (and a failed judge)
        for s, c_t in zip(rounds, c):
            out[s] = adv[i] * c_t * (T - 1)  # Eq. 5
    return _turn_result(inp, out)


@register_estimator("proceed", REFERENCES)
def proceed_reference(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    adv = _group_adv(inp, cfg)
    pc = cfg.proceed
    rewards, groups = inp.reward_B.tolist(), inp.group_id_B.tolist()
    mask, phi = [False] * inp.N, [False] * inp.N
    demo_N = inp.demo_mask_N.tolist()
    for i, turns in enumerate(_turns(inp)):
        failed = rewards[i] < 1.0
        same = all(rewards[j] == rewards[i] for j in range(inp.B) if groups[j] == groups[i])
        for s in turns:
            for j in _action_tokens(inp, s):
                demo = bool(demo_N[j])
                counted = not (pc.mask_failed_demo and demo and failed)
                counted = counted and not (pc.base == "dapo" and same)
                mask[j] = counted
                phi[j] = pc.chord_phi and counted and demo and not failed
    result = _turn_result(inp, [adv[b] for b in inp.seg_traj_S.tolist()])
    result.loss_mask_N = torch.tensor(mask, dtype=torch.bool)
    result.phi_mask_N = torch.tensor(phi, dtype=torch.bool)
    return result


def _gae(inp: CreditInputs, cfg: CreditConfig, token_reward: dict) -> tuple[list, list]:
    """Per trajectory, backwards over its action tokens (observations skipped)."""
    values = inp.values_N.tolist()
    adv, ret = [0.0] * inp.N, [0.0] * inp.N
    for turns in _turns(inp):
        positions = [j for s in turns for j in _action_tokens(inp, s)]
        last_gae, next_value = 0.0, 0.0
        for j in reversed(positions):
            delta = token_reward.get(j, 0.0) + cfg.gamma * next_value - values[j]
            last_gae = delta + cfg.gamma * cfg.lam * last_gae
            adv[j], ret[j] = last_gae, last_gae + values[j]
            next_value = values[j]
    return adv, ret


def _whiten(inp: CreditInputs, adv: list) -> list:
    positions = [j for s in range(inp.S) for j in _action_tokens(inp, s)]
    n = len(positions)
    if n < 2:
        return adv
    mean = sum(adv[j] for j in positions) / n
    var = sum((adv[j] - mean) ** 2 for j in positions) / (n - 1)
    out = [0.0] * inp.N
    for j in positions:
        out[j] = (adv[j] - mean) / math.sqrt(var + 1e-8)
    return out


def _add_kl(inp: CreditInputs, cfg: CreditConfig, token_reward: dict) -> None:
    if not cfg.kl_in_reward:
        return
    old, ref = inp.old_logp_N.tolist(), inp.ref_logp_N.tolist()
    for s in range(inp.S):
        for j in _action_tokens(inp, s):
            kl = old[j] - ref[j]
            token_reward[j] = token_reward.get(j, 0.0) - cfg.kl_in_reward * kl


def _pay_on_last_action(inp: CreditInputs, turns: list, t: int, reward: float, token_reward: dict) -> None:
    """Turn ``turns[t]``'s reward on its last action token, else the nearest earlier one of the trajectory."""
    for s in reversed(turns[: t + 1]):
        tokens = _action_tokens(inp, s)
        if tokens:
            token_reward[tokens[-1]] = token_reward.get(tokens[-1], 0.0) + reward
            return


def _token_result(inp: CreditInputs, cfg: CreditConfig, token_reward: dict) -> CreditResult:
    adv, ret = _gae(inp, cfg, token_reward)
    if cfg.whiten_advantages:
        adv = _whiten(inp, adv)
    return CreditResult(adv_N=_f32(adv), returns_N=_f32(ret))


@register_estimator("ppo", REFERENCES)
def ppo_reference(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    token_reward: dict = {}
    for i, turns in enumerate(_turns(inp)):
        _pay_on_last_action(inp, turns, len(turns) - 1, float(inp.reward_B[i]), token_reward)
    _add_kl(inp, cfg, token_reward)
    return _token_result(inp, cfg, token_reward)


def _pica_turn_rewards(inp: CreditInputs, cfg: CreditConfig, i: int, turns: list) -> list:
    pc = cfg.pica
    clamp = lambda f: min(max(f, pc.f_clamp), 1.0 - pc.f_clamp)  # noqa: E731
    R = []
    for t, s in enumerate(turns, start=1):
        if pc.step_reward == "log_ratio":
            prev = float(inp.prm_f0_B[i]) if t == 1 else float(inp.prm_f_S[s - 1])
            r = math.log(clamp(float(inp.prm_f_S[s]))) - math.log(clamp(prev))  # Eq. 7
        else:
            r = 1.0 - float(inp.prm_hazard_S[s]) - pc.hazard_bias
        if t >= pc.penalty_from_turn:
            r -= pc.lambda_p * pc.alpha_p ** (t - pc.penalty_from_turn)  # Eq. 11
        R.append(pc.s_step * r + (pc.s_out * float(inp.reward_B[i]) if t == len(turns) else 0.0))  # Eq. 12
    return R


def _pica_turn_level(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    values = inp.values_N.tolist()
    token_kl: dict = {}
    _add_kl(inp, cfg, token_kl)  # −β·KL per token; a turn's is summed into R_t
    adv_S, target = [0.0] * inp.S, [0.0] * inp.S
    for i, turns in enumerate(_turns(inp)):
        R = _pica_turn_rewards(inp, cfg, i, turns)
        for t, s in enumerate(turns):
            for j in _action_tokens(inp, s):
                R[t] += token_kl.get(j, 0.0)
        V = [values[_action_tokens(inp, s)[0]] if _action_tokens(inp, s) else 0.0 for s in turns] + [0.0]
        acc = 0.0
        for t in reversed(range(len(turns))):
            delta = R[t] + cfg.gamma * V[t + 1] - V[t]  # δ_t
            acc = delta + cfg.gamma * cfg.lam * acc  # Eq. 13
            adv_S[turns[t]], target[turns[t]] = acc, acc + V[t]
    returns = [0.0] * inp.N
    for s in range(inp.S):
        for j in _action_tokens(inp, s):
            returns[j] = target[s]
    if cfg.whiten_advantages:
        adv_S = _whiten_turns(inp, adv_S)
    result = _turn_result(inp, adv_S)
    result.returns_N = _f32(returns)
    return result


def _whiten_turns(inp: CreditInputs, adv_S: list) -> list:
    """Whitening of the per-token broadcast, written per turn."""
    lengths = inp.seg_action_len_S.tolist()
    n = sum(lengths)
    if n < 2:
        return adv_S
    mean = sum(a * k for a, k in zip(adv_S, lengths)) / n
    var = sum(k * (a - mean) ** 2 for a, k in zip(adv_S, lengths)) / (n - 1)
    return [(a - mean) / math.sqrt(var + 1e-8) for a in adv_S]


@register_estimator("pica", REFERENCES)
def pica_reference(inp: CreditInputs, cfg: CreditConfig) -> CreditResult:
    if cfg.pica.gae_level == "turn":
        return _pica_turn_level(inp, cfg)
    token_reward: dict = {}
    for i, turns in enumerate(_turns(inp)):
        for t, R_t in enumerate(_pica_turn_rewards(inp, cfg, i, turns)):
            _pay_on_last_action(inp, turns, t, R_t, token_reward)
    _add_kl(inp, cfg, token_reward)
    return _token_result(inp, cfg, token_reward)
