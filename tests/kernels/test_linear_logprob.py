"""Fused linear log-prob vs its float64 reference (kernels/linear_logprob/naive.py): log-prob,
entropy, and the gradients to the hidden states and the head. Interpreter on the CPU, compiled on a GPU."""
import pytest
import torch

from fastcredit.kernels._dispatch import IMPL_ENV
from fastcredit.kernels.linear_logprob import LogprobConfig, linear_logprob_naive, linear_logprob_triton
from fastcredit.kernels.linear_logprob.triton import gpu_config
from fastcredit.models.logprob import linear_logprob

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(N, H, V, dtype, seed, ignored_every=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    # Scaled so that logits spread over ~±8: peaked and flat rows both occur.
    weight = torch.randn(V, H, generator=g) * (2.0 / H ** 0.5)
    target = torch.randint(0, V, (N,), generator=g)
    if ignored_every:
        target[::ignored_every] = -100
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden.to(dtype), weight.to(dtype), target, g_logp, g_ent


def run(fn, hidden, weight, target, temperature, g_logp, g_ent, **kw):
    """(logp, entropy, dhidden, dweight); None upstream gradients leave that output out of the loss."""
    h = hidden.to(DEVICE).requires_grad_()
    w = weight.to(DEVICE).requires_grad_()
    logp, ent = fn(h, w, target.to(DEVICE), temperature, **kw)
    outs, grads = [], []
    for o, go in ((logp, g_logp), (ent, g_ent)):
        if go is not None:
            outs.append(o)
            grads.append(go.to(DEVICE).to(o.dtype))
    dh, dw = torch.autograd.grad(outs, (h, w), grads)
    return logp.detach(), ent.detach(), dh, dw


def reference(hidden, weight, target, temperature, g_logp, g_ent):
    g64 = [None if t is None else t.double() for t in (g_logp, g_ent)]
    return run(linear_logprob_naive, hidden.double(), weight.double(), target, temperature, *g64)


NAMES = ("logp", "entropy", "dhidden", "dweight")


def assert_close(got, ref, dtype, naive_lowp=None):
    for t in got:
        assert not torch.isnan(t).any(), "an output element was never written"
    err = {n: (a.double().cpu() - b.cpu()).abs().max().item() for n, a, b in zip(NAMES, got, ref)}
    if dtype == torch.float32:
        # fp32 accuracy (the interpreter's tl.dot in fp32; on a GPU, 3xTF32 on sm_80+: gpu_config, README.md):
        # relative to each output's largest magnitude.
        scale = {n: b.abs().max().item() for n, b in zip(NAMES, ref)}
        bad = {n: (e, scale[n]) for n, e in err.items() if e > 1e-5 * scale[n]}
    else:
        # Relative bound: within 2x the error of the naive op run in bf16.
        base = {n: (a.double().cpu() - b.cpu()).abs().max().item() for n, a, b in zip(NAMES, naive_lowp, ref)}
        bad = {n: (e, base[n]) for n, e in err.items() if e > 2.0 * base[n]}
    assert not bad, bad


CASES = {"N1000-H64-V4099": (1000, 64, 4099), "N1000-H64-V1000": (1000, 64, 1000)}
# The H100's launch shape (gpu_config: 128 x 128 tiles, 16 vocabulary splits) under the interpreter, which pays
# per program: one small case, 17 vocabulary tiles in splits of 2 (7 splits empty), H ragged against BLOCK_H.
H100_CASES = {"N97-H80-V2171": (97, 80, 2171)}
RUNS = [(case, "interp") for case in CASES] + [(case, "h100") for case in H100_CASES]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case, launch", RUNS, ids=[c if launch == "interp" else f"{c}-{launch}" for c, launch in RUNS])
def test_forward_and_gradients_match_reference(case, launch, dtype_name):
    N, H, V = {**CASES, **H100_CASES}[case]
    dtype = DTYPES[dtype_name]
    hidden, weight, target, g_logp, g_ent = make_inputs(N, H, V, dtype, seed=V)
    config = gpu_config(N, V, H, dtype) if launch == "h100" else None
    got = run(linear_logprob_triton, hidden, weight, target, 0.7, g_logp, g_ent, config=config)
    ref = reference(hidden, weight, target, 0.7, g_logp, g_ent)
    naive_lowp = run(linear_logprob_naive, hidden, weight, target, 0.7, g_logp, g_ent) if dtype != torch.float32 \
        else None
    assert_close(got, ref, dtype, naive_lowp)


# Uneven H (no EVEN_H fast path), three vocabulary splits of which the last is empty (4 tiles of 256
# over 1000 columns, 2 tiles per split), backward chunks of 512 with a ragged last one, N not a
# multiple of BLOCK_N.
ODD = LogprobConfig(block_n=128, block_v=256, block_h=32, n_splits=3, chunk_v=512)


@pytest.mark.parametrize("dtype_name", list(DTYPES), ids=[f"N333-H48-V1000-{d}" for d in DTYPES])
def test_odd_tiles_splits_and_chunks(dtype_name):
    dtype = DTYPES[dtype_name]
    hidden, weight, target, g_logp, g_ent = make_inputs(333, 48, 1000, dtype, seed=1)
    got = run(linear_logprob_triton, hidden, weight, target, 1.0, g_logp, g_ent, config=ODD)
    ref = reference(hidden, weight, target, 1.0, g_logp, g_ent)
    naive_lowp = run(linear_logprob_naive, hidden, weight, target, 1.0, g_logp, g_ent) if dtype != torch.float32 \
        else None
    assert_close(got, ref, dtype, naive_lowp)


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_one_output_used_and_ignored_targets(used):
    """Only one output in the loss (the other's gradient is None); targets of -100 give logp 0."""
    hidden, weight, target, g_logp, g_ent = make_inputs(200, 64, 1000, torch.float32, seed=2, ignored_every=7)
    g_logp, g_ent = (g_logp, None) if used == "logp" else (None, g_ent)
    got = run(linear_logprob_triton, hidden, weight, target, 1.3, g_logp, g_ent)
    ref = reference(hidden, weight, target, 1.3, g_logp, g_ent)
    assert_close(got, ref, torch.float32)
    assert not got[0][::7].any()


def test_frozen_head_and_tied_embedding():
    """Gradient to the hidden states only; and a tied embedding, whose two gradients autograd adds."""
    V, H, N = 1000, 64, 300
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (N,), generator=g)
    target = torch.roll(tokens, -1)
    emb0 = (torch.randn(V, H, generator=g) * 0.25).to(DEVICE)
    mix = (torch.randn(H, H, generator=g) / H ** 0.5).to(DEVICE)
    results = []
    for fn, dtype in ((linear_logprob_triton, torch.float32), (linear_logprob_naive, torch.float64)):
        emb = emb0.to(dtype).clone().requires_grad_()
        hidden = torch.tanh(emb[tokens.to(DEVICE)] @ mix.to(dtype))
        logp, ent = fn(hidden, emb, target.to(DEVICE), 1.0)
        (-logp.sum() + 0.1 * ent.sum()).backward()
        results.append((logp.detach(), emb.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a.double().cpu(), b.cpu(), rtol=1e-5, atol=1e-5 * b.abs().max().item())
    hidden, weight, target, g_logp, _ = make_inputs(300, 64, 1000, torch.float32, seed=4)
    h = hidden.to(DEVICE).requires_grad_()
    logp, _ = linear_logprob_triton(h, weight.to(DEVICE), target.to(DEVICE))
    (dh,) = torch.autograd.grad(logp, h, g_logp.to(DEVICE))
    h64 = hidden.double().requires_grad_()
    (dh64,) = torch.autograd.grad(linear_logprob_naive(h64, weight.double(), target)[0], h64, g_logp.double())
    torch.testing.assert_close(dh.double().cpu(), dh64, rtol=1e-5, atol=1e-5 * dh64.abs().max().item())


def test_deterministic():
    hidden, weight, target, g_logp, g_ent = make_inputs(1000, 64, 4099, torch.bfloat16, seed=5)
    repeats = 3 if DEVICE == "cuda" else 2  # the interpreter is deterministic anyway; the GPU run matters
    runs = [run(linear_logprob_triton, hidden, weight, target, 1.0, g_logp, g_ent) for _ in range(repeats)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, runs[0]))


def test_dispatch_and_env_override(monkeypatch):
    hidden, weight, target, _, _ = make_inputs(64, 64, 1000, torch.float32, seed=6)
    h, w, t = hidden.to(DEVICE), weight.to(DEVICE), target.to(DEVICE)
    naive = linear_logprob_naive(h, w, t)
    for impl in ("torch", "triton", "auto"):
        got = linear_logprob(h, w, t, impl=impl)
        for a, b in zip(got, naive):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(IMPL_ENV, "torch")
    assert all(torch.equal(a, b) for a, b in zip(linear_logprob(h, w, t), naive))
    monkeypatch.setenv(IMPL_ENV, "cuda")
    with pytest.raises(ValueError, match=IMPL_ENV):
        linear_logprob(h, w, t)
    with pytest.raises(ValueError, match="hidden is torch.float32 but weight is torch.bfloat16"):
        linear_logprob_triton(h, w.bfloat16(), t)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_real_vocabulary_on_gpu(dtype_name):
    """Qwen2.5's vocabulary with the default (GPU) tiles, splits and chunks (GPU only)."""
    dtype = DTYPES[dtype_name]
    hidden, weight, target, g_logp, g_ent = make_inputs(2049, 256, 151_936, dtype, seed=7)
    got = run(linear_logprob_triton, hidden, weight, target, 1.0, g_logp, g_ent)
    ref = reference(hidden, weight, target, 1.0, g_logp, g_ent)
    naive_lowp = run(linear_logprob_naive, hidden, weight, target, 1.0, g_logp, g_ent) if dtype != torch.float32 \
        else None
    assert_close(got, ref, dtype, naive_lowp)
