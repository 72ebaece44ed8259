"""Per-step time of fastcredit's design against Search-R1's, side by side, phase by phase.

    python -m bench.bench_step                   # CPU: the tiny policy on the toy world (GRPO)
    python -m bench.bench_step --steps 5 credit.estimator=ppo          # any key=value override
    python -m bench.bench_step --shape Qwen2.5-0.5B distributed.offload_state=false   # fastcredit's
                                                  # state kept on the GPU (the Search-R1 design offloads it)
    python -m bench.bench_step --shape Qwen2.5-0.5B    # GPU: random weights of that shape
    python -m bench.bench_step --shape Qwen2.5-3B --config configs/debug.yaml rollout.n_samples=5
    python -m bench.bench_step --placement split --staleness 0,1,2   # overlap: bench/step_split.py
    python -m bench.bench_step --shape Qwen2.5-0.5B --config configs/demo.yaml --tag search \
        warmstart.questions=1500 warmstart.epochs=1 warmstart.lr=5e-4   # GPU: warm-started, so it searches
    python -m bench.rehearsal model runs/smollm2-135m-instruct          # once: the real model's folder
    python -m bench.bench_step --config configs/race_smollm2.yaml --steps 2   # CPU: SmolLM2 on vLLM

Each design runs ``--warmup`` + ``--steps`` trainer steps in a fresh process of its own (nothing one design leaves
behind, threads, allocator state or caches, touches the other's timings) on the same config, model shape, data,
seed and batch: fastcredit's own (the config as given) and Search-R1's system design
(the config with ``configs/searchr1_design.yaml`` over it: lockstep turns, no stop strings, HTTP
retrieval to a ``/retrieve`` server this script starts on the same index, the unfused torch loss
and log-prob, no prefix caching). Per design it reports the medians over the timed steps of each
phase the trainer times (``time/*`` in metrics.jsonl), tokens/s and peak memory; then the ratio
fastcredit / Search-R1 design per phase and for the whole step (below 1: fastcredit is faster), with two
``--rounds`` or more each phase's ratio paired by round and its 95% interval (``step_report.paired_rounds``), and what
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
needs no training); without it the config's policy is timed (``tiny``, or a real model's folder, whose name the
results take). Writes ``bench/results/step_<shape>_<device>.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from bench.results_io import child_env, device_name, write_results
from bench.step_report import ROUND, comparability, headline, markdown, paired_rounds, phase_table, plot, workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "configs", "searchr1_design.yaml")


def design_pinned() -> list[str]:
    """What the Search-R1 design keeps whatever the overrides say (they go to both designs otherwise): every key its
    overlay sets, as ``key=value`` overrides applied last. So ``rollout.mode=async`` or
    ``distributed.offload_state=false`` changes fastcredit's side only; the design still runs lockstep turns and
    moves the training state to the host between phases, as Search-R1's scripts do."""
    import yaml

    def flat(tree: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in tree.items():
            if isinstance(value, dict):
                out += flat(value, f"{prefix}{key}.")
            else:
                text = json.dumps(value) if isinstance(value, bool) or value is None else str(value)
                out.append(f"{prefix}{key}={text}")
        return out

    with open(DESIGN) as f:
        return flat(yaml.safe_load(f))
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


def reset_peak() -> None:
    """Start this process's peak memory counters again (the GPU's allocator, the host's resident set)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:  # Linux: "5" resets the process's peak resident set (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_gib() -> dict:
    """This process's peak memory since :func:`reset_peak`, in GiB: the GPU's allocated, the host's resident set."""
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


def weights_digest(policy) -> str:
    """sha256 over the policy's full weights (names, dtypes, bytes) as the trainer holds them (fp32 masters)."""
    h = hashlib.sha256()
    for name, tensor in policy.full_state(torch.float32):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def run_design(name: str, config: str, overrides: list[str], work: str, steps: int, warmup: int) -> dict:
    """Train ``warmup + steps`` steps of one design in this process: the timed steps' metrics rows, and the digest
    of the policy's weights before the first step and after the last."""
    from fastcredit.config import load_config
    from fastcredit.distributed.process_group import init_distributed, shutdown
    from fastcredit.trainer.checks import check_run
    from fastcredit.trainer.build import colocated_trainer

    out = os.path.join(work, name)
    paths = [config] + ([DESIGN] if name == "searchr1_design" else [])
    pinned = design_pinned() if name == "searchr1_design" else ()
    cfg = load_config(paths, [*overrides, *pinned, f"logging.output_dir={out}", f"optim.total_steps={warmup + steps}"])
    print(f"[{name}] {warmup} warm-up + {steps} timed steps: rollout.mode={cfg.rollout.mode}, "
          f"stop_at_tags={cfg.rollout.stop_at_tags}, retrieval.backend={cfg.retrieval.backend}, "
          f"loss.impl={cfg.loss.impl}, optim.lr={cfg.optim.lr:g}", flush=True)
    check_run(cfg)  # the training command's checks, before anything loads
    info = init_distributed(cfg.distributed.backend, cfg.distributed.shard_size)
    trainer = colocated_trainer(cfg, info)
    start = weights_digest(trainer.parts.training.policy)
    reset_peak()
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    wall = time.perf_counter() - t0
    peak = peak_gib()
    end = weights_digest(trainer.parts.training.policy)
    from fastcredit.runtime.threads import process_threads, python_threads

    # what runs beside the main thread once the steps are done: no rollout thread, no second OpenMP team
    threads = {"python": python_threads(), "os": len(process_threads() or [])}
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"time/step"' in line]
    del trainer
    shutdown(info)  # FSDP2's one-process group: ended here, the process leaves through exit_process
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    timed = [r for r in rows if r["step"] > warmup]
    if len(timed) != steps:
        raise SystemExit(f"[{name}] expected {steps} timed steps in {out}/metrics.jsonl, found {len(timed)}")
    return {"rows": timed, "wall_s": wall, "peak": peak, "start_weights": start, "end_weights": end, "threads": threads}


def run_design_process(name: str, config: str, overrides: list[str], work: str, steps: int, warmup: int) -> dict:
    """:func:`run_design` in a fresh Python process (its output goes to ours); the same dict back."""
    result = os.path.join(work, f"{name}.result.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, "-m", "bench.bench_step", "--design", name, "--config", config, "--work", work,
           "--steps", str(steps), "--warmup", str(warmup), "--result", result, "--", *overrides]
    code = subprocess.run(cmd, cwd=ROOT, env=child_env(ROOT)).returncode
    if code != 0 or not os.path.exists(result):
        raise SystemExit(f"[{name}] the design's process exited with {code}")
    with open(result) as f:
        return json.load(f)


def run_rounds(a, common: list[str], world: str, work: str) -> dict:
    """``--rounds`` rounds, each a fresh process of each design (the Search-R1 design's ``/retrieve`` server up
    beside it), the order swapped every round (fastcredit first, then the Search-R1 design first, ...), their timed
    steps pooled: a machine whose speed drifts over minutes (a shared host) moves both designs alike instead of the
    one that ran later. The first round always starts with fastcredit's, which makes the warm start."""
    runs: dict = {}
    for r in range(a.rounds):
        order = ("fastcredit", "searchr1_design") if r % 2 == 0 else ("searchr1_design", "fastcredit")
        print(f"round {r + 1}/{a.rounds}: {' then '.join(order)}", flush=True)
        got = {}
        for name in order:
            if name == "fastcredit":
                got[name] = run_design_process(name, a.config, common, work, a.steps, a.warmup)
                continue
            server = RetrievalServer(os.path.join(world, "corpus.jsonl"), os.path.join(work, "retrieval_server.log"))
            try:
                server.wait()
                got[name] = run_design_process(name, a.config, [*common, f"retrieval.url={server.url}"], work,
                                               a.steps, a.warmup)
            finally:
                server.close()
        for name in ("fastcredit", "searchr1_design"):
            run = got[name]
            for row in run["rows"]:
                row[ROUND] = r
            if name not in runs:
                runs[name] = run
                continue
            if run["start_weights"] != runs[name]["start_weights"]:
                raise SystemExit(f"[{name}] round {r + 1} started from other weights than round 1")
            runs[name]["rows"] += run["rows"]
            runs[name]["wall_s"] += run["wall_s"]
            runs[name]["end_weights"] = run["end_weights"]
            runs[name]["peak"] = {k: max(v, run["peak"].get(k, 0.0)) for k, v in runs[name]["peak"].items()}
    return runs


def check_same_start(runs: dict, frozen: bool) -> str:
    """The start weights' digest, the same for both designs (one warm start, or one random init); frozen: also the
    end weights (lr 0 moved nothing, so every step rolled out the same policy). SystemExit names what differs."""
    starts = {d: r["start_weights"] for d, r in runs.items()}
    if len(set(starts.values())) != 1:
        raise SystemExit(f"the designs start from different weights: {starts} (the warm start's cache key, or the "
                         "model's initialisation, differs between them)")
    moved = [d for d, r in runs.items() if frozen and r["end_weights"] != r["start_weights"]]
    if moved:
        raise SystemExit(f"optim.lr=0 but the weights of {moved} moved: the steps did not roll out one policy")
    return next(iter(starts.values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "debug.yaml"), help="the method's config")
    p.add_argument("--steps", type=int, default=3, help="timed steps per design")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per design first (in every round)")
    p.add_argument("--rounds", type=int, default=2,
                   help="each design runs this many times in fresh processes, alternating with the other; the timed "
                        "steps of all rounds are pooled")
    p.add_argument("--shape", default="tiny", help="tiny, or a preset of fastcredit.trainer.memory (random weights)")
    p.add_argument("--work", default=None, help="folder for the runs and the toy world (default: a temporary one)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--learning", action="store_true",
                   help="let the policy learn while timed (the config's optim.lr): each design then times its own "
                        "policy's steps, not the same work; default: frozen (optim.lr=0), equal work")
    p.add_argument("--placement", choices=("colocated", "split"), default="colocated",
                   help="split: the split placement at each --staleness beside colocated, 2 ranks "
                        "(bench/step_split.py)")
    p.add_argument("--staleness", default="0,1,2", help="--placement split: the rollout.max_staleness values")
    p.add_argument("--tag", default="", help="added to the results' name: step_<shape>_<tag>_<device>")
    p.add_argument("--design", choices=("fastcredit", "searchr1_design"), default=None,
                   help=argparse.SUPPRESS)  # one design's steps, in the process the benchmark starts for it
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # --design: where its JSON goes
    p.add_argument("overrides", nargs="*", help="key=value config overrides, applied to both designs (the Search-R1 "
                                                "design keeps what its overlay sets: design_pinned)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        p.error("--steps and --rounds must be at least 1 and --warmup at least 0")
    if a.design is not None:
        from fastcredit.runtime.progress import quiet_library_bars

        quiet_library_bars()
        run = run_design(a.design, a.config, a.overrides, a.work, a.steps, a.warmup)
        with open(a.result, "w") as f:
            json.dump(run, f)
        return 0
    from fastcredit.runtime.progress import quiet_library_bars

    quiet_library_bars()  # a log gets plain progress lines, not the libraries' bar frames
    work = a.work = a.work or tempfile.mkdtemp(prefix="bench_step_")
    world = os.path.join(work, "world")
    # one warm start (a config that enables one) for both designs: its cache key leaves out where the searches go,
    # so the Search-R1 design (HTTP to the server below, same index) loads the one fastcredit's run made; --work
    # keeps it for a rerun. Frozen (optim.lr=0, after the overrides): every step of both designs rolls out the one
    # policy with the same prompts and per-trajectory seeds.
    frozen = [] if a.learning else ["optim.lr=0", "optim.critic_lr=0"]
    common = [f"data.world_dir={world}", "eval.questions=0", "eval.every=0", "logging.checkpoint_every=0",
              "logging.progress=false", f"warmstart.cache_dir={os.path.join(work, 'warmstart')}",
              *shape_overrides(a.shape), *a.overrides, *frozen]
    if a.placement == "split":
        from bench import step_split

        if not all(k.strip().isdigit() for k in a.staleness.split(",")):
            p.error(f"--staleness takes comma-separated whole numbers, got {a.staleness!r}")
        device = device_name("cuda" if torch.cuda.is_available() else "cpu")
        return step_split.main(a, common, ROOT, device, torch.__version__, write_results)
    if a.shape == "tiny":  # the config's own policy: a real model's folder names it
        from fastcredit.config import load_config

        policy = load_config([a.config], list(a.overrides)).model.policy
        a.shape = "tiny" if policy == "tiny" else os.path.basename(os.path.normpath(policy))
    runs = run_rounds(a, common, world, work)
    report = {"device": device_name("cuda" if torch.cuda.is_available() else "cpu"), "torch": torch.__version__,
              "shape": a.shape, "config": a.config, "overrides": a.overrides, "steps": a.steps * a.rounds,
              "warmup": a.warmup, "rounds": a.rounds,
              "frozen": not a.learning, "start_weights": check_same_start(runs, not a.learning),
              "runs": {d: {k: r[k] for k in ("wall_s", "peak", "rows", "start_weights", "end_weights", "threads")}
                       for d, r in runs.items()}}
    report["table"] = phase_table(runs)
    report["paired"] = paired_rounds(runs)
    report["workload"] = workload(runs)
    report["comparable"], report["not_comparable"] = comparability(report["workload"])
    step = next(r for r in report["table"] if r["phase"] == "step")
    report["step_ratio"] = step["ratio"]
    report["step_ratio_per_token"] = step["ratio_per_token"]
    report["equal_work_ratio"] = step["ratio"] if report["comparable"] and not a.learning else None
    report["headline"] = headline(report)
    text = markdown(report, ROOT)
    print(text)
    json_path = write_results(f"step_{a.shape}" + (f"_{a.tag}" if a.tag else ""), report, a.out)
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(text)
    plot(report, stem + ".png")
    print(f"{report['headline']}; wrote {stem}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    from fastcredit.distributed.process_group import exit_process

    exit_process(main())
