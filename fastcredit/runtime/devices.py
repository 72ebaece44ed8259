"""The rank's CUDA device in every thread that touches CUDA, and side streams for background work.

    bind_thread(device)                              # first thing in a thread's target
    pool = device_executor(device, "retrieval")      # a ThreadPoolExecutor whose threads are bound
    await asyncio.to_thread(on_device(device, fn), *args)
    with side_stream(device) as stream: ...          # work that must not queue behind the default stream

CUDA's current device is per host thread and a new thread starts on device 0. A torchrun
rank sets its own device in the main thread (``process_group.init_distributed``); any
other thread that launches kernels or allocates (vLLM's step driver, the retrieval
batcher and round thread, the engine executor, ``asyncio.to_thread`` calls) would otherwise
launch in GPU 0's context on GPU k's memory. On a CPU device every helper here is a no-op.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from typing import Callable, Iterator, Optional, Union

import torch

Device = Union[str, torch.device, None]


def _cuda(device: Device) -> Optional[torch.device]:
    """``device`` as a CUDA device with its index, None for a CPU device or None. A bare ``cuda`` (no index, which
    ``torch.cuda.set_device`` refuses) is the calling thread's current device: resolve it in the thread that
    chose it, as the helpers below do when they are made, not in the new thread (which starts on device 0)."""
    if device is None:
        return None
    d = torch.device(device)
    if d.type != "cuda":
        return None
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def bind_thread(device: Device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for a CPU device or None)."""
    d = _cuda(device)
    if d is not None:
        torch.cuda.set_device(d)


def current_device() -> Optional[torch.device]:
    """The calling thread's current CUDA device, None without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def device_executor(device: Device, name: str, workers: int = 1) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads start bound to ``device`` (e.g. :func:`current_device` of its creator)."""
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=bind_thread,
                                                 initargs=(_cuda(device),))


def on_device(device: Device, fn: Callable) -> Callable:
    """``fn`` wrapped to bind its thread to ``device`` first (for ``asyncio.to_thread`` and other pools)."""
    device = _cuda(device)
    if device is None:
        return fn

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        bind_thread(device)
        return fn(*args, **kwargs)

    return bound


@contextlib.contextmanager
def side_stream(device: Device) -> Iterator[Optional["torch.cuda.Stream"]]:
    """A stream of its own on ``device`` for the block (None and no change on a CPU device).

    Work queued inside does not serialise with the default stream (vLLM's decode, the
    trainer's kernels). The caller hands results across with :func:`hand_over`.
    """
    d = _cuda(device)
    if d is None:
        yield None
        return
    stream = torch.cuda.Stream(device=d)
    with torch.cuda.stream(stream):
        yield stream


def record(device: Device) -> Optional["torch.cuda.Event"]:
    """An event recorded on the current stream of ``device`` (None on a CPU device)."""
    d = _cuda(device)
    if d is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(d))
    return event


def hand_over(event: Optional["torch.cuda.Event"], *tensors: torch.Tensor) -> None:
    """Make the current stream wait for ``event`` (recorded on another stream) before it uses ``tensors``,
    and tell the caching allocator they are in use on it (so their memory is not reused under it)."""
    if event is None:
        return
    stream = torch.cuda.current_stream()
    stream.wait_event(event)
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)
