"""Test-wide setup. TRITON_INTERPRET must be set before any kernel module is imported."""
import os
import shutil
import subprocess

def _has_gpu() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


if not _has_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Process groups follow NCCL's device rules (fastcredit.distributed.process_group): every torchrun test builds its
# group as on GPUs, gloo standing in for NCCL on the cuda device type only. Plain gloo keeps its own tests.
os.environ.setdefault("FASTCREDIT_EMULATE_NCCL", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core: each worker (and every subprocess it starts) gets one
    # intra-op thread, so two workers never oversubscribe two cores with spinning OpenMP threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
