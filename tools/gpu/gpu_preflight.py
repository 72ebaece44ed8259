"""``make gpu-preflight``: what a CPU machine can check of the GPU path before a GPU is spent on it.

    python -m tools.gpu.gpu_preflight OUTDIR [--stages kernels,build,rules,vllm] [--arch 80,90,100]

Stages, each into OUTDIR as it goes, then OUTDIR/summary.md:

* kernels: every Triton kernel compiled ahead of time for sm_80, sm_90 and sm_100 with the
  tiles, warps and stages the host code picks on that GPU (``tools/gpu/gpu_preflight_kernels.py``):
  ``kernels/kernels.jsonl``, ``kernels/kernels.md``. Fails on a compile error, shared memory
  above the per-block limit, or a spill in the linear log-prob.
* build: ``fastcredit._C`` built against a CUDA build of torch with the Makefile's own command,
  then the Makefile's own import line in a fresh process (``tools/gpu/gpu_preflight_build.py``):
  ``extension/build.json``. The first run installs torch into a venv of its own (about 5.5 GB, ~7
  minutes); later runs reuse it (~1 minute).
* rules: the distributed rules of the GPU path on two gloo ranks: the process group built as
  on GPUs (NCCL's device dispatch, gloo standing in), vLLM's executor and device for rank 3 of
  8, every CUDA-touching thread binding the rank's device, whitening over ranks, the policy
  read on rank 0 only: ``rules.xml`` (junit).
* vllm: the lent GPU image's vLLM kit (``tools/gpu/gpu_preflight_vllm.py``): its parts against the manifest's sha256
  sums, installed with ``--no-index --no-deps`` beside PyPI's CUDA build of torch 2.11.0 in ``.venv-vllm024``, no GPU
  visible: ``from vllm import LLM``, the engine module, the 0.24 branch of ``vllm_compat``, and the CUDA path's
  imports and engine configuration under a stand-in H100 platform: ``vllm_kit.json``. The first run makes the venv
  (a few GB, about 2 minutes); later runs about 1 minute.

Exit status 1 when a stage fails. What no CPU can check is listed in summary.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ("kernels", "build", "rules", "vllm")
RULE_TESTS = ["tests/distributed/test_gpu_rules.py", "tests/runtime/test_devices.py",
              "tests/rollout/test_vllm_device.py"]
CANNOT = [
    "kernel speed, occupancy achieved and numerics on tensor cores (the interpreter ignores input precision; "
    "tf32x3 was checked by emulation only)",
    "NCCL itself: collectives of CUDA tensors, their streams, and the retrieval round thread's side stream",
    "vLLM's CUDA model runner, sleep mode, CUDA graphs and the memory it really takes",
    "that each rank's engine lands on its own GPU in a real run (make gpu-check's `ranks` stage does, "
    "with 2 or more GPUs)",
    "the CUDA extension's kernels (they compile and the library loads; the ops refuse CPU tensors)",
]


def run(cmd: list, log: str, env: dict | None = None) -> tuple[int, float]:
    t0 = time.time()
    print(f"[gpu-preflight] $ {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        for line in proc.stdout:
            f.write(line)
            if line.startswith(("[", "compiled", "sm_", "FAIL", "PASS", "kernels:", "build:")) or "passed" in line:
                print("   ", line.rstrip(), flush=True)
        rc = proc.wait()
    return rc, time.time() - t0


def stage_kernels(out: str, arch: str) -> dict:
    cmd = [sys.executable, "-m", "tools.gpu.gpu_preflight_kernels", os.path.join(out, "kernels"), "--arch", arch]
    rc, s = run(cmd, os.path.join(out, "kernels.log"))
    return {"status": "passed" if rc == 0 else "failed", "seconds": round(s, 1), "archs": arch,
            "note": "kernels/kernels.md" if rc == 0 else "see kernels.log"}


def stage_build(out: str) -> dict:
    rc, s = run([sys.executable, "-m", "tools.gpu.gpu_preflight_build", os.path.join(out, "extension")],
                os.path.join(out, "build_stage.log"))
    path = os.path.join(out, "extension", "build.json")
    info = json.load(open(path)) if os.path.exists(path) else {}
    note = f"failed at {info.get('failed_step')}" if rc else \
        f"torch {info.get('torch')}, archs {info.get('torch_cuda_arch_list')}, import ok"
    return {"status": "passed" if rc == 0 else "failed", "seconds": round(s, 1), "note": note}


def stage_rules(out: str) -> dict:
    xml = os.path.join(out, "rules.xml")
    rc, s = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", xml, *RULE_TESTS],
                os.path.join(out, "rules.log"), env={"TRITON_INTERPRET": "1", "FASTCREDIT_EMULATE_NCCL": "1"})
    counts = {}
    if os.path.exists(xml):
        suite = ET.parse(xml).getroot().find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"status": "passed" if rc == 0 else "failed", "seconds": round(s, 1),
            "note": ", ".join(f"{v} {k}" for k, v in counts.items()) or "see rules.log"}


def stage_vllm(out: str) -> dict:
    rc, s = run([sys.executable, "-m", "tools.gpu.gpu_preflight_vllm", out], os.path.join(out, "vllm_stage.log"))
    path = os.path.join(out, "vllm_kit.json")
    info = json.load(open(path)) if os.path.exists(path) else {}
    if rc or info.get("status") != "passed":
        note = f"failed at {info.get('failed_step')}: {info.get('reason', 'see vllm_stage.log')}"[:300]
    else:
        kit, probe, cuda = info["kit"], info["probe"], info["cuda_path"]
        note = (f"kit {len(kit['parts'])} parts, {kit['total_mib']} MiB, hashes match; vllm {probe['vllm']} beside "
                f"torch {probe['torch']}: LLM and the engine import, compat {sorted(set(probe['branches'].values()))}; "
                f"CUDA path: {cuda['modules']} modules, FA{cuda['flash_attn_version']}, {cuda['executor']}, sleep mode")
    return {"status": "passed" if rc == 0 else "failed", "seconds": round(s, 1), "note": note}


def summary(out: str, results: dict, kept: set = frozenset()) -> str:
    """summary.md: one row per stage (``kept``: rows of an earlier run, not run this time), the kernel table, and what
    no CPU can check."""
    lines = ["# gpu-preflight (a CPU machine checking the GPU path)", "", "| stage | status | seconds | note |",
             "|---|---|---|---|"]
    lines += [f"| {k} | {r['status']}{' (earlier run)' if k in kept else ''} | {r['seconds']} | {r['note']} |"
              for k, r in results.items()]
    table = os.path.join(out, "kernels", "kernels.md")
    if os.path.exists(table):
        lines += ["", "## Triton kernels compiled ahead of time", "", open(table).read().strip()]
    lines += ["", "## What the preflight cannot check", ""] + [f"- {c}" for c in CANNOT]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ", ".join(STAGES))
    p.add_argument("--arch", default="80,90,100", help="GPU architectures the kernels compile for")
    a = p.parse_args(argv)
    stages = [s for s in a.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stage(s) {', '.join(unknown)}; valid: {', '.join(STAGES)}")
    os.makedirs(a.out, exist_ok=True)
    done = {"kernels": lambda: stage_kernels(a.out, a.arch), "build": lambda: stage_build(a.out),
            "rules": lambda: stage_rules(a.out), "vllm": lambda: stage_vllm(a.out)}
    results = {}
    for stage in stages:
        results[stage] = done[stage]()
        print(f"[gpu-preflight] {stage}: {results[stage]['status']} ({results[stage]['note']})", flush=True)
    # a subset of stages updates its own rows: the others keep their last run's, so summary.md stays whole
    path = os.path.join(a.out, "stages.json")
    earlier = json.load(open(path)) if os.path.exists(path) else {}
    whole = {k: results.get(k, earlier.get(k)) for k in STAGES if k in results or k in earlier}
    with open(path, "w") as f:
        json.dump(whole, f, indent=1)
    print(summary(a.out, whole, kept=set(whole) - set(results)))
    failed = [k for k, r in results.items() if r["status"] != "passed"]
    print(f"[gpu-preflight] {'FAILED: ' + ', '.join(failed) if failed else 'all stages passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
