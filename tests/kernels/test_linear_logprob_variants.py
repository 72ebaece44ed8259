"""The fused log-prob's candidate variants (issue 46; kernels/linear_logprob/README.md, "Variants") against the
float64 reference with the same tolerances as the default kernels: TMA operand tiles, the persistent forward,
the warp-specialised H loop, the one-kernel (fused) backward and its tile skipping."""
from dataclasses import replace

import pytest
import torch

from fastcredit.kernels.linear_logprob import (LogprobConfig, linear_logprob_naive, linear_logprob_triton,
                                               variant_config)
from fastcredit.kernels.linear_logprob import triton as lp_triton

from test_linear_logprob import DEVICE, DTYPES, ODD, assert_close, make_inputs, reference, run

# ODD's ragged shape (H against BLOCK_H, N against BLOCK_N, an empty vocabulary split, a ragged last chunk).
VARIANT_FIELDS = {
    "tma": dict(tma=True),
    "persistent": dict(persistent=True),
    "tma+persistent": dict(tma=True, persistent=True),
    "warp_specialize": dict(warp_specialize=True),
    "fused": dict(bwd="fused", block_ho=32),
}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("variant", list(VARIANT_FIELDS))
def test_variant_matches_reference(variant, dtype_name):
    dtype = DTYPES[dtype_name]
    hidden, weight, target, g_logp, g_ent = make_inputs(333, 48, 1000, dtype, seed=11, ignored_every=9)
    cfg = replace(ODD, **VARIANT_FIELDS[variant])
    got = run(linear_logprob_triton, hidden, weight, target, 0.7, g_logp, g_ent, config=cfg)
    ref = reference(hidden, weight, target, 0.7, g_logp, g_ent)
    naive_lowp = run(linear_logprob_naive, hidden, weight, target, 0.7, g_logp, g_ent) \
        if dtype != torch.float32 else None
    assert_close(got, ref, dtype, naive_lowp)


@pytest.mark.parametrize("used", ["logp", "entropy", "hidden only"])
def test_fused_backward_one_output_and_frozen_head(used):
    """The fused backward with one upstream gradient, and with no gradient wanted for the head."""
    hidden, weight, target, g_logp, g_ent = make_inputs(200, 40, 700, torch.float32, seed=12, ignored_every=5)
    cfg = replace(ODD, bwd="fused", block_ho=16)
    g_logp, g_ent = (None, g_ent) if used == "entropy" else (g_logp, None)
    h = hidden.to(DEVICE).requires_grad_()
    w = weight.to(DEVICE).requires_grad_(used != "hidden only")
    h64 = hidden.double().requires_grad_()
    grads = []
    for fn, hh, ww in ((linear_logprob_triton, h, w), (linear_logprob_naive, h64, weight.double())):
        kw = dict(config=cfg) if fn is linear_logprob_triton else {}
        logp, ent = fn(hh, ww, target.to(hh.device), 1.0, **kw)
        out, go = (logp, g_logp) if g_logp is not None else (ent, g_ent)
        grads.append(torch.autograd.grad(out, hh, go.to(hh.device).to(out.dtype))[0])
    torch.testing.assert_close(grads[0].double().cpu(), grads[1], rtol=1e-5, atol=1e-5 * grads[1].abs().max().item())


def test_tma_and_persistent_take_their_paths(monkeypatch):
    """TMA descriptors reach the kernels where the strides allow (else pointers); a persistent grid of one
    program walks every (row block, split) item alone and still matches the reference."""
    hidden, weight, _, _, _ = make_inputs(64, 48, 300, torch.bfloat16, seed=13)
    hid, w, flags = lp_triton.operands(hidden, weight, replace(ODD, tma=True))
    assert flags == {"TMA": True} and type(hid).__name__ == "TensorDescriptor"
    odd_h = torch.zeros(64, 47, dtype=torch.bfloat16)  # 94-byte rows: not 16-byte aligned
    assert lp_triton.operands(odd_h, odd_h, replace(ODD, tma=True))[2] == {}
    monkeypatch.setattr(lp_triton, "resident_programs", lambda device, per_sm: 1)
    hidden, weight, target, g_logp, g_ent = make_inputs(333, 48, 1000, torch.float32, seed=13)
    got = run(linear_logprob_triton, hidden, weight, target, 1.0, g_logp, g_ent, config=replace(ODD, persistent=True))
    assert_close(got, reference(hidden, weight, target, 1.0, g_logp, g_ent), torch.float32)


def test_fused_skip_stays_within_its_bound():
    """Tiles whose every |dZ| < eps skip both products: dH[n, j] moves by at most eps·Σ_v |W[v, j]| and dW[v, j]
    by eps·Σ_n |H[n, j]| (README.md), and skipping does happen at this eps (peaked logits)."""
    hidden, weight, target, g_logp, g_ent = make_inputs(200, 32, 1000, torch.float32, seed=14)
    weight = weight * 8.0  # peaked softmax: most vocabulary tiles carry negligible mass
    cfg = LogprobConfig(block_n=32, block_v=64, block_h=32, n_splits=2, chunk_v=512, bwd="fused", block_ho=32)
    eps = 1e-3
    exact = run(linear_logprob_triton, hidden, weight, target, 1.0, g_logp, g_ent, config=cfg)
    skipped = run(linear_logprob_triton, hidden, weight, target, 1.0, g_logp, g_ent,
                  config=replace(cfg, skip_eps=eps))
    ref = reference(hidden, weight, target, 1.0, g_logp, g_ent)
    assert_close(exact, ref, torch.float32)
    bound_dh = eps * weight.double().abs().sum(0)  # [H]
    bound_dw = eps * hidden.double().abs().sum(0)  # [H]
    err_dh = (skipped[2].double().cpu() - ref[2]).abs()
    err_dw = (skipped[3].double().cpu() - ref[3]).abs()
    slack = 1e-5 * ref[2].abs().max().item(), 1e-5 * ref[3].abs().max().item()  # fp32 as in assert_close
    assert (err_dh <= bound_dh[None, :] + slack[0]).all() and (err_dw <= bound_dw[None, :] + slack[1]).all()
    assert not torch.equal(skipped[3], exact[3]), "no tile was skipped: the test does not exercise the option"
    assert torch.equal(skipped[0], exact[0]) and torch.equal(skipped[1], exact[1])  # the forward is untouched


@pytest.mark.parametrize("variant", ["tma+persistent", "fused"])
def test_variants_repeat(variant):
    """tma / persistent are bitwise deterministic; fused adds with fp32 atomics, whose order varies on a GPU: there
    repeated runs must agree to fp32 rounding of the sums (bitwise under the interpreter, which runs in order)."""
    hidden, weight, target, g_logp, g_ent = make_inputs(333, 48, 1000, torch.bfloat16, seed=15)
    cfg = replace(ODD, **VARIANT_FIELDS[variant])
    runs = [run(linear_logprob_triton, hidden, weight, target, 1.0, g_logp, g_ent, config=cfg) for _ in range(2)]
    for a, b in zip(*runs):
        if variant == "fused" and DEVICE == "cuda":
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-6)  # bf16 outputs of fp32 sums in any order
        else:
            assert torch.equal(a, b)


def test_variant_config_choices():
    for arch in (80, 90, 100):
        base = variant_config("default", 8192, 151_936, 2048, torch.bfloat16, arch)
        assert base == lp_triton.gpu_config(8192, 151_936, 2048, torch.bfloat16, arch)
        assert variant_config("tma", 8192, 151_936, 2048, torch.bfloat16, arch).tma == (arch >= 90)
        assert variant_config("fused", 8192, 151_936, 2048, torch.bfloat16, arch).bwd == "fused"
    with pytest.raises(ValueError, match="fused_skip does not compile for sm_100"):
        variant_config("fused_skip", 8192, 151_936, 2048, torch.bfloat16, 100)
    with pytest.raises(ValueError, match="valid: default, tma"):
        variant_config("fast", 8192, 151_936, 2048, torch.bfloat16, 90)
    with pytest.raises(ValueError, match="skip_eps needs bwd='fused'"):
        LogprobConfig(skip_eps=1e-3)
