"""Hand-worked examples of every estimator, written from the equations of docs/methods.md.

The arithmetic is in the comments; expected numbers are typed from it, not computed
by the code under test.
"""
import math

import pytest
import torch

from fastcredit.credit import CreditInputs, compute_advantages, get_estimator
from fastcredit.config.credit import CreditConfig
from fastcredit.rollout.trajectory import Turn, from_turns

S, A, INV, T = "search", "answer", "invalid", "truncated"
# The GRPO advantage of a (1, 0, 0, 1) group: mean 0.5, unbiased std sqrt(1/3) = 0.5773503,
# Â = ±0.5 / (0.5773503 + 1e-6) = ±0.8660239.
A4 = 0.5 / (math.sqrt(1 / 3) + 1e-6)


def _inputs(layouts, rewards, groups=None, em=None, demo=None, **extra):
    """``layouts[b]`` lists (kind, action tokens, observation tokens) per turn."""
    trajs = []
    for b, layout in enumerate(layouts):
        turns = []
        for t, (kind, a, o) in enumerate(layout):
            d = None if demo is None else demo[b][t]
            turns.append(Turn([1] * a, kind, [2] * o, demo=d))
        trajs.append(turns)
    batch = from_turns(trajs, group_id=groups or [0] * len(layouts), em=em if em is not None else rewards)
    tensors = {k: torch.as_tensor(v, dtype=torch.bool if k.endswith("ok_B") else torch.float32)
               for k, v in extra.items()}
    return CreditInputs.from_batch(batch, rewards, **tensors)


def _run(name, inputs, cfg=None):
    cfg = cfg or CreditConfig()
    vec = compute_advantages(name, inputs, cfg)
    ref = get_estimator(name, reference=True)(inputs, cfg)
    assert torch.allclose(vec.token_advantages(inputs.seg_id_N), ref.adv_N, atol=1e-6)
    return vec


def _expect(x, values, tol=1e-6):
    assert torch.allclose(x.double(), torch.tensor(values, dtype=torch.float64), atol=tol), (x.tolist(), values)


GROUP_OF_FOUR = [[(S, 2, 1), (A, 1, 0)], [(A, 2, 0)], [(S, 1, 1), (A, 1, 0)], [(A, 1, 0)]]


def test_grpo_every_turn_gets_the_group_advantage():
    inputs = _inputs(GROUP_OF_FOUR, [1.0, 0.0, 0.0, 1.0])
    res = _run("grpo", inputs)
    _expect(res.adv_S, [A4, A4, -A4, -A4, -A4, A4])
    # Tokens: traj 0 = [a a o a], traj 1 = [a a], traj 2 = [a o a], traj 3 = [a]; observations get 0.
    _expect(res.token_advantages(inputs.seg_id_N), [A4, A4, 0, A4, -A4, -A4, -A4, 0, -A4, A4])


def test_grpo_single_sample_group_and_dr_grpo():
    inputs = _inputs([[(A, 1, 0)], [(A, 1, 0)], [(A, 1, 0)]], [1.0, 0.2, 1.0], groups=[5, 6, 6])
    # Group 5 has one sample: Â = 0. Group 6 = (0.2, 1.0): mean 0.6, unbiased std sqrt(0.16 + 0.16) = 0.5656854,
    # Â = ∓0.4 / (0.5656854 + 1e-6) = ∓0.7071055.
    _expect(_run("grpo", inputs).adv_S, [0.0, -0.4 / (math.sqrt(0.32) + 1e-6), 0.4 / (math.sqrt(0.32) + 1e-6)])
    cfg = CreditConfig(norm_by_std=False)
    # Dr. GRPO: r − mean over group 6 = (0.2, 1.0) − 0.6 = (−0.4, +0.4).
    _expect(_run("grpo", inputs, cfg).adv_S, [0.0, -0.4, 0.4])


def _critic_batch(ok=(True, True)):
    # Trajectory 0 (r = 1): search Good, search Bad, invalid, search Good, answer.
    # Trajectory 1 (r = 0): search Bad, truncated.
    layouts = [[(S, 1, 1), (S, 1, 1), (INV, 1, 1), (S, 1, 1), (A, 1, 0)], [(S, 2, 1), (T, 1, 0)]]
    labels = [1, 0, 1, 1, 0, 0, 1]  # the invalid turn's and final turns' labels are ignored
    return _inputs(layouts, [1.0, 0.0], em=[1.0, 0.0], critic_label_S=labels, critic_ok_B=list(ok))


def test_criticsearch_eq7_eq8():
    # Group (1, 0): mean 0.5, std sqrt(0.5) = 0.7071068, Â = ±0.5 / (0.7071068 + 1e-6) = ±0.7071058.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    # Trajectory 0: r^a = (1, 0, 0, 1, 0), Σ = 2, A^a = (1, 0, 0, 1, 0) / (2 + 1e-6) = 0.49999975 on Good turns.
    # Ã = 0.25 · A^a + 0.75 · Â.
    g = 1 / (2 + 1e-6)
    # Trajectory 1: r^a = (0, 0): A^a = 0, Ã = 0.75 · (−Â).
    res = _run("criticsearch", _critic_batch())
    _expect(res.adv_S, [0.25 * g + 0.75 * a, 0.75 * a, 0.75 * a, 0.25 * g + 0.75 * a, 0.75 * a, -0.75 * a, -0.75 * a])
    _expect(res.turn_S["turn_adv"], [g, 0, 0, g, 0, 0, 0])
    # good_turn_frac: of the scored search turns (not the invalid or final turns), the share labelled Good.
    assert res.metrics["good_turn_frac"] == pytest.approx(2 / 4)  # 4 search turns, 2 Good
    assert res.metrics["critic_failure_rate"] == 0.0
    assert "contributive_round_frac" not in res.metrics  # CW-GRPO's metric, another judge over other turns


def test_criticsearch_failure_policies():
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    inputs = _critic_batch(ok=(False, True))
    # outcome: trajectory 0's EM = 1 labels its 3 search turns Good: A^a = 1 / (3 + 1e-6) each.
    t = 1 / (3 + 1e-6)
    res = _run("criticsearch", inputs)
    _expect(res.adv_S[:5], [0.25 * t + 0.75 * a, 0.25 * t + 0.75 * a, 0.75 * a, 0.25 * t + 0.75 * a, 0.75 * a])
    assert res.metrics["critic_failure_rate"] == 0.5
    assert res.metrics["good_turn_frac"] == pytest.approx(3 / 4)  # the labels used: EM's 3 Good, 1 Bad
    # skip: A^a = 0 for trajectory 0, so every turn gets (1 − α) Â = 0.75 · Â.
    cfg = CreditConfig()
    cfg.critic.on_failure = "skip"
    res = _run("criticsearch", inputs, cfg)
    _expect(res.adv_S[:5], [0.75 * a] * 5)
    assert res.metrics["good_turn_frac"] == 0.0  # scored: trajectory 1's one search, Bad


def _cw_batch(u, v, rewards=(1.0, 0.0), ok=(True, True)):
    # Trajectory 0: three search rounds then the answer (T = 4); trajectory 1: two searches and an answer (T = 3);
    # trajectory 2: answers at once (T = 1).
    layouts = [[(S, 1, 1)] * 3 + [(A, 1, 0)], [(S, 1, 1)] * 2 + [(A, 1, 0)], [(A, 2, 0)]]
    return _inputs(layouts, list(rewards) + [0.0], groups=[0, 0, 1], judge_u_S=u, judge_v_S=v,
                   judge_ok_B=list(ok) + [True])


def test_cwgrpo_alpha_inf_and_failure():
    # p = u·v: trajectory 0 rounds p = (1·1, 1·0, 1·1) = (1, 0, 1); final scores are ignored.
    u = [1, 1, 1, 0, 1, 1, 1, 1]
    v = [1, 0, 1, 0, 0, 0, 0, 0]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # group (1, 0): Â = ±0.7071058; trajectory 2 is alone: Â = 0
    # Success, α = ∞: c = p / Σp = (0.5, 0, 0.5); A_t = Â · c_t · (T − 1) = Â · (1.5, 0, 1.5); final: Â.
    # Failure (trajectory 1, T = 3): c = 1/2 each, A_t = −Â · 1/2 · 2 = −Â.
    res = _run("cwgrpo", _cw_batch(u, v))
    _expect(res.adv_S, [1.5 * a, 0.0, 1.5 * a, a, -a, -a, -a, 0.0])
    _expect(res.turn_S["weight"], [0.5, 0, 0.5, 0, 0.5, 0.5, 0, 0])
    # contributive_round_frac: of the judged rounds (non-final rounds of successes), the share with p = 1: 2 of
    # trajectory 0's 3; the failure's rounds and the final round are not judged. Not CriticSearch's good_turn_frac.
    assert res.metrics["contributive_round_frac"] == pytest.approx(2 / 3)
    assert "good_turn_frac" not in res.metrics
    assert res.metrics["weight_entropy"] == pytest.approx(math.log(2))  # −2 · 0.5 log 0.5


def test_cwgrpo_finite_alpha_softmax():
    u, v = [1, 1, 1, 0, 1, 1, 1, 1], [1, 0, 1, 0, 0, 0, 0, 0]
    cfg = CreditConfig()
    cfg.cwgrpo.alpha = 1.0
    # softmax(1·(1, 0, 1)) = (e, 1, e) / (2e + 1) = (0.4223188, 0.1553624, 0.4223188).
    e = math.e
    c = [e / (2 * e + 1), 1 / (2 * e + 1), e / (2 * e + 1)]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    res = _run("cwgrpo", _cw_batch(u, v), cfg)
    _expect(res.adv_S[:4], [a * c[0] * 3, a * c[1] * 3, a * c[2] * 3, a])


def test_cwgrpo_all_zero_switch():
    zeros = [0] * 8
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    # α = ∞ and p = (0, 0, 0) in the success: 'uniform' gives c = 1/3, A_t = Â; 'zero' gives A_t = 0.
    _expect(_run("cwgrpo", _cw_batch(zeros, zeros)).adv_S[:4], [a, a, a, a])
    cfg = CreditConfig()
    cfg.cwgrpo.all_zero = "zero"
    _expect(_run("cwgrpo", _cw_batch(zeros, zeros), cfg).adv_S[:4], [0, 0, 0, a])


def test_cwgrpo_success_by_and_judge_failure():
    u, v = [1, 0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1, 1, 1]
    # Rewards (0.8, 0.0): not R = 1, so by 'reward' trajectory 0 is a failure → uniform, A_t = Â.
    a = 0.4 / (math.sqrt(0.32) + 1e-6)
    res = _run("cwgrpo", _cw_batch(u, v, rewards=(0.8, 0.0)))
    _expect(res.adv_S[:4], [a, a, a, a])
    assert "contributive_round_frac" not in res.metrics  # no success, so no judged round (trajectory 1 has p = 1)
    # By 'advantage' (Â ≥ 0, the released code) it is a success: p = (1, 0, 0) → c = (1, 0, 0), A = (3Â, 0, 0).
    cfg = CreditConfig()
    cfg.cwgrpo.success_by = "advantage"
    res = _run("cwgrpo", _cw_batch(u, v, rewards=(0.8, 0.0)), cfg)
    _expect(res.adv_S[:4], [3 * a, 0, 0, a])
    assert res.metrics["contributive_round_frac"] == pytest.approx(1 / 3)
    # A success whose judge failed gets the uniform weights.
    a1 = 0.5 / (math.sqrt(0.5) + 1e-6)
    res = _run("cwgrpo", _cw_batch(u, v, ok=(False, True)))
    _expect(res.adv_S[:4], [a1, a1, a1, a1])
    assert res.metrics["judge_failure_rate"] == 1.0  # the one success that needed judging failed


def test_proceed_masks_and_chord_phi_flags():
    # Trajectory 0 succeeds (r = 1), trajectory 1 fails (r = 0); both have demonstration tokens.
    layouts = [[(S, 2, 1), (A, 2, 0)], [(S, 2, 1), (A, 1, 0)]]
    demo = [[[1, 0], [0, 1]], [[1, 1], [0]]]
    inputs = _inputs(layouts, [1.0, 0.0], demo=demo)
    res = _run("proceed", inputs)
    # Tokens: traj 0 = [d a o a d], traj 1 = [d d o a]. Failed demos masked; successful demos get φ.
    assert res.loss_mask_N.tolist() == [True, True, False, True, True, False, False, False, True]
    assert res.phi_mask_N.tolist() == [True, False, False, False, True, False, False, False, False]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    _expect(res.adv_S, [a, a, -a, -a])
    assert res.metrics["masked_token_frac"] == pytest.approx(2 / 7)
    # Both switches off: every action token counts with weight 1.
    cfg = CreditConfig()
    cfg.proceed.chord_phi, cfg.proceed.mask_failed_demo = False, False
    off = _run("proceed", inputs, cfg)
    assert off.loss_mask_N.tolist() == (inputs.seg_id_N >= 0).tolist() and not off.phi_mask_N.any()


def test_proceed_dapo_base_drops_degenerate_groups():
    layouts = [[(A, 2, 0)], [(A, 1, 0)], [(A, 1, 0)], [(A, 1, 0)]]
    inputs = _inputs(layouts, [1.0, 1.0, 1.0, 0.0], groups=[0, 0, 1, 1])
    cfg = CreditConfig()
    cfg.proceed.base = "dapo"
    # Group 0 has rewards (1, 1): all equal, its 3 tokens leave the loss; group 1 stays.
    assert _run("proceed", inputs, cfg).loss_mask_N.tolist() == [False, False, False, True, True]


def _ppo_batch(**kw):
    # One trajectory: search turn with 2 action + 2 observation tokens, then an answer with 2 tokens.
    return _inputs([[(S, 2, 2), (A, 2, 0)]], [1.0], values_N=[0.1, 0.2, 9.0, 9.0, 0.3, 0.4], **kw)


def test_ppo_gae_skips_observations():
    # γ = λ = 1: A_j = Σ_{k ≥ j} r_k − V_j = 1 − V_j on the action tokens: (0.9, 0.8, 0.7, 0.6);
    # the observation values (9.0) are never read. Returns = A + V = 1.
    res = _run("ppo", _ppo_batch())
    _expect(res.adv_N, [0.9, 0.8, 0, 0, 0.7, 0.6])
    _expect(res.returns_N, [1, 1, 0, 0, 1, 1])
    # γ = 0.5, λ = 1 over the action tokens (V = 0.1, 0.2, 0.3, 0.4):
    # δ4 = 1 − 0.4 = 0.6; δ3 = 0.5·0.4 − 0.3 = −0.1; δ2 = 0.5·0.3 − 0.2 = −0.05; δ1 = 0.5·0.2 − 0.1 = 0.
    # A4 = 0.6; A3 = −0.1 + 0.5·0.6 = 0.2; A2 = −0.05 + 0.5·0.2 = 0.05; A1 = 0 + 0.5·0.05 = 0.025.
    res = _run("ppo", _ppo_batch(), CreditConfig(gamma=0.5))
    _expect(res.adv_N, [0.025, 0.05, 0, 0, 0.2, 0.6])
    _expect(res.returns_N, [0.125, 0.25, 0, 0, 0.5, 1.0])


def test_ppo_kl_in_reward():
    # β = 0.1, logπold − logπref = (0.5, 0, ·, ·, 1.0, 0): token rewards (−0.05, 0, −0.1, 1).
    # γ = λ = 1: A_j = Σ_{k≥j} r_k − V_j; the suffix sums are (0.85, 0.9, 0.9, 1)
    # → (0.85 − 0.1, 0.9 − 0.2, 0.9 − 0.3, 1 − 0.4) = (0.75, 0.7, 0.6, 0.6).
    kw = dict(old_logp_N=[-0.5, -1.0, 0, 0, -1.0, -2.0], ref_logp_N=[-1.0, -1.0, 0, 0, -2.0, -2.0])
    res = _run("ppo", _ppo_batch(**kw), CreditConfig(kl_in_reward=0.1))
    _expect(res.adv_N, [0.75, 0.7, 0, 0, 0.6, 0.6])


def _pica_batch(f, f0=0.5, reward=0.7, values=None):
    # Three turns: search (2 action, 1 obs), search (1 action, 1 obs), answer (2 action).
    layouts = [[(S, 2, 1), (S, 1, 1), (A, 2, 0)]]
    return _inputs(layouts, [reward], prm_f0_B=[f0], prm_f_S=f, values_N=values or [0.0] * 7)


def test_pica_token_level_log_ratio():
    # f(0) = 0.5, f = (0.8, 0.4, 0.9).
    # r1 = log(0.8/0.5) = 0.4700036; r2 = log(0.4/0.8) = −0.6931472;
    # r3 = log(0.9/0.4) − 0.3·1.5^0 = 0.8109302 − 0.3 = 0.5109302 (penalty from turn 3).
    # R = 0.3·r + 1.5·r_out on the final turn: R1 = 0.1410011, R2 = −0.2079442, R3 = 0.1532791 + 1.05 = 1.2032791.
    R1, R2, R3 = 0.3 * math.log(1.6), 0.3 * math.log(0.5), 0.3 * (math.log(2.25) - 0.3) + 1.5 * 0.7
    # V = 0, γ = λ = 1: each action token gets the sum of the rewards from its own turn's end onward.
    res = _run("pica", _pica_batch([0.8, 0.4, 0.9]))
    g1, g2, g3 = R1 + R2 + R3, R2 + R3, R3
    _expect(res.adv_N, [g1, g1, 0, g2, 0, g3, g3])
    _expect(res.turn_S["turn_reward"], [R1, R2, R3])


def test_pica_clamp_penalty_growth_and_linear():
    # f = (0, 1, 1): clamped to (1e-4, 1 − 1e-4, 1 − 1e-4).
    # r1 = log(1e-4 / 0.5), r2 = log((1 − 1e-4) / 1e-4), r3 = log(1) − 0.3 = −0.3.
    res = _run("pica", _pica_batch([0.0, 1.0, 1.0]))
    R = [0.3 * math.log(1e-4 / 0.5), 0.3 * math.log((1 - 1e-4) / 1e-4), 0.3 * -0.3 + 1.05]
    _expect(res.turn_S["turn_reward"], R)
    # penalty_from_turn = 1: turns 1, 2, 3 pay 0.3·1.5^0, 0.3·1.5^1, 0.3·1.5^2 = 0.3, 0.45, 0.675.
    cfg = CreditConfig()
    cfg.pica.penalty_from_turn = 1
    res = _run("pica", _pica_batch([0.5, 0.5, 0.5]), cfg)
    _expect(res.turn_S["turn_reward"], [0.3 * -0.3, 0.3 * -0.45, 0.3 * -0.675 + 1.05])
    # linear (released code): r_t = 1 − h_t − 0.55 with h = (0.1, 0.6, 0.2) → (0.35, −0.15, 0.25 − 0.3).
    cfg = CreditConfig()
    cfg.pica.step_reward = "linear"
    inputs = _pica_batch([0.5] * 3)
    inputs.prm_hazard_S = torch.tensor([0.1, 0.6, 0.2])
    _expect(_run("pica", inputs, cfg).turn_S["turn_reward"], [0.3 * 0.35, 0.3 * -0.15, 0.3 * -0.05 + 1.05])


def test_pica_turn_level_eq13():
    # Values at the turns' first action tokens: V(s1) = 0.2 (token 0), V(s2) = 0.5 (token 3), V(s3) = 0.1 (token 5).
    values = [0.2, 9.0, 9.0, 0.5, 9.0, 0.1, 9.0]
    cfg = CreditConfig(gamma=0.9, lam=0.5)
    cfg.pica.gae_level = "turn"
    R1, R2, R3 = 0.3 * math.log(1.6), 0.3 * math.log(0.5), 0.3 * (math.log(2.25) - 0.3) + 1.05
    # δ3 = R3 + 0.9·0 − 0.1; δ2 = R2 + 0.9·0.1 − 0.5; δ1 = R1 + 0.9·0.5 − 0.2; Ã_t = δ_t + (0.9·0.5)·Ã_{t+1}.
    d3, d2, d1 = R3 - 0.1, R2 + 0.09 - 0.5, R1 + 0.45 - 0.2
    a3 = d3
    a2 = d2 + 0.45 * a3
    a1 = d1 + 0.45 * a2
    res = _run("pica", _pica_batch([0.8, 0.4, 0.9], values=values), cfg)
    _expect(res.adv_S, [a1, a2, a3])
    # Value targets Ã_t + V(s_t) on every action token of turn t.
    _expect(res.returns_N, [a1 + 0.2, a1 + 0.2, 0, a2 + 0.5, 0, a3 + 0.1, a3 + 0.1])


def test_unknown_switch_values_are_errors():
    cfg = CreditConfig()
    cfg.pica.gae_level = "episode"
    with pytest.raises(ValueError, match="gae_level"):
        compute_advantages("pica", _pica_batch([0.5] * 3), cfg)
    cfg = CreditConfig()
    cfg.critic.on_failure = "retry"
    with pytest.raises(ValueError, match="on_failure"):
        compute_advantages("criticsearch", _critic_batch(), cfg)
    with pytest.raises(ValueError, match="judge_u_S"):
        compute_advantages("cwgrpo", _critic_batch(), CreditConfig())
