"""The summary of ``make gpu-check``: ``OUT/summary.md`` from the stage files the stages of
``tools/gpu/gpu_check.py`` wrote into OUT (``python -m tools.gpu.gpu_check summary OUT`` runs it)."""
from __future__ import annotations

import glob
import json
import os

STAGES = ("env", "build", "tests", "kernels", "train", "ranks", "rollout", "step", "search_step", "split", "nsys",
          "vllm_engine", "vllm_sleep", "vllm_critic", "vllm_rollout", "vllm_train", "vllm_step")


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))


def write_summary(out: str) -> int:
    """OUT/summary.md from every stage file in OUT (a stage without one is failed); 1 on any failed stage or
    target, else 0."""
    stages = []
    for name in STAGES:
        path = os.path.join(out, f"stage_{name}.json")
        missing = {"stage": name, "status": "failed",
                   "reason": "no result in OUTDIR (not run yet, timed out or crashed)"}
        stages.append(json.load(open(path)) if os.path.exists(path) else missing)
    env = json.load(open(os.path.join(out, "env.json"))) if os.path.exists(os.path.join(out, "env.json")) else {}
    targets = (json.load(open(os.path.join(out, "targets.json")))
               if os.path.exists(os.path.join(out, "targets.json")) else [])
    lines = [f"# gpu-check: {env.get('gpu', 'no CUDA device')}", "",
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), driver {env.get('driver')}, "
             f"python {env.get('python')}", "", "| stage | status | note |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['status']} | {s.get('reason', '')} |" for s in stages]
    lines += ["", "| target | value | limit | result |", "|---|---|---|---|"]
    lines += [f"| {t['name']} ({t['what']}) | {_fmt(t['value'])} | {t['limit']} | {t['status']} |" for t in targets]
    kern = os.path.join(out, "kernels.jsonl")
    if os.path.exists(kern):
        lines += ["", "| op | shape | provider | python ms | graph ms | GB/s | TFLOP/s | peak GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in map(json.loads, open(kern)):
            if "op" in r:
                peak = r.get("peak_bytes")
                lines.append(f"| {r['op']} | {r['shape']} | {r['provider']} | {_fmt(r.get('python_ms'))} | "
                             f"{_fmt(r.get('graph_ms'))} | {_fmt(r.get('gbps'))} | {_fmt(r.get('tflops'))} | "
                             f"{_fmt(peak / 2 ** 30 if peak else None)} |")
    steps = os.path.join(out, "step_times.json")
    if os.path.exists(steps):
        for engine, res in json.load(open(steps))["engines"].items():
            last = res["steps"][-1] if res["steps"] else {}
            phases = ", ".join(f"{k[5:]} {v:.2f}" for k, v in sorted(last.items()) if k.startswith("time/"))
            lines += ["", f"train ({engine}), last step seconds: {phases}"]
            mem = {k[7:]: v for k, v in last.items() if k.startswith("memory/")}
            if mem:
                lines += ["", "| boundary | allocated GiB | reserved GiB | engine GiB | device used GiB |",
                          "|---|---|---|---|---|"]
                for b in sorted({k.rsplit("/", 1)[0] for k in mem}):
                    lines.append(f"| {b} | " + " | ".join(_fmt(mem.get(f"{b}/{c}_gib")) for c in (
                        "allocated", "reserved", "engine", "device_used")) + " |")
    for path in glob.glob(os.path.join(out, "packed_forward_*.json")):
        pf = json.load(open(path))
        lines += ["", f"packed vs padded forward ({pf['dtype']}, T={pf['shape']['T_real_tokens']} real tokens, "
                      f"{pf['shape']['padding_fraction']:.0%} padding): " + "; ".join(
                          f"{r['mode']} {r['packed_tokens_per_s']:,.0f} vs {r['padded_tokens_per_s']:,.0f} tok/s "
                          f"({r['speedup']:.2f}x)" for r in pf["results"])]
    for path in glob.glob(os.path.join(out, "rollout_*.json")):
        ro = json.load(open(path))
        lines += ["", f"rollout ({ro['engine']}, {ro['trajectories']} trajectories, turn-skewed): async "
                      f"{ro['modes']['async']['trajectories_per_s']:.1f} vs lockstep "
                      f"{ro['modes']['lockstep']['trajectories_per_s']:.1f} traj/s ({ro['async_over_lockstep']:.2f}x)"]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = ([s["stage"] for s in stages if s["status"] == "failed"]
              + [t["name"] for t in targets if t["status"] == "FAIL"])
    print(f"[gpu-check] {'FAILED: ' + ', '.join(failed) if failed else 'all stages passed or not run'}")
    return 1 if failed else 0
