"""The stages of ``make gpu-check`` (driven by ``tools/gpu/gpu_check.sh``), one per call, each writing into OUTDIR.

    python -m tools.gpu.gpu_check env     OUT       # env.json: GPU, driver, torch / CUDA, optional packages
    python -m tools.gpu.gpu_check kernels OUT       # kernels.jsonl (a line per case as it finishes), targets.json
    python -m tools.gpu.gpu_check train   OUT       # three trainer steps: step_times.json
    python -m tools.gpu.gpu_check rollout OUT       # async vs lockstep on the turn-skewed workload: rollout_*.json
    python -m tools.gpu.gpu_check summary OUT       # summary.md; exit 1 on any failed stage or target

Every stage records ``stage_<name>.json``: ``passed``, ``failed`` or ``not run`` with the reason
(a stage that needs CUDA or a package that is absent is "not run", never "passed"). On a CPU
the kernel cases run under the Triton interpreter at tiny shapes (the script proves itself);
their timings are not figures and the targets are "not run".
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

from tools.gpu.gpu_check_common import cuda_available, record

OPTIONAL = ("vllm", "faiss", "flash_attn", "liger_kernel", "deepspeed", "nvtx", "triton", "fastcredit._C")
# Targets on the GPU (the numbers): turn surrogate fwd+bwd at N = 8M, fused linear log-prob fwd+bwd.
SURROGATE_BW_FRAC, SURROGATE_SPEEDUP = 0.70, 5.0
LOGPROB_OVER_MATMUL, LOGPROB_MEM_FRAC = 1.5, 0.15


def stage_env(out: str) -> None:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "packages": {}}
    if env["cuda_available"]:
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        env["driver"] = smi.stdout.strip() if smi.returncode == 0 else None
    for name in OPTIONAL:
        try:
            mod = importlib.import_module(name)
            env["packages"][name] = getattr(mod, "__version__", "importable")
        except Exception as exc:  # absent, or present but broken (a wrong CUDA build raises OSError)
            env["packages"][name] = f"not importable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if "not importable" not in env["packages"]["faiss"]:
        from fastcredit.retrieval.indexes import faiss_has_gpu

        env["faiss_gpu"] = faiss_has_gpu()
    with open(os.path.join(out, "env.json"), "w") as f:
        json.dump(env, f, indent=1)
    record(out, "env", "passed", env.get("gpu", "no CUDA device"))


def _timers(cuda: bool):
    """(python_ms, graph_ms): median ms of one call; on a GPU also as one CUDA-graph replay (the kernels alone)."""
    if cuda:
        import triton.testing

        def python_ms(fn):
            return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))

        def graph_ms(fn):
            try:
                return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
            except Exception as exc:  # a host sync inside fn makes it uncapturable
                return f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"

        return python_ms, graph_ms

    def python_ms(fn, reps=3):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return python_ms, (lambda fn: "not run (needs CUDA)")


def _peak_bytes(fn, cuda: bool):
    if not cuda:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return int(torch.cuda.max_memory_allocated() - base)


def _cases(cuda: bool):
    """(op, shape, provider, mode, callable, bytes, flops) for the turn surrogate and the fused log-prob."""
    import torch
    from bench.bench_linear_logprob import gemm_flops, logprob_case, make_inputs
    from bench.bench_turn_surrogate import bytes_moved, make_batch, make_case
    from bench.shapes import LogprobShape, LossShape

    dev = "cuda" if cuda else "cpu"
    loss_shapes = [LossShape("N1M", 1 << 20), LossShape("N8M", 1 << 23)] if cuda else \
        [LossShape("cpu-N4k", 4096, context=1024)]
    lp_shapes = [LogprobShape("qwen2.5-3b-N8k", "qwen2.5-3b", 8192, 2048)] if cuda else \
        [LogprobShape("cpu-N64", "tiny", 64, 64, vocab=1000)]
    for shape in loss_shapes:
        batch = make_batch(shape, device=dev)
        N, S = batch["seg_id_N"].numel(), batch["seg_traj_S"].numel()
        for provider in ("torch", "triton"):
            yield ("turn_surrogate", shape.name, provider, "fwd+bwd",
                   make_case(batch, provider, "token-mean", "fwd+bwd"),
                   bytes_moved(N, S, "fwd+bwd", "token-mean"), None)
    for shape in lp_shapes:
        x = make_inputs(shape, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
        providers = ("torch", "triton", "matmul") if cuda else ("torch", "triton")
        for provider in providers:
            yield ("linear_logprob", shape.name, provider, "fwd+bwd", logprob_case(x, provider, "fwd+bwd"), None,
                   gemm_flops(provider, "fwd+bwd", shape.tokens, shape.vocab, shape.hidden))


def stage_kernels(out: str) -> None:
    cuda = cuda_available()
    python_ms, graph_ms = _timers(cuda)
    ceilings = {}
    if cuda:
        from bench.ceilings import bf16_matmul_tflops, copy_bandwidth_gbps

        ceilings = {"copy_gbps": copy_bandwidth_gbps(python_ms), "bf16_matmul_tflops": bf16_matmul_tflops(python_ms)}
    rows, failures = [], 0
    with open(os.path.join(out, "kernels.jsonl"), "w") as f:
        f.write(json.dumps({"ceilings": ceilings, "device": "cuda" if cuda else "cpu (Triton interpreter)"}) + "\n")
        for op, shape, provider, mode, fn, nbytes, flops in _cases(cuda):
            row = {"op": op, "shape": shape, "provider": provider, "mode": mode}
            try:
                row["peak_bytes"] = _peak_bytes(fn, cuda)
                row["python_ms"] = python_ms(fn)
                row["graph_ms"] = graph_ms(fn)
                best = min([t for t in (row["python_ms"], row["graph_ms"]) if isinstance(t, float)])
                if nbytes and cuda:
                    row["gbps"] = nbytes / (best * 1e-3) / 1e9
                    row["frac_of_copy_bw"] = row["gbps"] / ceilings["copy_gbps"]
                if flops and cuda:
                    row["tflops"] = flops / (best * 1e-3) / 1e12
                    row["frac_of_bf16_matmul"] = row["tflops"] / ceilings["bf16_matmul_tflops"]
                row["status"] = "ok"
            except Exception as exc:
                failures += 1
                row.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:500])
                traceback.print_exc()
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"[gpu-check] {op} {shape} {provider} {mode}: {row.get('python_ms', row.get('error'))}", flush=True)
    targets = check_targets(rows, cuda)
    with open(os.path.join(out, "targets.json"), "w") as f:
        json.dump(targets, f, indent=1)
    bad = [t["name"] for t in targets if t["status"] == "FAIL"]
    status = "failed" if failures or bad else "passed"
    record(out, "kernels", status, f"{failures} case(s) raised; targets failed: {bad}" if status == "failed" else
           ("" if cuda else "interpreter timings; targets not run without CUDA"))


def _best(row):
    return min([t for t in (row.get("python_ms"), row.get("graph_ms")) if isinstance(t, float)], default=None)


def check_targets(rows: list, cuda: bool) -> list:
    """PASS / FAIL / not run for each target (they are GPU targets: a CPU run says so)."""
    ok = {(r["op"], r["shape"], r["provider"]): r for r in rows if r.get("status") == "ok"}
    out = []

    def add(name, value, limit, passed, what):
        out.append({"name": name, "value": value, "limit": limit,
                    "status": "not run" if value is None else ("PASS" if passed else "FAIL"), "what": what})

    sur, ref = ok.get(("turn_surrogate", "N8M", "triton")), ok.get(("turn_surrogate", "N8M", "torch"))
    frac = sur.get("frac_of_copy_bw") if sur and cuda else None
    add("turn_surrogate N8M fwd+bwd bandwidth", frac, SURROGATE_BW_FRAC, frac is not None and frac >= SURROGATE_BW_FRAC,
        "fraction of the measured copy bandwidth")
    speed = _best(ref) / _best(sur) if sur and ref and cuda else None
    add("turn_surrogate N8M fwd+bwd vs eager torch", speed, SURROGATE_SPEEDUP,
        speed is not None and speed >= SURROGATE_SPEEDUP, "speed-up over policy_loss_torch")
    key = "qwen2.5-3b-N8k"
    tri, mm, naive = (ok.get(("linear_logprob", key, p)) for p in ("triton", "matmul", "torch"))
    ratio = _best(tri) / _best(mm) if tri and mm and cuda else None
    add("linear_logprob fwd+bwd vs its bf16 matmuls", ratio, LOGPROB_OVER_MATMUL,
        ratio is not None and ratio <= LOGPROB_OVER_MATMUL, "time over the three GEMMs alone (floor 4/3)")
    mem = tri["peak_bytes"] / naive["peak_bytes"] if tri and naive and cuda and naive.get("peak_bytes") else None
    add("linear_logprob fwd+bwd peak memory", mem, LOGPROB_MEM_FRAC, mem is not None and mem <= LOGPROB_MEM_FRAC,
        "fraction of the unfused version's peak memory")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("env", "kernels", "train", "rollout", "summary"))
    p.add_argument("out")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.stage == "summary":
        from tools.gpu.gpu_check_summary import write_summary

        return write_summary(a.out)
    try:
        from tools.gpu.gpu_check_train import stage_rollout, stage_train

        {"env": stage_env, "kernels": stage_kernels, "train": stage_train, "rollout": stage_rollout}[a.stage](a.out)
    except Exception as exc:
        traceback.print_exc()
        record(a.out, a.stage, "failed", f"{type(exc).__name__}: {exc}"[:500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
