"""The ``ranks`` stage of ``make gpu-check``: the trainer under torchrun on every visible GPU, two steps in bf16.

    python -m tools.gpu.gpu_check_ranks OUT    # stage_ranks.json, ranks.json, ranks_train.log, ranks_offload_train.log

Defects that only show with several ranks (an engine on the wrong GPU, a thread launching
on device 0, a collective on a CPU tensor under NCCL) are caught here: the run must finish
its two steps, and ``nvidia-smi`` sampled while it runs must show the trainer's processes on
as many distinct GPUs as there are ranks (vLLM's memory counts under the trainer's own
process: its engine runs inside it). The policy is a random Qwen2 saved as an HF folder, so
the policy is read on rank 0 only (the other ranks build it on the meta device). vLLM is used
where it imports, else the HF engine. A second run adds FSDP2's CPU offload and a warm start (rank 0 alone
trains it). With fewer than two GPUs the stage is "not run".
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

from tools.gpu.gpu_check_common import ROOT, cuda_available, record
from tools.gpu.gpu_check_train import TRAIN_OVERRIDES, random_policy


def _sample_gpus(pids_of_run, stop: threading.Event, seen: dict) -> None:
    """GPU uuid -> MiB used by the run's processes, every second until ``stop``."""
    while not stop.wait(1.0):
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                           capture_output=True, text=True)
        pids = pids_of_run()
        for line in q.stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) in pids:
                mib = int(parts[2].split()[0]) if parts[2].split()[0].isdigit() else 0
                seen[parts[1]] = max(seen.get(parts[1], 0), mib)


def _descendants(pid: int) -> set:
    out, todo = {pid}, [pid]
    while todo:
        p = todo.pop()
        try:
            children = open(f"/proc/{p}/task/{p}/children").read().split()
        except OSError:
            continue
        for c in map(int, children):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


# Each run: (name, extra overrides). "offload": FSDP2's CPU offload (rank 0's buffers stay on its GPU, the other
# ranks' shards are allocated on the host) and a warm start, which rank 0 alone trains (the others hold meta weights).
RUNS = (("ranks", []), ("ranks_offload", ["distributed.cpu_offload=true", "warmstart.enabled=true",
                                          "warmstart.epochs=1"]))


def _train(out: str, name: str, extra: list, count: int, engine: str, policy: str) -> tuple[dict, list]:
    """One two-step torchrun over ``count`` GPUs: (its ranks.json entry, the problems found)."""
    work = os.path.join(out, "work")
    run = os.path.join(work, f"train_{name}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={count}",
           "-m", "fastcredit.train", "--config", os.path.join(ROOT, "configs", "debug.yaml"),
           f"logging.output_dir={run}", f"data.world_dir={work}/world", f"model.policy={policy}",
           "model.dtype=bfloat16", "distributed.mixed_precision=true", f"rollout.engine={engine}",
           f"optim.batch_prompts={2 * count}", f"optim.mini_batch_prompts={count}", *TRAIN_OVERRIDES,
           "optim.total_steps=2", *extra]
    t0, seen, stop = time.time(), {}, threading.Event()
    with open(os.path.join(out, f"{name}_train.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = threading.Thread(target=_sample_gpus, args=(lambda: _descendants(proc.pid), stop, seen), daemon=True)
        sampler.start()
        try:
            rc = proc.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        stop.set()
        sampler.join()
    steps = []
    if os.path.exists(os.path.join(run, "metrics.jsonl")):
        steps = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if '"time/step"' in line]
    result = {"ranks": count, "engine": engine, "overrides": extra, "exit": rc, "wall_s": time.time() - t0,
              "steps": len(steps), "gpus_used_mib": seen, "step_s": [s.get("time/step") for s in steps]}
    problems = []
    if rc != 0:
        problems.append(f"{name}: torchrun exit {rc}, see {name}_train.log")
    if len(steps) != 2:
        problems.append(f"{name}: {len(steps)} of 2 steps logged")
    if len(seen) != count:
        problems.append(f"{name}: the run's processes used {len(seen)} distinct GPUs, expected {count} (one per rank)")
    return result, problems


def stage_ranks(out: str) -> None:
    count = 0
    if cuda_available():
        import torch

        count = torch.cuda.device_count()
    if count < 2:
        record(out, "ranks", "not run", f"needs 2 or more GPUs ({count} visible)")
        return
    engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
    policy = random_policy(os.path.join(out, "work"), True, "ranks_policy", seed=2)
    results, problems = {}, []
    for name, extra in RUNS:
        results[name], found = _train(out, name, extra, count, engine, policy)
        problems += found
    with open(os.path.join(out, "ranks.json"), "w") as f:
        json.dump(results, f, indent=1)
    record(out, "ranks", "failed" if problems else "passed",
           "; ".join(problems) or f"{count} ranks ({engine}), every rank on its own GPU, 2 steps each: "
           + ", ".join(name for name, _ in RUNS))


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    try:
        stage_ranks(sys.argv[1])
    except Exception as exc:  # noqa: BLE001  (the stage records why, the summary reports it)
        record(sys.argv[1], "ranks", "failed", f"{type(exc).__name__}: {exc}"[:500])
