"""Dynamic batching for asyncio callers: many concurrent requests, one worker thread.

Used by the retrieval and PRM servers and the agent loop's searches (``fastcredit.retrieval``) and by
the generation engines' async API (``fastcredit.rollout.engines``). Each request is a list
of items (the queries of one ``/retrieve`` call, one agent's search, one generation);
requests are never split. A batch is sent to the worker when it holds
``max_batch`` items or when its oldest request has waited ``timeout_ms``; while the worker
runs, new requests queue and form the next batch, so the worker is never idle while work
waits and a request never waits for more than one batch ahead of it plus the timeout.
The queue is bounded: past ``max_queue`` waiting items :class:`QueueFull` is raised at once.
A server wraps its batch function in :func:`isolate_failures`, so a request whose items make
the function raise fails alone.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
from typing import Callable, Optional, Sequence

from fastcredit.runtime.devices import current_device, device_executor

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The batcher already holds ``max_queue`` waiting items."""


class MicroBatcher:
    """``await batcher.submit(items)`` → ``fn``'s results for those items, in order.

    ``fn(items: list) -> list`` (same length) runs in a single worker thread, one batch at a time; that
    thread is bound to the creating thread's CUDA device (``fn`` may encode queries on the rank's GPU).
    """

    def __init__(self, fn: Callable[[list], Sequence], max_batch: int = 256, timeout_ms: float = 2.0,
                 max_queue: int = 4096, executor: Optional[concurrent.futures.Executor] = None,
                 own_executor: Optional[bool] = None, hold: Optional[Callable[[int], bool]] = None):
        """``executor``: where ``fn`` runs (default: a worker thread of its own); ``own_executor``: :meth:`close`
        shuts it down and waits for its thread to end (default: when the batcher made it). ``hold(queued)``: while
        it is true a batch smaller than ``max_batch`` keeps waiting past the timeout (asked again at every arrival
        and every ``timeout_ms``): work that shares the caller's thread and cores with ``fn`` goes first."""
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_queue ({max_queue}) must be positive")
        self.fn, self.max_batch, self.timeout_s, self.max_queue = fn, max_batch, timeout_ms / 1000.0, max_queue
        self.hold = hold
        self._executor = executor or device_executor(current_device(), "retrieval")
        self._own_executor = executor is None if own_executor is None else own_executor
        self._pending: collections.deque = collections.deque()  # (items, future, arrival time)
        self._queued = 0
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self.batches = 0

    @property
    def queued(self) -> int:
        return self._queued

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for _, fut, _ in self._pending:
            if not fut.done():
                fut.set_exception(RuntimeError("batcher closed"))
        self._pending.clear()
        if self._own_executor:
            # waited for: a worker that ran torch ops keeps an OpenMP team while it lives (fastcredit.runtime.threads)
            self._executor.shutdown(wait=True)

    async def submit(self, items: list) -> list:
        if self._task is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        if self._queued + len(items) > self.max_queue:
            raise QueueFull(f"queue is full ({self._queued} items waiting, limit {self.max_queue})")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((items, fut, loop.time()))
        self._queued += len(items)
        self._wake.set()
        return await fut

    def _drop_cancelled(self) -> None:
        # A request that timed out while queued leaves a cancelled future: never compute it.
        while self._pending and self._pending[0][1].done():
            self._queued -= len(self._pending.popleft()[0])

    def _take(self) -> list:
        batch, size = [], 0
        while self._pending:
            items, fut, _ = self._pending[0]
            if fut.done():
                self._pending.popleft()
                self._queued -= len(items)
                continue
            if batch and size + len(items) > self.max_batch:
                break
            self._pending.popleft()
            self._queued -= len(items)
            batch.append((items, fut))
            size += len(items)
        return batch

    async def _fill(self) -> None:
        """Wait until the oldest request's timeout ends (and :attr:`hold` lets go) or a full batch waits."""
        loop = asyncio.get_running_loop()
        while self._pending:
            self._drop_cancelled()
            if not self._pending or self._queued >= self.max_batch:
                return
            remaining = self._pending[0][2] + self.timeout_s - loop.time()
            if remaining <= 0:
                if self.hold is None or not self.hold(self._queued):
                    return
                remaining = max(self.timeout_s, 1e-3)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                if self.hold is None:
                    return

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            await self._fill()
            batch = self._take()
            if not batch:
                continue
            flat = [it for items, _ in batch for it in items]
            try:
                results = await loop.run_in_executor(self._executor, self.fn, flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(flat)} items")
            except Exception as exc:  # the worker's failure belongs to the batch's requests, not to the loop
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            at = 0
            for items, fut in batch:
                if not fut.done():
                    fut.set_result(list(results[at:at + len(items)]))
                at += len(items)


class ItemFailed:
    """The result of an item whose request could not be computed: ``exc`` says why."""
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def isolate_failures(batch_fn: Callable[[list], list]) -> Callable[[list], list]:
    """Items ``(request id, *args)`` → ``batch_fn([args, …])``'s result per item, or :class:`ItemFailed`.

    When ``batch_fn`` raises on the merged batch, the batch is retried in halves (a request's
    items stay together) until each failure is pinned on the requests that cause it: one bad
    request among n costs about ``2 log2 n`` extra calls, and every other request gets its results.
    """
    def solve(groups: list, out: list) -> None:
        flat = [tuple(it[1:]) for g in groups for it in g]
        try:
            results = batch_fn(flat)
            if len(results) != len(flat):
                raise RuntimeError(f"batch function returned {len(results)} results for {len(flat)} items")
        except Exception as exc:  # a failed batch: find who fails, answer everyone else
            if len(groups) == 1:
                log.error("batch failed for one request (%d items): %s: %s", len(flat), type(exc).__name__, exc,
                          exc_info=exc)
                out.extend([ItemFailed(exc)] * len(flat))
                return
            log.warning("a batch of %d requests failed (%s: %s); retrying in halves", len(groups),
                        type(exc).__name__, exc)
            solve(groups[:len(groups) // 2], out)
            solve(groups[len(groups) // 2:], out)
            return
        out.extend(results)

    def run(items: list) -> list:
        out: list = []
        solve([list(g) for _, g in itertools.groupby(items, key=lambda it: it[0])], out)
        return out
    return run
