"""``bench_step.py --placement split``: the split placement at several staleness bounds beside colocated training.

    python -m bench.bench_step --placement split --staleness 0,1,2          # CPU: 2 ranks, 1 thread each
    python -m bench.bench_step --placement split --steps 8 --config configs/demo.yaml

Every run is ``torchrun --nproc_per_node=2`` on the same config, data, seed and model, one thread per
rank: colocated (both ranks roll out and train their half of each batch, in turn) and split
(rank 0 trains, rank 1 rolls out) at each ``rollout.max_staleness`` k. Per run, over the timed steps
(medians): seconds per step and steps per second, the training side's idle fraction (waiting for a
batch), the rollout side's (waiting for weights), and the overlap achieved: no overlap can make
a step shorter than ``max(R, T)``, so ``max(R, T) / (R + T)`` is the best step-time ratio to split k = 0 (R: the
rollout rank's busy seconds, T: the training rank's, both at k = 0, which runs them in sequence), beside
the ratio measured. Writes
``bench/results/step_split_<shape>_<device>.{json,md}``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from bench.results_io import child_env


def run_one(name: str, config: str, overrides: list, work: str, steps: int, warmup: int, root: str) -> dict:
    """``warmup + steps`` steps under torchrun (2 ranks, 1 thread each); the timed steps' metrics rows."""
    out = os.path.join(work, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fastcredit.train", "--config", config, *overrides, f"logging.output_dir={out}",
           f"optim.total_steps={warmup + steps}"]
    print(f"[{name}] {warmup} warm-up + {steps} timed steps", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                          env=child_env(root, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"time/step"' in line]
    timed = [r for r in rows if r["step"] > warmup]
    if len(timed) != steps:
        raise SystemExit(f"[{name}] expected {steps} timed steps in {out}/metrics.jsonl, found {len(timed)}")
    return {"rows": timed, "wall_s": time.perf_counter() - t0}


def _median(rows: list, keys: tuple) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows)


def summarize(runs: dict) -> list:
    """One row per run: step seconds, steps/s, ratio to colocated; for split runs the idle fractions, the ratio to
    split k = 0 (the same division of work, run in sequence) and the overlap bound that division allows."""
    base = _median(runs["colocated"]["rows"], ("time/step",))
    sync = runs.get("split k=0")
    bound = None
    if sync is not None:  # R: the rollout rank's busy seconds; T: the training rank's, waiting aside
        r_side = statistics.median(r.get("split/rollout_busy_s", 0.0) for r in sync["rows"])
        t_side = statistics.median(r["time/step"] - r.get("time/wait_rollout", 0.0) for r in sync["rows"])
        bound = {"rollout_side_s": r_side, "train_side_s": t_side,
                 "ratio": max(r_side, t_side) / (r_side + t_side) if r_side + t_side > 0 else 1.0}
    sync_step = _median(sync["rows"], ("time/step",)) if sync is not None else None
    table = []
    for name, run in runs.items():
        rows = run["rows"]
        step = _median(rows, ("time/step",))
        row = {"run": name, "step_s": step, "steps_per_s": 1.0 / step if step else float("inf"),
               "ratio_to_colocated": step / base if base else float("nan")}
        if name != "colocated":
            busy = [r.get("split/rollout_busy_s", 0.0) for r in rows]
            waited = [r.get("split/rollout_wait_s", 0.0) for r in rows]
            row.update({"train_idle_frac": statistics.median(r.get("split/train_idle_frac", 0.0) for r in rows),
                        "rollout_idle_frac": statistics.median(w / (b + w) if b + w else 0.0
                                                               for b, w in zip(busy, waited)),
                        "version_lag_max": max(r.get("offpolicy/version_lag_max", 0.0) for r in rows),
                        "ratio_to_sync": step / sync_step if sync_step else None})
        table.append(row)
    return table, bound


def markdown(report: dict) -> str:
    lines = [f"# Split placement beside colocated ({report['device']})", "",
             f"`{report['command']}`: {report['steps']} timed steps after {report['warmup']} warm-up, medians; "
             "2 ranks under torchrun, one thread each (colocated: both roll out and train their half of each "
             "batch; split: rank 0 trains, rank 1 rolls out).", "",
             "| run | s / step | steps / s | ratio to colocated | ratio to split k=0 | training idle | rollout idle | "
             "max lag |", "|---|---|---|---|---|---|---|---|"]
    for r in report["table"]:
        if "train_idle_frac" in r:
            sync = "-" if r["ratio_to_sync"] is None else f"{r['ratio_to_sync']:.2f}"
            rest = (f"{sync} | {r['train_idle_frac']:.2f} | {r['rollout_idle_frac']:.2f} | "
                    f"{r['version_lag_max']:.0f}")
        else:
            rest = "- | - | - | 0"
        lines.append(f"| {r['run']} | {r['step_s']:.3f} | {r['steps_per_s']:.2f} | {r['ratio_to_colocated']:.2f} | "
                     f"{rest} |")
    b = report["bound"]
    if b is not None:
        lines += ["", f"Split k=0 runs its two sides in sequence: rollout rank R = {b['rollout_side_s']:.3f} s, "
                      f"training rank T = {b['train_side_s']:.3f} s a step. Overlap cannot make a step shorter than "
                      f"max(R, T): the bound on the ratio to split k=0 is max(R, T) / (R + T) = {b['ratio']:.2f}."]
    return "\n".join(lines) + "\n"


def main(a, common: list, root: str, device: str, torch_version: str, write_results) -> int:
    """Colocated, then split at each k of ``a.staleness``; prints and writes the report."""
    ks = [int(k) for k in a.staleness.split(",") if k.strip()]
    work = a.work
    runs = {"colocated": run_one("colocated", a.config, common, work, a.steps, a.warmup, root)}
    for k in ks:
        runs[f"split k={k}"] = run_one(f"split_k{k}", a.config, [*common, "distributed.placement=split",
                                                                 f"rollout.max_staleness={k}"],
                                       work, a.steps, a.warmup, root)
    report = {"device": device, "torch": torch_version, "shape": a.shape, "config": a.config,
              "overrides": a.overrides, "steps": a.steps, "warmup": a.warmup, "staleness": ks,
              "command": "python -m bench.bench_step --placement split " + " ".join(
                  [f"--staleness {a.staleness}", f"--steps {a.steps}", f"--warmup {a.warmup}", *a.overrides]),
              "runs": {n: r for n, r in runs.items()}}
    report["table"], report["bound"] = summarize(runs)
    text = markdown(report)
    print(text)
    json_path = write_results(f"step_split_{a.shape}", report, a.out)
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(text)
    print(f"wrote {os.path.splitext(json_path)[0]}.{{json,md}}")
    return 0
