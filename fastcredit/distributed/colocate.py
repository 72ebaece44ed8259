"""Colocation: each GPU takes turns between rollout, judging and training.

    phases = PhaseManager(engine, train_state=[policy], judge_weights=critic, ...)   # TrainEngines
    with phases.rollout(weights=policy):  # policy weights synced (shards still on the GPU), training state
        ...                               # offloaded, then the KV cache woken
    with phases.judge():                  # the critic's weights switched into the same engine and KV cache
        ...
    with phases.train():                  # engine asleep (level 2), training parameters and optimizer state on the GPU
        with phases.using(reference):     # a frozen model on the GPU for one pass
            ...

vLLM sleep levels: level 1 offloads an engine's weights to CPU
memory and drops its KV cache; level 2 drops both (right for the policy, whose weights
are re-synced after every update, and after every judge phase that switched a critic in). Waking a level-2
policy engine wakes ``weights`` first, streams the new weights in tensor by tensor, and
only then allocates the KV cache (``kv_cache``), so the two never peak together. Level 0, for the HF engine when
the training state stays on the GPU (``distributed.offload_state``), keeps the engine awake with its weights: only
torch's cache, where its KV cache was, is emptied for the update.
The training state moves through each :class:`fastcredit.distributed.engine.TrainEngine`'s
``offload`` / ``reload``: FSDP2 moves the module and its optimizer's state tensors,
DeepSpeed uses ZeRO's ``offload_states`` / ``reload_states``.
GPU memory (allocated / reserved by torch, used on the device, the engine's share) is logged
at every phase boundary, and the seconds of every weight switch, sync and move. On the
CPU the sleeps are no-ops and nothing is moved (``move_state``), but the same code runs, so
tests cover the phase order with recording fakes.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from fastcredit.runtime.profiling import nvtx_range


def gpu_memory(device: Optional[torch.device] = None) -> dict:
    """GiB allocated / reserved by torch's caching allocator, used on the whole device, and ``engine``: the
    rest (vLLM's sleep-mode pool with its weights and KV cache, the CUDA context, NCCL buffers); empty
    without CUDA."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    gib = 2.0 ** 30
    reserved = torch.cuda.memory_reserved(device)
    return {"allocated_gib": torch.cuda.memory_allocated(device) / gib, "reserved_gib": reserved / gib,
            "device_used_gib": (total - free) / gib, "engine_gib": max(total - free - reserved, 0) / gib}


class PhaseManager:
    """Sleep / wake the engines, switch the engine's weights and move the training state at phase boundaries.

    ``train_state``: the TrainEngines (``offload`` / ``reload``). ``judge_weights``: a frozen
    critic of the policy's architecture (``tensors()`` → ``(HF name, tensor)`` from pinned host
    memory) that the judge phase loads into the policy's own engine; ``judge_engine``: a
    critic with an engine of its own (the HF engine only; a second vLLM sleep-mode engine in
    this process is refused when the judge is built). ``judge_in_rollout``: that engine answers during the
    rollout too (ProCeed's critic, between the policy's turns), so the rollout phase wakes it instead of putting it
    to sleep (the HF engine's sleep moves its model to the host). ``move_state``: whether offload /
    reload run (default: colocated on CUDA; on the CPU there is nothing to free; False with
    ``distributed.offload_state=false``, which keeps the state on the GPU and only empties torch's cache for the
    engines).
    ``policy_sleep_level``: 1 or 2 as vLLM's; 0 never puts the policy engine to sleep (the HF engine beside a kept
    training state: its weights stay, torch's cached blocks go back to the driver instead).
    ``timings`` collects the seconds of each switch, sync and move since the last ``take_timings()``.
    """

    def __init__(self, policy_engine, judge_engine=None, train_state: Sequence = (),
                 device: torch.device = torch.device("cpu"), policy_sleep_level: int = 2,
                 judge_sleep_level: int = 1, colocate: bool = True,
                 sync_fn: Optional[Callable[[object], None]] = None, log: Optional[Callable[[str, dict], None]] = None,
                 judge_weights=None, train_on_device: bool = True, move_state: Optional[bool] = None,
                 judge_in_rollout: bool = False):
        if judge_engine is not None and judge_weights is not None:
            raise ValueError("a judge either has its own engine or switches its weights into the policy's, not both")
        self.policy, self.judge_engine, self.train_state = policy_engine, judge_engine, list(train_state)
        self.judge_weights, self.judge_in_rollout = judge_weights, judge_in_rollout
        self.device, self.colocate = device, colocate
        self.move_state = colocate and device.type == "cuda" if move_state is None else move_state
        self.policy_level, self.judge_level = policy_sleep_level, judge_sleep_level
        self.sync_fn, self.log = sync_fn, log
        self.awake = {"policy": True, "judge": judge_engine is not None}
        self.train_on_device = train_on_device
        self.history: list[tuple[str, dict]] = []  # (boundary, memory) for logs and tests
        self.stale_weights = False  # the policy engine holds no weights (level 2), old ones, or the critic's
        self.version = 0  # the policy's version (updates done); the engine's weights_version after each sync
        self.timings: dict = {}

    def _record(self, boundary: str) -> None:
        mem = gpu_memory(self.device if self.device.type == "cuda" else None)
        self.history.append((boundary, mem))
        if self.log is not None:
            self.log(boundary, mem)

    @contextlib.contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        """Seconds into ``timings[key]``, inside an NVTX range ``key`` (nested in the trainer's phase)."""
        t0 = time.perf_counter()
        try:
            with nvtx_range(key):
                yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0

    def _wake(self, engine, tags: Optional[list]) -> None:
        with self._timed("engine_wake"):
            engine.wake_up(tags)

    def take_timings(self) -> dict:
        """Seconds per switch / sync / move since the last call (``time/<key>`` in the step's metrics)."""
        out, self.timings = self.timings, {}
        return out

    def _sleep(self, who: str) -> None:
        engine = self.policy if who == "policy" else self.judge_engine
        if who == "policy" and self.policy_level == 0:
            if engine is not None and self.colocate and self.device.type == "cuda":
                # its KV cache lived in torch's cache: back to the driver, so blocks shaped for generation do not
                # hold memory the update's activations need in other sizes
                with self._timed("engine_sleep"):
                    torch.cuda.empty_cache()
            return
        if engine is not None and self.awake[who] and self.colocate:
            with self._timed("engine_sleep"):
                engine.sleep(self.policy_level if who == "policy" else self.judge_level)
            self.awake[who] = False
            if who == "policy" and self.policy_level >= 2:
                self.stale_weights = True

    def _train_state_to(self, where: str) -> None:
        on_device = where == "device"
        if self.train_on_device == on_device:
            return
        if self.move_state:
            with self._timed("offload" if not on_device else "reload"):
                for engine in self.train_state:
                    engine.reload() if on_device else engine.offload()
                if not on_device and torch.cuda.is_available():
                    torch.cuda.empty_cache()
        elif not on_device and self.colocate and self.device.type == "cuda":
            # the state stays (distributed.offload_state=false), but the blocks the update's activations left in
            # torch's cache go back to the driver, where the waking engine allocates
            torch.cuda.empty_cache()
        self.train_on_device = on_device

    def mark_updated(self, version: Optional[int] = None) -> None:
        """The policy changed (an optimizer step, a resume): the engine's weights are stale until synced.
        ``version``: the policy's version now (updates done; None keeps it), stamped on the engine at the sync."""
        self.stale_weights = True
        if version is not None:
            self.version = version

    @contextlib.contextmanager
    def rollout(self, weights: Optional[object] = None) -> Iterator[None]:
        """Policy engine awake with the current policy weights, training state off the GPU.

        Order when the engine's weights are stale: wake the engine's weight memory, stream the
        policy's shards into it (``sync_fn(weights)``, collective) while they are still on the
        training device, *then* offload the training state, then wake the KV cache, so the
        weights and the KV cache never coexist with the training state.
        """
        if not self.judge_in_rollout:
            self._sleep("judge")
        if self.stale_weights and weights is not None and self.sync_fn is not None:
            self._train_state_to("device")  # the shards are read where they live (NCCL cannot gather CPU shards)
            if not self.awake["policy"]:
                self._wake(self.policy, ["weights"])
            with self._timed("sync_weights"):
                self.sync_fn(weights)
            self.policy.weights_version = self.version
            self.stale_weights = False
            self._train_state_to("cpu")
            if not self.awake["policy"]:
                self._wake(self.policy, ["kv_cache"])
        else:
            self._train_state_to("cpu")
            if not self.awake["policy"]:
                self._wake(self.policy, None)
        self.awake["policy"] = True
        if self.judge_in_rollout and self.judge_engine is not None and not self.awake["judge"]:
            self._wake(self.judge_engine, None)  # after the offload: its weights never meet the training state
            self.awake["judge"] = True
        self._record("rollout:start")
        try:
            yield
        finally:
            self._record("rollout:end")

    @contextlib.contextmanager
    def judge(self) -> Iterator[None]:
        """The frozen critic ready: its weights switched into the policy's engine (same KV cache), or its own
        engine awake; a no-op phase when the judge runs elsewhere (HTTP, oracle, the policy itself)."""
        if self.judge_weights is not None:
            self._train_state_to("cpu")
            if not self.awake["policy"]:
                self._wake(self.policy, None)
                self.awake["policy"] = True
            with self._timed("switch_to_critic"):
                self.policy.update_weights(self.judge_weights.tensors())
            self.stale_weights = True  # the next rollout loads the policy's weights back
        elif self.judge_engine is not None:
            self._sleep("policy")
            if not self.awake["judge"]:
                self._wake(self.judge_engine, None)
                self.awake["judge"] = True
        self._record("judge:start")
        try:
            yield
        finally:
            self._record("judge:end")

    @contextlib.contextmanager
    def train(self) -> Iterator[None]:
        """Engines asleep, training state on the device."""
        self._sleep("policy")
        self._sleep("judge")
        self._train_state_to("device")
        self._record("train:start")
        try:
            yield
        finally:
            self._record("train:end")

    @contextlib.contextmanager
    def using(self, frozen) -> Iterator[None]:
        """A frozen model (the reference policy: ``reload`` / ``offload``) on the device for one pass only."""
        if frozen is None or not self.move_state:
            yield
            return
        with self._timed("reload"):
            frozen.reload()
        try:
            yield
        finally:
            with self._timed("offload"):
                frozen.offload()
