"""setup.py's decision to build the CUDA extension, how it links it (the rpath), and the optional-import fallback."""
import json
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
    no_cu = _fake_root(tmp_path, with_cu=False)
    assert want_cuda_extension(no_cu, {}, torch_cuda="13.0") == (False, "csrc/ has no .cu sources")
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


def _fake_torch_site(tmp_path, cudart_dirs=("nvidia/cu13/lib/libcudart.so.13",)):
    """site-packages with torch/lib/ and the given libcudart files (paths relative to it)."""
    site = tmp_path / "site-packages"
    (site / "torch" / "lib").mkdir(parents=True)
    for rel in cudart_dirs:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    return site


def test_the_rpath_names_torch_lib_and_the_cuda_runtime_torch_uses(tmp_path):
    from fastcredit._build import runtime_library_dirs

    site = _fake_torch_site(tmp_path, ["nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12"])
    toolkit = tmp_path / "cuda"
    (toolkit / "lib64").mkdir(parents=True)
    (toolkit / "lib64" / "libcudart.so.13").write_text("")
    torch_dir = str(site / "torch")
    # the pip runtime of torch's CUDA major, not the toolkit's copy (ld.so.cache would find that one anyway)
    assert runtime_library_dirs(torch_dir, "13.0", str(toolkit)) == [f"{torch_dir}/lib", f"{site}/nvidia/cu13/lib"]
    assert runtime_library_dirs(torch_dir, "12.8", None) == [f"{torch_dir}/lib", f"{site}/nvidia/cuda_runtime/lib"]


def test_the_rpath_without_a_pip_cuda_runtime(tmp_path):
    from fastcredit._build import runtime_library_dirs

    site = _fake_torch_site(tmp_path, [])
    torch_dir = str(site / "torch")
    toolkit = tmp_path / "cuda"
    assert runtime_library_dirs(torch_dir, "13.0", str(toolkit)) == [f"{torch_dir}/lib"]
    (toolkit / "lib64").mkdir(parents=True)
    (toolkit / "lib64" / "libcudart.so.13").write_text("")
    assert runtime_library_dirs(torch_dir, "13.0", str(toolkit)) == [f"{torch_dir}/lib", f"{toolkit}/lib64"]
    (site / "torch" / "lib" / "libcudart.so.13").write_text("")  # a torch that carries its own runtime
    assert runtime_library_dirs(torch_dir, "13.0", str(toolkit)) == [f"{torch_dir}/lib"]


FAKE_CPP_EXTENSION = '''
import json
from setuptools import Extension
CUDA_HOME = None
class BuildExtension:
    pass
def CUDAExtension(**kwargs):
    print("CUDAExtension " + json.dumps(kwargs))
    return Extension(kwargs["name"], kwargs["sources"])
'''


def test_setup_links_the_extension_with_an_rpath(tmp_path):
    """setup.py's forced build against a stand-in CUDA torch (a fake module laid out like PyPI's wheel)."""
    site = _fake_torch_site(tmp_path)
    (site / "torch" / "__init__.py").write_text("import types\nversion = types.SimpleNamespace(cuda='13.0')\n")
    (site / "torch" / "utils").mkdir()
    (site / "torch" / "utils" / "__init__.py").write_text("")
    (site / "torch" / "utils" / "cpp_extension.py").write_text(FAKE_CPP_EXTENSION)
    env = dict(os.environ, FASTCREDIT_BUILD_CUDA="1", PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("CUDAExtension "))
    kwargs = json.loads(line.removeprefix("CUDAExtension "))
    assert kwargs["runtime_library_dirs"] == [f"{site}/torch/lib", f"{site}/nvidia/cu13/lib"]
    assert "-Wl,--disable-new-dtags" in kwargs["extra_link_args"]
    assert kwargs["name"] == "fastcredit._C" and "csrc/retrieval_kernels.cu" in kwargs["sources"]


def test_the_preflight_reads_the_makefiles_gpu_lines():
    """tools/gpu/gpu_preflight_build.py runs the Makefile's own build and import lines: a Makefile edit that it can no
    longer find fails here, not on the next GPU machine."""
    from tools.gpu.gpu_preflight_build import makefile_gpu_commands, parse_readelf

    build, imp = makefile_gpu_commands(os.path.join(ROOT, "Makefile"))
    assert build.startswith("FASTCREDIT_BUILD_CUDA=1 $(PY) -m pip install") and build.endswith("-e .")
    assert imp.startswith('$(PY) -c "import fastcredit._C')
    elf = (" 0x0000000000000001 (NEEDED)             Shared library: [libc10.so]\n"
           " 0x0000000000000001 (NEEDED)             Shared library: [libcudart.so.13]\n"
           " 0x000000000000000f (RPATH)              Library rpath: [/v/torch/lib:/v/nvidia/cu13/lib]\n")
    assert parse_readelf(elf) == {"runpath": [], "rpath": ["/v/torch/lib", "/v/nvidia/cu13/lib"],
                                  "needed": ["libc10.so", "libcudart.so.13"]}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTCREDIT_PREFLIGHT") != "1",
                    reason="set FASTCREDIT_PREFLIGHT=1: builds fastcredit._C against a CUDA torch in its own venv "
                           "(about 1.5 min; 3-5 min more and 5.5 GB the first time, to create the venv)")
def test_the_preflight_build_end_to_end(tmp_path):
    """The Makefile's GPU build and import line against PyPI's CUDA torch, on a machine without a GPU."""
    out = subprocess.run([sys.executable, "-m", "tools.gpu.gpu_preflight_build", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600)
    report = json.load(open(tmp_path / "build.json"))
    assert out.returncode == 0 and report["status"] == "passed", out.stdout[-3000:] + report.get("reason", "")
    rpath = report["so"]["rpath"]
    assert rpath[0].endswith("/torch/lib"), rpath
    # one libcudart in the process, the one in torch's pip runtime that the rpath names, not the toolkit's
    assert os.path.dirname(report["probe"]["libcudart_mapped"][0]) in rpath[1:]
    assert report["probe"]["ops"] == ["fastcredit::assemble_observations", "fastcredit::merge_topk"]
    assert report["probe"]["cpu_op_error"].startswith("NotImplementedError: Could not run 'fastcredit::merge_topk'")
