"""Per-step time of fastcredit's design against Search-R1's, side by side, phase by phase.

    PYTHONPATH=. python bench/bench_step.py                   # CPU: the tiny policy on the toy world (GRPO)
    PYTHONPATH=. python bench/bench_step.py --steps 5 credit.estimator=ppo          # any key=value override
    PYTHONPATH=. python bench/bench_step.py --shape Qwen2.5-0.5B distributed.offload_state=false   # fastcredit's
                                                  # state kept on the GPU (the Search-R1 design offloads it)
    PYTHONPATH=. python bench/bench_step.py --shape Qwen2.5-0.5B    # GPU: random weights of that shape
    PYTHONPATH=. python bench/bench_step.py --shape Qwen2.5-3B --config configs/debug.yaml rollout.n_samples=5
    PYTHONPATH=. python bench/bench_step.py --placement split --staleness 0,1,2   # overlap: bench/step_split.py
    PYTHONPATH=. python bench/bench_step.py --shape Qwen2.5-0.5B --config configs/demo.yaml --tag search \
        warmstart.questions=1500 warmstart.epochs=1 warmstart.lr=5e-4   # GPU: warm-started, so it searches

One process runs ``--warmup`` + ``--steps`` trainer steps of each design on the same config, model
shape, data, seed and batch: fastcredit's own (the config as given) and Search-R1's system design
(the config with ``configs/searchr1_design.yaml`` over it: lockstep turns, no stop strings, HTTP
retrieval to a ``/retrieve`` server this script starts on the same index, the unfused torch loss
and log-prob, no prefix caching). Per design it reports the medians over the timed steps of each
phase the trainer times (``time/*`` in metrics.jsonl), tokens/s and peak memory; then the ratio
fastcredit / Search-R1 design per phase and for the whole step (below 1: fastcredit is faster), and what
the steps did (searches, turns and response tokens per trajectory: with random weights a policy does not
search, and the retrieval path, where the designs differ most, sits idle; a config with a warm start
searches: each design makes it the same way, before its steps, and keeps it in ``--work``).

Phases: the top-level ones partition a step (rollout, reward, judge, old / reference log-probs,
values, advantage, update; "other" is the rest: moving engines and the training state between the
phases, bookkeeping). Rows marked "of which" sit inside them: generation (seconds with a decode in
flight), retrieval wait (seconds with only retrieval in flight), weight sync, offload / reload
(training state and frozen models), engine sleep / wake.

``--shape`` takes a model of ``fastcredit.trainer.memory``'s presets (Qwen2.5-0.5B, Qwen2.5-3B, ...) and
builds the tiny Qwen2 with its layers, widths, heads and vocabulary rows, weights random (timing
needs no training). Writes ``bench/results/step_<shape>_<device>.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from results_io import child_env, device_name, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "configs", "searchr1_design.yaml")
DESIGNS = ("fastcredit", "searchr1_design")
# What the Search-R1 design keeps whatever the overrides say (they go to both designs otherwise): its scripts move
# the training state to the host between phases, so keeping it on the GPU is fastcredit's side only.
DESIGN_PINNED = ("distributed.offload_state=true",)
# (label, how it is read from a step's metrics row, top-level?)
TOP = (("rollout", ("time/rollout",)), ("reward", ("time/reward",)), ("judge", ("time/judge",)),
       ("old log-probs", ("time/old_logprobs",)), ("reference log-probs", ("time/ref_logprobs",)),
       ("values", ("time/values",)), ("advantage", ("time/advantage",)), ("update", ("time/update",)))
INSIDE = (("generation", ("time/rollout/generating",), ()),
          ("retrieval wait", ("time/rollout/retrieving",), ("time/rollout/overlap",)),
          ("weight sync", ("time/colocate/sync_weights",), ()),
          ("offload / reload", ("time/colocate/offload", "time/colocate/reload"), ()),
          ("engine sleep / wake", ("time/colocate/engine_sleep", "time/colocate/engine_wake"), ()))
# What each design's steps did (medians over the timed steps): a step without searches leaves the retrieval path,
# where the designs differ most, idle, so the figure says how much it searched.
WORKLOAD = (("searches / trajectory", "searches_per_traj"), ("turns / trajectory", "turns_per_traj"),
            ("response tokens / trajectory", "response_tokens_mean"), ("format followed", "format_ok"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shape_overrides(name: str) -> list[str]:
    """``model.tiny_*`` overrides giving the tiny policy the layers, widths, heads and vocabulary of a preset."""
    if name == "tiny":
        return []
    from fastcredit.trainer.memory import PRESETS

    s = PRESETS.get(name.lower())
    if s is None:
        raise SystemExit(f"--shape {name}: not a preset; valid: tiny, {', '.join(p.name for p in PRESETS.values())}")
    return [f"model.tiny_hidden={s.heads * s.head_dim}", f"model.tiny_layers={s.layers}",
            f"model.tiny_heads={s.heads}", f"model.tiny_kv_heads={s.kv_heads}",
            f"model.tiny_intermediate={s.intermediate}", f"model.tiny_vocab_rows={s.vocab}"]


class RetrievalServer:
    """``python -m fastcredit.retrieval.serve`` on the toy world's corpus and index, on a free loopback port."""

    def __init__(self, corpus: str, log_path: str, encoder: str = "minilm"):
        self.port, self.log = _free_port(), open(log_path, "w")
        self.url = f"http://127.0.0.1:{self.port}/retrieve"
        # Search-R1's client posts every query of a turn in one request, and its server takes any number.
        big = ["--max-queries", "1000000", "--max-queue", "1000000", "--max-body-bytes", str(1 << 30),
               "--timeout-s", "600"]
        self.proc = subprocess.Popen([sys.executable, "-m", "fastcredit.retrieval.serve", "--corpus", corpus,
                                      "--encoder", encoder, "--port", str(self.port), *big], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env=child_env(ROOT))

    def wait(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the retrieval server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                urllib.request.urlopen(self.url.replace("/retrieve", "/health"), timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"the retrieval server did not answer within {timeout_s:.0f} s; see {self.log.name}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:  # Linux: "5" resets the process's peak resident set (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_gib() -> dict:
    out = {}
    if torch.cuda.is_available():
        out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                out["host_peak_rss_gib"] = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return out


def run_design(name: str, config: str, overrides: list[str], work: str, steps: int, warmup: int) -> dict:
    """Train ``warmup + steps`` steps of one design in this process; the timed steps' metrics rows."""
    from fastcredit.config import load_config
    from fastcredit.distributed.process_group import init_distributed
    from fastcredit.trainer.loop import Trainer

    out = os.path.join(work, name)
    paths = [config] + ([DESIGN] if name == "searchr1_design" else [])
    pinned = DESIGN_PINNED if name == "searchr1_design" else ()
    cfg = load_config(paths, [*overrides, *pinned, f"logging.output_dir={out}", f"optim.total_steps={warmup + steps}"])
    print(f"[{name}] {warmup} warm-up + {steps} timed steps: rollout.mode={cfg.rollout.mode}, "
          f"retrieval.backend={cfg.retrieval.backend}, loss.impl={cfg.loss.impl}", flush=True)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    trainer = Trainer(cfg, info)
    _reset_peak()
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    wall = time.perf_counter() - t0
    peak = _peak_gib()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"time/step"' in line]
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    timed = [r for r in rows if r["step"] > warmup]
    if len(timed) != steps:
        raise SystemExit(f"[{name}] expected {steps} timed steps in {out}/metrics.jsonl, found {len(timed)}")
    return {"rows": timed, "wall_s": wall, "peak": peak}


def _median(rows: list[dict], plus: tuple, minus: tuple = ()) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in plus) - sum(r.get(k, 0.0) for k in minus) for r in rows)


def phase_table(runs: dict) -> list[dict]:
    """Rows ``{phase, inside, <design>: median seconds, ratio}``; top-level phases, "other", then "of which"."""
    table = []
    for label, keys in TOP:
        if any(k in r for run in runs.values() for r in run["rows"] for k in keys):
            table.append({"phase": label, "inside": False, **{d: _median(runs[d]["rows"], keys) for d in runs}})
    top_keys = tuple(k for _, keys in TOP for k in keys)
    table.append({"phase": "other", "inside": False,
                  **{d: _median(runs[d]["rows"], ("time/step",), top_keys) for d in runs}})
    for label, plus, minus in INSIDE:
        if any(k in r for run in runs.values() for r in run["rows"] for k in plus):
            table.append({"phase": label, "inside": True, **{d: _median(runs[d]["rows"], plus, minus) for d in runs}})
    table.append({"phase": "step", "inside": False, **{d: _median(runs[d]["rows"], ("time/step",)) for d in runs}})
    table.append({"phase": "tokens/s", "inside": False, **{d: _median(runs[d]["rows"], ("tokens_per_s",))
                                                          for d in runs}})
    for row in table:
        a, b = row[DESIGNS[0]], row[DESIGNS[1]]
        row["ratio"] = a / b if b > 1e-9 else None
    return table


def workload(runs: dict) -> list[dict]:
    """Rows ``{what, <design>: median over the timed steps}`` of ``WORKLOAD``, the ones the runs logged."""
    return [{"what": label, **{d: statistics.median(r[key] for r in runs[d]["rows"]) for d in runs}}
            for label, key in WORKLOAD if all(key in r for run in runs.values() for r in run["rows"])]


def markdown(report: dict) -> str:
    a, b = DESIGNS
    lines = [f"# Per-step time: fastcredit vs the Search-R1 design — {report['device']}", "",
             f"{report['shape']} policy, `{os.path.relpath(report['config'], ROOT)}` "
             f"{' '.join(report['overrides']) or ''}; medians of {report['steps']} steps after "
             f"{report['warmup']} warm-up, same seed, data and batch.", "",
             f"| phase | {a} (s) | {b} (s) | {a} / {b} |", "|---|---:|---:|---:|"]
    for row in report["table"]:
        name = f"&nbsp;&nbsp;of which: {row['phase']}" if row["inside"] else row["phase"]
        if row["phase"] in ("step", "tokens/s"):
            name = f"**{row['phase']}**"
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"| {name} | {row[a]:.3f} | {row[b]:.3f} | {ratio} |")
    if report.get("workload"):
        lines += ["", "What the timed steps did (medians):", "", f"| | {a} | {b} |", "|---|---:|---:|"]
        lines += [f"| {w['what']} | {w[a]:.2f} | {w[b]:.2f} |" for w in report["workload"]]
        searches = [w for w in report["workload"] if w["what"] == WORKLOAD[0][0]]
        if searches and max(searches[0][d] for d in DESIGNS) == 0:
            lines.append("\nNo trajectory searched: the retrieval path sat idle, so this step says little about "
                         "the designs' retrieval (a warm-started policy searches).")
    for d in DESIGNS:
        peaks = ", ".join(f"{k} {v:.2f}" for k, v in report["runs"][d]["peak"].items()) or "n/a"
        lines.append(f"\n{d}: peak memory {peaks}; wall {report['runs'][d]['wall_s']:.1f} s for all its steps.")
    lines.append("\nTop-level phases add up to the step; \"of which\" rows are inside them (generation and retrieval "
                 "wait inside rollout; sync, moves and sleeps inside whichever phase needed them).")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["table"] if not r["inside"] and r["phase"] not in ("step", "tokens/s")]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0, 0.0]
    for r in rows:
        ys = [r[d] for d in DESIGNS]
        ax.bar(DESIGNS, ys, bottom=bottom, label=r["phase"])
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(f"{report['shape']} on {report['device']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "debug.yaml"), help="the method's config")
    p.add_argument("--steps", type=int, default=3, help="timed steps per design")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per design first")
    p.add_argument("--shape", default="tiny", help="tiny, or a preset of fastcredit.trainer.memory (random weights)")
    p.add_argument("--work", default=None, help="folder for the runs and the toy world (default: a temporary one)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--placement", choices=("colocated", "split"), default="colocated",
                   help="split: the split placement at each --staleness beside colocated, 2 ranks "
                        "(bench/step_split.py)")
    p.add_argument("--staleness", default="0,1,2", help="--placement split: the rollout.max_staleness values")
    p.add_argument("--tag", default="", help="added to the results' name: step_<shape>_<tag>_<device>")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, applied to both designs (the Search-R1 "
                                                "design keeps DESIGN_PINNED)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    work = a.work = a.work or tempfile.mkdtemp(prefix="bench_step_")
    world = os.path.join(work, "world")
    # a warm start (a config that enables one) is made by each design (the Search-R1 design's oracle searches go to
    # its /retrieve server, so its fingerprint differs) and kept in --work for a rerun
    common = [f"data.world_dir={world}", "eval.questions=0", "eval.every=0", "logging.checkpoint_every=0",
              "logging.progress=false", f"warmstart.cache_dir={os.path.join(work, 'warmstart')}",
              *shape_overrides(a.shape), *a.overrides]
    if a.placement == "split":
        import step_split

        if not all(k.strip().isdigit() for k in a.staleness.split(",")):
            p.error(f"--staleness takes comma-separated whole numbers, got {a.staleness!r}")
        device = device_name("cuda" if torch.cuda.is_available() else "cpu")
        return step_split.main(a, common, ROOT, device, torch.__version__, write_results)
    runs = {"fastcredit": run_design("fastcredit", a.config, common, work, a.steps, a.warmup)}
    server = RetrievalServer(os.path.join(world, "corpus.jsonl"), os.path.join(work, "retrieval_server.log"))
    try:
        server.wait()
        runs["searchr1_design"] = run_design("searchr1_design", a.config, [*common, f"retrieval.url={server.url}"],
                                             work, a.steps, a.warmup)
    finally:
        server.close()
    report = {"device": device_name("cuda" if torch.cuda.is_available() else "cpu"), "torch": torch.__version__,
              "shape": a.shape, "config": a.config,
              "overrides": a.overrides, "steps": a.steps, "warmup": a.warmup,
              "runs": {d: {"wall_s": r["wall_s"], "peak": r["peak"], "rows": r["rows"]} for d, r in runs.items()}}
    report["table"] = phase_table(runs)
    report["workload"] = workload(runs)
    step = next(r for r in report["table"] if r["phase"] == "step")
    report["step_ratio"] = step["ratio"]
    text = markdown(report)
    print(text)
    json_path = write_results(f"step_{a.shape}" + (f"_{a.tag}" if a.tag else ""), report, a.out)
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(text)
    plot(report, stem + ".png")
    print(f"step ratio fastcredit / Search-R1 design: {report['step_ratio']:.2f} (target <= 0.4); "
          f"wrote {stem}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
