"""Build-time decisions shared by setup.py and the tests (stdlib only: setup.py loads this file by path)."""
from __future__ import annotations

import glob
import os
import shutil
from typing import Mapping, Optional

ENV_FLAG = "FASTCREDIT_BUILD_CUDA"
# Ampere, Hopper (H100 / H200), Blackwell, and PTX for what comes after; override with TORCH_CUDA_ARCH_LIST.
CUDA_ARCHS = "8.0;9.0;10.0+PTX"
# Our flags; torch's BuildExtension adds its own (the C++ standard, -fPIC, COMMON_NVCC_FLAGS, the -gencode list).
CXX_FLAGS = ["-O3"]
NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]


def want_cuda_extension(root: str, env: Mapping[str, str] = os.environ,
                        torch_cuda: Optional[str] = "probe") -> tuple[bool, str]:
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


def runtime_library_dirs(torch_dir: str, torch_cuda: str, cuda_home: Optional[str]) -> list[str]:
    """The folders ``fastcredit._C`` must search at load time: torch's ``lib/`` and the CUDA runtime torch uses.

    NOTE: a CUDAExtension links libc10, libtorch*, libc10_cuda and libcudart with no rpath (torch's
    cpp_extension adds one only to JIT-built standalone executables), so ``import fastcredit._C`` in a fresh
    process failed with "libc10.so: cannot open shared object file" unless torch was imported first. The
    extension's own rpath is what glibc searches for its direct dependencies, libcudart among them, so torch's
    ``lib/`` alone is not enough: PyPI's torch takes libcudart from a pip ``nvidia-*`` package
    (``site-packages/nvidia/cu13/lib`` for CUDA 13, ``nvidia/cuda_runtime/lib`` for CUDA 12), and without that
    folder the loader finds the toolkit's copy through ld.so.cache (a second, different libcudart) or nothing.
    A torch without such a package (conda, a source build) uses the toolkit's runtime: then ``cuda_home``'s.
    """
    torch_lib = os.path.join(torch_dir, "lib")
    soname = f"libcudart.so.{torch_cuda.split('.')[0]}"
    if os.path.exists(os.path.join(torch_lib, soname)):
        return [torch_lib]
    site_packages = os.path.dirname(torch_dir)
    pip_runtime = sorted(glob.glob(os.path.join(site_packages, "nvidia", "*", "lib", soname)))
    if pip_runtime:
        return [torch_lib, os.path.dirname(pip_runtime[0])]
    for sub in ("lib64", "lib"):
        if cuda_home and os.path.exists(os.path.join(cuda_home, sub, soname)):
            return [torch_lib, os.path.join(cuda_home, sub)]
    return [torch_lib]


def extension_kwargs(root: str, torch_dir: str, torch_cuda: str, cuda_home: Optional[str]) -> dict:
    """The keyword arguments of setup.py's ``CUDAExtension("fastcredit._C", ...)``."""
    sources = sorted(glob.glob(os.path.join(root, "csrc", "*.cpp")) + glob.glob(os.path.join(root, "csrc", "*.cu")))
    rpath = runtime_library_dirs(torch_dir, torch_cuda, cuda_home)
    return {
        "name": "fastcredit._C",
        "sources": [os.path.relpath(s, root) for s in sources],
        "extra_compile_args": {"cxx": list(CXX_FLAGS), "nvcc": list(NVCC_FLAGS)},
        "runtime_library_dirs": rpath,
        # DT_RPATH, the kind torch's own libraries carry: the loader searches it before LD_LIBRARY_PATH, so the
        # extension resolves libcudart to torch's file whether it is imported before or after torch. A RUNPATH
        # (the default of Debian's linker) would let a toolkit folder on LD_LIBRARY_PATH win.
        "extra_link_args": ["-Wl,--disable-new-dtags"],
    }
