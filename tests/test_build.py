"""setup.py's decision to build the CUDA extension, and the optional-import fallback."""
import os
import subprocess
import sys

import pytest

from fastcredit._build import want_cuda_extension
from fastcredit._ext import cuda_ext, cuda_ext_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_root(tmp_path, with_cu=True):
    (tmp_path / "csrc").mkdir()
    if with_cu:
        (tmp_path / "csrc" / "op.cu").write_text("__global__ void k() {}\n")
    return str(tmp_path)


def test_env_flag_forces_either_way(tmp_path):
    root = _fake_root(tmp_path, with_cu=False)
    assert want_cuda_extension(root, {"FASTCREDIT_BUILD_CUDA": "1"}, torch_cuda=None)[0] is True
    assert want_cuda_extension(root, {"FASTCREDIT_BUILD_CUDA": "0"}, torch_cuda="13.0")[0] is False
    with pytest.raises(ValueError, match="must be 1 or 0, got 'maybe'"):
        want_cuda_extension(root, {"FASTCREDIT_BUILD_CUDA": "maybe"})


def test_auto_needs_sources_nvcc_and_cuda_torch(tmp_path):
    assert want_cuda_extension(_fake_root(tmp_path, with_cu=False), {}, torch_cuda="13.0") == (False, "csrc/ has no .cu sources")
    root = str(tmp_path)
    (tmp_path / "csrc" / "op.cu").write_text("")
    fake_cuda = tmp_path / "cuda" / "bin"
    fake_cuda.mkdir(parents=True)
    (fake_cuda / "nvcc").write_text("")
    env = {"CUDA_HOME": str(tmp_path / "cuda")}
    assert want_cuda_extension(root, env, torch_cuda=None) == (False, "torch is a CPU build")
    assert want_cuda_extension(root, env, torch_cuda="13.0")[0] is True


def test_package_works_without_the_extension():
    ext = cuda_ext()
    assert ext is not None or "torch fallbacks" in cuda_ext_status()


def test_setup_rejects_a_bad_flag():
    env = dict(os.environ, FASTCREDIT_BUILD_CUDA="perhaps")
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "must be 1 or 0" in out.stderr


def test_kernels_install_under_fastcredit_only():
    import fastcredit.kernels  # noqa: F401

    out = subprocess.run([sys.executable, "-c", "import kernels"], cwd="/", capture_output=True, text=True)
    assert out.returncode != 0


def test_a_forced_build_says_why_it_cannot_work():
    from fastcredit._build import forced_build_problem

    assert "CPU build" in forced_build_problem(torch_cuda=None)
    assert forced_build_problem(torch_cuda="13.0") is None


def test_setup_with_a_forced_build_fails_loudly_on_a_cpu_torch():
    """FASTCREDIT_BUILD_CUDA=1 never falls back silently: with a CPU torch setup.py stops and says why."""
    import torch

    env = dict(os.environ, FASTCREDIT_BUILD_CUDA="1")
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True)
    if torch.version.cuda is None:
        assert out.returncode != 0 and "the installed torch is a CPU build" in out.stderr
    else:  # a CUDA torch: the extension is declared, and the arch list includes Hopper
        assert out.returncode == 0 and "TORCH_CUDA_ARCH_LIST=" in out.stdout and "9.0" in out.stdout
