"""Build-time decisions shared by setup.py and the tests (stdlib only: setup.py loads this file by path)."""
from __future__ import annotations

import glob
import os
import shutil
from typing import Mapping, Optional

ENV_FLAG = "FASTCREDIT_BUILD_CUDA"
# Ampere, Hopper (H100 / H200), Blackwell, and PTX for what comes after; override with TORCH_CUDA_ARCH_LIST.
CUDA_ARCHS = "8.0;9.0;10.0+PTX"


def want_cuda_extension(root: str, env: Mapping[str, str] = os.environ, torch_cuda: Optional[str] = "probe") -> tuple[bool, str]:
    """Whether to build ``fastcredit._C``, and why.

    ``FASTCREDIT_BUILD_CUDA=1`` forces it on, ``=0`` off. Unset, it is built only when
    ``csrc/`` has CUDA sources, ``nvcc`` is found, and torch is a CUDA build.
    ``torch_cuda`` is torch.version.cuda, probed unless given (tests pass it).
    """
    forced = env.get(ENV_FLAG, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True, f"{ENV_FLAG}={forced}"
    if forced in ("0", "false", "no", "off"):
        return False, f"{ENV_FLAG}={forced}"
    if forced:
        raise ValueError(f"{ENV_FLAG} must be 1 or 0, got {forced!r}")
    if not glob.glob(os.path.join(root, "csrc", "*.cu")):
        return False, "csrc/ has no .cu sources"
    cuda_home = env.get("CUDA_HOME", "/usr/local/cuda")
    if shutil.which("nvcc") is None and not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return False, "no nvcc on PATH or in CUDA_HOME"
    if torch_cuda == "probe":
        try:
            import torch
        except ImportError:
            return False, "torch is not importable in the build environment (use --no-build-isolation)"
        torch_cuda = torch.version.cuda
    if torch_cuda is None:
        return False, "torch is a CPU build"
    return True, f"nvcc and CUDA {torch_cuda} torch found"


def forced_build_problem(torch_cuda: Optional[str] = "probe") -> Optional[str]:
    """Why a build forced with ``FASTCREDIT_BUILD_CUDA=1`` cannot work here, or None (it can be tried)."""
    if torch_cuda == "probe":
        try:
            import torch
        except ImportError:
            return ("torch is not importable in the build environment: build without isolation, "
                    "pip install --no-build-isolation -e .")
        torch_cuda = torch.version.cuda
    if torch_cuda is None:
        return "the installed torch is a CPU build; the extension needs a CUDA build of torch"
    return None
