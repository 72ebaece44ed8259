"""Where the rollout's torch work runs: one OpenMP thread team per process on a CPU.

    pool = rollout_executor(device, "engine")   # a CPU device: the caller's own thread; a GPU: one bound thread
    ...
    pool.shutdown(wait=True)                     # a worker thread ends with the rollout, and its team with it

Torch's CPU build parallelises ops with OpenMP (GNU libgomp). Every host thread that runs a parallel op gets a
team of its own (itself plus ``torch.get_num_threads() - 1`` workers), kept while that thread lives. When the
process holds more team threads than it has cores, libgomp stops spinning between parallel regions and parks
its workers on a futex instead, so every op of every team pays a wake-up; the main thread's training ops slow
down as much as the rollout's. Measured on a 2-core machine (2 torch threads, a matmul and a log-softmax of
[256, 128] x [128, 6000], 300 times on the main thread): 0.86 s alone, 6.3 s while a thread-pool worker that
ran one torch op is alive, 0.86 s again once it has ended; with ``OMP_WAIT_POLICY=ACTIVE`` (always spin: every
phase pays in CPU time) the living worker costs nothing, which is the throttled spin and nothing else.

So the asynchronous rollout keeps its torch work on the thread whose team training uses: on a CPU device the
engine's batches and the in-process retriever's searches run on the event loop's own thread (the caller's,
:class:`CallerExecutor`), and a worker thread that a GPU rollout needs (to keep launching kernels while the loop
serves other trajectories) is shut down at the end of the rollout, taking its team with it.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Optional

import torch

from fastcredit.runtime.devices import Device, device_executor


class CallerExecutor(concurrent.futures.Executor):
    """An executor that runs each call at once in the thread that submits it (``loop.run_in_executor`` then runs
    the batch on the event loop's thread: the loop waits while it runs, as a lockstep rollout's caller does)."""

    def __init__(self):
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if self._shutdown:
            raise RuntimeError("cannot schedule new calls after shutdown")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as e:  # the caller's future carries it, as a pool's would (Ctrl-C propagates at once)
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True


def runs_on_cpu(device: Device) -> bool:
    """Whether torch work for ``device`` runs on the host's cores (a CPU device; None in a process without CUDA)."""
    if device is None:
        return not torch.cuda.is_available()
    return torch.device(device).type == "cpu"


def rollout_executor(device: Device, name: str) -> concurrent.futures.Executor:
    """Where a rollout's batches for ``device`` run: the submitting thread on a CPU (one thread team per process),
    else one worker thread bound to the device (shut it down, waiting, when the rollout ends)."""
    if runs_on_cpu(device):
        return CallerExecutor()
    return device_executor(device, name)


def process_threads() -> Optional[list[str]]:
    """The names of this process's live OS threads (OpenMP workers included), None where /proc is not there."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            continue
    return names


def python_threads() -> list[str]:
    """The names of this interpreter's live threads (the main thread included)."""
    return [t.name for t in threading.enumerate()]
