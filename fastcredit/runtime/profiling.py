"""NVTX ranges and phase timers: one ``with phase("rollout"):`` gives both.

    with timer.phase("rollout"):          # an NVTX range "rollout" + seconds in timer.seconds
        ...
    python -m fastcredit.train --profile  # + cudaProfilerStart/Stop around the profiled steps, and a torch trace

Ranges come from the ``nvtx`` package (a no-op without a GPU or outside ``nsys``;
``torch.cuda.nvtx`` raises on a CPU build of torch). On a GPU a phase synchronises the
device before reading the clock, so its seconds are the GPU's too, not just the launches.
``nsys profile --capture-range=cudaProfilerApi python -m fastcredit.train --profile``
records only the steps between :func:`profiler_start` and :func:`profiler_stop`. While
:func:`record_phases` is on (``--profile``'s torch.profiler session, ``fastcredit.runtime.torch_profile``) every
range is also a ``record_function`` range named ``fastcredit:<name>``, so the phases show in that trace.
"""
from __future__ import annotations

import contextlib
import platform
import re
import time
from collections import defaultdict
from typing import Iterator, Optional

import torch

try:
    import nvtx as _nvtx
except ImportError:  # the package is in every extra; keep the trainer importable without it
    _nvtx = None

_DOMAIN = "fastcredit"
_recording = False  # record_function ranges too: on while --profile's torch.profiler records


def record_phases(on: bool) -> None:
    """Make every :func:`nvtx_range` a torch.profiler ``record_function`` range ``fastcredit:<name>`` too (``on``),
    or stop; off outside a profile, where a record_function would cost an op record per range for nothing."""
    global _recording
    _recording = on


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX push/pop range named ``name`` in the ``fastcredit`` domain (no-op without nvtx), and a
    ``record_function`` range ``fastcredit:<name>`` while :func:`record_phases` is on."""
    with contextlib.ExitStack() as ranges:
        if _nvtx is not None:
            ranges.enter_context(_nvtx.annotate(name, domain=_DOMAIN))
        if _recording:
            ranges.enter_context(torch.profiler.record_function(f"{_DOMAIN}:{name}"))
        yield


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseTimer:
    """Seconds per phase within one step (``seconds``), NVTX-annotated; ``reset()`` between steps."""

    def __init__(self, sync_cuda: bool = True):
        self.sync_cuda = sync_cuda
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with nvtx_range(name):
            if self.sync_cuda:
                _sync()
            t0 = time.perf_counter()
            try:
                yield
            finally:
                if self.sync_cuda:
                    _sync()
                self.seconds[name] += time.perf_counter() - t0

    def reset(self) -> dict[str, float]:
        """The seconds recorded since the last reset (and start afresh)."""
        out = dict(self.seconds)
        self.seconds = defaultdict(float)
        return out


def profiler_start() -> None:
    """Open the ``nsys --capture-range=cudaProfilerApi`` window (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaProfilerStart()


def profiler_stop() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def device_name(device: str = "cpu", threads: Optional[int] = None) -> str:
    """The GPU's name for ``cuda``; else the CPU model (from /proc/cpuinfo where there is one) and ``threads`` (default:
    torch's threads in this process)."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
            model = found.group(1).strip() if found else model
    except OSError:
        pass
    return f"{model} ({threads or torch.get_num_threads()} threads)"


def device_slug(name: str) -> str:
    """``name`` as a file-name part: runs of other characters become one underscore."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
