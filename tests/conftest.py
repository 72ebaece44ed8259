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

from tests import background  # noqa: E402

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")


# The files that take longest on a 2-core CI run, longest first (per-file sums of `--durations` times; the figures
# of 2026-11-28, at e48b274, in seconds beside them). `make test` hands whole files to its two workers in this order
# (xdist's --no-loadscope-reorder: its default reorders files by their number of tests), longest first, so that no
# long file starts last while the other worker sits idle: the two workers end within a file of each other. Order
# only: a file missing here runs after these, in its usual place.
LONGEST_FIRST = (
    "tests/test_train.py",                            # 187
    "tests/test_split_train.py",                      # 134
    "tests/test_peer_trl.py",                         # 115
    "tests/test_compare.py",                          # 99
    "tests/test_gpu_check.py",                        # 89
    "tests/prm/test_prm_train.py",                    # 76
    "tests/test_eval.py",                             # 49
    "tests/retrieval/test_server_soak.py",            # 42
    "tests/distributed/test_fsdp_update.py",          # 34
    "tests/distributed/test_deepspeed_update.py",     # 34
    "tests/test_bench_step.py",                       # 33
    "tests/test_export.py",                           # 30
    "tests/retrieval/test_cross_rank.py",             # 30
    "tests/distributed/test_multinode.py",            # 24
    "tests/distributed/test_weight_stream.py",        # 19
    "tests/trainer/test_sft.py",                      # 16
    "tests/kernels/test_linear_logprob_variants.py",  # 16
    "tests/runtime/test_torch_profile.py",            # 14
    "tests/distributed/test_gpu_rules.py",            # 13
    "tests/kernels/test_aot_compile.py",              # 13
    "tests/kernels/test_turn_surrogate.py",           # 13
    "tests/kernels/test_turn_surrogate_variants.py",  # 12
    "tests/rollout/test_vllm_engine.py",              # 11
    "tests/test_layout.py",                           # 11
    "tests/credit/test_vectorised_vs_reference.py",   # 11
    "tests/kernels/test_linear_logprob.py",           # 11
    "tests/retrieval/test_csrc_compiles.py",          # 10
)


# Files that wait on a background job (tests/background.py) go last: by then the job is done and the wait is none.
LAST = ("tests/test_install.py",)


def _longest_first(items) -> None:
    rank = {path: k for k, path in enumerate(LONGEST_FIRST)}
    rank.update({path: len(LONGEST_FIRST) + 1 + k for k, path in enumerate(LAST)})

    def key(item):
        path = os.path.relpath(str(item.path), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return rank.get(path, len(LONGEST_FIRST))

    items.sort(key=key)  # stable: every file keeps its own order, the others their collection order


def pytest_configure(config):
    background.configure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller tells each worker where the background jobs (tests/background.py) write."""
    node.workerinput[background.KEY] = background.folder(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    background.start_for(node.config, ids)


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):  # pytest without workers: it collects and runs the tests itself
        background.start_for(session.config, [item.nodeid for item in session.items])


def pytest_unconfigure(config):
    background.finish(config)


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
