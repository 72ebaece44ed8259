"""Compile every Triton kernel for real GPUs on a machine without one, with the host code's own launch choices.

    python -m tools.gpu.gpu_preflight_kernels OUTDIR [--arch 80,90,100]     # default: --arch 90 (H100)

Runs the real host code, ``linear_logprob_triton`` and ``turn_surrogate_loss`` forward and
backward, at the benchmark shapes (``bench/shapes.py``) under ``tools/gpu/aot_compile.py``'s
``compile_only``: every launch compiles for ``sm_<arch>`` with the tiles, warps, stages and
argument specialisation that a run on that GPU would use, and nothing is launched. Writes
``OUTDIR/kernels.jsonl`` (a line per case and kernel: config, registers, spills, stack,
shared memory, blocks per SM, tensor-core instructions), ``OUTDIR/kernels.md`` (a row per
distinct compiled kernel) and a summary line on stdout.

Exit status 1, naming the kernel and its config, on a compile error (or host code that
fails before its launch), shared memory above the arch's per-block limit, or a register
spill of the linear log-prob (bf16 and fp32); the turn surrogate's spills (an fp32 op) are
warnings. About 20 s of CPU per arch with a cold Triton cache (``TRITON_CACHE_DIR``), most
of it compiling: 28 distinct kernels per arch from 40 cases, then issue 46's candidate variants
(``variant_cases``).
"""
from __future__ import annotations

import os

# NOTE: kernels compile only where @triton.jit makes compilable functions; gpu_check.sh exports
# TRITON_INTERPRET=1 on a CPU machine, so this process turns it off before anything imports Triton.
os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from bench.results_io import device_name  # noqa: E402
from bench.shapes import LOGPROB_SHAPES, LOSS_SHAPES  # noqa: E402
from tools.gpu.aot_compile import CompileFailed, compile_only, limit_problems, resource_usage  # noqa: E402

from fastcredit.kernels.linear_logprob import VARIANTS, linear_logprob_triton, variant_config  # noqa: E402
from fastcredit.kernels.turn_surrogate import AGG_MODES, SurrogateLaunch, turn_surrogate_loss  # noqa: E402
from fastcredit.trainer.loss import LossCounts  # noqa: E402
from fastcredit.config.loss import LossConfig  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SEG_DTYPES = {"int32": torch.int32, "int64": torch.int64}
LOGPROB_TOKENS = 8192
LOSS_TOKENS = (1 << 20, 1 << 23)
# The loss's optional inputs as training passes them. "default": LossConfig's defaults (the k3 KL
# to the reference needs ref log-probs; no entropy bonus, weights, CHORD-phi, loss mask or dual
# clip). "all": every optional input and the dual clip.
SURROGATE_INPUTS = {
    "default": ({}, ("ref_logp_N",)),
    "all": (dict(dual_clip=3.0, entropy_coef=1e-3),
            ("ref_logp_N", "entropy_N", "weight_N", "phi_mask_N", "loss_mask_N")),
}
# Ops whose spills are warnings: the turn surrogate runs on fp32 log-probs (the rule: spills fail on the bf16
# paths). Its one spill today: 4 B, one register around a layout-conversion barrier of the all-inputs backward on
# sm_80, which ptxas chose at 48 registers of 255. The linear log-prob spills in neither dtype: both fail.
SPILL_WARNS = {"turn_surrogate"}
# Candidate variants of issue 46 (kernels/*/README.md, "Variants"), compiled at the Qwen2.5 shapes in bf16 with both
# gradients (the log-prob: variant_config, the arch's own config with the variant's fields) and for the benchmark's
# token-mean case with every input (the turn surrogate).
LOGPROB_VARIANTS = [v for v in VARIANTS if v != "default"]
SURROGATE_LAUNCHES = {
    "stream": (SurrogateLaunch("stream"), None), "persistent": (SurrogateLaunch("persistent"), None),
    "stream b4096 w16": (SurrogateLaunch("stream", num_warps=16), 4096),
    "persistent b4096 w16": (SurrogateLaunch("persistent", num_warps=16, programs_per_sm=1), 4096),
}


@dataclass(frozen=True)
class Case:
    """One host-code call to compile: ``run`` calls the op forward and backward on tensors that hold no data."""

    op: str
    shape: str
    dtype: str
    variant: str
    run: Callable[[], None]
    seg_dtype: Optional[str] = None
    archs: Optional[tuple] = None  # the archs this case exists for; None: every arch


def _logprob(N: int, H: int, V: int, dtype: torch.dtype, grads: str, variant: Optional[str] = None) -> None:
    """Forward and backward of the fused log-prob on meta tensors (shape-only: the backward's GEMMs cost nothing)."""
    hidden = torch.empty(N, H, dtype=dtype, device="meta", requires_grad=True)
    weight = torch.empty(V, H, dtype=dtype, device="meta", requires_grad=True)
    target = torch.empty(N, dtype=torch.int64, device="meta")
    config = variant_config(variant, N, V, H, dtype) if variant else None  # for the arch compile_only targets
    logp, entropy = linear_logprob_triton(hidden, weight, target, config=config)
    outs = (logp, entropy) if grads == "logp+entropy" else (logp,)
    torch.autograd.grad(outs, (hidden, weight), [torch.empty_like(o) for o in outs])


def _surrogate(N: int, trajectories: int, turns: int, mode: str, inputs: str, seg_dtype: torch.dtype,
               launch: Optional[SurrogateLaunch] = None, block: Optional[int] = None) -> None:
    """Forward and backward of the fused loss on CPU tensors that are never written (no memory is touched).

    Not meta tensors: the per-trajectory modes size a buffer from ``seg_traj_S.max()`` on the host.
    """
    extra_cfg, names = SURROGATE_INPUTS[inputs]
    S = trajectories * turns
    opt = {name: torch.empty(N, dtype=torch.bool if name.endswith("mask_N") else torch.float32) for name in names}
    logp = torch.empty(N).requires_grad_()
    if "entropy_N" in opt:
        opt["entropy_N"].requires_grad_()
    loss, _ = turn_surrogate_loss(logp, torch.empty(N), torch.empty(N, dtype=seg_dtype),
                                  torch.arange(trajectories).repeat_interleave(turns),
                                  LossCounts(float(N), float(trajectories), float(S)),
                                  LossConfig(agg_mode=mode, **extra_cfg), adv_S=torch.empty(S), **opt,
                                  launch=launch, block=block)
    wrt = [logp] + ([opt["entropy_N"]] if "entropy_N" in opt else [])
    torch.autograd.grad(loss, wrt, torch.ones(()))


def cases() -> list:
    """The benchmark shapes of both ops, every dtype, aggregation mode, seg-id dtype and input set they run with."""
    out = []
    for shape in [s for s in LOGPROB_SHAPES if s.tokens == LOGPROB_TOKENS]:
        for dtype_name, dtype in DTYPES.items():
            for grads in ("logp", "logp+entropy"):
                run = functools.partial(_logprob, shape.tokens, shape.hidden, shape.vocab, dtype, grads)
                out.append(Case("linear_logprob", shape.name, dtype_name, f"grad {grads}", run))
    for shape in [s for s in LOSS_SHAPES if s.tokens in LOSS_TOKENS]:
        for mode in AGG_MODES:
            for inputs in SURROGATE_INPUTS:
                for seg_name, seg_dtype in SEG_DTYPES.items():
                    run = functools.partial(_surrogate, shape.tokens, shape.trajectories, shape.turns, mode, inputs,
                                            seg_dtype)
                    out.append(Case("turn_surrogate", shape.name, "fp32", f"{mode} {inputs}", run, seg_name))
    return out + variant_cases()


def variant_cases() -> list:
    """The candidate variants: the log-prob's at both Qwen2.5 shapes, the turn surrogate's at N = 8M."""
    out = []
    for shape in [s for s in LOGPROB_SHAPES if s.tokens == LOGPROB_TOKENS]:
        for name in LOGPROB_VARIANTS:
            run = functools.partial(_logprob, shape.tokens, shape.hidden, shape.vocab, torch.bfloat16,
                                    "logp+entropy", name)
            archs = (80, 90) if name == "fused_skip" else None  # variant_config: no sm_100 build with Triton 3.7.1
            out.append(Case("linear_logprob", shape.name, "bf16", f"grad logp+entropy {name}", run, archs=archs))
    shape = next(s for s in LOSS_SHAPES if s.tokens == 1 << 23)
    for name, (launch, block) in SURROGATE_LAUNCHES.items():
        run = functools.partial(_surrogate, shape.tokens, shape.trajectories, shape.turns, "token-mean", "all",
                                torch.int32, launch, block)
        out.append(Case("turn_surrogate", shape.name, "fp32", f"token-mean all {name}", run, "int32"))
    return out


_USAGE: dict = {}  # compiled kernel hash -> resource_usage (the same binary serves several cases)


def _usage(kernel) -> dict:
    if kernel.hash not in _USAGE:
        _USAGE[kernel.hash] = resource_usage(kernel)
    return _USAGE[kernel.hash]


def _row(case: Case, launch, launches: int) -> dict:
    md = launch.kernel.metadata
    row = {"op": case.op, "kernel": launch.name, "arch": launch.arch, "shape": case.shape, "dtype": case.dtype,
           "seg_dtype": case.seg_dtype, "variant": case.variant, "constexprs": launch.constexprs,
           "num_warps": launch.num_warps, "num_stages": launch.num_stages, "maxnreg": md.maxnreg,
           "grid": list(launch.grid), "launches": launches, "signature": launch.signature, "hash": md.hash,
           "compile_s": round(launch.compile_s, 3), **_usage(launch.kernel)}
    failures, warnings = limit_problems(row, row["arch"], spills_fail=row["op"] not in SPILL_WARNS)
    row.update(status="fail" if failures else "warn" if warnings else "ok", problems=failures + warnings)
    return row


def run_case(case: Case, arch: int, log: Callable[[str], None]) -> list:
    """The rows of one case: a row per distinct compiled kernel (a kernel launched per chunk is one row)."""
    tag = f"sm_{arch} {case.op} {case.shape} {case.dtype}{' ' + case.seg_dtype if case.seg_dtype else ''} " \
          f"{case.variant}"
    try:
        with compile_only(arch) as launches:
            case.run()
    except Exception as exc:  # a kernel that does not compile, or host code that fails before its launch
        failed = isinstance(exc, CompileFailed)
        log(f"[preflight] {tag}: {'COMPILE' if failed else 'HOST CODE'} ERROR {type(exc).__name__}: {exc}")
        return [{"op": case.op, "kernel": exc.kernel if failed else "(host code)", "arch": arch, "shape": case.shape,
                 "dtype": case.dtype, "seg_dtype": case.seg_dtype, "variant": case.variant,
                 "config": {k: repr(v) for k, v in exc.config.items()} if failed else None, "status": "error",
                 "problems": [f"{type(exc).__name__}: {exc}"]}]
    rows, index = [], {}
    for launch in launches:
        if launch.kernel.hash in index:
            rows[index[launch.kernel.hash]]["launches"] += 1
            continue
        index[launch.kernel.hash] = len(rows)
        rows.append(_row(case, launch, 1))
        r = rows[-1]
        if launch.compile_s:
            log(f"[preflight] {tag}: {launch.name} compiled in {launch.compile_s:.1f} s: {r['registers']} regs, "
                f"{r['spill_store_bytes']} B spilled, {r['smem_bytes'] / 1024:.1f} KB smem, {r['tensor_cores']}, "
                f"{r['blocks_per_sm']} blocks/SM")
        for problem in r["problems"]:
            log(f"[preflight] {tag}: {launch.name} {r['status'].upper()}: {problem}")
    return rows


def _config_text(row: dict) -> str:
    """Constexprs compactly: numbers and strings as name=value, true flags by name, false flags left out."""
    parts = []
    for name, value in row.get("constexprs", {}).items():
        if value is True:
            parts.append(name)
        elif value is not False and value is not None:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def markdown(rows: list) -> str:
    """A row per distinct compiled kernel and arch, with the cases that compile to it."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["arch"], r.get("hash", id(r))), []).append(r)
    lines = ["| arch | op | kernel | dtype | seg | config | warps | stages | maxnreg | regs | spill st/ld B | "
             "stack B | smem KB | blocks/SM | tensor cores | cases | status |", "|" + "---|" * 17]
    for (arch, _), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0]["op"], kv[1][0]["kernel"])):
        r = group[0]
        segs = sorted({g["seg_dtype"] for g in group if g["seg_dtype"]})
        dtypes = " ".join(sorted({g["dtype"] for g in group}))
        shapes = sorted({g["shape"] for g in group})
        status = "fail" if any(g["status"] in ("fail", "error") for g in group) else r["status"]
        if r["status"] == "error":
            lines.append(f"| sm_{arch} | {r['op']} | {r['kernel']} | {dtypes} | {' '.join(segs)} | "
                         f"{r['problems'][0][:200]} |" + " |" * 9 + f" {len(group)} | error |")
            continue
        lines.append(
            f"| sm_{arch} | {r['op']} | {r['kernel']} | {dtypes} | {' '.join(segs)} | {_config_text(r)} | "
            f"{r['num_warps']} | {r['num_stages']} | {r['maxnreg'] or ''} | {r['registers']} | "
            f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['stack_bytes']} | {r['smem_bytes'] / 1024:.1f} | "
            f"{r['blocks_per_sm']} | {r['tensor_cores']} | {len(group)} ({', '.join(shapes)}) | {status} |")
    return "\n".join(lines) + "\n"


def preflight(out_dir: str, archs: list, log: Callable[[str], None] = print) -> int:
    """Compile every case for every arch into ``out_dir``; returns the exit status (1 on any failure)."""
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    rows = []
    with open(os.path.join(out_dir, "kernels.jsonl"), "w") as f:
        f.write(json.dumps({"preflight": "kernels", "archs": archs, "triton": triton.__version__,
                            "torch": torch.__version__, "compiled_on": device_name("cpu")}) + "\n")
        for arch in archs:
            for case in cases():
                if case.archs and arch not in case.archs:
                    log(f"[preflight] sm_{arch} {case.op} {case.shape} {case.variant}: not built for sm_{arch}")
                    continue
                for row in run_case(case, arch, log):
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
    with open(os.path.join(out_dir, "kernels.md"), "w") as f:
        f.write(markdown(rows))
    bad = [r for r in rows if r["status"] in ("fail", "error")]
    warned = [r for r in rows if r["status"] == "warn"]
    distinct = len({(r["arch"], r.get("hash")) for r in rows})
    for r in bad:
        case = f"{r['op']} {r['shape']} {r['dtype']} {r['variant']}"
        config = "" if r["status"] == "error" else \
            f"; {_config_text(r)}, {r['num_warps']} warps, {r['num_stages']} stages, maxnreg {r['maxnreg']}"
        log(f"[preflight] FAILED sm_{r['arch']} {r['kernel']} ({case}{config}): {'; '.join(r['problems'])}")
    log(f"[preflight] {'FAILED' if bad else 'passed'}: sm_{', sm_'.join(map(str, archs))}: {distinct} distinct "
        f"kernels in {len(rows)} (case, kernel) rows; {len(bad)} failing, {len(warned)} warnings; "
        f"{time.perf_counter() - start:.0f} s; {out_dir}/kernels.jsonl, {out_dir}/kernels.md")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder: kernels.jsonl, kernels.md")
    p.add_argument("--arch", default="90", help="comma-separated compute capabilities, e.g. 80,90,100")
    a = p.parse_args(argv)
    return preflight(a.out, [int(x) for x in a.arch.split(",") if x.strip()],
                     log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
