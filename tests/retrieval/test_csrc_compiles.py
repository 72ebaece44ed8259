"""Every csrc/*.cu compiles with nvcc (compile only: CI has nvcc but no GPU and a CPU torch),
and every csrc/*.cpp passes a syntax check against torch's headers, with the flags of the real build:
the C++ standard torch's BuildExtension passes, torch's COMMON_NVCC_FLAGS, our flags, and a -gencode
for every arch of ``fastcredit._build.CUDA_ARCHS`` as torch turns TORCH_CUDA_ARCH_LIST into flags.

The CPU torch ships the c10/cuda headers but not the CMake-generated
``c10/cuda/impl/cuda_cmake_macros.h``; a two-line stub stands in for it (the CPU build of torch lacks it).
The sources avoid ``ATen/cuda/CUDAContext.h``, so no cuBLAS / cuSPARSE / cuSOLVER headers
are needed.
"""
import concurrent.futures
import glob
import inspect
import os
import re
import shutil
import subprocess
import sysconfig

import pytest

from fastcredit._build import CUDA_ARCHS, CXX_FLAGS, NVCC_FLAGS

CSRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "csrc"))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
SETUP_HINT = "the CPU and CI setup includes them (Debian: g++ and the CUDA toolkit's nvcc)"


def _nvcc():
    return shutil.which("nvcc") or (os.path.join(CUDA_HOME, "bin", "nvcc")
                                    if os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")) else None)


@pytest.fixture(scope="module")
def include_flags(tmp_path_factory):
    from torch.utils.cpp_extension import include_paths

    stub = tmp_path_factory.mktemp("stub")
    (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
    macros = stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [f"-I{stub}", f"-I{CSRC}"] + [f"-I{p}" for p in include_paths()]


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return cmd, proc


def _torch_cxx_standard():
    """The -std that torch's BuildExtension gives g++ and nvcc when an extension names none (ours names none)."""
    from torch.utils.cpp_extension import BuildExtension

    found = sorted(set(re.findall(r"c\+\+\d\d", inspect.getsource(BuildExtension.build_extensions))))
    assert len(found) == 1, f"torch's BuildExtension names {found}: which one the build uses needs a new look"
    return f"-std={found[0]}"


def _torch_gencode_flags(monkeypatch):
    """setup.py's TORCH_CUDA_ARCH_LIST default, turned into -gencode flags by the function the real build calls."""
    from torch.utils.cpp_extension import _get_cuda_arch_flags  # private, but it is what BuildExtension runs

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", CUDA_ARCHS)
    flags = _get_cuda_arch_flags()
    for arch in CUDA_ARCHS.split(";"):
        sm = arch.removesuffix("+PTX").replace(".", "")
        assert f"-gencode=arch=compute_{sm},code=sm_{sm}" in flags, (arch, flags)
        if arch.endswith("+PTX"):
            assert f"-gencode=arch=compute_{sm},code=compute_{sm}" in flags, (arch, flags)
    return flags


def test_every_cu_compiles_with_nvcc(include_flags, tmp_path, monkeypatch):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    nvcc = _nvcc()
    if nvcc is None:
        pytest.fail(f"nvcc is not on PATH or in CUDA_HOME: it compiles csrc/*.cu here; {SETUP_HINT}")
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
    assert sources, "csrc/ has no .cu files"
    flags = [*COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", *NVCC_FLAGS, *_torch_gencode_flags(monkeypatch),
             _torch_cxx_standard()]
    cmds = [[nvcc, "-c", *flags, *include_flags, src, "-o", str(tmp_path / (os.path.basename(src) + ".o"))]
            for src in sources]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for cmd, proc in pool.map(_run, cmds):
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"


def test_every_cpp_passes_syntax_check(include_flags):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail(f"no C++ compiler (g++ / c++) on PATH; {SETUP_HINT}")
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    assert sources, "csrc/ has no .cpp files"
    cuda_inc = os.path.join(CUDA_HOME, "include")
    if not os.path.exists(os.path.join(cuda_inc, "cuda_runtime.h")):
        pytest.fail(f"{cuda_inc} has no cuda_runtime.h (set CUDA_HOME to the CUDA toolkit); {SETUP_HINT}")
    py_inc = sysconfig.get_paths()["include"]
    std = _torch_cxx_standard()
    cmds = [[cxx, "-fsyntax-only", std, *CXX_FLAGS, *include_flags, f"-I{cuda_inc}", f"-I{py_inc}", src]
            for src in sources]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for cmd, proc in pool.map(_run, cmds):
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
