"""The trainer and rollout stages of ``make gpu-check`` (tools/gpu/gpu_check.py dispatches to them): three trainer steps
per engine and run (step_times.json, the packed forward against the padded one), and async against lockstep rollouts
on the turn-skewed workload; the trainer's overrides and the random policies the other stages' runs share
(``random_policy``, ``train_overrides``)."""
from __future__ import annotations

import glob
import importlib
import json
import os
import time
import subprocess
import sys

from tools.gpu.gpu_check_common import ROOT, cuda_available, record

TRAIN_OVERRIDES = ["optim.total_steps=3", "eval.questions=0", "logging.checkpoint_every=0",
                   "data.toy.num_questions=200"]
# On a CPU a world of a tenth the passages: embedding the default world's corpus with MiniLM is most of the stage's
# time there (about 40 s of a minute), and the suite runs this stage on every CI run.
CPU_WORLD = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60"]


def train_overrides(cuda: bool) -> list:
    """The trainer runs' overrides (the world's size, three steps, no evaluation or checkpoints)."""
    return TRAIN_OVERRIDES if cuda else [*TRAIN_OVERRIDES, *CPU_WORLD]


def random_policy(work: str, cuda: bool, name: str = "policy", seed: int = 0) -> str:
    """A random Qwen2 built in code over the toy world's tokenizer, saved as an HF folder; returns the folder.

    About 0.5B parameters on a GPU (hidden 1280, 28 layers of 20 heads), held by the trainer as
    fp32 master weights computing in ``model.dtype`` (bf16); the debug config's
    few-thousand-parameter model on the CPU. ``name`` / ``seed``: a second one of the same
    architecture is the frozen critic whose weights switch into the rollout engine.
    """
    from fastcredit.config import load_config
    from fastcredit.data.build import load_data
    from fastcredit.models.build import run_tokenizer
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy

    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"),
                      [f"data.world_dir={work}/world", *train_overrides(cuda)])
    tokenizer = run_tokenizer(cfg, load_data(cfg), work)
    size = dict(hidden=1280, layers=28, heads=20) if cuda else dict(hidden=64, layers=2, heads=2)
    lm = build_tiny_policy(tokenizer, seed=seed, **size)
    print(f"[gpu-check] random Qwen2 ({name}): {sum(p.numel() for p in lm.parameters()) / 1e6:.1f}M parameters",
          flush=True)
    return save_tiny_policy(lm, tokenizer, os.path.join(work, name))


# Each run: (name, overrides). "switch" adds a frozen critic of the policy's architecture, so
# every step switches the engine's weights to the critic and back (time/colocate/*); "keep" is "grpo" with the
# training state kept on the GPU (distributed.offload_state=false: no offload / reload). On a CPU only "switch"
# runs: it takes every step of "grpo" and the switch besides, and the suite runs this stage on every CI run.
def _train_runs(critic: str, cuda: bool) -> list:
    switch = ("switch", ["credit.estimator=criticsearch", "credit.reward=criticsearch", "judges.backend=colocated",
                         f"judges.model={critic}", "judges.max_tokens=64", "loss.kl_coef=0.001"])
    keep = ("keep", ["distributed.offload_state=false", "rollout.gpu_memory_utilization=0.3"])
    # "grpo" pins the move (offload_state's default, auto, keeps a state that fits), so it contrasts with "keep"
    moved = ("grpo", ["distributed.offload_state=true"])
    return [moved, keep, switch] if cuda else [switch]


def stage_train(out: str) -> None:
    """Three trainer steps per engine (HF; vLLM too when it imports) and run (grpo, grpo with the training state kept
    on the GPU, and a critic switched into the engine; on a CPU the switch run only) on a random Qwen2 built in code:
    per-phase seconds, switch / sync / move seconds, GPU memory at every phase boundary (allocated / reserved /
    engine)."""
    cuda = cuda_available()
    engines = ["hf"] + (["vllm"] if cuda and importlib.util.find_spec("vllm") else [])
    results, failed = {}, []
    work = os.path.join(out, "work")  # runs, world, tokenizer and weights: scratch, not results (.gitignore)
    policy = random_policy(work, cuda)
    critic = random_policy(work, cuda, "critic", seed=1)
    for engine in engines:
        for run_name, extra in _train_runs(critic, cuda):
            key = engine if run_name == "grpo" else f"{engine}_{run_name}"
            run = os.path.join(work, f"train_{key}")
            cmd = [sys.executable, "-m", "fastcredit.train", "--config", os.path.join(ROOT, "configs", "debug.yaml"),
                   f"logging.output_dir={run}", f"data.world_dir={work}/world", f"model.policy={policy}",
                   "model.dtype=bfloat16", f"rollout.engine={engine}", *train_overrides(cuda), *extra]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
            with open(os.path.join(out, f"train_{key}.log"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                failed.append(f"{key}: exit {proc.returncode}, see train_{key}.log")
                continue
            steps = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if '"time/step"' in line]
            results[key] = {"wall_s": time.time() - t0, "steps": [
                {k: v for k, v in s.items()
                 if k.startswith(("time/", "memory/")) or k in ("step", "tokens_per_s", "reward")} for s in steps]}
    failed += _packed_forward(out, cuda)
    with open(os.path.join(out, "step_times.json"), "w") as f:
        json.dump({"device": "cuda" if cuda else "cpu", "engines": results,
                   "vllm": "run" if "vllm" in engines else "not run (vllm does not import or no CUDA)"}, f, indent=1)
    record(out, "train", "failed" if failed else "passed", "; ".join(failed))


def _packed_forward(out: str, cuda: bool) -> list:
    """The actor's packed forward against the padded one (bench/bench_packed_forward.py) at 0.5B-like shapes."""
    shape = ["--hidden", "1280", "--layers", "8", "--heads", "20", "--vocab", "32000", "--trajectories", "64",
             "--repeats", "5"] if cuda else ["--repeats", "1", "--trajectories", "8", "--max-len", "128"]
    rc = run_bench(out, "bench_packed_forward", shape, "packed_forward.log", 900)
    return [] if rc == 0 else [f"packed forward bench: exit {rc}, see packed_forward.log"]


def run_bench(out: str, module: str, args: list, log: str, timeout: int) -> int:
    """``python -m bench.<module> --out OUT args`` from the checkout; its output goes to ``OUT/<log>``."""
    from bench.results_io import child_env  # here, not at the top: `env` runs before fastcredit is installed
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", "--out", out, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=child_env(ROOT))
    with open(os.path.join(out, log), "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc.returncode


def stage_rollout(out: str) -> None:
    """bench/bench_rollout.py on the GPU: vLLM when it imports, else the HF engine (no continuous batching)."""
    if not cuda_available():
        record(out, "rollout", "not run",
               "needs CUDA (the CPU figure: python -m bench.bench_rollout, in bench/results)")
        return
    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    rc = run_bench(out, "bench_rollout", ["--engine", engine, "--trajectories", "256", "--reps", "3"],
                    "rollout.log", 1200)
    if rc:
        record(out, "rollout", "failed", f"bench_rollout.py exit {rc}, see rollout.log")
        return
    ratio = json.load(open(glob.glob(os.path.join(out, f"rollout_{engine}_*.json"))[0]))["async_over_lockstep"]
    record(out, "rollout", "passed", f"engine {engine}" + ("" if engine == "vllm" else " (vllm does not import)"),
           async_over_lockstep=ratio)
