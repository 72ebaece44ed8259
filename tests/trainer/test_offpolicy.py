"""The decoupled PPO correction (fastcredit.trainer.offpolicy): a batch without stale turns trains exactly as
before; stale tokens get π_prox / π_behav, truncated or masked at the cap, checked against a per-token loop written
from the equation; the staleness bound and missing log-probs stop the step; versions travel with the batch."""
import dataclasses

import pytest
import torch

from fastcredit.config.loss import LossConfig
from fastcredit.kernels.turn_surrogate import turn_surrogate_loss
from fastcredit.rollout.trajectory import TrajectoryError, Turn, concat, from_turns, select, to_turns
from fastcredit.trainer.loss import loss_counts, policy_loss_torch
from fastcredit.trainer.offpolicy import StalenessError, behaviour_correction, behaviour_weights, token_lag, turn_lag


def _batch(versions, seed=0):
    """Three trajectories, five turns (versions in packed order); engine log-probs on every token."""
    g = torch.Generator().manual_seed(seed)
    v = iter(versions)
    b = from_turns([[Turn([5, 6, 7], "search", [1, 2], version=next(v)), Turn([8, 9], "answer", version=next(v))],
                    [Turn([5, 6], "search", [3], version=next(v)), Turn([4], "answer", version=next(v))],
                    [Turn([7, 7, 7, 7], "answer", version=next(v))]], group_id=[0, 0, 1])
    b.rollout_logp_N = -torch.rand(b.num_tokens, generator=g) * 2
    return b


def _logps(b, seed=1):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 2
    logp = (prox + 0.3 * torch.randn(b.num_tokens, generator=g, dtype=torch.float64)).requires_grad_(True)
    return logp, prox


ADV_S = torch.tensor([1.0, 2.0, -1.0, -0.5, 0.7], dtype=torch.float64)


def _loss(b, logp, prox, weight_N, cfg):
    counts = loss_counts(b.seg_id_N, b.seg_traj_S)
    return policy_loss_torch(logp, prox, b.seg_id_N, b.seg_traj_S, counts, cfg, adv_S=ADV_S, weight_N=weight_N)[0]


def _reference(b, logp, prox, behav, version, cap, mode, clip=0.2):
    """Token by token, from the equation: token-mean of w · max(−A·r, −A·clip(r)), r = π/π_prox,
    w = π_prox/π_behav on stale tokens (min(w, C), or 0 when w > C under mask), 1 on fresh ones."""
    total, n = 0.0, 0
    for i in range(b.num_tokens):
        s = int(b.seg_id_N[i])
        if s < 0:
            continue
        n += 1
        a = float(ADV_S[s])
        r = torch.exp(logp[i] - prox[i])
        pg = torch.maximum(-a * r, -a * r.clamp(1 - clip, 1 + clip))
        w = 1.0
        if version - int(b.seg_version_S[s]) > 0:
            w = float(torch.exp(prox[i] - behav[i]))
            w = min(w, cap) if mode == "truncate" else (w if w <= cap else 0.0)
        total = total + w * pg
    return total / n


def test_without_stale_turns_the_loss_is_todays_bit_for_bit():
    """Lag 0 everywhere: no weight at all, even though the engine's log-probs differ from the trainer's (as
    vLLM's bf16 ones do), so the loss and its gradient are exactly those of a batch without versions."""
    b = _batch([3, 3, 3, 3, 3])
    logp, prox = _logps(b)
    w, m = behaviour_correction(b, prox.float(), 3, 0, 5.0)
    assert w is None and m["offpolicy/version_lag_max"] == 0.0 and m["offpolicy/stale_token_frac"] == 0.0
    cfg = LossConfig(kl_coef=0.0)
    plain = dataclasses.replace(b, seg_version_S=None, rollout_logp_N=None)
    assert behaviour_correction(plain, prox.float(), 3, 0, 5.0) == (None, {})
    a = _loss(b, logp, prox, w, cfg)
    ga, = torch.autograd.grad(a, logp)
    c = _loss(plain, logp, prox, None, cfg)
    gc, = torch.autograd.grad(c, logp)
    assert torch.equal(a, c) and torch.equal(ga, gc)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_stale_tokens_are_weighted_as_the_equation_says(mode):
    version, cap = 4, 1.5
    b = _batch([4, 3, 2, 4, 3])  # lags 0, 1, 2, 0, 1
    logp, prox = _logps(b)
    b.rollout_logp_N = (prox + torch.tensor([-0.9, 0.2, -0.1] * 5)[:b.num_tokens].double()).float()  # some w above C
    w, m = behaviour_correction(b, prox.float(), version, 2, cap, mode)
    assert m["offpolicy/version_lag_max"] == 2.0 and m["offpolicy/version_lag_mean"] == pytest.approx(0.8)
    got = _loss(b, logp, prox, w.double(), LossConfig(kl_coef=0.0))
    ref = _reference(b, logp, prox, b.rollout_logp_N.double(), version, cap, mode)
    assert float(got) == pytest.approx(float(ref), rel=1e-6)
    g_got, = torch.autograd.grad(got, logp)
    g_ref, = torch.autograd.grad(ref, logp)
    assert torch.allclose(g_got, g_ref, rtol=1e-6, atol=1e-9)
    stale = (token_lag(b, turn_lag(b, version)) > 0) & (b.seg_id_N >= 0)
    assert m["offpolicy/stale_token_frac"] == pytest.approx(float(stale.sum()) / int((b.seg_id_N >= 0).sum()))
    raw = torch.exp(prox.float() - b.rollout_logp_N)
    assert m["offpolicy/capped_frac"] == pytest.approx(float((raw[stale] > cap).float().mean()))
    assert 0 < m["offpolicy/capped_frac"] < 1  # both sides of the cap are exercised
    assert torch.all(w[~stale] == 1.0)


def test_the_fused_kernel_takes_the_behaviour_weight_as_its_token_weight():
    b = _batch([2, 1, 1, 2, 0])
    logp, prox = _logps(b)
    w, _ = behaviour_correction(b, prox.float(), 2, 2, 5.0)
    cfg = LossConfig(kl_coef=0.0)
    counts = loss_counts(b.seg_id_N, b.seg_traj_S)
    args = (logp.float().detach(), prox.float(), b.seg_id_N, b.seg_traj_S, counts, cfg)
    ref = policy_loss_torch(*args, adv_S=ADV_S.float(), weight_N=w)[0]
    fused = turn_surrogate_loss(*args, adv_S=ADV_S.float(), weight_N=w)[0]
    assert float(fused) == pytest.approx(float(ref), rel=1e-5, abs=1e-7)


def test_bounds_and_missing_log_probs_stop_the_step():
    b = _batch([5, 5, 3, 5, 5])
    with pytest.raises(StalenessError, match=r"turn 2 of trajectory 1 .* version 3 .* lag 2, outside \[0, 1\]"):
        behaviour_correction(b, torch.zeros(b.num_tokens), 5, 1, 5.0)
    with pytest.raises(StalenessError, match="lag -1"):  # a turn from a version the trainer has not made
        behaviour_correction(_batch([5, 6, 5, 5, 5]), torch.zeros(b.num_tokens), 5, 2, 5.0)
    b.rollout_logp_N = None
    with pytest.raises(StalenessError, match="no behaviour log-probs"):
        behaviour_correction(b, torch.zeros(b.num_tokens), 5, 2, 5.0)
    with pytest.raises(ValueError, match="must be > 1"):
        behaviour_weights(torch.zeros(2), torch.zeros(2), torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="unknown loss.behaviour_weight_mode"):
        behaviour_weights(torch.zeros(2), torch.zeros(2), torch.ones(2), 2.0, "clip")


def test_observation_padding_never_reaches_the_weight():
    b = _batch([0, 0, 0, 0, 0])
    prox = torch.where(b.seg_id_N >= 0, torch.tensor(-1.0), torch.tensor(float("-inf")))
    w, _ = behaviour_correction(b, prox, 1, 1, 5.0)
    assert torch.isfinite(w).all() and torch.all(w[b.seg_id_N < 0] == 1.0)


def test_versions_travel_with_the_batch():
    b = _batch([4, 3, 2, 4, 3])
    assert b.seg_version_S.tolist() == [4, 3, 2, 4, 3]
    assert select(b, torch.tensor([2, 0])).seg_version_S.tolist() == [3, 4, 3]
    assert concat([b, select(b, torch.tensor([1]))]).seg_version_S.tolist() == [4, 3, 2, 4, 3, 2, 4]
    assert [t.version for traj in to_turns(b) for t in traj] == [4, 3, 2, 4, 3]
    assert from_turns([[Turn([1], "answer")]]).seg_version_S is None
    with pytest.raises(TrajectoryError, match="turn 1 .* no policy version"):
        from_turns([[Turn([1], "search", [2], version=0), Turn([1], "answer")]])
    with pytest.raises(TrajectoryError, match=r"seg_version_S must be int64 of shape \[5\]"):
        dataclasses.replace(b, seg_version_S=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TrajectoryError, match="got torch.float32"):
        dataclasses.replace(b, seg_version_S=torch.zeros(5))


def test_old_log_probs_come_from_the_rollout_only_where_they_are_pi_old():
    """loss.old_logprobs: auto takes the rollout's on the HF engine computing in float32 for a fresh, unrefined
    batch, and recomputes otherwise; rollout says why a batch does not qualify; recompute never takes them."""
    from fastcredit.config import load_config
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.trainer.step import old_from_rollout

    def cfg(*overrides):
        return load_config("configs/debug.yaml", list(overrides))

    info = DistInfo()
    fresh = _batch([3] * 5)
    assert old_from_rollout(cfg(), info, fresh, 3)
    assert not old_from_rollout(cfg("loss.old_logprobs=recompute"), info, fresh, 3)
    gpu = DistInfo(device=torch.device("cuda", 0))
    assert not old_from_rollout(cfg("model.dtype=bfloat16"), gpu, fresh, 3)  # half precision on a GPU
    assert old_from_rollout(cfg("model.dtype=float32"), gpu, fresh, 3)
    assert not old_from_rollout(cfg("rollout.engine=vllm"), info, fresh, 3)
    assert old_from_rollout(cfg("rollout.engine=vllm", "loss.old_logprobs=rollout"), info, fresh, 3)
    stale, refined, missing = _batch([3, 2, 3, 3, 3]), _batch([3] * 5), _batch([3] * 5)
    refined.demo_mask_N[int((refined.seg_id_N == 1).nonzero()[0])] = True
    missing.rollout_logp_N = None
    for b, why in ((stale, "older than version 3|other than version 3"), (refined, "refined by ProCeed"),
                   (missing, "no log-probs")):
        assert not old_from_rollout(cfg(), info, b, 3)
        with pytest.raises(ValueError, match=f"loss.old_logprobs=rollout: .*({why})"):
            old_from_rollout(cfg("loss.old_logprobs=rollout"), info, b, 3)
