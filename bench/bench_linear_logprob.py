"""Linear log-prob (hidden @ LM headᵀ → target log-prob and entropy), and hidden → policy loss (GPU only).

    pytest --benchmark-only bench/bench_linear_logprob.py   # -> bench/results/{linear_logprob,policy_head}_<gpu>.json

Legend: N tokens, H hidden size, V vocabulary, B sequences of L tokens.

Op ``linear_logprob``, providers: ``torch`` (unfused: ``[N, V]`` logits, log-softmax,
gather, entropy: ``naive.py``), ``compile`` (the same under ``torch.compile``),
``triton`` (the fused kernels), and ``matmul``: the three bf16 cuBLAS GEMMs alone that
an unfused fwd+bwd must run (logits, dH, dW), i.e. the bf16 matmul time of the op.
TFLOP/s count the GEMMs each provider actually runs (:func:`gemm_flops`, 2·N·V·H each):
the unfused ones 1 forward and 2 backward; the fused backward recomputes the logits, so
``triton`` runs 3 in its backward and 4 in fwd+bwd, and its floor is 4/3 of ``matmul``.
Targets (H100): fwd+bwd within 1.5x of ``matmul`` (the 4/3 floor plus the softmax and
entropy passes); peak memory <= 15% of ``torch``. Issue 46: <= 1.4x and <= 5% at both Qwen2.5 shapes,
N 8k and 32k; the ``triton_<variant>`` providers are its candidates, compared with ``triton`` in one run.

    python -m bench.bench_linear_logprob --device cpu      # a tiny run of every provider, no timing harness

Op ``policy_head`` (fwd+bwd only), hidden states → GRPO-style loss at equal work:
``triton`` = fused log-prob + fused turn-surrogate (token-mean, k3 KL), ``torch`` and
``compile`` = naive log-prob + ``policy_loss_torch``, ``liger_fused`` =
``LigerFusedLinearGRPOLoss``, ``liger_triton`` = cuBLAS logits + liger's
``triton_grpo_loss``. liger takes one advantage per sequence, so every turn of a
sequence gets that sequence's advantage here; observation tokens are masked for all.

On the host (``test_linear_logprob_cpu``, every machine, fp32): ``torch`` as above (the whole ``[N, V]`` logits at
once) against ``blocked``, the trainer's CPU path (``fastcredit.models.logprob.linear_logprob``: the same reference
``CPU_BLOCK_ROWS`` rows at a time), at a tiny policy's shape.
"""
from __future__ import annotations

import argparse
import functools
import time
from typing import Optional

import pytest
import torch

from bench.shapes import LOGPROB_SHAPES, MODES, LogprobShape

# triton_<variant>: issue 46's candidates (kernels/linear_logprob/README.md, "Variants"), variant_config's fields.
VARIANT_PROVIDERS = ("triton_tma", "triton_persistent", "triton_tma+persistent", "triton_warp_specialize",
                     "triton_fused", "triton_fused_skip")
LOGPROB_PROVIDERS = ("torch", "compile", "triton", "matmul") + VARIANT_PROVIDERS
POLICY_PROVIDERS = ("torch", "compile", "triton", "liger_fused", "liger_triton")
CPU_PROVIDERS = ("torch", "blocked")
CPU_SHAPE = LogprobShape("tiny-N2k", "tiny", 2048, 128, vocab=6000)  # the demo policy's LM head (hidden 128)
BETA, CLIP = 1e-3, 0.2
_COMPILED = {}
DEVICE = "cuda"


def make_inputs(shape: LogprobShape, seed: int = 0, device: str = DEVICE, dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    N, H, V = shape.tokens, shape.hidden, shape.vocab
    hidden = torch.randn(N, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(device, dtype)
    target = torch.randint(0, V, (N,), generator=g).to(device)
    return dict(hidden=hidden, weight=weight, target=target, g_logp=torch.randn(N, device=device),
                g_ent=torch.randn(N, device=device))


def logprob_fn(provider: str, x: Optional[dict] = None):
    """The op of ``provider``; a variant's config is built for the shapes and dtype of ``x``."""
    from fastcredit.kernels.linear_logprob import linear_logprob_naive, linear_logprob_triton, variant_config
    from fastcredit.models.logprob import linear_logprob

    if provider == "blocked":
        return functools.partial(linear_logprob, impl="torch")
    if provider in VARIANT_PROVIDERS:
        (N, H), V = x["hidden"].shape, x["weight"].shape[0]
        cfg = variant_config(provider[len("triton_"):], N, V, H, x["hidden"].dtype)
        return functools.partial(linear_logprob_triton, config=cfg)

    if provider == "compile":
        if "logprob" not in _COMPILED:
            _COMPILED["logprob"] = torch.compile(linear_logprob_naive, dynamic=False)
        return _COMPILED["logprob"]
    return linear_logprob_triton if provider == "triton" else linear_logprob_naive


def gemm_flops(provider: str, mode: str, N: int, V: int, H: int) -> float:
    """FLOPs of the [N, H] x [H, V]-sized GEMMs ``provider`` runs in ``mode``
    (the fused backward recomputes the logits)."""
    gemms = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[mode] + (mode != "fwd" and provider.startswith("triton"))
    return 2.0 * N * V * H * gemms


def matmul_case(x: dict, mode: str):
    """The unfused op's three GEMMs in bf16: logits = h Wᵀ (fwd); dH = dZ W and dW = dZᵀ h (bwd)."""
    h, w = x["hidden"], x["weight"]
    dz = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)
    fwd = lambda: h @ w.t()  # noqa: E731
    bwd = lambda: (dz @ w, dz.t() @ h)  # noqa: E731
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": lambda: (fwd(), bwd())}[mode]


def logprob_case(x: dict, provider: str, mode: str):
    if provider == "matmul":
        return matmul_case(x, mode)
    fn = logprob_fn(provider, x)
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"].clone().requires_grad_()
    grads = (x["g_logp"], x["g_ent"])
    if mode == "fwd":
        return lambda: fn(h, w, x["target"], 1.0)
    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(h, w, x["target"], 1.0), (h, w), grads)
    outs = fn(h, w, x["target"], 1.0)
    return lambda: torch.autograd.grad(outs, (h, w), grads, retain_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", LOGPROB_PROVIDERS)
@pytest.mark.parametrize("shape", LOGPROB_SHAPES, ids=[s.name for s in LOGPROB_SHAPES])
def test_linear_logprob(benchmark, harness, shape, provider, mode):
    x = make_inputs(shape)
    case = {"shape": shape.name, "tokens": shape.tokens, "hidden": shape.hidden, "vocab": shape.vocab,
            "provider": provider, "mode": mode}
    harness.measure(benchmark, "linear_logprob", case, logprob_case(x, provider, mode),
                    flops=gemm_flops(provider, mode, shape.tokens, shape.vocab, shape.hidden), rep_ms=500)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_linear_logprob_cpu(benchmark, provider, mode):
    """The log-prob's torch reference on the host, whole or in the trainer's row blocks (fp32)."""
    from bench.results_io import device_name

    x = make_inputs(CPU_SHAPE, device="cpu", dtype=torch.float32)
    benchmark.extra_info.update(device=device_name("cpu"), shape=CPU_SHAPE.name, tokens=CPU_SHAPE.tokens,
                                hidden=CPU_SHAPE.hidden, vocab=CPU_SHAPE.vocab)
    benchmark(logprob_case(x, provider, mode))


def policy_inputs(shape: LogprobShape, seed: int = 1) -> dict:
    """Sequences of L = context tokens, 4 turns each: action spans then an observation, the last an answer."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, L, T = shape.tokens // shape.context, shape.context, 4
    cuts = torch.sort(torch.randint(1, L, (B, 2 * T - 1), generator=g), 1).values
    bounds = torch.cat([torch.zeros(B, 1, dtype=torch.long), cuts, torch.full((B, 1), L)], 1)
    pos = torch.arange(L)
    span = (pos[None, :, None] >= bounds[:, None, 1:]).sum(-1)  # [B, L] which of the 2T-1 spans
    span = span.clamp(max=2 * T - 2)
    is_action = span % 2 == 0
    seg_local = span // 2
    seg_id = torch.where(is_action, seg_local + T * torch.arange(B)[:, None], -1).to(torch.int32)
    x = make_inputs(shape, seed)
    with torch.no_grad():  # old / ref policies close to the current one, as in training
        logp0 = logprob_fn("triton")(x["hidden"], x["weight"], x["target"], 1.0)[0].reshape(B, L).cpu()
    x.update(seg_id_BL=seg_id.to(DEVICE), mask_BL=is_action.to(DEVICE),
             adv_B=torch.randn(B, generator=g).to(DEVICE),
             old_BL=(logp0 + 0.1 * torch.randn(B, L, generator=g)).to(DEVICE),
             ref_BL=(logp0 + 0.1 * torch.randn(B, L, generator=g)).to(DEVICE), B=B, L=L, T=T)
    return x


def ours_policy(x: dict, provider: str):
    """fastcredit: log-prob (fused or naive) then the policy loss (fused or torch), token-mean over action tokens."""
    from fastcredit.config.loss import LossConfig
    from fastcredit.kernels.turn_surrogate import turn_surrogate_loss
    from fastcredit.trainer.loss import loss_counts, policy_loss_torch

    seg = x["seg_id_BL"].reshape(-1)
    traj_S = torch.repeat_interleave(torch.arange(x["B"], device=DEVICE), x["T"])
    adv_S = x["adv_B"][traj_S]  # every turn of a sequence gets the sequence's advantage
    counts = loss_counts(seg, traj_S)
    cfg = LossConfig(agg_mode="token-mean", clip_low=CLIP, clip_high=CLIP, kl_coef=BETA)
    loss_fn = turn_surrogate_loss if provider == "triton" else policy_loss_torch
    lp_fn = logprob_fn(provider)
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"].clone().requires_grad_()

    def step():
        logp, _ = lp_fn(h, w, x["target"], 1.0)
        loss, _ = loss_fn(logp, x["old_BL"].reshape(-1), seg, traj_S, counts, cfg, adv_S=adv_S,
                          ref_logp_N=x["ref_BL"].reshape(-1))
        return torch.autograd.grad(loss, (h, w))

    return step


def liger_policy(x: dict, provider: str):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    B, L, H = x["B"], x["L"], x["hidden"].shape[1]
    mask = x["mask_BL"].to(torch.int64)
    tokens = x["target"].reshape(B, L)
    w = x["weight"].clone().requires_grad_()
    if provider == "liger_fused":
        h = x["hidden"].reshape(B, L, H).clone().requires_grad_()
        loss_mod = LigerFusedLinearGRPOLoss(beta=BETA, epsilon_low=CLIP, epsilon_high=CLIP, loss_type="dapo",
                                            use_ref_model=True, compiled=True)

        def step():
            loss, _ = loss_mod(h, w, tokens, mask, x["adv_B"], ref_per_token_logps=x["ref_BL"],
                               old_per_token_logps=x["old_BL"])
            return torch.autograd.grad(loss, (h, w))

        return step
    # triton_grpo_loss reads logits [B, L+1, V] (position l predicts token l): one extra row per sequence.
    h = torch.cat([x["hidden"].reshape(B, L, H), x["hidden"].reshape(B, L, H)[:, -1:]], 1).clone().requires_grad_()

    def step():
        logits = h @ w.t()
        loss, _ = triton_grpo_loss(logits, x["old_BL"], x["ref_BL"], tokens, x["adv_B"], completion_mask=mask,
                                   temperature=1.0, beta=BETA, eps_low=CLIP, eps_high=CLIP, loss_type="dapo",
                                   reduce=True)
        return torch.autograd.grad(loss, (h, w))

    return step


@pytest.mark.gpu
@pytest.mark.parametrize("provider", POLICY_PROVIDERS)
@pytest.mark.parametrize("shape", LOGPROB_SHAPES, ids=[s.name for s in LOGPROB_SHAPES])
def test_policy_head(benchmark, harness, shape, provider):
    x = policy_inputs(shape)
    step = liger_policy(x, provider) if provider.startswith("liger") else ours_policy(x, provider)
    case = {"shape": shape.name, "tokens": shape.tokens, "hidden": shape.hidden, "vocab": shape.vocab,
            "provider": provider, "mode": "fwd+bwd"}
    harness.measure(benchmark, "policy_head", case, step,
                    flops=6.0 * shape.tokens * shape.vocab * shape.hidden, rep_ms=500)


def main(argv=None) -> None:
    """One fwd+bwd of every log-prob provider at a tiny shape, against ``torch`` (a smoke run, not a timing)."""
    p = argparse.ArgumentParser(description="tiny smoke run of the linear log-prob providers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    x = make_inputs(LogprobShape("tiny", "tiny", 256, 64, vocab=1000), device=a.device, dtype=dtype)
    ref = None
    for provider in [q for q in LOGPROB_PROVIDERS if q not in ("compile", "matmul")]:
        start = time.perf_counter()
        grads = logprob_case(x, provider, "fwd+bwd")()
        ref = grads if ref is None else ref
        err = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref))
        print(f"{provider}: {1e3 * (time.perf_counter() - start):.1f} ms, max |grad - torch's| {err:.2e}")


if __name__ == "__main__":
    main()
