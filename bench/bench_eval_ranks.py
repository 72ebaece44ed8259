"""Data-parallel evaluation against one process: ``python -m fastcredit.eval`` on the same questions, once in one
process and once under ``torchrun --nproc_per_node=R`` (each rank its shard of the questions and of the index),
side by side in one run; questions/s of each, their ratio, and whether the two tables are the same.

    python -m bench.bench_eval_ranks                       # runs/demo's last checkpoint (make demo)
    python -m bench.bench_eval_ranks --model runs/x --ranks 2 --threads 2 [key=value ...]

On a CPU the comparison is fair in cores: the one process gets ``--threads`` intra-op threads, each rank
``--threads / --ranks``. questions/s times the rollout alone (``results.json``'s ``timing``: from the engine and
index being open to every question rolled out and gathered); the whole command's wall time, start-up, model
load and index included, is reported beside it. Writes
``bench/results/eval_ranks_<device>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.results_io import RESULTS_DIR, device_name, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_eval(cmd: list[str], out: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run(cmd + ["--out", out, "--fresh", "logging.progress=false"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.load(open(os.path.join(out, "results.json")))
    return {"wall_s": round(wall, 2), **res["timing"], "table": {k: res[k] for k in ("sources", "average")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "runs", "demo"), help="run folder or HF folder")
    p.add_argument("--ranks", type=int, default=2, help="torchrun processes")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads in all (the one process gets them all)")
    p.add_argument("--limit", type=int, default=None, help="questions (default: the whole test split)")
    p.add_argument("--out", default=RESULTS_DIR)
    args, overrides = p.parse_known_args()
    if not os.path.isdir(args.model):
        sys.exit(f"--model {args.model}: no such folder (run `make demo` first for runs/demo)")
    base = [*(["--limit", str(args.limit)] if args.limit else []), "--engine", "hf", *overrides]
    work = tempfile.mkdtemp(prefix="eval_ranks_")
    one = run_eval([sys.executable, "-m", "fastcredit.eval", "--model", args.model, *base],
                   os.path.join(work, "one"), args.threads)
    ranks = run_eval([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc_per_node={args.ranks}", "-m", "fastcredit.eval", "--model", args.model, *base],
                     os.path.join(work, "ranks"), max(1, args.threads // args.ranks))
    same = one["table"] == ranks["table"]
    report = {"device": device_name("cpu"), "model": os.path.abspath(args.model), "ranks": args.ranks,
              "threads": args.threads, "questions": one["rolled_out"], "same_table": same,
              "one_process": one, "torchrun": ranks,
              "speedup_questions_per_s": round(ranks["questions_per_s"] / one["questions_per_s"], 3)}
    path = write_results("eval_ranks", report, args.out)
    em = one["table"]["average"]["em"]
    md = [f"# Evaluation: {args.ranks} torchrun ranks against one process ({report['device']})", "",
          f"`python -m bench.bench_eval_ranks`, {report['questions']} questions of "
          f"{os.path.relpath(args.model, ROOT)}, greedy, HF engine; "
          f"{args.threads} threads in all. questions/s over the rollout alone; the command's wall time beside it.", "",
          "| | questions/s | rollout s | command wall s | EM |", "|---|---|---|---|---|",
          f"| 1 process, {args.threads} threads | {one['questions_per_s']:.2f} | {one['seconds']:.1f} | "
          f"{one['wall_s']:.1f} | {em:.3f} |",
          f"| torchrun, {args.ranks} ranks x {max(1, args.threads // args.ranks)} thread(s) | "
          f"{ranks['questions_per_s']:.2f} | {ranks['seconds']:.1f} | {ranks['wall_s']:.1f} | "
          f"{ranks['table']['average']['em']:.3f} |", "",
          f"Speed-up in questions/s: **{report['speedup_questions_per_s']:.2f}x**; the two tables are "
          f"{'the same' if same else 'DIFFERENT'}.", ""]
    with open(path[:-5] + ".md", "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
