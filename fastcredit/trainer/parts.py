"""What a rank holds for its roles (``fastcredit.trainer.roles``), assembled for its placement.

    training, rollout = build_colocated(cfg, info, out_dir, say)  # every rank rolls out, judges and trains in turn
    training = build_training_rank(cfg, layout, out_dir, say)     # distributed.placement=split: a training rank
    rollout = build_rollout_rank(cfg, layout, out_dir, say)       # ... and a rollout rank

A rank that trains holds :class:`TrainingParts`, one that rolls out :class:`RolloutParts`; a colocated rank holds
both, over the same data and one phase manager (``fastcredit.distributed.colocate``) that takes the GPU from one
role to the other: the rollout side's searcher feeds the training side's warm start and its engine shares the GPU
with the training state (sized by the run's offload choice, ``fastcredit.trainer.memory.offload``). In a split
placement each rank holds one, and a rollout rank's engine is synced from the newest weights it received
(:class:`WeightMirror`). Neither holds what its rank does not have: code that needs the engine takes the
:class:`RolloutParts`. The order inside each builder is the order the seeded generators are drawn from: reordering
changes the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from fastcredit.config import TrainConfig
from fastcredit.trainer.roles import RolloutSide, Shared, TrainingSide, build_rollout_side, build_shared, \
    build_training_side


@dataclass
class TrainingParts:
    """What a rank that trains holds: the data and tokenizer (``shared``), the trained models and their training
    engines (``training``), the phase manager, and the GPU memory it logs at phase boundaries (the step's metrics
    take it)."""

    shared: Shared
    training: TrainingSide
    phases: Any  # PhaseManager: what holds the GPU in each phase of a step
    memory: dict = field(default_factory=dict)


@dataclass
class RolloutParts:
    """What a rank that rolls out holds: the data and tokenizer (``shared``), the searcher, engine, judges and
    ProCeed's hook (``rollout``), the phase manager, and ``weights``: what the engine is synced from before a
    rollout (the policy's training engine colocated, a rollout rank's :class:`WeightMirror`)."""

    shared: Shared
    rollout: RolloutSide
    phases: Any  # PhaseManager
    weights: Any


def build_colocated(cfg: TrainConfig, info, out_dir: str,
                    say: Callable[[str], None]) -> tuple[TrainingParts, RolloutParts]:
    """Both roles on this rank (``info``: its DistInfo), over the same data and one phase manager that takes the
    GPU from one to the other. ``out_dir``: the run folder; ``say``: rank 0's console."""
    from fastcredit.distributed.colocate import PhaseManager
    from fastcredit.retrieval.searcher import make_searcher
    from fastcredit.trainer.memory.offload import local_offload

    offload = local_offload(cfg, info.device, info.world_size)  # once, from this rank's GPU and the job's size
    say(offload.line())
    shared = build_shared(cfg, info, out_dir)
    opened = make_searcher(cfg, shared.tokenizer, shared.data.corpus, progress=cfg.logging.progress and info.is_main,
                           device=info.device, info=info)
    training = build_training_side(cfg, info, shared, out_dir, say, searcher=opened[0], offload=offload)
    rollout = build_rollout_side(cfg, info, shared, out_dir, say, training.config, searcher=opened,
                                 train_state=tuple(training.state), offload=offload)
    # the choice in the run's metrics too (its first step's line): 1 the state moves, 0 it stays
    memory: dict = {"offload_state/moves": float(offload.moves)} if info.is_main else {}

    def log_memory(boundary: str, mem: dict) -> None:
        if mem and info.is_main:
            memory.update({f"memory/{boundary}/{k}": v for k, v in mem.items()})

    engine = rollout.engine
    # A state that stays keeps the HF engine's weights too (its sleep would move them to the host; level 0 only
    # empties torch's cache, its KV cache). vLLM keeps rollout.sleep_level: its level 1 copies the weights to the
    # host and back, level 2 drops them and the sync after every update refills them.
    policy_level = 0 if cfg.rollout.engine == "hf" and not offload.moves else cfg.rollout.sleep_level
    phases = PhaseManager(engine, getattr(rollout.judges, "engine", None), training.state, info.device, policy_level,
                          cfg.judges.sleep_level, cfg.distributed.colocate,
                          sync_fn=lambda trained: engine.update_weights(trained.full_state(engine.weight_dtype)),
                          log=log_memory, judge_weights=rollout.judge_weights,
                          train_on_device=not rollout.offloaded, judge_in_rollout=cfg.rollout.proceed.enabled,
                          move_state=moves_training_state(cfg, info, offload))
    if rollout.empty_engine:
        phases.mark_updated()  # the engine started without the policy's weights: the first rollout streams them in
    return (TrainingParts(shared, training, phases, memory),
            RolloutParts(shared, rollout, phases, weights=training.policy))


def build_training_rank(cfg: TrainConfig, layout, out_dir: str, say: Callable[[str], None]) -> TrainingParts:
    """A split placement's training rank: the training side (a retriever is opened for the warm start's
    observations only, and only when the warm start is not cached) and a phase manager with nothing to colocate."""
    from fastcredit.distributed.colocate import PhaseManager

    info = layout.info
    shared = build_shared(cfg, info, out_dir, layout.global_rank)
    training = build_training_side(cfg, info, shared, out_dir, say)
    # nothing to colocate with: the training state stays on the device, no engine sleeps
    phases = PhaseManager(None, None, training.state, info.device, colocate=False, move_state=False)
    return TrainingParts(shared, training, phases)


def build_rollout_rank(cfg: TrainConfig, layout, out_dir: str, say: Callable[[str], None]) -> RolloutParts:
    """A split placement's rollout rank: the rollout side (with ``retrieval.across_ranks=shard`` the index split
    over the rollout ranks), its engine built for the policy's architecture (the weights come from the training
    rank before the first rollout), and the host copy of the newest weights received (:class:`WeightMirror`)."""
    from fastcredit.distributed.colocate import PhaseManager
    from fastcredit.models.build import load_policy, policy_config

    info = layout.info
    shared = build_shared(cfg, info, out_dir, layout.global_rank)
    # the architecture only: a policy read from files stays on the meta device
    config = policy_config(load_policy(cfg, shared.tokenizer, None, meta=True))
    rollout = build_rollout_side(cfg, info, shared, out_dir, say, config)
    mirror, engine = WeightMirror(), rollout.engine
    phases = PhaseManager(engine, getattr(rollout.judges, "engine", None), [], info.device, cfg.rollout.sleep_level,
                          cfg.judges.sleep_level, colocate=False,
                          sync_fn=lambda w: engine.update_weights(w.full_state(engine.weight_dtype)),
                          judge_weights=rollout.judge_weights, move_state=False)
    phases.mark_updated()  # nothing loaded until the training rank's first weights arrive
    return RolloutParts(shared, rollout, phases, weights=mirror)


class WeightMirror:
    """The policy's newest weights on a rollout rank (host memory), with their version: what the engine is synced
    from after a critic switched its own weights in, read like a training engine's ``full_state``."""

    def __init__(self):
        self.named: Optional[list] = None
        self.version = -1

    def set(self, version: int, named: list) -> None:
        self.version, self.named = version, named

    def full_state(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        if self.named is None:
            raise RuntimeError("no policy weights have arrived from the training ranks yet")
        for name, t in self.named:
            yield name, t if dtype is None else t.to(dtype)


def moves_training_state(cfg: TrainConfig, info, offload=None) -> bool:
    """Whether the training state and the reference policy leave the GPU while the engines roll out and judge
    (the phase manager's ``move_state``; the reference starts on the host exactly when its passes will bring it
    in): ``offload``, the run's :class:`~fastcredit.trainer.memory.offload.OffloadChoice`, else the choice for this
    rank's device (``local_offload``: no GPU, nothing moves)."""
    if offload is None:
        from fastcredit.trainer.memory.offload import local_offload

        offload = local_offload(cfg, info.device, info.world_size)
    return offload.moves
