"""IG-Search's estimator (docs/methods.md §11): the vectorised code against its loop reference on random batches,
the mapping from a gain to its shaped value on given numbers, a hand-worked batch, and its invariants."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastcredit.config import ConfigError, load_config
from fastcredit.config.credit import CreditConfig
from fastcredit.credit import CreditInputs, compute_advantages, estimator_needs, get_estimator
from fastcredit.credit.igsearch import shape_information_gain
from fastcredit.rollout.trajectory import Turn, from_turns

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def igsearch_inputs(draw):
    """Groups of 1-6 trajectories of 0-4 search / invalid turns (some never search), actions of 0-6 tokens, query
    spans anywhere inside a search's action (empty ones too), gains that are NaN, inside or outside the dead zone."""
    trajs, groups, rewards, ems, spans = [], [], [], [], []
    reward_kind = draw(st.sampled_from(["binary", "tied", "graded", "all_fail"]))
    for g in range(draw(st.integers(1, 3))):
        for _ in range(draw(st.integers(1, 6))):
            turns = []
            for _ in range(draw(st.integers(0, 4))):
                kind = draw(st.sampled_from(["search", "search", "invalid"]))
                a = draw(st.integers(0, 6))
                turns.append(Turn([5] * a, kind, [7] * draw(st.integers(0, 2))))
                q = draw(st.integers(0, a)) if kind == "search" else 0
                first = draw(st.integers(0, a - q))
                spans.append((first, q))
            turns.append(Turn([5] * draw(st.integers(0, 3)), draw(st.sampled_from(["answer", "truncated"]))))
            spans.append((0, 0))
            trajs.append(turns)
            groups.append(g)
            em = 0.0 if reward_kind == "all_fail" else float(draw(st.integers(0, 1)))
            ems.append(em)
            rewards.append({"binary": em, "tied": 1.0, "all_fail": 0.0,
                            "graded": draw(st.sampled_from([0.0, 0.2, 0.8, 1.0]))}[reward_kind])
    batch = from_turns(trajs, group_id=groups, em=ems)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ig_S = 3 * torch.randn(batch.num_turns, generator=gen)
    small = torch.rand(batch.num_turns, generator=gen) < 0.2
    ig_S[small] = 0.05 * torch.randn(int(small.sum()), generator=gen)  # in or near the dead zone
    ig_S[torch.rand(batch.num_turns, generator=gen) < 0.2] = math.nan
    return CreditInputs.from_batch(batch, rewards, ig_S=ig_S,
                                   seg_query_start_S=torch.tensor([f for f, _ in spans], dtype=torch.int64),
                                   seg_query_len_S=torch.tensor([q for _, q in spans], dtype=torch.int64))


@st.composite
def igsearch_configs(draw):
    cfg = CreditConfig()
    cfg.norm_by_std = draw(st.booleans())
    c = cfg.igsearch
    c.delta = draw(st.sampled_from([0.0, 0.1, 1.0]))
    c.neg_scale = draw(st.sampled_from([0.0, 0.5, 1.0]))
    c.clip = draw(st.sampled_from([0.3, 1.0, 5.0]))
    c.alpha = draw(st.sampled_from([0.0, 1.0, 2.5]))
    return cfg


@SETTINGS
@given(igsearch_inputs(), igsearch_configs())
def test_igsearch_matches_reference(inputs, cfg):
    vec = compute_advantages("igsearch", inputs, cfg)
    ref = get_estimator("igsearch", reference=True)(inputs, cfg)
    assert vec.adv_S is None and vec.adv_N.dtype == torch.float32
    torch.testing.assert_close(vec.adv_N.double(), ref.adv_N.double(), rtol=1e-6, atol=1e-6)
    assert all(math.isfinite(v) for v in vec.metrics.values()), vec.metrics


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(igsearch_inputs(), igsearch_configs())
def test_alpha_zero_is_grpo(inputs, cfg):
    cfg.igsearch.alpha = 0.0
    got = compute_advantages("igsearch", inputs, cfg).adv_N
    assert torch.equal(got, compute_advantages("grpo", inputs, cfg).token_advantages(inputs.seg_id_N))


def test_shaping_on_given_values():
    """Dead zone (|IG| < δ, so |IG| = δ is outside it), the negative side times λ, then c·tanh(g / c)."""
    ig = torch.tensor([0.05, -0.05, 0.1, 0.3, -0.3, 2.0, -4.0, 0.0])
    got = shape_information_gain(ig, delta=0.1, neg_scale=0.5, clip=1.0)
    want = [0.0, 0.0, math.tanh(0.1), math.tanh(0.3), math.tanh(-0.15), math.tanh(2.0), math.tanh(-2.0), 0.0]
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(want, abs=1e-7)
    got = shape_information_gain(torch.tensor([0.05, -0.6, 3.0]), delta=0.0, neg_scale=1.0, clip=0.5)
    assert got.tolist() == pytest.approx([0.5 * math.tanh(0.1), 0.5 * math.tanh(-1.2), 0.5 * math.tanh(6.0)])
    # the clip bounds the result: |ĨG| < c however large the gain
    assert float(shape_information_gain(torch.tensor([1e6]), 0.1, 0.5, 2.0)) == pytest.approx(2.0)
    assert float(shape_information_gain(torch.tensor([-1e6]), 0.1, 0.0, 2.0)) == 0.0  # λ = 0: no negative side


def _hand_batch(ig):
    """Group 0: a success that searched twice (queries of 2 and 3 tokens) and a failure that never searched; group 1:
    two failures, one with a search (a query of 1 token), one with an invalid turn (a span and a gain it ignores).
    Turns: 0-2 trajectory 0, 3 trajectory 1, 4-5 trajectory 2, 6-7 trajectory 3."""
    batch = from_turns([
        [Turn([1, 2, 3, 4], "search", [9]), Turn([1, 2, 3, 4, 5], "search", [9, 9]), Turn([6, 6], "answer")],
        [Turn([6, 6, 6], "answer")],
        [Turn([1, 2, 3], "search", [9]), Turn([6], "answer")],
        [Turn([1, 1], "invalid", [8]), Turn([6], "truncated")],
    ], group_id=[0, 0, 1, 1], em=[1.0, 0.0, 0.0, 0.0])
    return CreditInputs.from_batch(batch, [1.0, 0.0, 0.0, 0.0], ig_S=torch.tensor(ig),
                                   seg_query_start_S=torch.tensor([1, 1, 0, 0, 1, 0, 1, 0]),
                                   seg_query_len_S=torch.tensor([2, 3, 0, 0, 1, 0, 1, 0]))


def test_hand_worked_batch():
    """δ 0.1, λ 0.5, c 1, α 2. Group 0: rewards 1, 0, deviations ±0.5, std √0.5, so Â = ±0.5 / (√0.5 + ε);
    group 1 all fail: Â = 0."""
    cfg = CreditConfig()
    cfg.igsearch.alpha = 2.0
    nan = math.nan
    res = compute_advantages("igsearch", _hand_batch([0.5, -0.8, nan, nan, 0.05, nan, 3.0, nan]), cfg)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    q1 = 2.0 * math.tanh(0.5) / 2  # turn 0: 0.5 outside the dead zone, on query tokens 1-2 of 4
    q2 = 2.0 * math.tanh(-0.4) / 3  # turn 1: -0.8 · λ = -0.4, on tokens 1-3 of 5
    want = ([a, a + q1, a + q1, a] + [0.0] + [a, a + q2, a + q2, a + q2, a] + [0.0] * 2 + [a, a]  # trajectory 0
            + [-a] * 3  # trajectory 1 never searched: GRPO's Â
            + [0.0] * 3 + [0.0] + [0.0]  # trajectory 2: its gain 0.05 is inside the dead zone
            + [0.0] * 2 + [0.0] + [0.0])  # trajectory 3: an invalid turn gets nothing, its gain 3.0 unread
    assert res.adv_N.tolist() == pytest.approx(want, abs=1e-6)
    m = res.metrics
    assert m["ig_scored_frac"] == 1.0 and m["ig_dead_frac"] == pytest.approx(1 / 3)
    assert m["ig_positive_frac"] == pytest.approx(2 / 3)
    assert m["ig_mean"] == pytest.approx((0.5 - 0.8 + 0.05) / 3, rel=1e-6)
    # group 1 failed everywhere and its one gain is in the dead zone: no all-fail group moves
    assert m["all_fail_group_frac"] == 0.5 and m["all_fail_nonzero_frac"] == 0.0
    res = compute_advantages("igsearch", _hand_batch([0.5, -0.8, nan, nan, 0.4, nan, 3.0, nan]), cfg)
    assert res.adv_N[18].item() == pytest.approx(2.0 * math.tanh(0.4))  # trajectory 2's one query token
    assert res.adv_N[17].item() == 0.0 and res.metrics["all_fail_nonzero_frac"] == 1.0
    assert compute_advantages("grpo", _hand_batch([nan] * 8), cfg).metrics["all_fail_nonzero_frac"] == 0.0


def test_a_query_outside_its_action_is_refused():
    inputs = _hand_batch([0.5] * 8)
    inputs.seg_query_len_S = torch.tensor([4, 3, 0, 0, 1, 0, 1, 0])  # 1 + 4 > the turn's 4 action tokens
    with pytest.raises(ValueError, match=r"turn 0: query tokens \[1, 5\) lie outside its 4 action tokens"):
        compute_advantages("igsearch", inputs, CreditConfig())
    inputs = _hand_batch([0.5] * 8)
    inputs.ig_S = None
    with pytest.raises(ValueError, match="needs ig_S"):
        compute_advantages("igsearch", inputs, CreditConfig())


def test_needs_and_config_ranges():
    needs = estimator_needs("igsearch")
    assert needs.gold_answers and needs.answer_scoring and needs.judge is None and not needs.value_model
    assert needs.inputs == ("ig_S", "seg_query_start_S", "seg_query_len_S")
    with pytest.raises(ValueError, match="answer_scoring scores the gold answers"):
        type(needs)(answer_scoring=True)
    c = load_config(None, ["credit.estimator=igsearch"]).credit.igsearch
    assert (c.delta, c.neg_scale, c.clip, c.alpha, c.n_random, c.max_golds) == (0.1, 0.5, 1.0, 1.0, 3, 3)
    for bad, key in (("neg_scale=1.5", "neg_scale"), ("clip=0", "clip"), ("delta=-0.1", "delta"),
                     ("alpha=-1", "alpha"), ("n_random=0", "n_random"), ("max_golds=0", "max_golds")):
        with pytest.raises(ConfigError, match=f"credit.igsearch.{key} must lie in"):
            load_config(None, [f"credit.igsearch.{bad}"])
