"""The estimator registry, the input / result types, the config conventions, and the logging metrics."""
import dataclasses
import math
import typing

import pytest
import torch

from fastcredit.credit import CreditInputs, CreditResult, compute_advantages, estimator_names, get_estimator
from fastcredit.config import credit as credit_config
from fastcredit.config.credit import CreditConfig
from fastcredit.config.loss import LossConfig
from fastcredit.credit.metrics import estimator_metrics
from fastcredit.rollout.trajectory import Turn, from_turns

METHODS = ["criticsearch", "cwgrpo", "gigpo", "grpo", "igsearch", "pica", "ppo", "proceed"]


def test_registry_names_and_unknown_name():
    assert estimator_names() == METHODS
    with pytest.raises(KeyError, match="valid: criticsearch, cwgrpo, gigpo, grpo, igsearch, pica, ppo, proceed"):
        get_estimator("gae")
    for name in METHODS:
        assert get_estimator(name) is not get_estimator(name, reference=True)
    # The config's Literal lists exactly the registered names.
    assert sorted(typing.get_args(typing.get_type_hints(CreditConfig)["estimator"])) == METHODS


def _all_dataclasses():
    return [obj for obj in vars(credit_config).values() if dataclasses.is_dataclass(obj) and isinstance(obj, type)]


@pytest.mark.parametrize("cls", _all_dataclasses(), ids=lambda c: c.__name__)
def test_config_conventions(cls):
    """Plain dataclasses; every field has a default and a one-line help; only the allowed types."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help") and "\n" not in f.metadata["help"], f.name
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
        t = hints[f.name]
        args = typing.get_args(t)
        ok = (t in (int, float, str, bool) or dataclasses.is_dataclass(t)
              or typing.get_origin(t) is typing.Literal
              or (typing.get_origin(t) is typing.Union and set(args) - {type(None)} <= {int, float, str, bool}))
        assert ok, f"{cls.__name__}.{f.name}: {t}"
    cls()


def test_config_defaults_from_methods_md():
    c, lo = CreditConfig(), LossConfig()
    assert (c.norm_by_std, c.eps, c.gamma, c.lam, c.kl_in_reward) == (True, 1e-6, 1.0, 1.0, 0.0)
    assert (c.critic.retries, c.critic.on_failure) == (2, "outcome")
    assert (c.criticsearch.alpha, c.criticsearch.eps_c, c.criticsearch.gold_answer) == (0.25, 1e-6, True)
    assert math.isinf(c.cwgrpo.alpha) and (c.cwgrpo.all_zero, c.cwgrpo.success_by) == ("uniform", "reward")
    p = c.pica
    assert (p.step_reward, p.gae_level, p.s_step, p.s_out, p.lambda_p, p.alpha_p) == ("log_ratio", "token", 0.3,
                                                                                       1.5, 0.3, 1.5)
    assert (p.penalty_from_turn, p.hazard_bias, p.f_clamp) == (3, 0.55, 1e-4)
    assert (c.proceed.base, c.proceed.chord_phi, c.proceed.mask_failed_demo) == ("grpo", True, True)
    assert (lo.clip_low, lo.clip_high, lo.dual_clip, lo.kl_clamp, lo.agg_mode) == (0.2, 0.2, None, 10.0, "token-mean")


def _inputs(**extra):
    batch = from_turns([[Turn([1, 1], "search", [2]), Turn([1], "answer")], [Turn([1, 1, 1], "truncated")]],
                       group_id=[0, 0], em=[1.0, 0.0])
    return CreditInputs.from_batch(batch, [1.0, 0.0], **extra)


def test_from_batch_reads_the_layout_and_validate_names_the_bad_field():
    inputs = _inputs()
    assert (inputs.B, inputs.S, inputs.N) == (2, 3, 7)
    assert inputs.seg_kind_S.tolist() == [0, 1, 3] and inputs.reward_B.dtype == torch.float32
    with pytest.raises(ValueError, match=r"values_N must have shape \[7\]"):
        compute_advantages("ppo", _inputs(values_N=torch.zeros(6)), CreditConfig())
    with pytest.raises(ValueError, match="needs values_N"):
        compute_advantages("ppo", _inputs(), CreditConfig())


def test_common_metrics_by_turn_kind():
    # Advantages per turn: search 1.0 (2 tokens), answer −1.0 (1 token), truncated 0.0 (3 tokens).
    inputs = _inputs()
    result = CreditResult(adv_S=torch.tensor([1.0, -1.0, 0.0]))
    m = estimator_metrics(inputs, result)
    assert m["adv_mean/search"] == 1.0 and m["adv_std/search"] == 0.0 and m["adv_mean/answer"] == -1.0
    assert m["adv_mean/truncated"] == 0.0 and "adv_mean/invalid" not in m
    assert m["zero_adv_frac"] == pytest.approx(3 / 6)
    assert m["adv_mean"] == pytest.approx((2 - 1) / 6)
    # the answer turn of the successful trajectory is pushed down: 1 of the 3 nonzero tokens goes against its outcome
    assert m["against_outcome_frac"] == pytest.approx(1 / 3)
    # A loss mask restricts the statistics to the tokens that count.
    mask = torch.tensor([True, False, False, True, False, False, False])
    m = estimator_metrics(inputs, CreditResult(adv_S=torch.tensor([1.0, -1.0, 0.0]), loss_mask_N=mask))
    assert m["adv_mean"] == 0.0 and m["zero_adv_frac"] == 0.0 and "adv_mean/truncated" not in m
    assert m["against_outcome_frac"] == pytest.approx(1 / 2)
    # a group whose rewards are all equal has no outcome direction to go against
    same = CreditInputs.from_batch(from_turns([[Turn([1], "answer")], [Turn([1], "answer")]], group_id=[0, 0],
                                              em=[1.0, 1.0]), [1.0, 1.0])
    assert "against_outcome_frac" not in estimator_metrics(same, CreditResult(adv_S=torch.tensor([1.0, -1.0])))


def test_all_fail_groups_with_a_nonzero_advantage():
    """Of the groups whose samples all failed (EM 0), the share in which some counted token's advantage is not 0;
    absent without such a group."""
    batch = from_turns([[Turn([1, 1], "answer")], [Turn([1], "answer")], [Turn([1], "answer")],
                        [Turn([1, 1], "answer")], [Turn([1], "answer")]], group_id=[0, 0, 1, 1, 2],
                       em=[0.0, 0.0, 0.0, 0.0, 1.0])
    inputs = CreditInputs.from_batch(batch, [0.2, 0.0, 0.0, 0.0, 1.0])
    # group 0 failed but one token moves, group 1 failed and nothing moves, group 2 succeeded
    m = estimator_metrics(inputs, CreditResult(adv_N=torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 1.0])))
    assert m["all_fail_group_frac"] == pytest.approx(2 / 3) and m["all_fail_nonzero_frac"] == 0.5
    # masked tokens do not count
    mask = torch.tensor([True, False, True, True, True, True, True])
    m = estimator_metrics(inputs, CreditResult(adv_N=torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 1.0]),
                                               loss_mask_N=mask))
    assert m["all_fail_nonzero_frac"] == 0.0
    assert compute_advantages("grpo", inputs, CreditConfig()).metrics["all_fail_nonzero_frac"] == 0.5  # 0.2 vs 0
    assert "all_fail_nonzero_frac" not in estimator_metrics(_inputs(), CreditResult(adv_S=torch.zeros(3)))


def test_grpo_reports_degenerate_groups():
    m = compute_advantages("grpo", _inputs(), CreditConfig()).metrics
    assert m["degenerate_group_frac"] == 0.0 and m["adv_mean/search"] > 0 and m["against_outcome_frac"] == 0.0


def test_each_estimator_declares_what_it_needs():
    from fastcredit.credit import estimator_needs

    table = {n: estimator_needs(n) for n in METHODS}
    assert {n for n, x in table.items() if x.value_model} == {"ppo", "pica"}
    assert {n: x.judge for n, x in table.items() if x.judge} == {"criticsearch": "critic", "cwgrpo": "round_judge",
                                                                  "pica": "prm"}
    assert [n for n, x in table.items() if x.proceed_rollout] == ["proceed"]
    assert table["cwgrpo"].inputs == ("judge_u_S", "judge_v_S")
    with pytest.raises(KeyError, match="valid: criticsearch"):
        estimator_needs("gae")
    with pytest.raises(ValueError, match="unknown judge kind"):
        type(table["grpo"])(judge="oracle")
    with pytest.raises(ValueError, match="unknown CreditInputs fields: judge_w_S"):
        type(table["grpo"])(inputs=("judge_w_S",))
