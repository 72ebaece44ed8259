"""Continuous batching over an in-process vLLM ``LLMEngine``: one driver steps the scheduler, many callers wait.

Used by :class:`fastcredit.rollout.engines.vllm.VLLMEngine`; see its module docstring for the engine around it.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

from fastcredit.runtime.devices import bind_thread
from fastcredit.rollout.engines.base import GenOutput, SamplingParams, StepCounters

# settle(result, error): called once per request from the driver thread
Settle = Callable[[Optional[GenOutput], Optional[BaseException]], None]


class EngineError(RuntimeError):
    """A generation request failed: vLLM rejected it, an engine step raised, or the engine closed."""


class StepLoop:
    """Continuous batching over an in-process vLLM ``LLMEngine``, driven by one thread at a time.

    ``submit`` queues a request and returns at once; the driver adds queued requests between
    scheduler steps and settles each request when it finishes. ``lock`` is held around every
    engine call, so sleep / wake / weight loads (which take it too) never run inside a step.
    The driver is a thread of its own while asynchronous callers wait (:meth:`release` ends it
    once the rollout is over: a thread that ran torch ops on a CPU keeps an OpenMP team alive,
    fastcredit.runtime.threads), the blocking caller itself (:meth:`drive`), or a caller that
    takes the role (:meth:`claim`) and steps it (:meth:`step_here`: the CPU event loop's task).
    """

    def __init__(self, llm_engine, render: Callable, params: Callable, convert: Callable, device=None,
                 version: Callable[[], Optional[int]] = lambda: None):
        self._engine, self._render, self._params, self._convert = llm_engine, render, params, convert
        self._version = version  # the weights' policy version a request starts with
        # called in the driver thread before every scheduler step, under ``lock`` (in-flight weight loads)
        self.between_steps: Optional[Callable[[], None]] = None
        self.device = device  # the engine's device, bound in the driver thread before its first step
        self.lock = threading.RLock()
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()  # (request id, prompt, SamplingParams, settle)
        self._aborts: list[str] = []
        self._inflight: dict = {}  # request id -> (SamplingParams, settle, version); the driver thread's own
        self._moving = 0  # taken from the inbox, not yet added to the engine
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None  # the driver: a thread of ours, or a caller in drive()
        self._closed = False
        self._release = False  # the driver thread ends once idle
        self._started: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # driver threads (not callers)
        self.dead: Optional[BaseException] = None
        self.steps, self.step_s, self.max_running = 0, 0.0, 0
        self.counters = StepCounters()  # since the last take_counters (a rollout's, for its metrics)

    @property
    def busy(self) -> bool:
        """Requests queued or running."""
        return bool(self._inbox or self._inflight or self._moving)

    def submit(self, prompt: Sequence[int], params: SamplingParams, settle: Settle, start: bool = True) -> str:
        """Queue a request; ``start``: start the driver thread if none drives (False: the caller will drive)."""
        rid = f"fc-{next(self._ids)}"
        with self._cv:
            if self.dead is not None:
                raise EngineError(f"the vLLM engine failed earlier and takes no requests: {self.dead!r}") from self.dead
            if self._closed:
                raise EngineError("the vLLM engine is closed")
            self._inbox.append((rid, list(prompt), params, settle))
            if start and self._thread is None:
                self._start_thread()
            self._cv.notify()
        return rid

    def _start_thread(self) -> None:  # under _cv
        self._thread = threading.Thread(target=self._run, name="vllm-steps", daemon=True)
        self._started.add(self._thread)
        self._thread.start()

    def abort(self, rid: str) -> None:
        """Drop a request (its caller is gone); it is never settled."""
        with self._cv:
            self._aborts.append(rid)
            self._cv.notify()

    def _take(self, block: bool = True) -> Optional[tuple[list, list]]:
        """What arrived since the last step (``block``: waits while there is nothing to do); None once closed, or
        once idle after :meth:`release` (the driver thread then stands down in the same critical section, so a
        request submitted after it starts a new one)."""
        with self._cv:
            while block and not (self._inbox or self._aborts or self._inflight or self._closed or self._release):
                self._cv.wait()
            if self._closed:
                return None
            if self._release and not (self._inbox or self._aborts or self._inflight):
                self._thread = None
                return None
            new, aborts = list(self._inbox), self._aborts
            self._moving = len(new)
            self._inbox.clear()
            self._aborts = []
            return new, aborts

    def _add(self, new: list, aborts: list) -> int:
        """Abort ``aborts``, add ``new`` to the engine; how many were added."""
        gone, added = set(aborts), 0
        for rid in aborts:
            if self._inflight.pop(rid, None) is not None:
                self._engine.abort_request([rid])
        for rid, prompt, params, settle in new:
            if rid in gone:
                continue
            try:
                self._engine.add_request(rid, self._render(prompt), self._params(params))
            except Exception as e:  # this request alone: too long for the model, bad parameters, ...
                settle(None, EngineError(f"vLLM rejected the request ({len(prompt)} prompt tokens): {e}"))
                continue
            self._inflight[rid] = (params, settle, self._version())
            added += 1
        return added

    def _step(self, new: list, aborts: list) -> None:
        """Add what arrived, run one scheduler step, settle the requests that finished."""
        with self.lock:
            added = self._add(new, aborts)
            self._moving = 0
            if not self._inflight:
                return
            self.max_running = max(self.max_running, len(self._inflight))
            if self.between_steps is not None:
                self.between_steps()
            t = time.perf_counter()
            outs = self._engine.step()
            dt = time.perf_counter() - t
            self.step_s += dt
            self.steps += 1
            self._count_step(len(self._inflight), added > 0, dt)
        for o in outs:
            if o.finished and o.request_id in self._inflight:
                self._count_finished(o)
                params, settle, version = self._inflight.pop(o.request_id)
                try:
                    result = self._convert(o.outputs[0], params, version)
                except Exception as e:  # this request alone; its caller must not wait for ever
                    settle(None, EngineError(f"reading vLLM's output failed: {e!r}"))
                    continue
                settle(result, None)

    def _count_step(self, seqs: int, admitted: bool, seconds: float) -> None:
        c = self.counters
        c.steps, c.step_s, c.seqs = c.steps + 1, c.step_s + seconds, c.seqs + seqs
        if admitted:
            c.admit_steps, c.admit_s, c.admit_seqs = c.admit_steps + 1, c.admit_s + seconds, c.admit_seqs + seqs

    def _count_finished(self, o) -> None:
        c = self.counters
        c.requests += 1
        c.prompt_tokens += len(getattr(o, "prompt_token_ids", None) or [])
        c.cached_tokens += int(getattr(o, "num_cached_tokens", None) or 0)
        # read as optionally as the rest: an output the counters cannot read is still settled
        c.decoded_tokens += len(getattr(o.outputs[0], "token_ids", None) or []) if o.outputs else 0

    def take_counters(self) -> dict:
        """The step counters since the last call (:class:`StepCounters`' metrics), and new ones from here."""
        with self.lock:
            taken, self.counters = self.counters, StepCounters()
        return taken.metrics()

    def _run(self) -> None:
        try:
            bind_thread(self.device)
            while (taken := self._take()) is not None:
                self._step(*taken)
        except BaseException as e:  # noqa: BLE001  (every waiting caller learns why, then the thread ends)
            self.dead = e
        if self.dead is None and not self._closed:
            return  # released while idle: nothing waits
        self._fail_waiting()

    def drive(self, done: Callable[[], bool]) -> None:
        """Run scheduler steps in the calling thread until ``done()`` (a blocking ``generate``): its torch work runs
        on the caller's own OpenMP team, as vLLM's ``LLM.generate`` does. Returns at once when a driver thread is
        running (the caller then waits on its requests), and hands what is left to a new one if the caller's
        requests finish while others are still in flight."""
        if not self.claim():
            return
        try:
            while not done():
                self.step_here()
        finally:
            self.unclaim()

    def claim(self) -> bool:
        """Make the calling thread the driver; False when another one drives (a driver thread, another caller)."""
        with self._cv:
            if self._thread is not None and self._thread is not threading.current_thread():
                return False
            self._thread = threading.current_thread()
            return True

    def step_here(self) -> bool:
        """One scheduler step in the calling thread, the driver after :meth:`claim`; False when nothing was queued or
        running. A failed step fails every waiting request and raises."""
        taken = self._take(block=False)
        if taken is None:
            raise EngineError("the vLLM engine is closed")
        if not (taken[0] or taken[1] or self._inflight):
            return False
        try:
            self._step(*taken)
        except BaseException as e:
            self.dead = e
            self._fail_waiting()
            raise
        return True

    def unclaim(self) -> None:
        """The calling thread stops driving; what is still queued or running goes to a new driver thread."""
        with self._cv:
            if self._thread is threading.current_thread():
                self._thread = None
                if self._inbox or self._inflight:
                    self._start_thread()

    def release(self) -> None:
        """End the driver thread once it is idle (the next request starts a new one)."""
        with self._cv:
            thread = self._thread
            if thread is None or thread is threading.current_thread() or thread not in self._started:
                return
            self._release = True
            self._cv.notify()
        thread.join()
        with self._cv:
            self._release = False

    def _fail_waiting(self) -> None:
        err = EngineError(f"vLLM engine step failed: {self.dead!r}") if self.dead is not None else \
            EngineError("the vLLM engine was closed with requests in flight")
        with self._cv:
            waiting = [s for *_, s in self._inbox] + [s for _, s, _ in self._inflight.values()]
            self._inbox.clear()
            self._inflight.clear()
        for settle in waiting:
            settle(None, err)

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)


def settle_future(fut: asyncio.Future, result, error) -> None:
    if not fut.done():  # a cancelled caller
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
