"""The vLLM kit of the lent GPU image, checked on a machine without a GPU (``make gpu-preflight``'s ``vllm`` stage).

    python -m tools.gpu.gpu_preflight_vllm OUTDIR     # OUTDIR/vllm_kit.json, OUTDIR/vllm_kit.log

1. kit: ``tools/gpu/vllm_kit.py build`` when ``.whl/vllm_kit`` holds no manifest (downloads are cached), then the parts
   checked against the manifest, joined, and every wheel checked against its own sha256 (the GPU machine's code).
2. venv: ``.venv-vllm024`` (ignored by git; made once, a stamp names what it holds): PyPI's ``torch==2.11.0``, its
   CUDA 13 build as on the image, and the image's own packages that vLLM imports, at the image's versions where
   they are known (IMAGE_SET).
3. install: the kit's wheels with ``--no-index --no-deps`` into a target folder outside the venv, on PYTHONPATH, as
   ``tools/gpu/gpu_lease.sh run`` does with /tmp/site; this venv is Python 3.11, so each compiled requirement built for
   the image's 3.12 is swapped for the same version's 3.11 build.
4. probe, a fresh process with no GPU visible: ``from vllm import LLM``; ``fastcredit.rollout.engines.vllm``
   imports; ``vllm_compat`` resolves every choice to the 0.24 branch.
5. cuda path, a fresh process with vLLM's CUDA platform standing in for an H100 (it reports capability 9.0) and a
   stub ``libcuda.so.1`` built here (the ops library links the driver, which no CPU machine has): the ops library
   and ``cumem_allocator`` load against torch 2.11, every module of the engine's GPU path imports, FlashAttention-3
   is the attention, and ``EngineArgs(**engine_kwargs(...cuda...)).create_engine_config()`` builds with sleep mode.

Exit status 1 when a step fails; vllm_kit.json says which, and what each step found.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tools.gpu import vllm_kit

ROOT = vllm_kit.ROOT
VENV = os.path.join(ROOT, ".venv-vllm024")
KIT = os.path.join(ROOT, ".whl", "vllm_kit")
STAMP = ".fastcredit-preflight.json"
# The image's packages that vLLM 0.24 imports (the lender's list, 2026-11-17), pinned where the list gives a version.
IMAGE_SET = [*vllm_kit.IMAGE_PINS[:2], *vllm_kit.IMAGE_PINS[4:], "numpy", "regex", "psutil", "requests", "tqdm",
             "py-cpuinfo", "protobuf", "aiohttp", "pillow", "prometheus-client", "pyyaml", "einops", "cloudpickle",
             "opencv-python-headless", "ninja", "six", "setuptools<81", "filelock", "typing-extensions", "uvloop",
             "anyio", "httpx", "packaging", "jinja2", "msgpack"]

PROBE = r"""
import json, time
t = time.time()
import torch
from vllm import LLM
import vllm
import fastcredit.rollout.engines.vllm as engine
from fastcredit.rollout.engines import vllm_compat
api = vllm_compat.installed()
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available":
                  torch.cuda.is_available(), "vllm": vllm.__version__, "vllm_from": vllm.__file__,
                  "LLM": LLM.__module__, "engine_module": engine.__name__, "branches": api.branches,
                  "import_s": round(time.time() - t, 1)}))
"""

CUDA_PATH = r"""
import importlib, json, sys, time
t = time.time()
import torch
import vllm.platforms as platforms
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import DeviceCapability

class H100(CudaPlatform):  # what an H100 answers; nothing here reaches a device
    @classmethod
    def get_device_capability(cls, device_id=0):
        return DeviceCapability(9, 0)

    @classmethod
    def get_device_name(cls, device_id=0):
        return "NVIDIA H100 80GB HBM3 (stand-in)"

platforms.current_platform = H100()
import vllm._C_stable_libtorch, vllm.cumem_allocator
ops = len([n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::")])
MODULES = ["vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker",
           "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.qwen2", "vllm.model_executor.models.llama",
           "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
           "vllm.v1.sample.sampler", "vllm.device_allocator.cumem", "vllm.v1.structured_output.backend_xgrammar",
           "vllm.compilation.backends", "vllm.model_executor.model_loader.default_loader"]
failed = {}
for name in MODULES:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.executor.abstract import Executor
from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy
from fastcredit.rollout.engines import vllm as fv
tok = build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer>"] * 20, vocab_size=300)
folder = save_tiny_policy(build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=1), tok, sys.argv[1])
kw = fv.engine_kwargs(folder, folder, torch.device("cuda", 0))
config = EngineArgs(**kw).create_engine_config()
print(json.dumps({"ops_registered": ops, "modules": len(MODULES), "failed": failed,
                  "flash_attn_version": get_flash_attn_version(), "engine_kwargs": {k: str(v) for k, v in kw.items()},
                  "sleep_mode": config.model_config.enable_sleep_mode,
                  "attention_backend": str(config.attention_config.backend),
                  "executor": Executor.get_class(config).__name__, "seconds": round(time.time() - t, 1)}))
"""


class Failed(Exception):
    def __init__(self, step: str, reason: str):
        super().__init__(f"{step}: {reason}")
        self.step, self.reason = step, reason


def say(msg: str) -> None:
    print(f"[preflight-vllm] {msg}", flush=True)


def run(step: str, cmd: list, log, env: dict | None = None, timeout: int = 1800, cwd: str = ROOT) -> str:
    """``cmd``'s output, appended to the log; Failed (naming ``step``) on a non-zero exit or a timeout."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(step, f"timed out after {timeout} s") from None
    log.write(proc.stdout + proc.stderr)
    log.flush()
    if proc.returncode:
        raise Failed(step, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-600:]}")
    return proc.stdout


def last_json(text: str) -> dict:
    """The last line of ``text`` that parses as a JSON object (the probes print one after vLLM's logging)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the probe's output")


def ensure_venv(log) -> str:
    """The venv's python, made or completed as IMAGE_SET says (a stamp skips the install when it matches)."""
    py = os.path.join(VENV, "bin", "python")
    stamp = os.path.join(VENV, STAMP)
    if os.path.exists(stamp) and json.load(open(stamp)) == IMAGE_SET:
        return py
    if not os.path.exists(py):
        say(f"creating {VENV} (torch 2.11.0's CUDA build and its libraries: a few GB, once)")
        run("venv", [sys.executable, "-m", "venv", VENV], log)
    # no machine-wide constraints: a local torch cap must not stand in for the image's pins
    run("venv", [py, "-m", "pip", "install", "-q", *IMAGE_SET], log, env={**os.environ, "PIP_CONSTRAINT": ""})
    with open(stamp, "w") as f:
        json.dump(IMAGE_SET, f)
    return py


def stub_libcuda(folder: str, libraries: list, log) -> str:
    """A ``libcuda.so.1`` defining the driver functions ``libraries`` import, each returning CUDA_ERROR_NO_DEVICE:
    they link; nothing calls them without a device."""
    if not (shutil.which("gcc") and shutil.which("nm")):
        raise Failed("cuda path", "gcc and nm are needed to build the stub libcuda.so.1")
    names = set()
    for lib in libraries:
        out = run("cuda path", ["nm", "-D", "--undefined-only", lib], log)
        names |= {line.split()[-1] for line in out.splitlines() if line.split()[-1][:2] == "cu"
                  and line.split()[-1][2:3].isupper()}
    src = os.path.join(folder, "libcuda_stub.c")
    with open(src, "w") as f:
        f.write("".join(f"int {n}(void) {{ return 100; }}\n" for n in sorted(names)))
    run("cuda path", ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                      os.path.join(folder, "libcuda.so.1"), src], log)
    return folder


def check(out: str) -> dict:
    """Steps 1-5 of the module docstring; returns what each found (raises Failed at the first that fails)."""
    res: dict = {}
    with open(os.path.join(out, "vllm_kit.log"), "w") as log, tempfile.TemporaryDirectory() as tmp:
        if not os.path.exists(os.path.join(KIT, vllm_kit.MANIFEST)):
            say("building the kit (python -m tools.gpu.vllm_kit build)")
            run("kit", [sys.executable, "-m", "tools.gpu.vllm_kit", "build", "--out", KIT], log)
        t = time.time()
        try:
            wheels = vllm_kit.unpack(KIT, os.path.join(tmp, "wheels"))
        except SystemExit as exc:
            raise Failed("kit", str(exc)) from None
        manifest = vllm_kit.load_manifest(KIT)
        res["kit"] = {"parts": [{"name": p["name"], "mib": round(p["bytes"] / vllm_kit.MIB, 2)}
                                for p in manifest["parts"]], "total_mib": round(manifest["bytes"] / vllm_kit.MIB, 1),
                      "wheels": len(wheels), "sha256": manifest["sha256"], "unpack_s": round(time.time() - t, 1)}
        say(f"kit: {len(manifest['parts'])} parts, {res['kit']['total_mib']} MiB, every hash matches")
        py = ensure_venv(log)
        local = vllm_kit.for_python(wheels, "3.11", os.path.join(tmp, "cp311"))
        site = os.path.join(tmp, "site")
        t = time.time()
        run("install", [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", site,
                        *local], log)
        res["install"] = {"seconds": round(time.time() - t, 1), "swapped_for_cp311": sorted(
            os.path.basename(w) for w in local if w not in wheels)}
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}:{site}"}
        env.pop("TRITON_INTERPRET", None)
        res["probe"] = last_json(run("probe", [py, "-c", PROBE], log, env=env, cwd=tmp, timeout=600))
        if set(res["probe"]["branches"].values()) != {"0.24"}:
            raise Failed("probe", f"vllm_compat chose {res['probe']['branches']}, not the 0.24 branch throughout")
        say(f"probe: vllm {res['probe']['vllm']} imports, branches {res['probe']['branches']}")
        libs = [os.path.join(site, "vllm", n) for n in ("_C_stable_libtorch.abi3.so", "cumem_allocator.abi3.so")]
        env["LD_LIBRARY_PATH"] = stub_libcuda(tmp, libs, log)
        cuda = last_json(run("cuda path", [py, "-c", CUDA_PATH, os.path.join(tmp, "policy")], log, env=env, cwd=tmp,
                             timeout=900))
        res["cuda_path"] = cuda
        if cuda["failed"] or not cuda["sleep_mode"] or cuda["flash_attn_version"] != 3:
            raise Failed("cuda path", f"modules failed: {cuda['failed']}; sleep mode {cuda['sleep_mode']}; "
                         f"FlashAttention {cuda['flash_attn_version']}")
        say(f"cuda path: {cuda['modules']} modules import, {cuda['ops_registered']} ops, FA{cuda['flash_attn_version']}"
            f", executor {cuda['executor']}, sleep mode on")
    return res


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t = time.time()
    try:
        res = {"status": "passed", **check(a.out)}
    except Failed as exc:
        res = {"status": "failed", "failed_step": exc.step, "reason": exc.reason}
        say(f"FAILED at {exc.step}: {exc.reason}")
    res["seconds"] = round(time.time() - t, 1)
    with open(os.path.join(a.out, "vllm_kit.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if res["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
