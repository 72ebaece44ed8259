"""Colocation: each GPU takes turns between rollout, judging and training.

    phases = PhaseManager(policy_engine, judge_engine, train_state=[policy], ...)   # TrainEngines
    with phases.rollout(weights=model):  # training state off the GPU, policy engine awake
        ...                              # (weights streamed in first when it slept at level 2)
    with phases.judge():                 # policy engine asleep, frozen critic awake
        ...
    with phases.train():                 # engines asleep, training parameters and optimizer state on the GPU
        ...

vLLM sleep levels: level 1 offloads an engine's weights to CPU
memory and drops its KV cache (right for a frozen critic); level 2 drops both (right for
the policy, whose weights are re-synced after every update anyway). Waking a level-2
policy engine wakes ``weights`` first, streams the new weights in tensor by tensor, and
only then allocates the KV cache (``kv_cache``), so the two never peak together.
The training state moves through each :class:`fastcredit.distributed.engine.TrainEngine`'s
``offload`` / ``reload``: FSDP2 moves the module and its optimizer's state tensors,
DeepSpeed uses ZeRO's ``offload_states`` / ``reload_states``.
GPU memory (allocated / reserved by torch, and used on the device as a whole) is logged
at every phase boundary. On the CPU the moves and sleeps are no-ops, but the same code
runs, so tests cover the phase order.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch


def gpu_memory(device: Optional[torch.device] = None) -> dict:
    """GiB allocated / reserved by torch and used on the whole device (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    gib = 2.0 ** 30
    return {"allocated_gib": torch.cuda.memory_allocated(device) / gib,
            "reserved_gib": torch.cuda.memory_reserved(device) / gib, "device_used_gib": (total - free) / gib}


class PhaseManager:
    """Sleep / wake the engines and move the training state (``train_state``: TrainEngines) at phase boundaries."""

    def __init__(self, policy_engine, judge_engine=None, train_state: Sequence = (),
                 device: torch.device = torch.device("cpu"), policy_sleep_level: int = 2,
                 judge_sleep_level: int = 1, colocate: bool = True,
                 sync_fn: Optional[Callable[[object], None]] = None, log: Optional[Callable[[str, dict], None]] = None):
        self.policy, self.judge_engine, self.train_state = policy_engine, judge_engine, list(train_state)
        self.device, self.colocate = device, colocate
        self.policy_level, self.judge_level = policy_sleep_level, judge_sleep_level
        self.sync_fn, self.log = sync_fn, log
        self.awake = {"policy": True, "judge": judge_engine is not None}
        self.train_on_device = True
        self.history: list[tuple[str, dict]] = []  # (boundary, memory) for logs and tests
        self.stale_weights = False  # the policy engine dropped its weights (level 2) or they are old

    def _record(self, boundary: str) -> None:
        mem = gpu_memory(self.device if self.device.type == "cuda" else None)
        self.history.append((boundary, mem))
        if self.log is not None:
            self.log(boundary, mem)

    def _sleep(self, who: str) -> None:
        engine = self.policy if who == "policy" else self.judge_engine
        if engine is not None and self.awake[who] and self.colocate:
            engine.sleep(self.policy_level if who == "policy" else self.judge_level)
            self.awake[who] = False
            if who == "policy" and self.policy_level >= 2:
                self.stale_weights = True

    def _train_state_to(self, device) -> None:
        if not self.colocate or self.device.type != "cuda":
            return
        to_cpu = device == "cpu" or getattr(device, "type", None) == "cpu"
        for engine in self.train_state:
            engine.offload() if to_cpu else engine.reload()
        if to_cpu:
            torch.cuda.empty_cache()

    def mark_updated(self) -> None:
        """The policy changed (an optimizer step): the engine's weights are stale until synced."""
        self.stale_weights = True

    @contextlib.contextmanager
    def rollout(self, weights: Optional[object] = None) -> Iterator[None]:
        """Policy engine awake with current weights (``sync_fn(weights)``, the policy's TrainEngine, when stale);
        training state and the judge asleep / off the GPU."""
        self._sleep("judge")
        self._train_state_to("cpu")
        self.train_on_device = False
        if not self.awake["policy"]:
            self.policy.wake_up(["weights"])
        if self.stale_weights and weights is not None and self.sync_fn is not None:
            self.sync_fn(weights)
            self.stale_weights = False
        if not self.awake["policy"]:
            self.policy.wake_up(["kv_cache"])
            self.awake["policy"] = True
        self._record("rollout:start")
        try:
            yield
        finally:
            self._record("rollout:end")

    @contextlib.contextmanager
    def judge(self) -> Iterator[None]:
        """The colocated critic awake (a no-op phase when judges run elsewhere)."""
        if self.judge_engine is None:
            yield
            return
        self._sleep("policy")
        if not self.awake["judge"]:
            self.judge_engine.wake_up(None)
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
        if not self.train_on_device:
            self._train_state_to(self.device)
            self.train_on_device = True
        self._record("train:start")
        try:
            yield
        finally:
            self._record("train:end")
