"""A split placement: training ranks and rollout ranks in one torchrun job, and what passes between them.

    torchrun --nproc_per_node=8 -m fastcredit.train distributed.placement=split distributed.rollout_ranks=4 ...
    torchrun --nproc_per_node=2 -m fastcredit.train distributed.placement=split rollout.max_staleness=1   # a CPU

The first ``W - R`` ranks train (rank 0 among them logs and checkpoints), the last ``R``
(``distributed.rollout_ranks``) roll out, score and judge. :func:`split_layout` builds the groups
(every rank calls it, in step) and gives each role a :class:`DistInfo` of its own ranks, whose
reductions, FSDP2 mesh and checkpoints stay inside the role:

- ``train``: the training ranks (FSDP2's 1-D mesh, the update's reductions, checkpoints);
- ``rollout``: the rollout ranks (DAPO's refill rounds, held-out evaluation shards);
- ``weights``: training rank 0 and the rollout ranks: the policy's weights after each update
  (``fastcredit.distributed.weight_stream``; NCCL on GPUs) and the start message (gloo);
- one pair group per rollout rank and the training rank it feeds (gloo: batches are pickled objects).
  Rollout rank ``j`` (``j``-th of the rollout ranks) feeds training rank ``j mod (W - R)``, so ``R`` must be
  a multiple of ``W - R``.

Each side receives on a thread of its own (:class:`Mailbox` for batches, :class:`WeightInbox` for
weights), so a sender only waits for the transfer, never for the other side's work.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastcredit.distributed.process_group import DistInfo


class SplitError(RuntimeError):
    """The split placement cannot run as configured, or the other side failed (its message names the rank)."""


@dataclass
class SplitLayout:
    """One rank's view of the split: its role, its role's DistInfo and the groups it talks over."""

    role: str  # "train" or "rollout"
    info: DistInfo  # rank / world_size inside the role; reductions over the role's group
    global_rank: int
    trainers: list
    rollouts: list
    weights_group: Any = None  # training rank 0 + the rollout ranks (None on other training ranks)
    control_group: Any = None  # the same ranks over gloo: the start message
    pairs: dict = field(default_factory=dict)  # rollout rank → (training rank, its pair group), ours only

    @property
    def feeds(self) -> int:
        """The training rank this rollout rank sends its batches to."""
        return self.pairs[self.global_rank][0]

    def sources(self) -> list:
        """``[(rollout rank, pair group)]`` feeding this training rank, in rank order."""
        return [(r, g) for r, (_, g) in sorted(self.pairs.items())]


def split_sizes(world: int, rollout_ranks: int) -> tuple[int, int]:
    """``(training ranks, rollout ranks)`` of a job of ``world`` ranks; SplitError when they cannot be."""
    if world < 2:
        raise SplitError("distributed.placement=split needs at least 2 ranks (torchrun --nproc_per_node=2 or more): "
                         "one that trains and one that rolls out")
    rollouts = rollout_ranks or world // 2
    trainers = world - rollouts
    if not 1 <= rollouts < world:
        raise SplitError(f"distributed.rollout_ranks={rollout_ranks} must leave at least one training rank and one "
                         f"rollout rank among the job's {world}")
    if rollouts % trainers:
        raise SplitError(f"distributed.rollout_ranks={rollouts} must be a multiple of the {trainers} training ranks "
                         "(each training rank takes the batches of the same number of rollout ranks)")
    return trainers, rollouts


def split_layout(world: DistInfo, rollout_ranks: int, batch_prompts: int) -> SplitLayout:
    """Groups and this rank's role of a split job (collective: every rank calls it, in step)."""
    from torch.distributed.device_mesh import DeviceMesh

    from fastcredit.distributed.manifest import use_group

    n_train, n_roll = split_sizes(world.world_size, rollout_ranks)
    if batch_prompts % n_roll:
        raise SplitError(f"optim.batch_prompts={batch_prompts} must be a multiple of the {n_roll} rollout ranks")
    trainers, rollouts = list(range(n_train)), list(range(n_train, world.world_size))
    rank = world.rank
    train_group, rollout_group = dist.new_group(trainers), dist.new_group(rollouts)
    weights_group = dist.new_group([0] + rollouts)
    control_group = dist.new_group([0] + rollouts, backend="gloo")
    pairs = {}
    for j, r in enumerate(rollouts):
        t = trainers[j % n_train]
        group = dist.new_group([t, r], backend="gloo")
        if rank in (t, r):
            pairs[r] = (t, group)
    mesh = DeviceMesh(world.device.type, torch.arange(n_train), mesh_dim_names=("dp",))  # collective too
    in_weights = rank == 0 or rank in rollouts
    if rank in trainers:
        use_group(train_group)  # checkpoints are the training ranks' alone
        info = DistInfo(rank, n_train, world.local_rank, world.device, world.backend, mesh, train_group)
        role = "train"
    else:
        info = DistInfo(rank - n_train, n_roll, world.local_rank, world.device, world.backend, None, rollout_group)
        role = "rollout"
    return SplitLayout(role, info, rank, trainers, rollouts, weights_group if in_weights else None,
                       control_group if in_weights else None, pairs)


def send_object(obj, dst: int, group) -> None:
    """Pickle ``obj`` to rank ``dst`` over ``group`` (a gloo pair group); returns once it is sent."""
    dist.send_object_list([obj], dst=dst, group=group)


def recv_object(src: int, group):
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


class Mailbox:
    """Messages from several ranks, each received on a thread of its own, taken one round at a time.

    A message is a dict; one with ``"final"`` ends its sender's thread, one with ``"error"`` makes
    :meth:`take` raise (the sender failed and said why). ``waited_s`` counts the seconds :meth:`take`
    spent waiting (the receiving side's idle time)."""

    def __init__(self, sources: list):
        self.sources = [src for src, _ in sources]
        self._queues: dict = {src: deque() for src in self.sources}
        self._cv = threading.Condition()
        self._failed: Optional[BaseException] = None
        self.waited_s = 0.0
        for src, group in sources:
            threading.Thread(target=self._receive, args=(src, group), name=f"mailbox-{src}", daemon=True).start()

    def _receive(self, src: int, group) -> None:
        try:
            while True:
                msg = recv_object(src, group)
                with self._cv:
                    self._queues[src].append(msg)
                    self._cv.notify_all()
                if msg.get("final") or "error" in msg:
                    return
        except BaseException as exc:  # noqa: BLE001  (the taker learns why; the job is going down)
            with self._cv:
                self._failed = exc
                self._cv.notify_all()

    def take(self) -> list:
        """The next message of every source, in source order (waits for the last to arrive)."""
        t0 = time.perf_counter()
        with self._cv:
            while not all(self._queues[s] for s in self.sources):
                for s in self.sources:
                    if self._queues[s] and "error" in self._queues[s][0]:
                        raise SplitError(f"rollout rank {s} failed: {self._queues[s][0]['error']}")
                if self._failed is not None:
                    raise SplitError(f"receiving from the rollout ranks failed: {self._failed!r}")
                self._cv.wait(timeout=1.0)
            out = [self._queues[s].popleft() for s in self.sources]
        self.waited_s += time.perf_counter() - t0
        for s, msg in zip(self.sources, out):
            if "error" in msg:
                raise SplitError(f"rollout rank {s} failed: {msg['error']}")
        return out


class WeightInbox:
    """The policy versions the training rank streams, received on a thread (``recv_weights``) as they come, kept
    in host memory until an engine loads them.

    ``count``: the streams to expect. :meth:`take` hands over the newest version received up to a
    limit (older ones it skips are dropped), waiting for one when asked to."""

    def __init__(self, src: int, group, device: torch.device, count: int):
        from fastcredit.distributed.weight_stream import recv_weights

        self._recv = recv_weights
        self._pending: list = []  # (version, [(name, tensor)]) in arrival (= version) order
        self._cv = threading.Condition()
        self._failed: Optional[BaseException] = None
        self.received = 0
        self.waited_s = 0.0
        threading.Thread(target=self._receive, args=(src, group, device, count), name="weights-inbox",
                         daemon=True).start()

    def _receive(self, src: int, group, device: torch.device, count: int) -> None:
        from fastcredit.runtime.devices import bind_thread

        try:
            bind_thread(device)
            for _ in range(count):
                version, it = self._recv(src, group, device)
                # into host memory as each bucket arrives: the GPU holds the engine's copy only (a CUDA bucket is
                # freed once read); engines load from the host, as colocated training's sync does
                named = [(n, t.to("cpu")) for n, t in it]
                with self._cv:
                    self._pending.append((version, named))
                    self.received += 1
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001
            with self._cv:
                self._failed = exc
                self._cv.notify_all()

    def wait_for(self, version: int) -> None:
        """Block until a version ``>= version`` has arrived (taking nothing)."""
        self.take(upto=-1, at_least=version)

    def newest(self, upto: float = float("inf")) -> Optional[int]:
        """The newest version received and not yet taken that is ``<= upto``; None when there is none."""
        with self._cv:
            return max((v for v, _ in self._pending if v <= upto), default=None)

    def take(self, upto: float = float("inf"), at_least: Optional[int] = None) -> Optional[tuple[int, list]]:
        """The newest pending version ``<= upto`` (older pending ones dropped), or None when there is none.
        ``at_least``: wait until a version ``>= at_least`` has arrived first (the staleness bound)."""
        t0 = time.perf_counter()
        with self._cv:
            while at_least is not None and not any(v >= at_least for v, _ in self._pending):
                if self._failed is not None:
                    raise SplitError(f"receiving weights from the training rank failed: {self._failed!r}")
                self._cv.wait(timeout=1.0)
            usable = [i for i, (v, _) in enumerate(self._pending) if v <= upto]
            if not usable:
                got = None
            else:
                got = self._pending[usable[-1]]
                del self._pending[:usable[-1] + 1]
        self.waited_s += time.perf_counter() - t0
        return got
