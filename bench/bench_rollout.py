"""Rollout throughput: the async agent loop vs Search-R1's lockstep turns, same model, prompts and seeds.

    PYTHONPATH=. python bench/bench_rollout.py                 # 64 trajectories, HF engine, CPU
    PYTHONPATH=. python bench/bench_rollout.py --trajectories 16 --reps 1    # a quick look

The policy is the tiny Qwen2 of the embedded default, warm-started on oracle trajectories
whose think text varies in length (0-3 restatements), so turns are skewed as real ones are;
retrieval is the in-process MiniLM retriever over the toy corpus. Both modes roll out the
same prompts with the same per-trajectory seeds, one mode after the other in one process;
medians of ``--reps``. Results: ``bench/results/rollout_<device>.json``.
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from results_io import device_name, write_results  # noqa: E402


def main() -> None:
    from fastcredit.config import load_config
    from fastcredit.distributed.process_group import init_distributed
    from fastcredit.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args()
    out_dir = "/tmp/fastcredit_bench_rollout"
    cfg = load_config(os.path.join(os.path.dirname(HERE), "configs", "demo.yaml"), [
        f"logging.output_dir={out_dir}", f"data.world_dir={out_dir}/world", "logging.progress=false",
        "warmstart.enabled=true", "warmstart.epochs=3", "eval.questions=0", "judges.backend=none",
        "credit.estimator=grpo"])
    t0 = time.time()
    trainer = Trainer(cfg, init_distributed("gloo"))
    print(f"setup (world, index, warm start) {time.time() - t0:.0f} s", flush=True)
    idx = list(range(a.trajectories))
    rows = {}
    for mode in ("lockstep", "async", "lockstep", "async")[: 2 if a.reps == 1 else 4]:
        trainer.cfg.rollout.mode = mode
        times = []
        for r in range(a.reps):
            t = time.perf_counter()
            result, _ = trainer.rollout(idx, trainer.data.train, seed_base=1000 * r)
            times.append(time.perf_counter() - t)
        rows[mode] = {"median_s": statistics.median(times), "trajectories_per_s": a.trajectories / statistics.median(times),
                      "turns_per_traj": result.stats["turns_per_traj"],
                      "searches_per_traj": result.stats["searches_per_traj"],
                      "response_tokens_mean": result.stats["response_tokens_mean"],
                      "action_tokens_std": float(torch.tensor([len(t.action_ids) for e in result.episodes
                                                               for t in e.turns], dtype=torch.float).std())}
        print(f"{mode:9s} {rows[mode]['median_s']:7.2f} s  {rows[mode]['trajectories_per_s']:6.2f} traj/s  "
              f"turns {rows[mode]['turns_per_traj']:.2f}  searches {rows[mode]['searches_per_traj']:.2f}", flush=True)
    ratio = rows["async"]["trajectories_per_s"] / rows["lockstep"]["trajectories_per_s"]
    print(f"async / lockstep throughput: x{ratio:.2f}")
    write_results("rollout", {"device": device_name("cuda" if torch.cuda.is_available() else "cpu"), "engine": "hf", "trajectories": a.trajectories, "reps": a.reps,
                   "load_average_1min": os.getloadavg()[0], "modes": rows, "async_over_lockstep": ratio}, a.out)


if __name__ == "__main__":
    main()
