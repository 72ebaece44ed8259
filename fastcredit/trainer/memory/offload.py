"""``distributed.offload_state``: whether the training state leaves the GPU while the engines roll out and judge.

    choice = decide_offload(cfg, gpu_gib=80, gpus=8)     # --memory-report: the plan's GPU
    choice = local_offload(cfg, info.device, info.world_size)   # the trainer, once at start: this rank's GPU
    choice.moves, choice.reason, choice.utilization
    plan = memory.plan(cfg, gpu_gib=80, gpus=8)          # the memory plan as the run will run: decided, then planned

One function decides (:func:`decide_offload`); the trainer's phase manager, the reference policy's placement,
vLLM's share and the memory plan (:func:`plan`) ask it. ``true`` and ``false`` are the user's word. ``auto``
plans the run with the training state and the reference kept on the GPU in every phase
(``fastcredit.trainer.memory.gpu.plan_for``) and keeps them there when that plan

* has nothing that stops a run (every phase within the GPU, vLLM able to start),
* leaves every phase a margin free: ``KEEP_MARGIN_FRACTION`` of the GPU, at least ``KEEP_MARGIN_MIN_GIB`` (the
  plan's rows marked "est." are rough, and torch's allocator fragments); with vLLM's automatic share
  (``rollout.gpu_memory_utilization: 0``) the margin comes out of the share, which the plan then gives vLLM,
  since a share measured at start-up would not see the optimizer state the kept state holds after the first update,
* and, with vLLM, still leaves a KV cache that holds a step's sequences: keeping the state must not make vLLM
  queue (queued sequences cost decode steps in every rollout, the moves a few seconds a step: not measured
  against each other yet, so the rule errs towards moving).

Otherwise the state moves, as Search-R1 does. Without colocation, or without a GPU, nothing moves. When the state
stays, so do the HF engine's weights (only its cache is emptied for training); vLLM's policy engine keeps
``rollout.sleep_level`` (level 1 would copy the weights to the host and back; level 2 drops them and the weight
sync after every update refills them).
"""
from __future__ import annotations

from typing import Optional

from fastcredit.trainer.memory.gpu import MemoryPlan, plan_for
from fastcredit.trainer.memory.parts import OffloadChoice
from fastcredit.trainer.memory.shapes import ModelShape, ShapeError
from fastcredit.trainer.memory.units import GIB, gib_text, tokens_text

KEEP_MARGIN_FRACTION = 0.10  # of the GPU left free in every phase by a kept training state
KEEP_MARGIN_MIN_GIB = 4.0


def keep_margin_bytes(gpu_gib: float) -> int:
    """The GPU memory a kept state must leave free in every phase: 10% of the GPU, at least 4 GiB."""
    return int(max(KEEP_MARGIN_FRACTION * gpu_gib, KEEP_MARGIN_MIN_GIB) * GIB)


def decide_offload(cfg, gpu_gib: Optional[float], gpus: int, index_rows: Optional[int] = None,
                   index_dim: Optional[int] = None) -> OffloadChoice:
    """Whether the training state moves, for ``cfg`` on ``gpus`` GPUs of ``gpu_gib`` GiB each (None: no GPU, a
    CPU run); the rule is the module docstring's. ``index_rows`` / ``index_dim``: the index size when its file is
    not here, as the memory plan takes them."""
    dcfg, setting = cfg.distributed, cfg.distributed.offload_state
    if not dcfg.colocate:
        return OffloadChoice(False, "distributed.colocate=false: nothing sleeps", setting, applies=False)
    if gpu_gib is None:
        return OffloadChoice(False, "no GPU", setting, applies=False)
    if setting is True or setting is False:
        return OffloadChoice(setting, "as set", setting)
    margin = keep_margin_bytes(gpu_gib)
    automatic = cfg.rollout.engine == "vllm" and cfg.rollout.gpu_memory_utilization == 0
    trial = OffloadChoice(False, "planned with the state kept", setting, reserve_bytes=margin if automatic else 0)
    try:
        kept = plan_for(cfg, gpu_gib, gpus, trial, index_rows=index_rows, index_dim=index_dim)
    except ShapeError as exc:
        return OffloadChoice(True, f"the plan cannot size the run, so it moves: {exc}", setting)
    why = why_not_keep(kept, margin)
    if why is not None:
        return OffloadChoice(True, f"with it kept {why}", setting)
    spare = min(int(gpu_gib * GIB) - kept.total(phase) for phase in kept.phases)
    share = f"; vLLM's share {kept.utilization:.2f} from the plan" if automatic else ""
    reason = (f"the plan with it kept fits every phase with at least {gib_text(spare)} GiB free, margin "
              f"{gib_text(margin)} GiB{share}")
    return OffloadChoice(False, reason, setting, kept.utilization if automatic else None, trial.reserve_bytes)


def why_not_keep(kept, margin: int) -> Optional[str]:
    """Why the plan with the state kept (``kept``: a MemoryPlan) must not run that way, or None when it may."""
    limit = int(kept.gpu_gib * GIB) - margin
    for phase in kept.phases:
        if kept.total(phase) > limit:
            return (f"the {phase} phase would need {gib_text(kept.total(phase))} GiB of the {kept.gpu_gib:g} GiB GPU, "
                    f"more than {gib_text(limit)} GiB (margin {gib_text(margin)} GiB kept free)")
    if kept.hard:
        return f"the run could not start: {kept.hard[0]}"
    if kept.utilization is not None and kept.kv_tokens < kept.kv_tokens_step:
        return (f"vLLM's KV cache would hold {tokens_text(kept.kv_tokens)} tokens, fewer than the "
                f"{tokens_text(kept.kv_tokens_step)} a step asks for (vLLM would queue)")
    return None


def local_offload(cfg, device, gpus: int) -> OffloadChoice:
    """The choice for this process, made once at start: its ``device`` (not CUDA: nothing moves), that GPU's size,
    and the job's ``gpus`` (the world size)."""
    if device.type != "cuda":
        return decide_offload(cfg, None, gpus)
    import torch

    return decide_offload(cfg, torch.cuda.get_device_properties(device).total_memory / GIB, gpus)


def plan(cfg, gpu_gib: float, gpus: int, shape: Optional[ModelShape] = None, index_rows: Optional[int] = None,
         index_dim: Optional[int] = None, host_gib: Optional[float] = None, gpus_per_node: Optional[int] = None,
         host_source: str = "--host-gib", offload: Optional[OffloadChoice] = None) -> MemoryPlan:
    """GiB per GPU of every phase of a step for ``cfg`` on ``gpus`` GPUs of ``gpu_gib`` each, and host RAM per
    node of ``host_gib`` (None: not checked) with ``gpus_per_node`` ranks (default min(gpus, 8)); nothing loads.
    The training state placed as :func:`decide_offload` decides for that GPU (``offload``: a choice already made),
    the choice in the plan's ``offload`` and notes (``fastcredit.trainer.memory.gpu.plan_for``)."""
    offload = offload or decide_offload(cfg, gpu_gib, gpus, index_rows, index_dim)
    return plan_for(cfg, gpu_gib, gpus, offload, shape=shape, index_rows=index_rows, index_dim=index_dim,
                    host_gib=host_gib, gpus_per_node=gpus_per_node, host_source=host_source)
