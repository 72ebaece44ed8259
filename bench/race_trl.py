"""fastcredit against TRL's GRPOTrainer on one machine, in one run: the training side on identical tokens and the
rollout side on each trainer's own generation, rounds of fresh processes in alternating order.

    python -m bench.race_trl --config configs/demo.yaml --steps 3 --rounds 4          # the warm-started tiny policy
    python -m bench.rehearsal model runs/smollm2-135m-instruct                          # once: SmolLM2's folder
    python -m bench.race_trl --config configs/race_smollm2.yaml --steps 2 --rounds 2  # SmolLM2, its warm start

First the start policy: fastcredit's trainer for the config makes (or loads, from ``WORK/warmstart``) its warm
start and ``bench/race_fastcredit.py prepare`` writes it as an HF folder that TRL loads (both sides' digests are
checked against it in every run). Then ``--rounds`` rounds, each one fresh process of each of three runs, the
order reversed every other round (fastcredit, TRL replay, TRL; then TRL, TRL replay, fastcredit; ...), so that a
machine whose speed drifts moves all of them alike:

* ``fastcredit``: ``--warmup`` + ``--steps`` trainer steps (``bench/race_fastcredit.py steps``), its batches
  recorded; round 1's recording is what TRL replays (later rounds' are compared with it: a frozen policy with the
  same seeds rolls out the same tokens).
* ``trl_replay``: TRL trains on the recorded batches (``bench/peer_trl.py --replay``): the same prompts, tokens,
  observation masks and rewards.
* ``trl``: TRL rolls out itself (``bench/peer_trl.py``, Search-R1's turns with ``model.generate``) against a
  ``/retrieve`` server on the same corpus, started for that run only (as ``bench/bench_step.py`` serves the
  Search-R1 design), and trains on what it rolled out.

Both trainers are frozen (``optim.lr=0``: every step does the same work, from the same weights) and roll out on the
HF engine (``--engine``; TRL's vLLM mode is not run here). The report (``bench/race_report.py``) goes to
``bench/results/race_trl_<shape>[_<tag>]_<device>.{json,md}``. A round whose three results are in ``WORK`` is
not run again: an interrupted race restarts at the round it lost.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from bench.bench_step import RetrievalServer
from bench.race_fastcredit import DIGEST
from bench.race_report import build, markdown
from bench.results_io import child_env, device_name, write_results
from bench.step_report import ROUND

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("fastcredit", "trl_replay", "trl")


def _run(cmd: list, what: str) -> None:
    code = subprocess.run(cmd, cwd=ROOT, env=child_env(ROOT)).returncode
    if code != 0:
        raise SystemExit(f"[{what}] exited with {code}: {' '.join(cmd)}")


def common_overrides(a, work: str) -> list:
    """What every run of the race is given: GRPO (TRL's), its world and warm-start cache, no evaluation or
    checkpoints, the engine; then the command line's overrides, and frozen weights."""
    return ["credit.estimator=grpo", f"data.world_dir={os.path.join(work, 'world')}",
            f"warmstart.cache_dir={os.path.join(work, 'warmstart')}",
            "eval.questions=0", "eval.every=0", "logging.checkpoint_every=0", "logging.progress=false",
            f"rollout.engine={a.engine}", *a.overrides, "optim.lr=0"]


def prepare(a, work: str, common: list) -> dict:
    """The start policy's folder (``WORK/start``, made once) and its digests."""
    start = os.path.join(work, "start")
    if not os.path.exists(os.path.join(start, DIGEST)):
        _run([sys.executable, "-m", "bench.race_fastcredit", "prepare", "--config", a.config, "--work", work,
              "--start", start, *common], "prepare")
    with open(os.path.join(start, DIGEST)) as f:
        return json.load(f)


def one_run(name: str, a, work: str, rnd: int, common: list, world: str) -> dict:
    """Run ``name`` of round ``rnd`` in a fresh process (unless its result is there); its result."""
    folder = os.path.join(work, f"round{rnd}")
    result = os.path.join(folder, f"{name}.result.json")
    if os.path.exists(result):
        with open(result) as f:
            return json.load(f)
    os.makedirs(folder, exist_ok=True)
    total = str(a.warmup + a.steps)
    if name == "fastcredit":
        record = os.path.join(work, "replay") if rnd == 0 else os.path.join(folder, "replay")
        _run([sys.executable, "-m", "bench.race_fastcredit", "steps", "--config", a.config, "--work", folder,
              "--steps", str(a.steps), "--warmup", str(a.warmup), "--record", record, "--result", result, *common],
             f"round {rnd + 1} {name}")
    else:
        cmd = [sys.executable, "-m", "bench.peer_trl", "--config", a.config, "--model", os.path.join(work, "start"),
               "--out", os.path.join(folder, name), "--steps", total, "--warmup", str(a.warmup), "--result", result]
        cmd += ["--micro-batch", str(a.micro_batch)] if a.micro_batch else []
        if name == "trl_replay":
            _run([*cmd, "--replay", os.path.join(work, "replay"), *common], f"round {rnd + 1} {name}")
        else:
            from fastcredit.config import load_config

            encoder = load_config([a.config], common).retrieval.encoder
            server = RetrievalServer(os.path.join(world, "corpus.jsonl"), os.path.join(folder, "server.log"), encoder)
            try:
                server.wait()
                _run([*cmd, "--retrieval-url", server.url, *common], f"round {rnd + 1} {name}")
            finally:
                server.close()
    with open(result) as f:
        return json.load(f)


def recordings_agree(work: str, rounds: int) -> list:
    """The rounds after the first whose recorded batches differ from round 1's (by their digests)."""
    def digests(folder: str) -> list:
        return [json.load(open(os.path.join(folder, f)))["digest"] for f in sorted(os.listdir(folder))]

    first = digests(os.path.join(work, "replay"))
    return [r + 1 for r in range(1, rounds) if digests(os.path.join(work, f"round{r}", "replay")) != first]


def check_starts(runs: dict, digests: dict) -> None:
    """Every run started from the prepared policy (fastcredit's digest for its runs, the folder's for TRL's), and
    the frozen weights did not move."""
    for name, run in runs.items():
        want = digests["fastcredit" if name == "fastcredit" else "folder"]
        if run["start_weights"] != want:
            raise SystemExit(f"[{name}] started from other weights than the prepared start ({DIGEST})")
        if run["end_weights"] != run["start_weights"]:
            raise SystemExit(f"[{name}] optim.lr=0 but its weights moved")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"), help="the run's config (grpo)")
    p.add_argument("--steps", type=int, default=3, help="timed steps a run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps a run first")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each a fresh process of each run")
    p.add_argument("--engine", default="hf", choices=("hf",), help="both trainers' generation engine")
    p.add_argument("--micro-batch", type=int, default=0, help="TRL's trajectories a forward (0: one group)")
    p.add_argument("--work", default=None, help="the race's folder (default: a temporary one); a rerun resumes")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default="", help="added to the results' name: race_trl_<shape>_<tag>_<device>")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both trainers")
    a = p.parse_intermixed_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        p.error("--steps and --rounds must be at least 1 and --warmup at least 0")
    from fastcredit.config import load_config
    from fastcredit.runtime.progress import quiet_library_bars

    quiet_library_bars()
    work = a.work or tempfile.mkdtemp(prefix="race_trl_")
    common = common_overrides(a, work)
    cfg = load_config([a.config], common)
    if cfg.credit.estimator != "grpo":
        p.error(f"credit.estimator={cfg.credit.estimator}: TRL's GRPOTrainer races fastcredit's grpo")
    digests = prepare(a, work, common)
    world = os.path.join(work, "world")
    runs: dict = {}
    for r in range(a.rounds):
        order = RUNS if r % 2 == 0 else RUNS[::-1]
        print(f"round {r + 1}/{a.rounds}: {' then '.join(order)}", flush=True)
        for name in order:
            got = one_run(name, a, work, r, common, world)
            for row in got["rows"]:
                row[ROUND] = r
            if name not in runs:
                runs[name] = {**got, "rows": list(got["rows"])}
            else:
                runs[name]["rows"] += got["rows"]
                runs[name]["wall_s"] += got["wall_s"]
                runs[name]["peak"] = {k: max(v, got["peak"].get(k, 0.0)) for k, v in runs[name]["peak"].items()}
    check_starts(runs, digests)
    import trl

    policy = cfg.model.policy
    shape = "tiny" if policy == "tiny" else os.path.basename(os.path.normpath(policy))
    report = {"device": device_name("cuda" if torch.cuda.is_available() else "cpu"), "torch": torch.__version__,
              "trl": trl.__version__, "shape": shape, "config": a.config, "overrides": a.overrides,
              "steps": a.steps * a.rounds, "warmup": a.warmup, "rounds": a.rounds, "engine": a.engine,
              "start_weights": digests["fastcredit"], "start_folder": digests["folder"],
              "recordings_differ_in_rounds": recordings_agree(work, a.rounds), "work": work,
              "runs": {n: {k: runs[n][k] for k in ("wall_s", "peak", "rows", "start_weights")} for n in RUNS}}
    report.update(build(runs))
    text = markdown(report, ROOT)
    print(text)
    path = write_results(f"race_trl_{shape}" + (f"_{a.tag}" if a.tag else ""), report, a.out)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
