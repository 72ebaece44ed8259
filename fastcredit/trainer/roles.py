"""The two roles of a rank and what both read: each built by one function, the same wherever it runs.

    shared = build_shared(cfg, info, out_dir)                        # the data and the tokenizer
    training = build_training_side(cfg, info, shared, out_dir, say)  # policy (warm-started), value, reference
    rollout = build_rollout_side(cfg, info, shared, out_dir, say, training.config)   # searcher, engine, judges

A colocated rank builds both (``fastcredit.trainer.parts.build_colocated``: the rollout side's searcher feeds the
training side's warm start, and its engine shares the GPU with the training state); a split placement builds the
training side on its training ranks and the rollout side on its rollout ranks (``build_training_rank``,
``build_rollout_rank``). The rollout side never reads the policy's weights: its engine starts empty (the HF engine's
model on the meta device, vLLM's ``dummy`` weights) and the phase manager streams the policy's weights in before the
first rollout, as after every update; only vLLM on an unmodified policy folder loads the folder itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from fastcredit.config import ConfigError, TrainConfig
from fastcredit.data.build import Data, load_data
from fastcredit.models.build import frozen_copy, load_policy, policy_config, run_tokenizer
from fastcredit.retrieval.searcher import Searcher, make_searcher
from fastcredit.rollout.build import EngineStart, rollout_engine, rollout_mode, vllm_start_folder


@dataclass
class Shared:
    """What both roles read: the questions and corpus, and the policy's tokenizer."""

    data: Data
    tokenizer: Any


@dataclass
class TrainingSide:
    """The trained models and their training engines (``fastcredit.distributed.engine.TrainEngine``)."""

    policy: Any  # TrainEngine over a PolicyModel
    value: Optional[Any]  # TrainEngine over a ValueModel, when the estimator needs a value model
    ref: Optional[Any]  # FrozenModel: the reference policy, when a KL term needs one
    config: Any  # the policy's HF config: the architecture the rollout side builds its engine for

    @property
    def state(self) -> list:
        """The training engines whose state moves between phases (policy, value model)."""
        return [self.policy] + ([self.value] if self.value is not None else [])


@dataclass
class RolloutSide:
    """What rolls out and judges: the searcher, the engine, ProCeed's hook, the judges."""

    searcher: Searcher
    retriever: Optional[Any]  # the in-process retriever behind ``searcher``; None with a /retrieve server
    engine: Any  # the rollout engine (HF or vLLM)
    proceed_hook: Optional[Any]  # ProCeed's step hook, when rollouts rewind
    judges: Optional[Any]  # JudgePhase: the critic, judge or PRM the estimator needs
    judge_weights: Optional[Any]  # a critic of the policy's architecture, switched into ``engine`` to judge
    empty_engine: bool  # the engine holds no weights yet: the phase manager streams them in first
    offloaded: bool = False  # sizing vLLM's share offloaded the colocated training state
    notes: list = field(default_factory=list)


def build_shared(cfg: TrainConfig, info, out_dir: str, rank: Optional[int] = None) -> Shared:
    """The data (the toy world generated once, ``rank`` 0 writes) and the tokenizer (``tiny``: trained once)."""
    rank = info.rank if rank is None else rank
    data = load_data(cfg, rank)
    return Shared(data, run_tokenizer(cfg, data, out_dir, rank))


def build_training_side(cfg: TrainConfig, info, shared: Shared, out_dir: str, say: Callable[[str], None],
                        searcher: Optional[Searcher] = None, offload=None) -> TrainingSide:
    """The policy as the run starts it (warm-started when ``warmstart.enabled``, its observations from ``searcher``,
    else from a retriever opened for the warm start alone when it is not cached), the reference policy and value
    model, and the training engines that shard them. ``offload``: the run's choice
    (``fastcredit.trainer.memory.offload``) when the training state shares its GPU with an engine; the reference
    then waits on the host between its passes."""
    from fastcredit.distributed.build import build_train_engine, compute_dtype
    from fastcredit.distributed.engine import adamw
    from fastcredit.distributed.from_rank0 import has_meta
    from fastcredit.distributed.fsdp import FrozenModel
    from fastcredit.credit.registry import estimator_needs
    from fastcredit.models.packed import PolicyModel, ValueModel
    from fastcredit.trainer.sft import warm_start

    lm = load_policy(cfg, shared.tokenizer, info)  # meta on ranks other than 0 (loads_on_rank0)
    if cfg.warmstart.enabled:
        opened: list = []

        def search(queries):  # the warm start's observations: a retriever is opened only if it is not cached
            if not opened:
                opened.append(searcher or make_searcher(cfg, shared.tokenizer, shared.data.corpus, device=info.device,
                                                        progress=cfg.logging.progress and info.is_main)[0])
            return opened[0](queries)

        warm_start(lm, cfg, shared.data, shared.tokenizer, search if searcher is None else searcher, info, say)
        if not has_meta(lm):  # the master weights go back to the host; a meta rank's have no data to move
            lm.cpu()
        opened.clear()
    o, impl = cfg.optim, cfg.loss.impl
    dtype = compute_dtype(cfg.distributed, info, cfg.model.dtype)
    ref = FrozenModel(PolicyModel(frozen_copy(lm, dtype), impl), info) \
        if cfg.loss.kl_coef or cfg.credit.kl_in_reward else None
    if ref is not None and offload is not None and offload.moves:
        ref.offload()  # on the GPU only for its passes (PhaseManager.using)
    # copied before the policy's engine shards lm (ZeRO-3 leaves empty placeholders behind)
    value_lm = frozen_copy(lm).requires_grad_(True).train() if estimator_needs(cfg.credit.estimator).value_model \
        else None
    policy = build_train_engine(PolicyModel(lm, impl), info, cfg.distributed,
                                adamw(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay), o.grad_clip, dtype)
    value = None if value_lm is None else build_train_engine(
        ValueModel(value_lm), info, cfg.distributed, adamw(lr=o.critic_lr, weight_decay=o.weight_decay),
        o.grad_clip, dtype)
    return TrainingSide(policy, value, ref, policy_config(lm))


def engine_start(cfg: TrainConfig, info, policy_config, tokenizer, out_dir: str, rank: int) -> EngineStart:
    """What the rollout engine starts from, without the policy's weights: the HF engine's own model of
    ``policy_config``'s architecture in the compute dtype, its weights random (drawn with the run's generators
    saved and restored: nothing of the run's randomness is used) until the first sync streams the policy's in; or
    vLLM's folder: the policy's own when nothing changed its weights (no warm start), else its config and tokenizer
    in ``out_dir`` with ``dummy`` weights."""
    from fastcredit.distributed.build import compute_dtype

    if cfg.rollout.engine == "hf":
        from transformers import AutoModelForCausalLM

        dtype = compute_dtype(cfg.distributed, info, cfg.model.dtype)
        # made where it runs (no host copy of the policy), its random values drawn on generators saved and restored
        with torch.random.fork_rng(devices=[info.device] if info.device.type == "cuda" else []), \
                torch.device(info.device):
            lm = AutoModelForCausalLM.from_config(policy_config, dtype=dtype)
        return EngineStart(lm=lm.requires_grad_(False).eval())
    folder, load_format = vllm_start_folder(cfg, policy_config, tokenizer, out_dir, rank, cfg.warmstart.enabled)
    return EngineStart(folder=folder, load_format=load_format)


def build_rollout_side(cfg: TrainConfig, info, shared: Shared, out_dir: str, say: Callable[[str], None],
                       policy_config, searcher: Optional[tuple] = None, train_state: tuple = (),
                       offload=None) -> RolloutSide:
    """The searcher (``searcher``: a ``(searcher, retriever)`` pair opened already, else opened here; with
    ``retrieval.across_ranks=shard`` the index split over the ranks that build this side), the rollout engine for
    ``policy_config``'s architecture (:func:`engine_start`; vLLM sized beside ``train_state``, the training engines
    sharing this GPU, by the run's ``offload`` choice), the judges and ProCeed's hook."""
    from fastcredit.judges.phase import build_judge_phase, build_proceed_hook, make_backend

    search, retriever = searcher or make_searcher(cfg, shared.tokenizer, shared.data.corpus,
                                                  progress=cfg.logging.progress and info.is_main,
                                                  device=info.device, info=info)
    start = engine_start(cfg, info, policy_config, shared.tokenizer, out_dir, info.rank)
    util, offloaded = None, False
    if cfg.rollout.engine == "vllm":
        util, offloaded = vllm_memory_share(cfg, info.device, start.folder, list(train_state), say, offload)
    engine = rollout_engine(cfg, shared.tokenizer, start, info.device, util)
    if cfg.rollout.engine == "vllm":
        say(f"rollout.engine=vllm: vLLM's {engine.executor} executor on {info.device}")
    backend = make_backend(cfg, engine, info.device, policy_config=policy_config)
    proceed_hook = build_proceed_hook(cfg, backend, engine, shared.tokenizer)
    judges = build_judge_phase(cfg, backend, engine, info.device)
    mode, why = rollout_mode(cfg.rollout.mode, engine, proceed_hook)
    say(f"rollout.mode=auto: {mode} ({why})" if cfg.rollout.mode == "auto" else f"rollout.mode={mode}")
    empty = start.lm is not None or start.load_format == "dummy"
    return RolloutSide(search, retriever, engine, proceed_hook, judges, getattr(backend, "weights", None), empty,
                       offloaded)


def vllm_memory_share(cfg: TrainConfig, device: torch.device, folder: str, train_state, say,
                      offload=None) -> tuple[float, bool]:
    """``(gpu_memory_utilization, offloaded)`` for the vLLM engine about to start on ``folder``.

    ``offload``: the run's :class:`~fastcredit.trainer.memory.offload.OffloadChoice` (None: no training state shares
    this GPU, a split placement's rollout rank). A fixed ``rollout.gpu_memory_utilization`` is checked against what
    is free. 0 (auto): when the training state moves, what is free once it is offloaded here (``train_state``:
    TrainEngines, offloaded as during every rollout), minus ``rollout.memory_margin_gib``
    (``fastcredit.trainer.memory.engine_memory_utilization``); when it stays, the share the memory plan gave the
    choice (measured now it would miss the optimizer state the first update creates beside it). The figures go to
    ``say``.
    """
    from fastcredit.trainer import memory

    r = cfg.rollout
    if device.type != "cuda":
        return r.gpu_memory_utilization, False
    offloaded = offload is not None and offload.moves
    kept = bool(train_state) and offload is not None and not offload.moves
    if offloaded:
        for engine in train_state:
            engine.offload()
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    if r.gpu_memory_utilization > 0 or kept:
        util = r.gpu_memory_utilization or offload.utilization
        if not util:
            raise ConfigError("distributed.offload_state keeps the training state beside vLLM, whose share then needs "
                              "a fixed rollout.gpu_memory_utilization or the memory plan's (offload_state=auto)")
        memory.check_fixed_utilization(util, free, total)
    else:
        shape = memory.ModelShape.from_folder(folder)
        max_context = cfg.data.max_prompt_tokens + r.max_response_tokens
        util = memory.engine_memory_utilization(free, total, r.memory_margin_gib * 2**30, shape.params * 2,
                                                memory.kv_bytes_per_token(shape) * max_context)
    where = ("with the training state offloaded" if offloaded else "beside the training state" if kept
             else "no training state on this GPU")
    how = ("fixed" if r.gpu_memory_utilization > 0 else "the memory plan's" if kept
           else f"margin {r.memory_margin_gib:g} GiB")
    say(f"vLLM gpu_memory_utilization {util:.2f} ({how}): {free / 2**30:.1f} of {total / 2**30:.1f} GiB free {where}")
    return util, offloaded
