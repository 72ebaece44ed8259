"""The vLLM kit: vllm 0.24.0, slimmed, and the requirements the lent GPU image lacks, in parts that each fit one
transfer to that machine, with a manifest of sha256 sums.

    python -m tools.gpu.vllm_kit build [--out .whl/vllm_kit] [--part-mib auto]  # here (tools/gpu/gpu_lease.sh prepare)
    python -m tools.gpu.vllm_kit verify .whl/vllm_kit                          # every part present, hashes match
    python -m tools.gpu.vllm_kit unpack .whl/vllm_kit DEST                     # there: verify, reassemble, DEST/*.whl
    python -m tools.gpu.vllm_kit resolve                                       # maintenance: re-resolve KIT_WHEELS

Why this version: the GPU image (Python 3.12, torch 2.11.0+cu130, no network) cannot take vllm 0.32 (it pins torch
2.13); vllm 0.24.0 pins exactly the image's torch 2.11.0, torchvision 0.26.0 and torchaudio 2.11.0 and is a CUDA 13
build. Its wheel (265 MiB) is slimmed to what a dense Qwen2 / Llama on sm_90 with sleep mode loads: the ops library
``_C_stable_libtorch``, ``cumem_allocator`` (sleep mode), FlashAttention-3 (sm_90 only) and the Python package;
SLIM_REMOVED lists what goes and why. On a GPU other than sm_90 the engine takes vLLM's Triton attention backend
(fastcredit.rollout.engines.vllm_compat.attention_backend). KIT_WHEELS are the requirements not on the image, at
versions pip's resolver chose beside the image's pins (``resolve`` re-runs it); LEFT_OUT names those that stay
behind and why.

The wheels go into one uncompressed, reproducible tar (they are compressed already), split into parts of at most
``--part-mib`` MiB: ``auto`` is 64 MiB less this checkout's working tree (which travels with every call) less 2 MiB,
at most 60. ``manifest.json`` holds the sha256 of every part, of the whole tar and of every wheel in it, and the
removal lists; ``KIT.md`` says the same for people. Downloads are cached in ``$FASTCREDIT_KIT_CACHE`` (default
``~/.cache/fastcredit/vllm_kit``). ``unpack`` and ``verify`` use the standard library only (the image's python).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM = "vllm==0.24.0"
MIB = 1 << 20
TRANSFER_MIB = 64  # what one call to the GPU machine carries, the working tree included
MAX_PART_MIB = 60
ARCHIVE = "vllm_kit.tar"
MANIFEST = "manifest.json"
# glibc 2.35 (Ubuntu 22.04, the oldest base of NVIDIA's CUDA 13 images) down to the oldest manylinux tags
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(35, 4, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]

# Paths inside the vllm 0.24.0 wheel that the kit drops (prefix match), and why a dense Qwen2 / Llama in bf16 on
# sm_90 with sleep mode never loads them. Every one is imported lazily or under try/except in vLLM 0.24.
SLIM_REMOVED = [
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "FlashAttention-2 kernels (191 MB) for sm_80 / sm_86 / sm_89: on "
     "sm_90 vLLM takes FlashAttention-3, kept (vllm.vllm_flash_attn refuses to import with neither, and every model's "
     "attention layer imports it); elsewhere the engine selects vLLM's Triton backend"),
    ("vllm/vllm_flash_attn/cute/", "FlashAttention-4 in the CuTe DSL: needs nvidia-cutlass-dsl (left out); while "
     "present, vLLM would count FA4 as available"),
    ("vllm/_moe_C_stable_libtorch.abi3.so", "fused mixture-of-experts ops (45 MB): a dense model calls none; "
     "vLLM's platform imports it under try/except"),
    ("vllm/_flashmla_C.abi3.so", "FlashMLA: multi-head latent attention (DeepSeek-style models) only"),
    ("vllm/_flashmla_extension_C.abi3.so", "FlashMLA's sparse extension: as above"),
    ("vllm/third_party/flashmla/", "FlashMLA's Python interface: as above"),
    ("vllm/_qutlass_C.abi3.so", "FP4 (NVFP4 / MXFP4) quantisation kernels: imported under try/except"),
    ("vllm/third_party/deep_gemm/", "DeepGEMM FP8 GEMMs (5 compiled copies, one per Python): vLLM probes it with "
     "a trial import (has_deep_gemm)"),
    ("vllm/third_party/fmha_sm100/", "Blackwell (sm_100) sparse FMHA for MiniMax M3"),
    ("vllm/vllm-rs", "the Rust HTTP frontend binary (37 MB): the OpenAI server only, by VLLM_RUST_FRONTEND_PATH"),
    ("vllm/_rust_tool_parser.abi3.so", "tool-call parsing of the OpenAI server, loaded by importlib on first use"),
]

# Requirements of vllm 0.24.0 (and theirs) that the image lacks, as pip resolved them for Python 3.12 beside the
# image's torch 2.11.0 / transformers 5.17.0 (tools/gpu/vllm_kit.py resolve, 2026-11-27). Compiled ones are cp312 or
# abi3 manylinux wheels; the preflight installs cp311 builds of the same versions on its Python 3.11.
KIT_WHEELS = [
    "annotated-types==0.8.0", "apache-tvm-ffi==0.1.15.post2", "astor==0.8.1", "blake3==1.0.11", "cachetools==8.0.2",
    "cbor2==6.3.0", "compressed-tensors==0.17.0", "depyf==0.20.0", "dill==0.4.1", "diskcache==5.6.3",
    "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2", "ijson==3.6.0", "interegular==0.3.3", "jiter==0.19.0",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "lark==1.2.2", "llguidance==1.7.6",
    "lm-format-enforcer==0.11.3", "loguru==0.7.3", "msgspec==0.22.0", "openai==3.57.0", "openai-harmony==0.0.8",
    "outlines-core==0.2.14", "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "python-json-logger==4.2.0", "pyzmq==27.3.0", "referencing==0.37.0", "rpds-py==2026.9.1",
    "setproctitle==1.3.8", "sniffio==1.3.1", "starlette==1.10.0", "truststore==0.10.5", "typing-inspection==0.4.5",
    "watchfiles==1.3.0", "xgrammar==0.2.8",
]

# Requirements of vllm 0.24.0 the kit leaves behind (none is imported on the engine's path), with why.
LEFT_OUT = [
    ("flashinfer-python, flashinfer-cubin", "FlashInfer attention / sampling kernels (hundreds of MB): vLLM probes "
     "them with find_spec and takes FlashAttention-3 (or its Triton attention) and its PyTorch sampler"),
    ("apache-tvm-ffi==0.1.9", "pinned for FlashInfer; xgrammar from 0.2.6 (the first to allow transformers 5) needs "
     ">= 0.1.10, so the kit carries xgrammar 0.2.8 with apache-tvm-ffi 0.1.15.post2"),
    ("tilelang, nvidia-cutlass-dsl[cu13], quack-kernels, tokenspeed-mla, humming-kernels[cu13]",
     "kernel DSLs and kernels for MLA, MoE, Blackwell and FP4 paths; imported only inside those paths"),
    ("nvidia-cudnn-frontend", "cuDNN attention (a FlashInfer option): not selected"),
    ("fastsafetensors", "load_format=fastsafetensors only"),
    ("fastapi[standard] extras (uvicorn, fastapi-cli, email-validator, python-multipart, ...)", "the OpenAI HTTP "
     "server; plain fastapi and starlette are carried: vllm.entrypoints.llm imports them"),
    ("prometheus-fastapi-instrumentator, model-hosting-container-standards, anthropic, mcp",
     "the HTTP server's metrics, SageMaker hooks, Anthropic Messages API and tool server"),
    ("opentelemetry-sdk, -api, -exporter-otlp, -semantic-conventions-ai", "request tracing; vllm.tracing imports "
     "them under try/except"),
    ("mistral_common[image]", "Mistral's tokenizer format (tokenizer_mode=mistral) and image inputs"),
    ("numba==0.65.0", "on the image at its own version; vLLM uses it for n-gram speculative decoding only"),
    ("setuptools<81", "on the image at its own version"),
]

# On the image already (read from the lender's package list, 2026-11-17): the resolver pins the versions it knows,
# and ``resolve`` leaves every package of this list out of the kit.
IMAGE_PINS = ["torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0", "triton==3.6.0", "transformers==5.17.0",
              "tokenizers==0.23.2", "safetensors==0.8.0", "sentencepiece==0.2.2", "tiktoken==0.14.0",
              "huggingface-hub==1.33.0"]
IMAGE_HAS = set("""
aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click cloudpickle cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit einops filelock frozenlist fsspec grpcio h11 hf-xet httpcore httpx
huggingface-hub idna jinja2 markdown-it-py markupsafe mdurl mpmath msgpack multidict networkx ninja numba numpy
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx opencv-python-headless packaging pillow pip prometheus-client propcache protobuf
psutil py-cpuinfo pygments pyyaml regex requests rich safetensors sentencepiece setuptools shellingham six sympy
tiktoken tokenizers torch torchaudio torchvision tqdm transformers triton typer typing-extensions urllib3 uvloop
wheel yarl
""".split())
# The roots handed to the resolver: vllm 0.24.0's requirements less the image's and LEFT_OUT.
RESOLVE_ROOTS = ["cachetools", "blake3", "fastapi<0.137.0,>=0.133.0", "starlette>=1.0.1", "openai>=2.0.0",
                 "pydantic>=2.12.0", "lm-format-enforcer==0.11.3", "llguidance<1.8.0,>=1.7.0", "outlines_core==0.2.14",
                 "diskcache==5.6.3", "lark==1.2.2", "xgrammar<1.0.0,>=0.2.1", "partial-json-parser",
                 "jsonschema>=4.23.0", "pyzmq>=25.0.0", "msgspec", "compressed-tensors==0.17.0", "depyf==0.20.0",
                 "watchfiles", "python-json-logger", "pybase64", "cbor2", "ijson", "setproctitle",
                 "openai-harmony>=0.0.3"]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def say(msg: str) -> None:
    print(f"[vllm-kit] {msg}", flush=True)


def cache_dir() -> str:
    return os.environ.get("FASTCREDIT_KIT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fastcredit",
                                                               "vllm_kit"))


def pip_download(specs: list, dest: str, python: str = "3.12") -> None:
    """Binary wheels of exactly ``specs`` (no dependencies) for CPython ``python`` on manylinux x86-64 into ``dest``."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", *plats, "-d", dest, *specs]
    # NOTE: no constraints file: a machine-wide pip constraint (a local torch cap) must not veto these pins
    proc = subprocess.run(cmd, env={**os.environ, "PIP_CONSTRAINT": ""}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"pip download failed for {specs}:\n{proc.stderr[-3000:]}")


def wheel_name(filename: str) -> str:
    """The normalised distribution name of a wheel file (``pydantic_core-2.50.5-...whl`` -> ``pydantic-core``)."""
    return re.sub(r"[-_.]+", "-", os.path.basename(filename).split("-")[0]).lower()


def pick(folder: str, spec: str) -> str:
    """The wheel in ``folder`` for ``name==version``; an error naming the spec when there is none or several."""
    name, version = spec.split("==")
    norm = re.sub(r"[-_.]+", "-", name).lower()
    found = [f for f in os.listdir(folder) if f.endswith(".whl") and wheel_name(f) == norm
             and f.split("-")[1] == version]
    if len(found) != 1:
        raise SystemExit(f"{spec}: expected one wheel in {folder}, found {found or 'none'}")
    return os.path.join(folder, found[0])


def removed_reason(path: str):
    for prefix, why in SLIM_REMOVED:
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return why
    return None


def slim_wheel(src: str, dst: str) -> dict:
    """Copy the wheel ``src`` to ``dst`` without the SLIM_REMOVED paths (entries keep their dates and compression,
    so the result is the same bytes on every build); RECORD loses their lines. Returns what was removed."""
    dropped, record = {}, None
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if removed_reason(info.filename):
                dropped[info.filename] = info.file_size
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                record = info
                continue
            zout.writestr(info, zin.read(info))
        kept = [line for line in zin.read(record).decode().splitlines() if not removed_reason(line.split(",")[0])]
        zout.writestr(record, "\n".join(kept) + "\n")
    missing = [p for p, _ in SLIM_REMOVED if not any(d == p or d.startswith(p) for d in dropped)]
    if missing:
        raise SystemExit(f"{os.path.basename(src)}: the slim list names paths this wheel does not hold: {missing}")
    return dropped


def working_tree_bytes() -> int:
    """Bytes of what travels with every call: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         check=True).stdout
    return sum(os.path.getsize(os.path.join(ROOT, p)) for p in out.decode().split("\0")
               if p and os.path.isfile(os.path.join(ROOT, p)))


def part_bytes(option: str, tree: int) -> int:
    """The part size: ``auto`` leaves room for the working tree and a 2 MiB margin in a 64 MiB transfer."""
    if option == "auto":
        mib = min(MAX_PART_MIB, (TRANSFER_MIB * MIB - tree) // MIB - 2)
    else:
        try:
            mib = int(option)
        except ValueError:
            raise SystemExit(f"--part-mib {option!r}: give a whole number of MiB or 'auto'") from None
    if not 1 <= mib <= MAX_PART_MIB:
        raise SystemExit(f"--part-mib {mib}: parts must be 1 to {MAX_PART_MIB} MiB "
                         f"(the working tree is {tree / MIB:.1f} MiB of each {TRANSFER_MIB} MiB transfer)")
    return mib * MIB


def write_tar(wheels: list, path: str) -> None:
    """An uncompressed tar of ``wheels`` in name order with fixed owners and dates: the same wheels, the same hash."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for whl in sorted(wheels, key=os.path.basename):
            info = tar.gettarinfo(whl, arcname=os.path.basename(whl))
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(whl, "rb") as f:
                tar.addfile(info, f)


def split(path: str, out: str, size: int) -> list:
    """``path`` cut into ``out/<name>.NN`` of at most ``size`` bytes; returns [{name, bytes, sha256}]."""
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(size):
            name = f"{os.path.basename(path)}.{len(parts):02d}"
            with open(os.path.join(out, name), "wb") as g:
                g.write(chunk)
            parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return parts


def kit_md(manifest: dict) -> str:
    """KIT.md: what the kit holds, what was removed from vllm and what was left out, for people."""
    lines = [f"# vLLM kit: {manifest['vllm']} for CPython {manifest['python']}, manylinux x86-64", "",
             f"{len(manifest['parts'])} parts of at most {manifest['part_bytes'] / MIB:.0f} MiB, "
             f"{manifest['bytes'] / MIB:.1f} MiB in all ({ARCHIVE}, sha256 {manifest['sha256']}).", "",
             "| wheel | MiB | compiled |", "|---|---:|---|"]
    lines += [f"| {w['file']} | {w['bytes'] / MIB:.2f} | {'yes' if w['compiled'] else ''} |"
              for w in manifest["wheels"]]
    lines += ["", "## Removed from the vllm wheel", "", "| path | MB unpacked | why |", "|---|---:|---|"]
    lines += [f"| `{r['path']}` | {r['unpacked_bytes'] / 1e6:.1f} | {r['why']} |" for r in manifest["removed"]]
    lines += ["", "## Requirements left out", ""] + [f"- {w}: {why}" for w, why in manifest["left_out"]]
    return "\n".join(lines) + "\n"


def build(out: str, part_option: str) -> dict:
    """Download, slim, pack and split; writes out/manifest.json, out/KIT.md and the parts. Returns the manifest."""
    cache = cache_dir()
    dl, slim = os.path.join(cache, "cp312"), os.path.join(cache, "slim")
    os.makedirs(dl, exist_ok=True)
    os.makedirs(slim, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    tree = working_tree_bytes()
    size = part_bytes(part_option, tree)
    want = [VLLM, *KIT_WHEELS]
    missing = [s for s in want if not any(wheel_name(f) == re.sub(r"[-_.]+", "-", s.split("==")[0]).lower()
                                          and f.split("-")[1] == s.split("==")[1] for f in os.listdir(dl))]
    if missing:
        say(f"downloading {len(missing)} wheel(s) for CPython 3.12 into {dl}")
        pip_download(missing, dl)
    full = pick(dl, VLLM)
    slimmed = os.path.join(slim, os.path.basename(full))
    dropped = slim_wheel(full, slimmed)
    say(f"{os.path.basename(full)}: {os.path.getsize(full) / MIB:.1f} -> {os.path.getsize(slimmed) / MIB:.1f} MiB")
    wheels = [slimmed, *(pick(dl, s) for s in KIT_WHEELS)]
    for old in os.listdir(out):  # parts of an earlier kit would otherwise stay beside the new ones
        if old.startswith(ARCHIVE + ".") or old in (MANIFEST, "KIT.md"):
            os.remove(os.path.join(out, old))
    archive = os.path.join(cache, ARCHIVE)
    write_tar(wheels, archive)
    removed = [{"path": p, "why": why, "unpacked_bytes": sum(b for d, b in dropped.items() if removed_reason(d) == why
                                                             and (d == p or d.startswith(p)))}
               for p, why in SLIM_REMOVED]
    manifest = {"vllm": VLLM, "python": "3.12", "platforms": PLATFORMS, "archive": ARCHIVE,
                "bytes": os.path.getsize(archive), "sha256": sha256(archive), "part_bytes": size,
                "working_tree_bytes": tree, "parts": split(archive, out, size),
                "wheels": [{"file": os.path.basename(w), "bytes": os.path.getsize(w), "sha256": sha256(w),
                            "compiled": not w.endswith("-none-any.whl")} for w in sorted(wheels, key=os.path.basename)],
                "removed": removed, "left_out": LEFT_OUT}
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    with open(os.path.join(out, "KIT.md"), "w") as f:
        f.write(kit_md(manifest))
    os.remove(archive)
    say(f"{len(wheels)} wheels, {manifest['bytes'] / MIB:.1f} MiB in {len(manifest['parts'])} part(s) of at most "
        f"{size / MIB:.0f} MiB (working tree {tree / MIB:.1f} MiB) -> {out}")
    for p in manifest["parts"]:
        say(f"  {p['name']}  {p['bytes'] / MIB:6.2f} MiB  {p['sha256'][:16]}")
    return manifest


def load_manifest(kit: str) -> dict:
    path = os.path.join(kit, MANIFEST)
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no manifest (build the kit with: python -m tools.gpu.vllm_kit build)")
    with open(path) as f:
        return json.load(f)


def verify(kit: str) -> dict:
    """Every part of the manifest present with its size and sha256; a clear error naming the first that is not."""
    manifest = load_manifest(kit)
    whole = hashlib.sha256()
    for p in manifest["parts"]:
        path = os.path.join(kit, p["name"])
        if not os.path.exists(path):
            raise SystemExit(f"{path}: missing (ferry it: docs/gpu.md, 'vLLM kit and ferry')")
        data = open(path, "rb").read()
        if len(data) != p["bytes"] or hashlib.sha256(data).hexdigest() != p["sha256"]:
            raise SystemExit(f"{path}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}...; the "
                             f"manifest says {p['bytes']} bytes, {p['sha256'][:16]}... (a broken or stale part)")
        whole.update(data)
    if whole.hexdigest() != manifest["sha256"]:
        raise SystemExit(f"the parts join to sha256 {whole.hexdigest()}, not the manifest's {manifest['sha256']}")
    return manifest


def unpack(kit: str, dest: str) -> list:
    """Verify the parts, join them and extract the wheels into ``dest``, each checked against its own hash."""
    manifest = verify(kit)
    os.makedirs(dest, exist_ok=True)
    joined = b"".join(open(os.path.join(kit, p["name"]), "rb").read() for p in manifest["parts"])
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        names = tar.getnames()
        if any(os.path.basename(n) != n or not n.endswith(".whl") for n in names):
            raise SystemExit(f"{ARCHIVE}: unexpected members {names}")
        tar.extractall(dest, filter="data")
    paths = []
    for w in manifest["wheels"]:
        path = os.path.join(dest, w["file"])
        if sha256(path) != w["sha256"]:
            raise SystemExit(f"{path}: sha256 differs from the manifest's")
        paths.append(path)
    return paths


def runs_on(filename: str, python: str) -> bool:
    """Whether a wheel's tags let CPython ``python`` (``3.11``) import it: pure, abi3 from an older CPython, or its
    own version's build."""
    py_tags, abi = os.path.basename(filename).split("-")[-3:-1]
    want = int(python.replace(".", "")[1:])  # 3.11 -> 11
    if abi == "none":
        return True
    minors = [int(t[3:]) for t in py_tags.split(".") if t.startswith("cp3")]
    return any(m <= want for m in minors) if abi == "abi3" else want in minors


def for_python(wheels: list, python: str, dest: str) -> list:
    """The kit's wheels for another CPython: each that cannot run there replaced by the same version's build for it
    (downloaded into ``dest``). The preflight's venv is Python 3.11; the kit itself is for the image's 3.12."""
    keep = [w for w in wheels if runs_on(w, python)]
    swap = [w for w in wheels if not runs_on(w, python)]
    specs = [f"{wheel_name(w)}=={os.path.basename(w).split('-')[1]}" for w in swap]
    if specs:
        os.makedirs(dest, exist_ok=True)
        pip_download(specs, dest, python)
    return keep + [pick(dest, s) for s in specs]


def resolve() -> int:
    """Re-run pip's resolver for RESOLVE_ROOTS beside IMAGE_PINS (Python 3.12, binaries only, metadata only) and
    print the KIT_WHEELS it implies: everything resolved that the image does not hold."""
    import tempfile

    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    with tempfile.TemporaryDirectory() as tmp:
        cons, report = os.path.join(tmp, "c.txt"), os.path.join(tmp, "r.json")
        with open(cons, "w") as f:
            f.write("\n".join(IMAGE_PINS) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", report,
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *plats,
               "--target", os.path.join(tmp, "t"), "-c", cons, *RESOLVE_ROOTS]
        proc = subprocess.run(cmd, env={**os.environ, "PIP_CONSTRAINT": ""}, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        got = json.load(open(report))["install"]
    pins = sorted(f"{re.sub(r'[-_.]+', '-', i['metadata']['name']).lower()}=={i['metadata']['version']}"
                  for i in got)
    print(json.dumps([p for p in pins if p.split("==")[0] not in IMAGE_HAS], indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, slim, pack and split (needs the package index)")
    b.add_argument("--out", default=os.path.join(ROOT, ".whl", "vllm_kit"))
    b.add_argument("--part-mib", default="auto", help=f"MiB per part, at most {MAX_PART_MIB}, or auto")
    v = sub.add_parser("verify", help="check every part against the manifest")
    v.add_argument("kit")
    u = sub.add_parser("unpack", help="verify, join the parts and extract the wheels into DEST")
    u.add_argument("kit")
    u.add_argument("dest")
    sub.add_parser("resolve", help="re-resolve the kit's requirements (prints KIT_WHEELS)")
    a = p.parse_args(argv)
    if a.cmd == "build":
        build(a.out, a.part_mib)
    elif a.cmd == "verify":
        m = verify(a.kit)
        say(f"{len(m['parts'])} part(s), {m['bytes'] / MIB:.1f} MiB: every sha256 matches the manifest")
    elif a.cmd == "unpack":
        say(f"{len(unpack(a.kit, a.dest))} wheels checked into {a.dest}")
    else:
        return resolve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
