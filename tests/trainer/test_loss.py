"""The torch reference policy loss and value loss: hand-checked terms, aggregation modes, and
gradient equality however a batch is split across micro-batches and ranks."""
import dataclasses
import math
import sys
import types

import pytest
import torch

import fastcredit.trainer.loss
from fastcredit.config.loss import LossConfig
from fastcredit.trainer.loss import AGG_MODES, LossCounts, loss_counts, policy_loss, policy_loss_torch, value_loss
from fastcredit.rollout.trajectory import Turn, from_turns


def _cfg(**kw):
    return dataclasses.replace(LossConfig(kl_coef=0.0), **kw)


def _tiny():
    # Trajectory 0: search turn, 2 action tokens (A = 1) + 1 observation; answer turn, 1 token (A = 2).
    # Trajectory 1: answer turn, 2 tokens (A = −1). Token order: [a a o a | a a].
    return from_turns([[Turn([1, 1], "search", [2]), Turn([1], "answer")], [Turn([1, 1], "answer")]])


def _tiny_loss(mode, **kw):
    b = _tiny()
    logp = torch.full((b.num_tokens,), -1.0)
    counts = loss_counts(b.seg_id_N, b.seg_traj_S, kw.get("loss_mask_N"))
    loss, _ = policy_loss_torch(logp, logp.clone(), b.seg_id_N, b.seg_traj_S, counts, _cfg(agg_mode=mode),
                                adv_S=torch.tensor([1.0, 2.0, -1.0]), **kw)
    return float(loss)


@pytest.mark.parametrize("mode, expected", [
    # ρ = 1, so every token's loss is −A: [−1, −1, (obs), −2, 1, 1].
    ("token-mean", (-1 - 1 - 2 + 1 + 1) / 5),  # = −0.4
    ("seq-mean-token-mean", ((-1 - 1 - 2) / 3 + (1 + 1) / 2) / 2),  # = (−4/3 + 1) / 2 = −1/6
    ("seq-mean-token-sum", ((-1 - 1 - 2) + (1 + 1)) / 2),  # = −1
    ("turn-mean", ((-1 - 1) / 2 + (-2) / 1 + (1 + 1) / 2) / 3),  # = (−1 − 2 + 1) / 3 = −2/3
])
def test_aggregation_modes_hand_checked(mode, expected):
    assert _tiny_loss(mode) == pytest.approx(expected)


def test_weights_scale_losses_but_not_counts_and_masks_remove_tokens():
    w = torch.tensor([0.5, 1, 1, 1, 1, 1])
    # Weight 0.5 on token 0: (−0.5 − 1 − 2 + 1 + 1) / 5 = −0.3 (the count stays 5).
    assert _tiny_loss("token-mean", weight_N=w) == pytest.approx(-0.3)
    mask = torch.tensor([True, True, True, True, False, True])
    # Token 4 masked: (−1 − 1 − 2 + 1) / 4 = −0.75; per sequence: (−4/3 + 1/1) / 2 = −1/6.
    assert _tiny_loss("token-mean", loss_mask_N=mask) == pytest.approx(-0.75)
    assert _tiny_loss("seq-mean-token-mean", loss_mask_N=mask) == pytest.approx(-1 / 6)


def _single(adv, log_ratio, cfg, ref_d=None, entropy=None, phi=False, logp0=-1.0):
    """One action token; returns (loss, metrics, d loss / d logp)."""
    b = from_turns([[Turn([1], "answer")]])
    logp = torch.tensor([logp0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([logp0 - log_ratio], dtype=torch.float64)
    kw = {"adv_N": torch.tensor([adv], dtype=torch.float64)}
    if ref_d is not None:
        kw["ref_logp_N"] = torch.tensor([logp0 + ref_d], dtype=torch.float64)
    if entropy is not None:
        kw["entropy_N"] = entropy
    if phi:
        kw["phi_mask_N"] = torch.tensor([True])
    loss, metrics = policy_loss_torch(logp, old, b.seg_id_N, b.seg_traj_S, LossCounts(1, 1, 1), cfg, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return float(loss.detach()), metrics, float(grad)


def test_dual_clip():
    # A = −1, ρ = 5: max(−A·ρ, −A·clip(ρ, 0.8, 1.2)) = max(5, 1.2) = 5; the dual clip caps it at −A·c = 3.
    loss, _, grad = _single(-1.0, math.log(5.0), _cfg())
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)  # d(−A·ρ)/dlogπ = −A·ρ = 5
    loss, m, grad = _single(-1.0, math.log(5.0), _cfg(dual_clip=3.0))
    assert loss == pytest.approx(3.0) and grad == 0.0 and float(m["clipfrac_dual"]) == 1.0
    # A > 0 is never dual-clipped: A = 1, ρ = 5 → max(−5, −1.2) = −1.2.
    assert _single(1.0, math.log(5.0), _cfg(dual_clip=3.0))[0] == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="dual_clip"):
        _single(-1.0, 0.0, _cfg(dual_clip=0.5))


def test_clip_fractions_and_separate_bounds():
    b = from_turns([[Turn([1] * 6, "answer")]])
    # (A, ρ): (1, 1.5) high bound binds; (1, 0.5) none; (−1, 0.5) low bound binds; (−1, 1.5) none;
    # (1, 1.1) none; (1, 1.25) binds with clip_high 0.2, not with DAPO's 0.28.
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 1.0])
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1, 1.25])
    logp = torch.zeros(6)
    counts = loss_counts(b.seg_id_N, b.seg_traj_S)
    _, m = policy_loss_torch(logp, -ratio.log(), b.seg_id_N, b.seg_traj_S, counts, _cfg(), adv_N=adv)
    assert float(m["clipfrac_high"]) == pytest.approx(2 / 6) and float(m["clipfrac_low"]) == pytest.approx(1 / 6)
    loss, m = policy_loss_torch(logp, -ratio.log(), b.seg_id_N, b.seg_traj_S, counts, _cfg(clip_high=0.28),
                                adv_N=adv)
    assert float(m["clipfrac_high"]) == pytest.approx(1 / 6)
    # Token losses: −1.28 (1.5 clipped to 1.28), −0.5, 0.8, 1.5, −1.1, −1.25 → mean.
    assert float(loss) == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 - 1.1 - 1.25) / 6)
    assert float(m["approx_kl"]) == pytest.approx(float(-ratio.log().mean()))


def test_k3_kl_value_gradient_and_clamp():
    cfg = _cfg(kl_coef=0.1)
    # d = ref − logπ = 0.5: k3 = e^0.5 − 0.5 − 1 = 0.1487213; d k3 / d logπ = 1 − e^0.5 = −0.6487213.
    loss, m, grad = _single(0.0, 0.0, cfg, ref_d=0.5)
    assert loss == pytest.approx(0.1 * (math.exp(0.5) - 1.5))
    assert grad == pytest.approx(0.1 * (1 - math.exp(0.5)))
    assert float(m["kl_ref"]) == pytest.approx(math.exp(0.5) - 1.5)
    # d = 5: k3 = e^5 − 6 = 142.4 → clamped to kl_clamp = 10, and no gradient flows through the clamp.
    loss, m, grad = _single(0.0, 0.0, cfg, ref_d=5.0)
    assert loss == pytest.approx(1.0) and grad == 0.0 and float(m["kl_ref"]) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="ref_logp_N"):
        _single(0.0, 0.0, cfg)


def test_entropy_bonus_lowers_the_loss():
    H = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    b = from_turns([[Turn([1], "answer")]])
    logp = torch.tensor([-1.0], dtype=torch.float64)
    loss, m = policy_loss_torch(logp, logp, b.seg_id_N, b.seg_traj_S, LossCounts(1, 1, 1), _cfg(entropy_coef=0.01),
                                adv_N=torch.zeros(1, dtype=torch.float64), entropy_N=H)
    (g,) = torch.autograd.grad(loss, H)
    # ℓ = −η·H = −0.02; dℓ/dH = −η < 0: descending the loss raises the entropy.
    assert float(loss.detach()) == pytest.approx(-0.02) and float(g) == pytest.approx(-0.01)
    assert float(m["entropy"]) == 2.0


def test_chord_phi_weight_is_detached():
    # p = 0.2: φ = p(1 − p) = 0.16. A = 1, ρ = 1: ℓ = −A·ρ·φ = −0.16; dℓ/dlogπ = −A·ρ·φ = −0.16
    # (φ carries no gradient; if it did, dφ/dlogπ = p(1 − p)(1 − 2p) = 0.096 would add −0.096).
    loss, _, grad = _single(1.0, 0.0, _cfg(), phi=True, logp0=math.log(0.2))
    assert loss == pytest.approx(-0.16) and grad == pytest.approx(-0.16)


def _batch8():
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for b in range(8):
        turns = [Turn([1] * int(torch.randint(1, 5, (1,), generator=gen)), "search", [2] * 2) for _ in range(b % 3)]
        turns.append(Turn([1] * int(torch.randint(1, 6, (1,), generator=gen)), "answer"))
        trajs.append(turns)
    return from_turns(trajs), gen


def _micro_loss(W, data, b0, b1, counts, cfg, dp_size):
    """Loss of trajectories [b0, b1) as their own micro-batch (local seg ids and trajectory ids)."""
    batch, x, x2, old, ref, adv_S, w, phi, mask = data
    cu, first = batch.cu_seqlens.long(), batch.first_seg_B.tolist() + [batch.num_turns]
    n0, n1, s0, s1 = int(cu[b0]), int(cu[b1]), first[b0], first[b1]
    seg = batch.seg_id_N[n0:n1]
    seg = torch.where(seg >= 0, seg - s0, seg)
    logp = torch.nn.functional.logsigmoid(x[n0:n1] @ W)
    entropy = torch.nn.functional.softplus(x2[n0:n1] @ W)
    return policy_loss(logp, old[n0:n1], seg, batch.seg_traj_S[s0:s1] - b0, counts, cfg, adv_S=adv_S[s0:s1],
                       ref_logp_N=ref[n0:n1], entropy_N=entropy, weight_N=w[n0:n1], phi_mask_N=phi[n0:n1],
                       loss_mask_N=mask[n0:n1], dp_size=dp_size)[0]


def _grad(W, losses):
    W.grad = None
    for loss in losses:
        loss.backward()  # accumulate, as gradient accumulation over micro-batches does
    return W.grad.clone()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_same_gradient_however_the_batch_is_split(mode, dual):
    batch, gen = _batch8()
    N, S = batch.num_tokens, batch.num_turns
    x, x2 = torch.randn(N, 5, generator=gen), torch.randn(N, 5, generator=gen)
    W = torch.randn(5, generator=gen).requires_grad_()
    with torch.no_grad():
        old = torch.nn.functional.logsigmoid(x @ W) + 0.3 * torch.randn(N, generator=gen)
    ref = old - 0.2 * torch.rand(N, generator=gen)
    mask = torch.rand(N, generator=gen) > 0.15
    data = (batch, x, x2, old, ref, torch.randn(S, generator=gen), torch.rand(N, generator=gen) + 0.5,
            torch.rand(N, generator=gen) > 0.7, mask)
    cfg = _cfg(agg_mode=mode, dual_clip=dual, kl_coef=0.05, entropy_coef=0.01, clip_high=0.28, impl="torch")
    counts = loss_counts(batch.seg_id_N, batch.seg_traj_S, mask)
    # Per-micro-batch counts add up to the global ones (the trainer all-reduces them).
    parts = [loss_counts(batch.seg_id_N[int(batch.cu_seqlens[b]):int(batch.cu_seqlens[b + 4])] , batch.seg_traj_S,
                         mask[int(batch.cu_seqlens[b]):int(batch.cu_seqlens[b + 4])], num_trajectories=8)
             for b in (0, 4)]
    assert parts[0] + parts[1] == counts
    full = _grad(W, [_micro_loss(W, data, 0, 8, counts, cfg, 1)])
    two_micro = _grad(W, [_micro_loss(W, data, 0, 4, counts, cfg, 1), _micro_loss(W, data, 4, 8, counts, cfg, 1)])
    # Two ranks of two micro-batches each; each loss × dp_size, then the ranks' gradients are averaged.
    rank0 = _grad(W, [_micro_loss(W, data, 0, 2, counts, cfg, 2), _micro_loss(W, data, 2, 4, counts, cfg, 2)])
    rank1 = _grad(W, [_micro_loss(W, data, 4, 6, counts, cfg, 2), _micro_loss(W, data, 6, 8, counts, cfg, 2)])
    assert full.abs().max() > 1e-3
    assert torch.allclose(two_micro, full, atol=1e-6, rtol=0)
    assert torch.allclose((rank0 + rank1) / 2, full, atol=1e-6, rtol=0)


def test_tokens_that_do_not_count_cannot_poison_the_loss():
    """NaN / inf on observation and masked tokens change neither the loss nor the gradient."""
    b = _tiny()
    clean = torch.full((b.num_tokens,), -1.0)
    poisoned = clean.clone()
    poisoned[2], poisoned[4] = float("nan"), float("-inf")  # token 2: observation; token 4: masked below
    mask = torch.tensor([True, True, True, True, False, True])
    out = []
    for logp0 in (clean, poisoned):
        logp = logp0.clone().requires_grad_()
        H = logp0.clone().abs().requires_grad_()
        loss, m = policy_loss_torch(logp, logp0 - 0.1, b.seg_id_N, b.seg_traj_S, LossCounts(4, 2, 3),
                                    _cfg(kl_coef=0.1, entropy_coef=0.01), adv_S=torch.tensor([1.0, 2.0, -1.0]),
                                    ref_logp_N=logp0 + 0.2, entropy_N=H, loss_mask_N=mask)
        loss.backward()
        out.append((loss.detach(), logp.grad, H.grad, m["kl_ref"]))
    for a, c in zip(*out):
        assert torch.isfinite(c).all() and torch.allclose(a, c)


def test_value_loss_clipping_hand_checked():
    b = from_turns([[Turn([1, 1], "answer")]])
    v = torch.tensor([1.0, 0.6], requires_grad=True)
    old, ret = torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.0])
    # Token 0: V_clip = 0.5 + clamp(0.5, ±0.2) = 0.7; (V − R)² = 1.0, (V_clip − R)² = 1.69 → ½·1.69 = 0.845.
    # Token 1: V_clip = 0.6 (inside the range); both 0.36 → 0.18. Token mean 0.5125, × vf_coef 0.5 = 0.25625.
    loss, m = value_loss(v, old, ret, b.seg_id_N, b.seg_traj_S, LossCounts(2, 1, 1), _cfg(vf_coef=0.5))
    assert float(loss.detach()) == pytest.approx(0.25625) and float(m["vf_clipfrac"]) == pytest.approx(0.5)
    (g,) = torch.autograd.grad(loss, v)
    # Token 0 is on the clipped branch (no gradient); token 1: 0.5 · ½ · 2 (0.6 − 0) / 2 = 0.15.
    assert g.tolist() == pytest.approx([0.0, 0.15])


def test_dispatch(monkeypatch):
    b = _tiny()
    logp = torch.zeros(b.num_tokens)
    args = (logp, logp, b.seg_id_N, b.seg_traj_S, LossCounts(5, 2, 3))
    adv = {"adv_S": torch.tensor([1.0, 2.0, -1.0])}
    ref = policy_loss_torch(*args, _cfg(), **adv)[0]
    # A stand-in kernel module: 'triton' must call it; 'auto' only for CUDA tensors; 'torch' never.
    calls = []
    fake = types.ModuleType("fake_kernel")
    fake.turn_surrogate_loss = lambda *a, **kw: calls.append(kw) or (torch.tensor(7.0), {})
    monkeypatch.setitem(sys.modules, "fake_kernel", fake)
    monkeypatch.setattr(fastcredit.trainer.loss, "KERNEL_MODULE", "fake_kernel")
    assert float(policy_loss(*args, _cfg(impl="triton"), **adv)[0]) == 7.0 and calls[0] == adv
    assert torch.equal(policy_loss(*args, _cfg(impl="auto"), **adv)[0], ref)
    assert torch.equal(policy_loss(*args, _cfg(impl="triton"), impl="torch", **adv)[0], ref)
    assert len(calls) == 1
    # The environment variable overrides loss.impl; an explicit impl= overrides both.
    monkeypatch.setenv("FASTCREDIT_LOSS_IMPL", "triton")
    assert float(policy_loss(*args, _cfg(impl="torch"), **adv)[0]) == 7.0 and len(calls) == 2
    assert torch.equal(policy_loss(*args, _cfg(impl="triton"), impl="torch", **adv)[0], ref)
    monkeypatch.setenv("FASTCREDIT_LOSS_IMPL", "torch")
    assert torch.equal(policy_loss(*args, _cfg(impl="triton"), **adv)[0], ref) and len(calls) == 2
    monkeypatch.delenv("FASTCREDIT_LOSS_IMPL")
    monkeypatch.setattr(fastcredit.trainer.loss, "KERNEL_MODULE", "fastcredit.no_such_kernel")
    with pytest.raises(RuntimeError, match="no_such_kernel"):
        policy_loss(*args, _cfg(impl="triton"), **adv)
    assert torch.equal(policy_loss(*args, _cfg(impl="auto"), **adv)[0], ref)
    with pytest.raises(ValueError, match="valid: auto, triton, torch"):
        policy_loss(*args, _cfg(impl="cuda"), **adv)
    with pytest.raises(ValueError, match="exactly one"):
        policy_loss_torch(*args, _cfg(), adv_S=adv["adv_S"], adv_N=torch.zeros(b.num_tokens))
    with pytest.raises(ValueError, match="agg_mode"):
        policy_loss_torch(*args, _cfg(agg_mode="sum"), **adv)


def test_forced_triton_runs_the_real_kernel_and_agrees():
    """impl=triton on CPU tensors runs the fused kernel (interpreted here, compiled on a GPU)."""
    b = _tiny()
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(b.num_tokens, generator=g)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(b.num_tokens, generator=g)
    args = (b.seg_id_N, b.seg_traj_S, loss_counts(b.seg_id_N, b.seg_traj_S))
    for mode in AGG_MODES:
        cfg = _cfg(agg_mode=mode)
        fused, _ = policy_loss(logp, old, *args, cfg, impl="triton", adv_S=torch.tensor([1.0, 2.0, -1.0]))
        ref, _ = policy_loss(logp, old, *args, cfg, impl="torch", adv_S=torch.tensor([1.0, 2.0, -1.0]))
        (d_fused,), (d_ref,) = torch.autograd.grad(fused, logp), torch.autograd.grad(ref, logp)
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(d_fused, d_ref, rtol=1e-5, atol=1e-7)
