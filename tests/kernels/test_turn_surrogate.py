"""Fused turn-surrogate loss vs its float64 reference (kernels/turn_surrogate/naive.py), and the
reference vs fastcredit.trainer.loss. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""
import dataclasses

import pytest
import torch

from fastcredit.config.loss import LossConfig
from fastcredit.kernels.turn_surrogate import turn_counts, turn_surrogate_loss, turn_surrogate_naive
from fastcredit.kernels.turn_surrogate.triton import gpu_block
from fastcredit.trainer.loss import AGG_MODES, LossCounts, loss_counts, policy_loss_torch
from fastcredit.rollout.trajectory import Turn, from_turns

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Counts of the other micro-batches and ranks of the step: the denominators are global.
ELSEWHERE = LossCounts(tokens=50.0, seqs=3.0, turns=9.0)


def make_layout(N: int, S: int, B: int, seed: int, empty: int = 3, single: int = 3):
    """A packed batch of exactly N tokens and S turns over B trajectories, with ``empty`` turns that
    have no action token and ``single`` one-token turns; the rest of the tokens fall at random."""
    g = torch.Generator().manual_seed(seed)
    per_traj = torch.ones(B, dtype=torch.long) + torch.bincount(torch.randint(0, B, (S - B,), generator=g),
                                                                minlength=B)
    last = (torch.cumsum(per_traj, 0) - 1).tolist()
    special = torch.randperm(S, generator=g)[: empty + single].tolist()
    action = [0 if s in special[:empty] else 1 for s in range(S)]
    free = [("a", s) for s in range(S) if s not in special] + [("o", s) for s in range(S) if s not in last]
    spare = N - sum(action)
    extra = torch.bincount(torch.randint(0, len(free), (spare,), generator=g), minlength=len(free)).tolist()
    obs = [0] * S
    for (kind, s), n in zip(free, extra):
        if kind == "a":
            action[s] += n
        else:
            obs[s] += n
    trajs, s = [], 0
    for b in range(B):
        turns = []
        for _ in range(int(per_traj[b])):
            kind = "answer" if s in last else "search"
            turns.append(Turn([7] * action[s], kind, [9] * obs[s]))
            s += 1
        trajs.append(turns)
    batch = from_turns(trajs)
    assert batch.num_tokens == N and batch.num_turns == S
    return batch.seg_id_N, batch.seg_traj_S


def make_inputs(seg_id_N, seg_traj_S, seed, dtype, per_token_adv=False, mask_first_traj=True):
    """Random policy / old / ref log-probs, entropy, weights, CHORD-phi mask and loss mask."""
    g = torch.Generator().manual_seed(seed)
    N, S = seg_id_N.numel(), seg_traj_S.numel()
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    logp = -torch.rand(N, generator=g, dtype=torch.float64) * 4.0
    loss_mask = torch.rand(N, generator=g) < 0.9
    if mask_first_traj:  # one fully masked trajectory
        loss_mask &= seg_traj_S[seg_id_N.long().clamp(min=0)] != 0
    # Wide tails so that the ratio clips, the dual clip binds (rho > 3) and the KL clamp (10) binds.
    wide = lambda narrow, far, frac: torch.where(torch.rand(N, generator=g) < frac, far, narrow) * rnd(N)  # noqa: E731
    x = dict(logp_N=logp, old_logp_N=logp - wide(0.3, 1.5, 0.2), ref_logp_N=logp + wide(0.5, 3.0, 0.1),
             entropy_N=2.0 * torch.rand(N, generator=g, dtype=torch.float64),
             weight_N=torch.rand(N, generator=g, dtype=torch.float64),
             phi_mask_N=torch.rand(N, generator=g) < 0.2, loss_mask_N=loss_mask)
    x["adv_N" if per_token_adv else "adv_S"] = rnd(N if per_token_adv else S)
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in x.items()}


def run(fn, seg_id_N, seg_traj_S, x, cfg, grad_out, dp_size=2, **kw):
    """(loss, metrics, dlogp, dentropy) of ``fn`` for upstream gradient ``grad_out``."""
    x = dict(x)
    logp = x.pop("logp_N").to(DEVICE).requires_grad_()
    ent = x.pop("entropy_N", None)
    ent = None if ent is None else ent.to(DEVICE).requires_grad_()
    x = {k: v.to(DEVICE) for k, v in x.items()}
    counts = loss_counts(seg_id_N.to(DEVICE), seg_traj_S.to(DEVICE), x.get("loss_mask_N")) + ELSEWHERE
    loss, metrics = fn(logp, x.pop("old_logp_N"), seg_id_N.to(DEVICE), seg_traj_S.to(DEVICE), counts, cfg,
                       entropy_N=ent, dp_size=dp_size, **x, **kw)
    inputs = [logp] + ([ent] if ent is not None else [])
    grads = torch.autograd.grad(loss, inputs, grad_outputs=grad_out.to(loss.dtype).to(DEVICE), allow_unused=True)
    return loss.detach(), metrics, grads[0], (grads[1] if ent is not None else None)


def reference(seg_id_N, seg_traj_S, x, cfg, grad_out, **kw):
    x64 = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    return run(turn_surrogate_naive, seg_id_N, seg_traj_S, x64, cfg, grad_out, **kw)


def _outputs(result):
    """Name → tensor for the loss, each metric and each gradient."""
    out = {"loss": result[0], **{f"metric:{k}": v for k, v in result[1].items()}, "dlogp": result[2]}
    if result[3] is not None:
        out["dentropy"] = result[3]
    return out


def errors(got, ref):
    """Max abs error of every output (loss, each metric, each gradient) against the fp64 reference."""
    got, ref = _outputs(got), _outputs(ref)
    assert set(got) == set(ref)
    return {k: (got[k].double().cpu() - ref[k].cpu()).abs().max().item() if ref[k].numel() else 0.0 for k in ref}


def assert_close(got, ref, dtype, naive_lowp=None):
    err = errors(got, ref)
    for t in (got[2], got[3]):
        assert t is None or not torch.isnan(t).any(), "an output element was never written"
    if dtype == torch.float32:
        # fp32 arithmetic on fp32 inputs: relative to each output's largest magnitude.
        scale = {k: v.abs().max().item() if v.numel() else 0.0 for k, v in _outputs(ref).items()}
        bad = {k: (e, scale[k]) for k, e in err.items() if e > 1e-5 * scale[k] + 1e-12}
    else:
        # Relative bound: within 2x the error of the naive op run in bf16. Floor: one bf16
        # ulp (2^-7 relative) of the output's largest element. Storing a gradient in bf16 costs half
        # an ulp whoever computes it (a whole one under TRITON_INTERPRET, whose fp32 -> bf16
        # conversion truncates); on a few dozen tokens the naive op is sometimes luckier than that.
        base = errors(naive_lowp, ref)
        ulp = {k: 2.0 ** -7 * (v.abs().max().item() if v.numel() else 0.0) for k, v in _outputs(ref).items()}
        bad = {k: (e, base[k]) for k, e in err.items() if e > max(2.0 * base[k], ulp[k]) + 1e-6}
    assert not bad, bad


LAYOUTS = {"N1000-S37": (1000, 37, 9, 0), "N63-S5": (63, 5, 2, 1), "N777-S120": (777, 120, 30, 2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FULL = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
# Every layout in programs of 128 tokens; two also with the H100's (gpu_block: one program of 2048 here, its
# tail masked), whose int64 seg ids take the other pointer type.
RUNS = [(layout, "block128") for layout in LAYOUTS] + [("N1000-S37", "h100"), ("N63-S5", "h100")]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout, launch", RUNS, ids=[lay if launch == "block128" else f"{lay}-{launch}"
                                                      for lay, launch in RUNS])
def test_forward_and_gradients_match_reference(layout, launch, dtype_name, mode):
    N, S, B, seed = LAYOUTS[layout]
    dtype = DTYPES[dtype_name]
    seg, traj = make_layout(N, S, B, seed)
    if launch == "h100":
        seg = seg.long()
    x = make_inputs(seg, traj, seed, dtype)
    cfg = LossConfig(agg_mode=mode, **FULL)
    g = torch.tensor(1.7)
    got = run(turn_surrogate_loss, seg, traj, x, cfg, g, block=gpu_block(N) if launch == "h100" else 128)
    ref = reference(seg, traj, x, cfg, g)
    naive_lowp = run(turn_surrogate_naive, seg, traj, x, cfg, g) if dtype != torch.float32 else None
    assert_close(got, ref, dtype, naive_lowp)


@pytest.mark.parametrize("mode", ["token-mean", "turn-mean"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_per_token_advantages_and_no_optional_inputs(dtype_name, mode):
    dtype = DTYPES[dtype_name]
    seg, traj = make_layout(1000, 37, 9, 3)
    x = make_inputs(seg, traj, 3, dtype, per_token_adv=True)
    for k in ("ref_logp_N", "entropy_N", "weight_N", "phi_mask_N", "loss_mask_N"):
        x.pop(k)
    cfg = LossConfig(agg_mode=mode, kl_coef=0.0, clip_low=0.1, clip_high=0.3)
    g = torch.tensor(-0.6)
    got = run(turn_surrogate_loss, seg, traj, x, cfg, g, dp_size=1, block=256)
    naive_lowp = run(turn_surrogate_naive, seg, traj, x, cfg, g, dp_size=1) if dtype != torch.float32 else None
    assert_close(got, reference(seg, traj, x, cfg, g, dp_size=1), dtype, naive_lowp)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_gives_zero_loss_and_gradients(mode):
    seg, traj = make_layout(300, 6, 2, 4)
    x = make_inputs(seg, traj, 4, torch.float32)
    x["loss_mask_N"] = torch.zeros_like(x["loss_mask_N"])
    cfg = LossConfig(agg_mode=mode, **FULL)
    loss, metrics, dlogp, dent = run(turn_surrogate_loss, seg, traj, x, cfg, torch.tensor(1.0), block=128)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    assert torch.equal(dlogp, torch.zeros_like(dlogp)) and torch.equal(dent, torch.zeros_like(dent))


def test_observation_only_and_empty_batches():
    seg = torch.full((40,), -1, dtype=torch.int32)  # every token an observation
    traj = torch.tensor([0, 0, 1])
    cfg = LossConfig(agg_mode="turn-mean", kl_coef=0.0)
    for n in (40, 0):
        logp = torch.zeros(n, device=DEVICE, requires_grad=True)
        loss, _ = turn_surrogate_loss(logp, torch.zeros(n, device=DEVICE), seg[:n].to(DEVICE), traj.to(DEVICE),
                                      LossCounts(1.0, 1.0, 1.0), cfg, adv_S=torch.ones(3, device=DEVICE))
        (dlogp,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0 and dlogp.shape == (n,) and not dlogp.any()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_deterministic(mode):
    seg, traj = make_layout(1000, 37, 9, 5)
    x = make_inputs(seg, traj, 5, torch.float32)
    cfg = LossConfig(agg_mode=mode, **FULL)
    runs = [run(turn_surrogate_loss, seg, traj, x, cfg, torch.tensor(1.0), block=128) for _ in range(3)]
    for other in runs[1:]:
        assert torch.equal(other[0], runs[0][0]) and torch.equal(other[2], runs[0][2])
        assert torch.equal(other[3], runs[0][3])
        assert all(torch.equal(other[1][k], runs[0][1][k]) for k in runs[0][1])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_the_whole_batch(mode):
    """With the step's global counts, the losses and gradients of two halves add up to the whole's."""
    seg, traj = make_layout(1000, 37, 9, 6)
    x = make_inputs(seg, traj, 6, torch.float64)
    cfg = LossConfig(agg_mode=mode, **FULL)
    counts = loss_counts(seg, traj, x["loss_mask_N"])
    cut_s = int(torch.nonzero(traj == 4)[0])  # first turn of trajectory 4
    cut_n = int(torch.nonzero(seg == cut_s)[0])  # its first action token (turn cut_s is not empty)

    def loss_of(lo, hi, s_lo, s_hi):
        part = {k: (v[lo:hi] if k != "adv_S" else v[s_lo:s_hi]).to(DEVICE) for k, v in x.items()}
        logp = part.pop("logp_N").requires_grad_()
        sub_seg = torch.where(seg[lo:hi] >= 0, seg[lo:hi] - s_lo, seg[lo:hi])
        loss, _ = turn_surrogate_loss(logp, part.pop("old_logp_N"), sub_seg.to(DEVICE),
                                      (traj[s_lo:s_hi] - traj[s_lo]).to(DEVICE), counts, cfg, **part, block=128)
        return loss, torch.autograd.grad(loss, logp)[0]

    whole, d_whole = loss_of(0, seg.numel(), 0, traj.numel())
    a, d_a = loss_of(0, cut_n, 0, cut_s)
    b, d_b = loss_of(cut_n, seg.numel(), cut_s, traj.numel())
    torch.testing.assert_close(a + b, whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([d_a, d_b]), d_whole, rtol=1e-5, atol=1e-9)


def test_turn_counts_match_bincount():
    seg, traj = make_layout(777, 120, 30, 7)
    mask = torch.rand(seg.numel(), generator=torch.Generator().manual_seed(7)) < 0.7
    for m in (None, mask):
        keep = (seg >= 0) if m is None else (seg >= 0) & m
        expected = torch.bincount(seg[keep].long(), minlength=traj.numel())
        got = turn_counts(seg.to(DEVICE), None if m is None else m.to(DEVICE).view(torch.uint8), traj.numel(), 64)
        assert torch.equal(got.long().cpu(), expected)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("per_token_adv", [False, True], ids=["adv_S", "adv_N"])
def test_naive_matches_fastcredit_loss(mode, per_token_adv):
    seg, traj = make_layout(777, 120, 30, 8)
    x = make_inputs(seg, traj, 8, torch.float64, per_token_adv=per_token_adv)
    cfg = LossConfig(agg_mode=mode, **FULL)
    g = torch.tensor(0.9, dtype=torch.float64)
    ours = run(turn_surrogate_naive, seg, traj, x, cfg, g)
    theirs = run(policy_loss_torch, seg, traj, x, cfg, g)
    assert set(ours[1]) == set(theirs[1])
    for k in ours[1]:
        torch.testing.assert_close(ours[1][k], theirs[1][k], rtol=1e-12, atol=1e-14)
    for a, b in zip((ours[0], ours[2], ours[3]), (theirs[0], theirs[2], theirs[3])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad, message", [
    (dict(cfg=dict(agg_mode="sum")), "unknown loss.agg_mode"),
    (dict(cfg=dict(dual_clip=0.5)), "dual_clip must be > 1"),
    (dict(cfg=dict(kl_coef=0.1), drop="ref_logp_N"), "needs ref_logp_N"),
    (dict(cfg=dict(entropy_coef=0.1), drop="entropy_N"), "needs entropy_N"),
    (dict(cfg={}, both_adv=True), "exactly one of adv_S"),
    (dict(cfg={}, grad="old_logp_N"), "old_logp_N requires grad"),
])
def test_errors_name_the_problem(bad, message):
    seg, traj = make_layout(63, 5, 2, 9)
    x = make_inputs(seg, traj, 9, torch.float32)
    x.pop(bad.get("drop", "none"), None)
    if bad.get("both_adv"):
        x["adv_N"] = torch.zeros(63)
    if bad.get("grad"):
        x[bad["grad"]] = x[bad["grad"]].clone().requires_grad_()
    cfg = dataclasses.replace(LossConfig(**FULL), **bad["cfg"])
    with pytest.raises(ValueError, match=message):
        run(turn_surrogate_loss, seg, traj, x, cfg, torch.tensor(1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", AGG_MODES)
def test_large_batch_on_gpu(mode):
    """Compiled kernel at a size with thousands of programs and turns (GPU only)."""
    seg, traj = make_layout(200_003, 2_000, 400, 10)
    x = make_inputs(seg, traj, 10, torch.float32)
    cfg = LossConfig(agg_mode=mode, **FULL)
    g = torch.tensor(1.0)
    got = run(turn_surrogate_loss, seg, traj, x, cfg, g)
    ref = run(policy_loss_torch, seg, traj, {k: (v.double() if v.is_floating_point() else v)
                                             for k, v in x.items()}, cfg, g)
    assert_close(got, ref, torch.float32)
