"""Compile Triton kernels for a GPU that is not there: run the real host code, compile every launch, launch nothing.

    with compile_only(arch=90) as launches:                 # sm_90 (H100); 80 (A100), 100 (B200) likewise
        linear_logprob_fwd(hidden_NH, weight_VH, ...)      # host tensors on "meta" (or untouched CPU memory)
    for launch in launches:
        print(launch.name, launch.constexprs, resource_usage(launch.kernel))

Inside the block Triton's active driver reports ``GPUTarget("cuda", arch, 32)`` (device 0,
stream 0) and ``JITFunction.run`` compiles with ``warmup=True`` and records the launch
instead of running it. The JIT's own binder specialises the arguments, so a kernel is
compiled exactly as a real launch of the same host call would compile it: tile sizes,
warps and stages are the host code's choices, and pointers and integers get the same
16-byte alignment / divisibility-by-16 attributes (which change the generated code). The
host tensors' ``data_ptr()`` must then be aligned as a CUDA allocation is: a meta tensor's
is its byte offset from 0, a CPU tensor's is 64-byte aligned, both like a CUDA tensor's.

Needs a process where ``TRITON_INTERPRET`` is unset or 0: under the interpreter
``@triton.jit`` makes interpreter functions, which cannot be compiled. Registers, spills and
shared memory come from the bundled ``ptxas`` (the same command Triton runs, with ``-v``)
and ``cuobjdump --dump-resource-usage`` on the cubin Triton produced.

NOTE: this leans on Triton 3.x internals (``JITFunction.run(..., warmup=True)``, its
per-device ``device_caches``, ``CompiledKernel.src``, ``CUDABackend.make_cubin``);
``tests/kernels/test_aot_compile.py`` fails when a Triton upgrade moves them.
"""
from __future__ import annotations

import collections
import contextlib
import io
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# Per-block shared memory limits (dynamic + static, bytes): sm_80 163 KB; sm_90 and sm_100 227 KB.
SMEM_PER_BLOCK = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}
# Shared memory per SM, registers per SM and the most warps / blocks an SM holds.
SMEM_PER_SM = {80: 167_936, 86: 102_400, 89: 102_400, 90: 233_472, 100: 233_472, 120: 102_400}
REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM, SMEM_RESERVED_PER_BLOCK = 65_536, 64, 32, 1024
_BINDERS: dict = {}  # (JITFunction, arch) -> the device_caches the JIT builds for that target


@dataclass
class Launch:
    """One launch the host code asked for, compiled for ``arch`` and not run."""

    name: str  # the kernel function's name
    module: str
    arch: int
    grid: tuple
    constexprs: dict  # name -> value of every tl.constexpr parameter
    signature: dict  # name -> Triton type, with ":16" where the JIT specialised it as divisible by 16
    num_warps: int
    num_stages: int
    kernel: object  # triton.compiler.CompiledKernel: .asm["ptx"], .asm["cubin"], .metadata
    compile_s: float  # wall time of this launch's compile (0.0 when the JIT's in-memory cache had it)


class CompileFailed(RuntimeError):
    """A launch that did not compile: names the kernel, the target and the launch's constexprs and options."""

    def __init__(self, name: str, arch: int, kwargs: dict, exc: BaseException):
        self.kernel, self.arch, self.config = name, arch, dict(kwargs)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        why = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # where, then the cause
        super().__init__(f"{name} for sm_{arch} with {self.config}: {type(exc).__name__}: {why}")


@dataclass
class _Recorder:
    arch: int
    launches: list = field(default_factory=list)


class _CompileOnlyDriver:
    """The part of Triton's driver interface that ``JITFunction.run`` asks: target, device and stream."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Optional[int] = None) -> int:
        return 0


def _signature(src) -> dict:
    """The specialisation the JIT chose: the types, and ``:16`` where an argument was specialised divisible by 16."""
    names = list(src.signature)
    out = {}
    for i, name in enumerate(names):
        ty = src.signature[name]
        attrs = src.attrs.get((i,), [])
        out[name] = ty + (":16" if ["tt.divisibility", 16] in [list(a) for a in attrs] else "")
    return out


def _recording_run(recorder: _Recorder):
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        saved = self.device_caches
        key = (self, recorder.arch)
        if key not in _BINDERS:  # the binder and kernel cache the JIT builds for this target
            _BINDERS[key] = collections.defaultdict(self.create_binder)
        self.device_caches = _BINDERS[key]
        try:
            start = time.perf_counter()
            n_cached = len(self.device_caches[0][0])  # [device 0][0]: the JIT's compiled-kernel cache
            kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
            fresh = len(self.device_caches[0][0]) > n_cached
        except Exception as exc:
            raise CompileFailed(self.fn.__name__, recorder.arch, kwargs, exc) from exc
        finally:
            self.device_caches = saved
        md = kernel.metadata
        constexprs = {self.arg_names[path[0]]: value for path, value in kernel.src.constants.items()
                      if self.arg_names[path[0]] in {p.name for p in self.params if p.is_constexpr}}
        recorder.launches.append(Launch(
            name=self.fn.__name__, module=self.module, arch=recorder.arch, grid=tuple(grid) if not callable(grid)
            else ("callable",), constexprs=constexprs, signature=_signature(kernel.src), num_warps=md.num_warps,
            num_stages=md.num_stages, kernel=kernel, compile_s=time.perf_counter() - start if fresh else 0.0))
        return kernel

    return original, run


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list]:
    """Inside: every Triton launch compiles for ``sm_<arch>`` and is appended to the yielded list, not run."""
    if knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET=1: kernels are interpreter functions and cannot be compiled; "
                           "run the ahead-of-time compile in a process with TRITON_INTERPRET unset or 0")
    recorder = _Recorder(arch)
    original, run = _recording_run(recorder)
    # NOTE: DriverConfig.reset_active() would build the real driver, which raises on a machine without a GPU;
    # the previous active driver (None until first use) is put back as it was.
    previous = driver._active
    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = run
    try:
        yield recorder.launches
    finally:
        JITFunction.run = original
        driver._active = previous


def _ptxas_log(kernel) -> str:
    """``ptxas -v`` on the kernel's PTX with the command Triton itself runs (its flags, its bundled ptxas)."""
    md = kernel.metadata
    backend = make_backend(md.target)
    out = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True  # make_cubin then prints ptxas's log
    try:
        with contextlib.redirect_stdout(out):
            backend.make_cubin(kernel.asm["ptx"], {}, md, md.target.arch)
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    return out.getvalue()


def _cuobjdump_usage(cubin: bytes) -> dict:
    """``REG``, ``STACK``, ``SHARED`` (static), ``LOCAL`` of the cubin's one function."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def tensor_cores(ptx: str) -> str:
    """Which tensor-core instructions the PTX uses: ``tcgen05``, ``wgmma``, ``mma``, or ``none``."""
    for name, pattern in (("tcgen05", r"\btcgen05\.mma"), ("wgmma", r"\bwgmma\.mma_async"), ("mma", r"\bmma\.sync")):
        if re.search(pattern, ptx):
            return name
    return "none"


def occupancy(arch: int, num_warps: int, registers: int, smem_bytes: int) -> int:
    """Blocks of this kernel one SM can hold (registers are allocated per warp in units of 256)."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * num_warps)
    by_smem = SMEM_PER_SM.get(arch, SMEM_PER_SM[90]) // (smem_bytes + SMEM_RESERVED_PER_BLOCK)
    return max(0, min(by_regs, by_smem, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM))


def resource_usage(kernel) -> dict:
    """Registers, spills, stack and shared memory of a compiled kernel, and its tensor-core instructions."""
    log = _ptxas_log(kernel)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if not (spills and regs):
        raise RuntimeError(f"cannot read ptxas -v output for {kernel.name}:\n{log}")
    usage = _cuobjdump_usage(kernel.asm["cubin"])
    md = kernel.metadata
    out = {"registers": usage.get("REG", int(regs.group(1))), "ptxas_registers": int(regs.group(1)),
           "stack_bytes": usage.get("STACK", int(spills.group(1))), "spill_store_bytes": int(spills.group(2)),
           "spill_load_bytes": int(spills.group(3)), "local_bytes": usage.get("LOCAL", 0),
           "smem_dynamic_bytes": int(md.shared), "smem_static_bytes": usage.get("SHARED", 0),
           "tensor_cores": tensor_cores(kernel.asm["ptx"])}
    out["smem_bytes"] = out["smem_dynamic_bytes"] + out["smem_static_bytes"]
    arch = md.target.arch
    out["smem_limit_bytes"] = SMEM_PER_BLOCK.get(arch, SMEM_PER_BLOCK[90])
    out["blocks_per_sm"] = occupancy(arch, md.num_warps, out["registers"], out["smem_bytes"])
    return out


def limit_problems(usage: dict, arch: int, spills_fail: bool = True) -> tuple[list, list]:
    """``(failures, warnings)`` of a :func:`resource_usage`: shared memory above the arch's per-block limit
    fails; a register spill fails, or only warns where ``spills_fail`` is False."""
    failures, warnings = [], []
    if usage["smem_bytes"] > usage["smem_limit_bytes"]:
        failures.append(f"shared memory {usage['smem_bytes']} B > sm_{arch} limit {usage['smem_limit_bytes']} B")
    if usage["spill_store_bytes"] or usage["spill_load_bytes"]:
        spill = f"spills {usage['spill_store_bytes']} B stored / {usage['spill_load_bytes']} B loaded"
        (failures if spills_fail else warnings).append(spill)
    return failures, warnings
