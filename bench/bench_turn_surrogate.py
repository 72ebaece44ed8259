"""Turn-surrogate policy loss: eager torch vs torch.compile vs the fused Triton kernel (GPU only).

    pytest --benchmark-only bench/bench_turn_surrogate.py       # results: bench/results/turn_surrogate_<gpu>.json

Legend: N packed tokens, S turns, B trajectories.

Providers: ``torch`` is ``fastcredit.trainer.loss.policy_loss_torch`` run eagerly on the GPU (the
reference the kernel replaces), ``compile`` the same under ``torch.compile``, ``triton``
``fastcredit.kernels.turn_surrogate.turn_surrogate_loss``. liger-kernel has no loss that
starts from per-token log-probs (its ``triton_grpo_loss`` starts from ``[B, L+1, V]``
logits), so it is compared at equal work in ``bench_linear_logprob.py`` instead.

Throughput is counted from the bytes the op must move at least (inputs read once,
gradients written once; ``bytes_moved``), the same for every provider, against the
measured device-to-device copy bandwidth. Target (H100): fwd+bwd at N = 8M at >= 70% of
that bandwidth and >= 5x faster than ``torch`` (issue 46: >= 80% on the H100 and the H200).

    python -m bench.bench_turn_surrogate --device cpu      # a tiny run of every provider, no timing harness

On the host (``test_turn_surrogate_cpu``, every machine): the ``torch`` provider alone, the loss reference that a
CPU run's update computes, at N = 32k.
"""
from __future__ import annotations

import argparse
import functools
import time

import pytest
import torch

from bench.shapes import LOSS_SHAPES, MODES, LossShape

AGG = ("turn-mean", "token-mean")
# triton_<variant>[_b<block>w<warps>]: issue 46's candidate launches (kernels/turn_surrogate/README.md, "Variants").
LAUNCHES = {"triton_stream": ("stream", None, 8), "triton_persistent": ("persistent", None, 8),
            "triton_stream_b4096w16": ("stream", 4096, 16), "triton_persistent_b4096w16": ("persistent", 4096, 16)}
PROVIDERS = ("torch", "compile", "triton") + tuple(LAUNCHES)
_COMPILED = {}
DEVICE = "cuda"
CPU_SHAPE = LossShape("N32k", 1 << 15)


def make_batch(shape: LossShape, seed: int = 0, device: str = DEVICE) -> dict:
    """Trajectories of ``shape.context`` tokens, each ``shape.turns`` turns of random action / observation spans."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T = shape.trajectories, shape.turns
    share = torch.rand(B, 2 * T - 1, generator=g) + 0.2  # action, obs, action, ..., action (answer: no obs)
    spans = torch.floor(share / share.sum(1, keepdim=True) * shape.context).long()
    spans[:, -1] += shape.context - spans.sum(1)
    action_S = spans[:, 0::2].reshape(-1)
    obs_S = torch.cat([spans[:, 1::2], torch.zeros(B, 1, dtype=torch.long)], 1).reshape(-1)
    seg_len = action_S + obs_S
    start_S = torch.cumsum(seg_len, 0) - seg_len
    N, S = B * shape.context, B * T
    turn_N = torch.repeat_interleave(torch.arange(S), seg_len)
    is_action = (torch.arange(N) - start_S[turn_N]) < action_S[turn_N]
    logp = -torch.rand(N, generator=g) * 3
    batch = dict(seg_id_N=torch.where(is_action, turn_N, -1).to(torch.int32),
                 seg_traj_S=torch.repeat_interleave(torch.arange(B), T),
                 logp_N=logp, old_logp_N=logp + 0.2 * torch.randn(N, generator=g),
                 ref_logp_N=logp + 0.3 * torch.randn(N, generator=g), entropy_N=2 * torch.rand(N, generator=g),
                 weight_N=torch.rand(N, generator=g), adv_S=torch.randn(S, generator=g))
    return {k: v.to(device) for k, v in batch.items()}


def bytes_moved(N: int, S: int, mode: str, agg: str) -> float:
    """Least bytes per mode: fp32 logp, old, ref, weight (+ entropy in fwd), int32 seg_id; grads out in bwd."""
    fwd = N * (5 * 4 + 4) + S * 8
    bwd = N * (4 * 4 + 4) + S * 8 + N * 2 * 4  # no entropy read; dlogp and dentropy written
    counts = N * 4 if agg == "turn-mean" else 0  # the per-turn token counts read seg_id once more
    return {"fwd": fwd + counts, "bwd": bwd, "fwd+bwd": fwd + bwd + counts}[mode]


def loss_fn(provider: str):
    from fastcredit.kernels.turn_surrogate import turn_surrogate_loss
    from fastcredit.trainer.loss import policy_loss_torch

    if provider == "torch":
        return policy_loss_torch
    if provider == "compile":
        if "fn" not in _COMPILED:
            _COMPILED["fn"] = torch.compile(policy_loss_torch, dynamic=False)
        return _COMPILED["fn"]
    if provider in LAUNCHES:
        from fastcredit.kernels.turn_surrogate import SurrogateLaunch

        variant, block, warps = LAUNCHES[provider]
        # one program per SM at 16 warps (1 block/SM resident: bench/results/gpu_preflight)
        launch = SurrogateLaunch(variant, num_warps=warps, programs_per_sm=1 if warps == 16 else 2)
        return functools.partial(turn_surrogate_loss, launch=launch, block=block)
    return turn_surrogate_loss


def make_case(batch: dict, provider: str, agg: str, mode: str):
    """The callable to time for ``mode`` (fwd builds the autograd graph, as training does)."""
    from fastcredit.config.loss import LossConfig
    from fastcredit.trainer.loss import loss_counts

    cfg = LossConfig(agg_mode=agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=1e-3, entropy_coef=1e-3)
    logp = batch["logp_N"].clone().requires_grad_()
    ent = batch["entropy_N"].clone().requires_grad_()
    counts = loss_counts(batch["seg_id_N"], batch["seg_traj_S"])
    kw = {k: batch[k] for k in ("adv_S", "ref_logp_N", "weight_N")}
    fn = loss_fn(provider)

    def forward():
        return fn(logp, batch["old_logp_N"], batch["seg_id_N"], batch["seg_traj_S"], counts, cfg, entropy_N=ent,
                  **kw)[0]

    if mode == "fwd":
        return forward
    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(forward(), (logp, ent))
    loss = forward()
    return lambda: torch.autograd.grad(loss, (logp, ent), retain_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("shape", LOSS_SHAPES, ids=[s.name for s in LOSS_SHAPES])
def test_turn_surrogate(benchmark, harness, shape, agg, provider, mode):
    batch = make_batch(shape)
    N, S = batch["seg_id_N"].numel(), batch["seg_traj_S"].numel()
    case = {"shape": f"{shape.name}-{agg}", "tokens": N, "turns": S, "agg": agg, "provider": provider,
            "mode": mode}
    harness.measure(benchmark, "turn_surrogate", case, make_case(batch, provider, agg, mode),
                    bytes_moved=bytes_moved(N, S, mode, agg))


@pytest.fixture(scope="module")
def cpu_batch() -> dict:
    return make_batch(CPU_SHAPE, device="cpu")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGG)
def test_turn_surrogate_cpu(benchmark, cpu_batch, agg, mode):
    """``policy_loss_torch`` on the host, eager."""
    from bench.results_io import device_name

    benchmark.extra_info.update(device=device_name("cpu"), shape=CPU_SHAPE.name, tokens=CPU_SHAPE.tokens)
    benchmark(make_case(cpu_batch, "torch", agg, mode))


def main(argv=None) -> None:
    """One fwd+bwd of every provider at a tiny shape, against the torch provider (a smoke run, not a timing)."""
    p = argparse.ArgumentParser(description="tiny smoke run of the turn-surrogate providers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4096)
    a = p.parse_args(argv)
    batch = make_batch(LossShape("tiny", a.tokens, context=1024), device=a.device)
    ref = None
    for provider in [q for q in PROVIDERS if q != "compile"]:
        start = time.perf_counter()
        grads = make_case(batch, provider, "turn-mean", "fwd+bwd")()
        ref = grads if ref is None else ref
        err = max((g - r).abs().max().item() for g, r in zip(grads, ref))
        print(f"{provider}: {1e3 * (time.perf_counter() - start):.1f} ms, max |grad - torch's| {err:.2e}")


if __name__ == "__main__":
    main()
