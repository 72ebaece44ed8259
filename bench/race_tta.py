"""Time to accuracy: wall seconds of training for TRL's GRPO and fastcredit's GRPO (and any other fastcredit method)
to reach held-out EM thresholds, from one warm start, on the tiny policy in the demo world.

    python -m bench.race_tta --config configs/demo.yaml --steps 60 --every 10 --thresholds 0.76,0.80
    python -m bench.race_tta --config configs/demo.yaml --methods grpo,criticsearch --work runs/tta   # a rerun resumes

One start (``bench/race_fastcredit.py prepare``: fastcredit's warm start, cached in ``WORK/warmstart``, written as an
HF folder for TRL); then each trainer trains ``--steps`` steps with the config's prompts per step, group size,
learning rate and KL (TRL's ``GRPOConfig`` mapped by ``bench/peer_trl_settings.py``; its dataset in fastcredit's
draw order, so step ``t`` of each trains on the same prompts), saving the policy every ``--every`` steps, with no
evaluation inside either run:

* fastcredit: ``python -m fastcredit.train`` itself (``credit.estimator=<method>``, checkpoints every ``--every``
  steps, ``--resume`` after an interruption); its training seconds are the ``time/step`` of its ``metrics.jsonl``.
* TRL: ``bench/peer_trl.py`` (its own rollout against a ``/retrieve`` server on the same corpus, HF checkpoints
  every ``--every`` steps, resumed from the last one); its training seconds are its ``steps.jsonl``'s ``time/step``.

Every saved policy, and the start, is then scored by the same greedy evaluation: ``python -m fastcredit.eval``
on ``--questions`` held-out questions (0: the whole test split) with the config's turn and token caps and
retriever, on the HF engine. A trainer's time to a threshold is its summed step seconds up to the first saved step
whose held-out EM reaches it (start-up, the warm start, saving and evaluating are left out of both). Each stage
leaves its result in ``WORK`` and a rerun skips what is done: training resumes from its last checkpoint, an
evaluation already written is read back. Writes ``bench/results/race_tta_<shape>[_<tag>]_<device>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from bench.bench_step import RetrievalServer
from bench.race_trl import prepare
from bench.results_io import child_env, device_name, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list, what: str) -> None:
    print(f"[{what}] {' '.join(cmd)}", flush=True)
    code = subprocess.run(cmd, cwd=ROOT, env=child_env(ROOT)).returncode
    if code != 0:
        raise SystemExit(f"[{what}] exited with {code}")


def common_overrides(a, work: str) -> list:
    """Every run's and evaluation's: the world, the warm-start cache, the engine, no evaluation inside training."""
    return [f"data.world_dir={os.path.join(work, 'world')}", f"warmstart.cache_dir={os.path.join(work, 'warmstart')}",
            "eval.questions=0", "eval.every=0", "logging.progress=false", f"rollout.engine={a.engine}", *a.overrides]


def saved_steps(a) -> list:
    """The steps whose policy is evaluated: 0 (the start), every ``--every``, and the last."""
    return sorted({0, *range(a.every, a.steps + 1, a.every), a.steps})


def train_fastcredit(a, work: str, common: list, method: str) -> str:
    """fastcredit's run of ``method`` (resumed when interrupted); its folder."""
    out = os.path.join(work, f"fastcredit_{method}")
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    if any(r.get("step") == a.steps and "time/step" in r for r in rows):
        return out
    resume = ["--resume"] if os.path.isdir(os.path.join(out, "checkpoints")) else []
    _run([sys.executable, "-m", "fastcredit.train", "--config", a.config, *common, f"credit.estimator={method}",
          f"logging.output_dir={out}", f"optim.total_steps={a.steps}", f"logging.checkpoint_every={a.every}",
          "logging.keep_checkpoints=0", *resume], f"fastcredit {method}")
    return out


def train_trl(a, work: str, common: list) -> str:
    """TRL's GRPO run (resumed from its last checkpoint when interrupted), beside a ``/retrieve`` server; its
    folder."""
    from fastcredit.config import load_config

    out = os.path.join(work, "trl_grpo")
    if os.path.exists(os.path.join(out, "result.json")):
        return out
    cfg = load_config([a.config], [*common, "credit.estimator=grpo"])
    server = RetrievalServer(os.path.join(work, "world", "corpus.jsonl"), os.path.join(work, "trl_server.log"),
                             cfg.retrieval.encoder)
    try:
        server.wait()
        _run([sys.executable, "-m", "bench.peer_trl", "--config", a.config, "--model", os.path.join(work, "start"),
              "--out", out, "--steps", str(a.steps), "--save-every", str(a.every), "--retrieval-url", server.url,
              "--resume", *common, "credit.estimator=grpo"], "TRL grpo")
    finally:
        server.close()
    return out


def evaluate(a, work: str, common: list, name: str, model: list, step: int) -> float:
    """Held-out EM of one saved policy (``model``: ``fastcredit.eval``'s ``--model`` arguments), evaluated once."""
    out = os.path.join(work, "eval", name, f"step_{step:06d}")
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        limit = ["--limit", str(a.questions)] if a.questions else []
        _run([sys.executable, "-m", "fastcredit.eval", *model, "--config", a.config, "--engine", "hf",
              "--out", out, *limit, *common, "credit.estimator=grpo"], f"eval {name} step {step}")
    with open(path) as f:
        return float(json.load(f)["average"]["em"])


def read_jsonl(path: str) -> list:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def clock(rows: list, steps: list) -> dict:
    """``{step: summed time/step of steps 1..step}`` (the last row of a step counts: a resumed run's redone steps
    replace the lost ones)."""
    per = {}
    for r in rows:
        if "time/step" in r:
            per[r["step"]] = r["time/step"]
    return {s: sum(v for k, v in per.items() if k <= s) for s in steps}


def curve(a, work: str, common: list, name: str, folder: str, trl: bool) -> list:
    """``[{step, seconds, em}]`` of one trainer at every saved step."""
    from bench.peer_trl import per_rollout
    from fastcredit.config import load_config

    steps = saved_steps(a)
    k = per_rollout(load_config([a.config], common))
    rows = read_jsonl(os.path.join(folder, "steps.jsonl" if trl else "metrics.jsonl"))
    seconds = clock(rows, steps)
    out = []
    for s in steps:
        if s == 0:
            model = ["--model", os.path.join(work, "start")]
        elif trl:
            model = ["--model", os.path.join(folder, f"checkpoint-{s * k}")]
        else:
            model = ["--model", folder, "--step", str(s)]
        out.append({"step": s, "seconds": seconds[s],
                    "em": evaluate(a, work, common, "start" if s == 0 else name, model, s)})
    return out


def reached(points: list, threshold: float):
    """The first saved point whose EM reaches ``threshold`` (None: none did)."""
    return next((p for p in points if p["em"] >= threshold), None)


def markdown(report: dict) -> str:
    names = list(report["curves"])
    lines = [f"# Time to accuracy: fastcredit against TRL's GRPOTrainer — {report['device']}", "",
             f"{report['shape']} policy, `{report['config']}` {' '.join(report['overrides'])}; {report['steps']} "
             f"steps each from one warm start (sha256 {report['start_weights'][:12]}), a policy saved every "
             f"{report['every']} steps and scored by `python -m fastcredit.eval` (greedy, "
             f"{report['questions'] or 'all'} held-out questions). Seconds: the training steps' own, summed.", "",
             "| threshold | " + " | ".join(f"{n}: step, s" for n in names) + " | fastcredit grpo / TRL |",
             "|---:|" + "---|" * len(names) + "---:|"]
    for t in report["thresholds"]:
        cells = []
        for n in names:
            p = t["reached"][n]
            cells.append("not reached" if p is None else f"{p['step']}, {p['seconds']:.0f}")
        ratio = "" if t.get("ratio") is None else f"{t['ratio']:.2f}"
        lines.append(f"| {t['threshold']:.3f} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "| step | " + " | ".join(f"{n} EM | {n} s" for n in names) + " |",
              "|---:|" + "---:|---:|" * len(names)]
    for i, s in enumerate(p["step"] for p in report["curves"][names[0]]):
        lines.append(f"| {s} | " + " | ".join(f"{report['curves'][n][i]['em']:.3f} | "
                                               f"{report['curves'][n][i]['seconds']:.0f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"))
    p.add_argument("--steps", type=int, default=60, help="training steps of each trainer")
    p.add_argument("--every", type=int, default=10, help="steps between saved (and evaluated) policies")
    p.add_argument("--thresholds", default="0.76,0.80", help="held-out EM thresholds, comma-separated")
    p.add_argument("--questions", type=int, default=0, help="held-out questions per evaluation (0: all)")
    p.add_argument("--methods", default="grpo", help="fastcredit's methods on the same clock (grpo first)")
    p.add_argument("--engine", default="hf", choices=("hf",), help="both trainers' generation engine")
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "race_tta"), help="its folder; a rerun resumes")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default="")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run and evaluation")
    a = p.parse_intermixed_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    if a.steps < 1 or a.every < 1 or "grpo" not in methods:
        p.error("--steps and --every must be at least 1, and --methods must hold grpo (TRL's peer)")
    thresholds = sorted(float(t) for t in a.thresholds.split(","))
    work = a.work
    common = common_overrides(a, work)
    digests = prepare(a, work, [*common, "credit.estimator=grpo"])
    curves = {}
    trl = train_trl(a, work, common)
    curves["TRL grpo"] = curve(a, work, common, "trl_grpo", trl, True)
    for m in methods:
        folder = train_fastcredit(a, work, common, m)
        curves[f"fastcredit {m}"] = curve(a, work, common, f"fastcredit_{m}", folder, False)
    rows = []
    for t in thresholds:
        hit = {n: reached(c, t) for n, c in curves.items()}
        ours, theirs = hit["fastcredit grpo"], hit["TRL grpo"]
        ratio = ours["seconds"] / theirs["seconds"] if ours and theirs and theirs["seconds"] > 0 else None
        rows.append({"threshold": t, "reached": hit, "ratio": ratio})
    from fastcredit.config import load_config

    policy = load_config([a.config], common).model.policy
    shape = "tiny" if policy == "tiny" else os.path.basename(os.path.normpath(policy))
    report = {"device": device_name("cuda" if torch.cuda.is_available() else "cpu"), "shape": shape,
              "config": os.path.relpath(a.config, ROOT), "overrides": a.overrides, "steps": a.steps,
              "every": a.every, "questions": a.questions, "start_weights": digests["fastcredit"],
              "curves": curves, "thresholds": rows, "work": work}
    text = markdown(report)
    print(text)
    path = write_results(f"race_tta_{shape}" + (f"_{a.tag}" if a.tag else ""), report, a.out)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
