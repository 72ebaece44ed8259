"""Every method from the same warm start, several seeds, one table: the papers' claim at toy scale.

    python -m fastcredit.compare --config configs/compare.yaml --methods grpo,ppo,criticsearch,cwgrpo,proceed,pica --seeds 3
    python -m fastcredit.compare --config configs/compare.yaml --quick          # 1 seed, half the steps
    nohup python -m fastcredit.compare --config configs/compare.yaml > runs/compare.log 2>&1 &   # in the background

One warm start is made (or loaded: ``warmstart.cache_dir``) and shared by every run; then each
method trains for the same steps, prompts and samples with the toy world's oracle judges, and,
for the methods that have a judge, once more with a noisy oracle (``--noise p``: each verdict
flipped with probability p, ``judges.oracle_noise``). Runs go one after another, each a
``python -m fastcredit.train`` process with its own folder under ``--runs``; a finished run is
not redone and an interrupted one resumes from its last checkpoint, so the command can simply
be started again. The report (``fastcredit.compare_report``) goes to
``<out>/compare_<name>_<device>.{md,json,png}``: held-out EM per method (mean ± 95% interval
over seeds), steps to reach a threshold EM, seconds per step and judge calls per step.
Exit status: 0 done, 1 a run failed (its log is named), 2 bad arguments or config.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional

from fastcredit.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What each method adds to the shared config: its estimator and the judge it reads (the oracle on the toy world).
# ProCeedRL runs without DAPO's dynamic sampling here, so every method sees the same prompts per step.
METHODS = {
    "grpo": ["credit.estimator=grpo"],
    "ppo": ["credit.estimator=ppo"],
    "criticsearch": ["credit.estimator=criticsearch", "judges.backend=oracle"],
    "cwgrpo": ["credit.estimator=cwgrpo", "judges.backend=oracle"],
    "proceed": ["credit.estimator=proceed", "rollout.proceed.enabled=true", "judges.backend=oracle"],
    "pica": ["credit.estimator=pica", "judges.prm=oracle"],
}
JUDGED = ("criticsearch", "cwgrpo", "proceed", "pica")
QUICK_STEP_SHARE = 0.5  # --quick: this share of optim.total_steps, one seed


def variants(methods: list[str], noise: float) -> list[tuple[str, list[str]]]:
    """``(label, overrides)`` per run kind: each method, then each judged one with a noisy oracle."""
    out = [(m, METHODS[m]) for m in methods]
    if noise > 0:
        out += [(f"{m}+noise{noise:g}", METHODS[m] + [f"judges.oracle_noise={noise}"]) for m in methods if m in JUDGED]
    return out


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m fastcredit.compare", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "compare.yaml"), help="the shared run config")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per method (the config's seed, +1, +2, ...)")
    p.add_argument("--noise", type=float, default=0.2, help="noisy-oracle variants of the judged methods (0: none)")
    p.add_argument("--quick", action="store_true", help=f"1 seed and {QUICK_STEP_SHARE:.0%} of the steps")
    p.add_argument("--runs", default=None, help="folder of the runs (default: runs/<run_name>)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="where the report goes")
    p.add_argument("--threshold", type=float, default=None,
                   help="EM for 'steps to threshold' (default: GRPO's final mean EM, or the first method's)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from finished runs")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        p.error(f"unknown argument(s): {' '.join(bad)} (config overrides are key=value)")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        p.error(f"--methods: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(METHODS)}")
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, got {args.seeds}")
    if not 0.0 <= args.noise <= 1.0:
        p.error(f"--noise must be in [0, 1], got {args.noise}")
    args.methods = methods
    if args.quick:
        args.seeds = 1
    return args, overrides


def read_metrics(path: str) -> list[dict]:
    """The run's metrics.jsonl lines (a torn last line, from a crash mid-write, is skipped)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def summarize_run(rows: list[dict]) -> dict:
    """Held-out EM by step, mean seconds per step and judge calls per step from a run's metrics lines."""
    em = {}
    secs, calls, steps = [], [], 0
    for r in rows:
        step = int(r.get("step", 0))
        if "eval/em" in r:
            em[step] = float(r["eval/em"])
        if "time/step" in r:
            secs.append(float(r["time/step"]))
        if "reward" in r:  # a training step's line
            steps = max(steps, step)
            calls.append(sum(float(v) for k, v in r.items() if k.endswith("/requests") or k == "proceed/critiqued_steps"))
    return {"eval_em": {str(k): em[k] for k in sorted(em)}, "steps": steps,
            "seconds_per_step": sum(secs) / len(secs) if secs else None,
            "judge_calls_per_step": sum(calls) / len(calls) if calls else 0.0}


def run_one(cmd: list[str], folder: str, label: str, total_steps: int) -> int:
    """One training run in a subprocess, its output in ``folder/train.log``; prints progress from metrics.jsonl."""
    os.makedirs(folder, exist_ok=True)
    log = os.path.join(folder, "train.log")
    metrics = os.path.join(folder, "metrics.jsonl")
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        last = -1
        while proc.poll() is None:
            time.sleep(2.0)
            done = summarize_run(read_metrics(metrics))["steps"] if os.path.exists(metrics) else 0
            if done != last:
                print(f"  {label}: step {done}/{total_steps}", flush=True)
                last = done
    return proc.returncode


def run_all(args, overrides: list[str], cfg) -> Optional[str]:
    """Every (variant, seed) run not finished yet; returns the failed run's log, None when all finished."""
    total = cfg.optim.total_steps if not args.quick else max(1, int(cfg.optim.total_steps * QUICK_STEP_SHARE))
    shared = ["--config", args.config, *overrides, f"optim.total_steps={total}", "logging.progress=false",
              f"warmstart.cache_dir={os.path.join(args.runs, 'warmstart')}"]
    todo = [(label, extra, cfg.seed + k) for label, extra in variants(args.methods, args.noise)
            for k in range(args.seeds)]
    for i, (label, extra, seed) in enumerate(todo, 1):
        folder = os.path.join(args.runs, label, f"seed{seed}")
        result = os.path.join(folder, "result.json")
        if os.path.exists(result):
            print(f"[{i}/{len(todo)}] {label} seed {seed}: done before, kept", flush=True)
            continue
        cmd = [sys.executable, "-m", "fastcredit.train", *shared, *extra, f"seed={seed}",
               f"run_name={cfg.run_name}-{label}-seed{seed}", f"logging.output_dir={folder}"]
        ckpt = os.path.join(folder, "checkpoints")
        if os.path.isdir(ckpt) and os.listdir(ckpt):
            cmd.append("--resume")
        print(f"[{i}/{len(todo)}] {label} seed {seed}{' (resuming)' if '--resume' in cmd else ''}", flush=True)
        t0 = time.time()
        rc = run_one(cmd, folder, label, total)
        if rc != 0:
            return os.path.join(folder, "train.log")
        summary = summarize_run(read_metrics(os.path.join(folder, "metrics.jsonl")))
        summary.update(method=label, seed=seed, wall_s=time.time() - t0)
        with open(result + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1)
        os.replace(result + ".tmp", result)
        final = summary["eval_em"].get(str(summary["steps"]))
        print(f"[{i}/{len(todo)}] {label} seed {seed}: held-out EM {final} after {summary['steps']} steps, "
              f"{time.time() - t0:.0f} s", flush=True)
    return None


def main(argv: Optional[list] = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if cfg.data.source != "toy":
        print(f"config error: {args.config}: the comparison uses the toy world's oracle judges; data.source must be "
              f"toy, got {cfg.data.source!r}", file=sys.stderr)
        return 2
    args.runs = args.runs or os.path.join("runs", cfg.run_name)
    if not args.report_only:
        failed = run_all(args, overrides, cfg)
        if failed is not None:
            print(f"error: a run failed; see {failed} (start the command again to resume)", file=sys.stderr)
            return 1
    from fastcredit.compare_report import write_report

    name = os.path.splitext(os.path.basename(args.config))[0] + ("_quick" if args.quick else "")
    labels = [label for label, _ in variants(args.methods, args.noise)]
    paths = write_report(args.runs, labels, args.out, name, args.threshold)
    print("\n".join(["report:", *paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
