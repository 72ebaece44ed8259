"""The parts of a run, built once from the config into one :class:`Parts` handed to the loop.

:func:`build_parts` builds them in order: data, tokenizer, searcher, the policy (warm-started
when ``warmstart.enabled``), its reference and value model with their training engines
(``fastcredit.distributed.build``), then the rollout engine (``fastcredit.rollout.engines``),
the judges (``fastcredit.judges.phase``) and the phase manager that colocates them. The
functions below it each read one section of :class:`fastcredit.config.TrainConfig` and
return a ready object; evaluation, export and the PRM's labelling use them too. Nothing
here downloads: models and data are local paths, the toy world is generated, ``tiny``
models are built in code.
"""
from __future__ import annotations

import copy
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from fastcredit.config import ConfigError, TrainConfig
from fastcredit.config.checks import check_paths
from fastcredit.credit.registry import estimator_needs
from fastcredit.data.loaders import DataError, load_qa
from fastcredit.data.prompts import example_prompt_ids
from fastcredit.models.smollm2 import smollm2_files
from fastcredit.runtime.files import built_from, mark_built, wait_for_built


@dataclass
class Data:
    train: list
    test: list
    corpus: str  # Search-R1 corpus jsonl


@dataclass
class Parts:
    """What one run trains with, built once by :func:`build_parts`.

    The policy and value model are TrainEngines (``fastcredit.distributed.engine``), callable like the
    PolicyModel / ValueModel they train; the rollout engine owns a copy of the policy's weights, which
    ``phases`` syncs into it before the first rollout after an update."""

    data: Data
    tokenizer: Any
    searcher: Callable  # the rollout's Searcher (fastcredit.rollout.agent)
    retriever: Optional[Any]  # the in-process retriever behind ``searcher``; None with a /retrieve server
    policy: Any  # TrainEngine over a PolicyModel
    value: Optional[Any]  # TrainEngine over a ValueModel, when the estimator needs a value model
    ref: Optional[Any]  # FrozenModel: the reference policy, when a KL term needs one
    engine: Any  # the rollout engine (HF or vLLM)
    proceed_hook: Optional[Any]  # ProCeed's step hook, when rollouts rewind
    judges: Optional[Any]  # JudgePhase: the critic, judge or PRM the estimator needs
    phases: Any  # PhaseManager: what holds the GPU in each phase of a step
    memory: dict  # GPU memory at the phase boundaries of the step: ``phases`` writes it, the step takes it


@dataclass
class EngineStart:
    """What the rollout engine starts from: the HF engine's own copy of the policy (``lm``), or vLLM's
    ``folder`` and ``load_format`` (``dummy``: no weights; the first rollout streams them in)."""

    lm: Optional[torch.nn.Module] = None
    folder: Optional[str] = None
    load_format: Optional[str] = None


def build_parts(cfg: TrainConfig, info, out_dir: str, say: Callable[[str], None]) -> Parts:
    """Every part of the run on this rank (``info``: its DistInfo), in this order (the seeded generators are
    drawn from in it: reordering changes the run). ``out_dir``: the run folder; ``say``: rank 0's console."""
    from fastcredit.distributed.colocate import PhaseManager
    from fastcredit.distributed.from_rank0 import has_meta
    from fastcredit.judges.phase import build_judge_phase, build_proceed_hook, make_backend
    from fastcredit.trainer.memory.offload import local_offload

    offload = local_offload(cfg, info.device, info.world_size)  # once, from this rank's GPU and the job's size
    say(offload.line())
    data = load_data(cfg, info.rank)
    tokenizer = load_tokenizer(cfg, data, out_dir, info.rank)
    searcher, retriever = make_searcher(cfg, tokenizer, data.corpus, progress=cfg.logging.progress and info.is_main,
                                        device=info.device, info=info)
    lm = load_policy(cfg, tokenizer, info)  # meta on ranks other than 0 (loads_on_rank0)
    if cfg.warmstart.enabled:
        warm_start(lm, cfg, data, tokenizer, searcher, info, say)  # on the device (sft_train moves it there)
        if not has_meta(lm):  # the master weights go back to the host; a meta rank's have no data to move
            lm.cpu()
    policy, value, ref, start = build_models(cfg, info, lm, tokenizer, out_dir, offload=offload)
    train_state = [policy] + ([value] if value is not None else [])
    engine, offloaded = make_rollout_engine(cfg, info, tokenizer, start, train_state, say, offload)
    backend = make_backend(cfg, engine, info.device, policy_config=policy.module.lm.config)
    proceed_hook = build_proceed_hook(cfg, backend, engine, tokenizer)
    # the choice in the run's metrics too (its first step's line): 1 the state moves, 0 it stays
    memory: dict = {"offload_state/moves": float(offload.moves)} if info.is_main else {}

    def log_memory(boundary: str, mem: dict) -> None:
        if mem and info.is_main:
            memory.update({f"memory/{boundary}/{k}": v for k, v in mem.items()})

    judges = build_judge_phase(cfg, backend, engine, info.device)
    # A state that stays keeps the HF engine's weights too (its sleep would move them to the host; level 0 only
    # empties torch's cache, its KV cache). vLLM keeps rollout.sleep_level: its level 1 copies the weights to the
    # host and back, level 2 drops them and the sync after every update refills them.
    policy_level = 0 if cfg.rollout.engine == "hf" and not offload.moves else cfg.rollout.sleep_level
    phases = PhaseManager(engine, getattr(judges, "engine", None), train_state, info.device, policy_level,
                          cfg.judges.sleep_level, cfg.distributed.colocate,
                          sync_fn=lambda trained: engine.update_weights(trained.full_state(engine.weight_dtype)),
                          log=log_memory, judge_weights=getattr(backend, "weights", None),
                          train_on_device=not offloaded, judge_in_rollout=cfg.rollout.proceed.enabled,
                          move_state=moves_training_state(cfg, info, offload))
    if start.load_format == "dummy":
        phases.mark_updated()  # the engine started without weights: the first rollout streams them in
    return Parts(data, tokenizer, searcher, retriever, policy, value, ref, engine, proceed_hook, judges, phases,
                 memory)


def moves_training_state(cfg: TrainConfig, info, offload=None) -> bool:
    """Whether the training state and the reference policy leave the GPU while the engines roll out and judge
    (the phase manager's ``move_state``; the reference starts on the host exactly when its passes will bring it
    in): ``offload``, the run's :class:`~fastcredit.trainer.memory.offload.OffloadChoice`, else the choice for this
    rank's device (``local_offload``: no GPU, nothing moves)."""
    if offload is None:
        from fastcredit.trainer.memory.offload import local_offload

        offload = local_offload(cfg, info.device, info.world_size)
    return offload.moves


def build_models(cfg: TrainConfig, info, lm, tokenizer, out_dir: str, engine: bool = True,
                 offload=None) -> tuple[Any, Any, Any, EngineStart]:
    """``(policy, value, ref, engine start)`` from the policy ``lm``: the policy (and value model) as fp32 master
    weights sharded by the training engine; the reference policy as a frozen copy in the compute dtype, sharded
    the same way and, when the training state moves (``offload``: :func:`moves_training_state`), on the device
    only while it is used; what the rollout engine starts from (nothing without ``engine``: a split placement's
    training ranks have none)."""
    from fastcredit.distributed.build import build_train_engine, compute_dtype
    from fastcredit.distributed.engine import adamw
    from fastcredit.distributed.fsdp import FrozenModel
    from fastcredit.models.packed import PolicyModel, ValueModel

    o, impl = cfg.optim, cfg.loss.impl
    dtype = compute_dtype(cfg.distributed, info, cfg.model.dtype)
    # The rollout engine's weights: the HF engine's own copy in the compute dtype; vLLM loads a folder.
    start = EngineStart(lm=hf_engine_copy(cfg, lm, dtype, info)) if engine and cfg.rollout.engine == "hf" \
        else EngineStart()
    ref = FrozenModel(PolicyModel(frozen_copy(lm, dtype), impl), info) \
        if cfg.loss.kl_coef or cfg.credit.kl_in_reward else None
    if ref is not None and engine and moves_training_state(cfg, info, offload):
        ref.offload()  # on the GPU only for its passes (PhaseManager.using); a split placement's stays there
    # copied before the policy's engine shards lm (ZeRO-3 leaves empty placeholders behind)
    value_lm = frozen_copy(lm).requires_grad_(True).train() if estimator_needs(cfg.credit.estimator).value_model \
        else None
    if engine and cfg.rollout.engine == "vllm":
        start.folder, start.load_format = vllm_start_folder(cfg, lm, tokenizer, out_dir, info.rank,
                                                            cfg.warmstart.enabled)
    policy = build_train_engine(PolicyModel(lm, impl), info, cfg.distributed,
                                adamw(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay), o.grad_clip, dtype)
    value = None if value_lm is None else build_train_engine(
        ValueModel(value_lm), info, cfg.distributed, adamw(lr=o.critic_lr, weight_decay=o.weight_decay),
        o.grad_clip, dtype)
    return policy, value, ref, start


def warm_start(lm, cfg: TrainConfig, data: Data, tokenizer, searcher, info, say: Callable[[str], None]) -> None:
    """SFT of ``lm`` on oracle trajectories; observations come from the run's own searcher, as in rollouts. With
    ``warmstart.cache_dir`` a warm start of the same config is loaded instead of redone (``sft.cached_warm_start``)."""
    from fastcredit.data.detours import choose_detours, planned_queries
    from fastcredit.data.toyqa import oracle_actions
    from fastcredit.distributed.from_rank0 import has_meta
    from fastcredit.trainer.sft import cached_warm_start, sft_sequences, sft_train, warm_start_fingerprint

    w = cfg.warmstart
    seed = w.seed_for(cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # what the SFT batches pad with

    def run() -> str:
        examples = [ex for ex in data.train if ex.metadata.get("hops")]
        examples = examples[: w.questions] if w.questions else examples
        t0 = time.time()
        plan = detour_plan(cfg, examples, seed)
        queries = sorted({h["query"] for ex in examples for h in ex.metadata["hops"]} | set(planned_queries(plan)))
        found = dict(zip(queries, searcher(queries)))  # on every rank: the searcher may be split over the ranks
        if has_meta(lm):  # loads_on_rank0: rank 0 warm-starts the weights every rank is filled from
            return "warm start: on rank 0"
        detours = choose_detours(plan, examples, {q: ids for q, (_, ids) in found.items()})
        seqs = sft_sequences(examples, prompt_ids(cfg, tokenizer, examples), tokenizer, lambda q: found[q][0],
                             seed=seed, actions=lambda ex, rng: oracle_actions(ex, rng, detour=detours.get(ex.id)))
        bar = cfg.logging.progress and info.is_main
        losses = sft_train(lm, seqs, pad_id, w.epochs, w.lr, w.batch_size, seed, str(info.device),
                           progress=bar, on_epoch=None if bar else lambda k, loss: say(
                               f"warm start: epoch {k}/{w.epochs}, loss {loss:.3f} ({time.time() - t0:.0f} s)"),
                           threads=w.threads)
        made = f" ({len(detours)} with a detour)" if w.detour_fraction else ""
        # the mean loss of the first epoch and of the last (one epoch: its mean)
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if len(losses) > 1 else f"{losses[0]:.3f}"
        epochs = f"{w.epochs} epoch{'s' if w.epochs > 1 else ''}"
        return f"warm start: {len(seqs)} oracle trajectories{made} x {epochs} in {time.time() - t0:.0f} s, loss {loss}"

    cached_warm_start(lm, w.cache_dir, warm_start_fingerprint(cfg), run, say)
    lm.requires_grad_(True).train()


def detour_plan(cfg: TrainConfig, examples: list, seed: int) -> dict:
    """The warm start's planned detours (``fastcredit.data.detours.plan_detours``, ``warmstart.detour_fraction`` of
    the examples; the world's entities read from ``data.world_dir``); empty at fraction 0."""
    if not cfg.warmstart.detour_fraction:
        return {}
    from fastcredit.data.detours import plan_detours
    from fastcredit.data.toyworld import load_world

    entities = load_world(cfg.data.world_dir).entities
    return plan_detours(examples, entities, cfg.warmstart.detour_fraction, random.Random(f"detours-{seed}"))


def make_rollout_engine(cfg: TrainConfig, info, tokenizer, start: EngineStart, train_state: list,
                        say: Callable[[str], None], offload=None) -> tuple[Any, bool]:
    """``(engine, offloaded)``: the rollout engine ``rollout.engine`` names, started from ``start``. Sizing vLLM's
    memory share may offload the training state first (``offloaded``; ``offload``: the run's choice, None where no
    training state shares the GPU: see :func:`vllm_memory_share`)."""
    from fastcredit.rollout.engines import make_engine

    kw, offloaded = {}, False
    if cfg.rollout.engine == "vllm":
        util, offloaded = vllm_memory_share(cfg, info.device, start.folder, train_state, say, offload)
        kw = {"model_path": start.folder, "memory_utilization": util, "load_format": start.load_format}
    return make_engine(cfg.rollout.engine, start.lm, tokenizer, cfg.rollout, device=info.device, **kw), offloaded


def load_data(cfg: TrainConfig, rank: int = 0) -> Data:
    """The toy world (generated once into ``data.world_dir``, rank 0 writes) or Search-R1 / FlashRAG files.
    A missing file, an empty training set or a missing ``retrieval.corpus`` is an error naming it."""
    check_paths(cfg, "data")  # before anything is read or generated
    data = _load_data(cfg, rank)
    if not data.train:
        where = cfg.data.train_path if cfg.data.source != "toy" else os.path.join(cfg.data.world_dir, "train.jsonl")
        raise DataError(f"{where}: no training questions (an empty file?)")
    if cfg.data.prompt_source == "parquet":  # every row must bring its own prompt: say so before anything trains
        splits = (("train", cfg.data.train_path, data.train), ("test", cfg.data.test_path, data.test))
        for split, path, examples in splits:
            missing = next((ex for ex in examples if ex.prompt is None), None)
            if missing is not None:
                raise DataError(f"{path or cfg.data.world_dir}: {split} example {missing.id!r} has no 'prompt' field, "
                                "which data.prompt_source=parquet reads (the toy world has none; "
                                "data.prompt_source=template builds prompts from the questions)")
    if data.corpus is None and cfg.retrieval.backend == "local":
        raise ConfigError(f"data.source={cfg.data.source} needs retrieval.corpus: the corpus jsonl (Search-R1 format) "
                          "the retriever searches, the one its index was built from")
    return data


def _load_data(cfg: TrainConfig, rank: int) -> Data:
    if cfg.data.source == "toy":
        from fastcredit.data.toyworld import generate_world, write_world

        folder = cfg.data.world_dir
        key = {"toy": asdict(cfg.data.toy)}
        if rank == 0 and not built_from(folder, key):
            import shutil

            # the retriever's default index next to the corpus belongs to the old world
            shutil.rmtree(os.path.join(folder, "corpus.fastcredit"), ignore_errors=True)
            write_world(generate_world(cfg.data.toy), folder)
            mark_built(folder, key)
        wait_for_built(folder, key)
        return Data(load_qa(os.path.join(folder, "train.jsonl")), load_qa(os.path.join(folder, "test.jsonl")),
                    os.path.join(folder, "corpus.jsonl"))
    test = load_qa(cfg.data.test_path) if cfg.data.test_path else []
    return Data(load_qa(cfg.data.train_path), test, cfg.retrieval.corpus)


def load_tokenizer(cfg: TrainConfig, data: Data, out_dir: str, rank: int = 0):
    """The policy's tokenizer; ``tiny`` trains a byte-level BPE over the corpus and prompts (rank 0, once)."""
    check_paths(cfg, "model")  # a missing folder named here, not as a Hugging Face hub id
    from transformers import AutoTokenizer

    if cfg.model.policy != "tiny":
        if cfg.model.policy == "smollm2":
            folder, gguf = smollm2_files()
            return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        return AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.policy, local_files_only=True)
    if cfg.model.tokenizer:
        return AutoTokenizer.from_pretrained(cfg.model.tokenizer, local_files_only=True)
    folder = os.path.join(out_dir, "tokenizer")
    corpus = os.stat(data.corpus)
    key = {"vocab": cfg.model.tiny_vocab, "template": cfg.data.prompt_template, "corpus": data.corpus,
           "corpus_bytes": corpus.st_size, "corpus_mtime_ns": corpus.st_mtime_ns, "train_questions": len(data.train)}
    if rank == 0 and not built_from(folder, key):
        from fastcredit.data.loaders import iter_corpus
        from fastcredit.data.prompts import build_prompt
        from fastcredit.data.tokenizer import build_tiny_tokenizer

        texts = [f'Doc 1(Title: "{t}") {x}' for _, t, x in iter_corpus(data.corpus)]
        texts += [build_prompt(ex.question, cfg.data.prompt_template) for ex in data.train]
        build_tiny_tokenizer(texts, cfg.model.tiny_vocab, folder)
        mark_built(folder, key)
    wait_for_built(folder, key)
    return AutoTokenizer.from_pretrained(folder)


def loads_on_rank0(cfg: TrainConfig, info) -> bool:
    """Whether a policy read from files is read on rank 0 only (torchrun with FSDP2): the other ranks build it on
    the meta device and FSDP2 fills their shards from rank 0 (``fastcredit.distributed.from_rank0``). A tiny
    policy is built in code on every rank; DeepSpeed loads on every rank."""
    # a split placement's training ranks each read the file (their group is not the job's, which the broadcast uses)
    return info is not None and info.distributed and info.group is None and cfg.distributed.engine == "fsdp2" \
        and cfg.model.policy != "tiny"


def load_policy(cfg: TrainConfig, tokenizer, info=None, meta: bool = False) -> torch.nn.Module:
    """The policy's HF causal LM in float32 on the CPU: the master weights the training engine shards onto the
    device (``model.dtype`` is the compute dtype there, not the storage dtype). Under :func:`loads_on_rank0`,
    ranks other than 0 get the same model on the meta device (no memory); so does ``meta`` (a policy read from
    files, whose weights come from elsewhere: a split placement's vLLM rollout ranks need its architecture only)."""
    check_paths(cfg, "model")
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    if m.policy != "tiny" and (meta or (loads_on_rank0(cfg, info) and info.rank != 0)):
        folder, gguf = smollm2_files() if m.policy == "smollm2" else (m.policy, None)
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **({"gguf_file": gguf} if gguf else {}))
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32,
                                                  attn_implementation=m.attn_impl if m.policy != "smollm2" else None)
        return lm.float()
    if m.policy == "tiny":
        from fastcredit.models.tiny import build_tiny_policy

        # a warm-started policy is initialised by the warm start's seed: it is part of the warm start
        seed = cfg.warmstart.seed_for(cfg.seed) if cfg.warmstart.enabled else cfg.seed
        lm = build_tiny_policy(tokenizer, hidden=m.tiny_hidden, layers=m.tiny_layers, heads=m.tiny_heads, seed=seed,
                               intermediate=m.tiny_intermediate, kv_heads=m.tiny_kv_heads, vocab_rows=m.tiny_vocab_rows)
    elif m.policy == "smollm2":
        from fastcredit.models.smollm2 import CACHE, prepare_smollm2

        # de-quantised from the package's GGUF once per machine (20-60 s), then read as a plain fp32 folder; NOTE: not
        # a bare from_pretrained(gguf_file=...): transformers marks that model quantized and it refuses .float()
        lm = AutoModelForCausalLM.from_pretrained(prepare_smollm2(CACHE), torch_dtype=torch.float32,
                                                  local_files_only=True, attn_implementation=m.attn_impl)
    else:
        lm = AutoModelForCausalLM.from_pretrained(m.policy, torch_dtype=torch.float32, local_files_only=True,
                                                  attn_implementation=m.attn_impl)
    return lm.float()


def frozen_copy(lm, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """A frozen copy (reference policy, or the HF engine's own weights), cast to ``dtype`` when given."""
    ref = copy.deepcopy(lm)
    ref.requires_grad_(False)
    return (ref if dtype is None else ref.to(dtype)).eval()


def hf_engine_copy(cfg: TrainConfig, lm, dtype: Optional[torch.dtype], info) -> torch.nn.Module:
    """The HF rollout engine's own frozen copy of the policy in the compute dtype, whole on every rank
    (broadcast from rank 0 where the other ranks hold ``lm`` on the meta device)."""
    copy_ = frozen_copy(lm, dtype)
    if not loads_on_rank0(cfg, info):
        return copy_
    from fastcredit.distributed.from_rank0 import broadcast_module

    return broadcast_module(copy_, info, info.device)


def vllm_start_folder(cfg: TrainConfig, lm, tokenizer, out_dir: str, rank: int,
                      modified: bool) -> tuple[str, str]:
    """``(folder, load_format)`` vLLM starts from: the policy's own folder when its weights are as loaded;
    else (tiny / packaged / ``modified``, e.g. warm-started, policies) the model's config and tokenizer
    in the run directory, one folder per rank, and ``dummy`` weights: the trainer streams the real ones
    in before the first rollout (no rank writes or reads a weight file; ranks other than 0 may hold
    ``lm`` on the meta device)."""
    if os.path.isdir(cfg.model.policy) and not modified:
        return cfg.model.policy, "auto"
    folder = os.path.join(out_dir, f"engine_config_rank{rank}")
    os.makedirs(folder, exist_ok=True)
    config = copy.deepcopy(lm.config)
    config.architectures = [type(lm).__name__]
    # NOTE: the config's own save_pretrained is not used: transformers writes checkpoints on rank 0 only
    config.to_json_file(os.path.join(folder, "config.json"))
    tokenizer.save_pretrained(folder)
    return folder, "dummy"


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


def make_searcher(cfg: TrainConfig, tokenizer, corpus: str, progress: bool = True,
                  device: Optional[torch.device] = None, info=None):
    """The rollout's :data:`~fastcredit.rollout.agent.Searcher` (in-process retriever, or a ``/retrieve`` server).

    ``device``: the process's own device (the trainer's ``info.device``); a GPU index starts
    there and spreads over ``retrieval.num_shards`` consecutive GPUs (1: only this one).
    ``info``: the :class:`~fastcredit.distributed.process_group.DistInfo`; with several ranks and
    ``retrieval.across_ranks=shard`` every rank holds 1/W of the index and searches go through
    retrieval rounds with the other ranks (``fastcredit.retrieval.ranks``): every rank must
    call this, and search, in step.
    """
    from fastcredit.rollout.agent import http_searcher, retriever_searcher

    r = cfg.retrieval
    check_paths(cfg, "retrieval")  # corpus, encoder, and an index retrieval.build_index will not build
    if r.backend == "http":
        from fastcredit.retrieval.client import RetrievalClient

        return http_searcher(RetrievalClient(r.url), tokenizer, r.topk), None
    from fastcredit.retrieval.retriever import from_config

    # retrieval.device "cuda" / "auto" in a CUDA process means the process's own GPU
    if device is None and info is not None:
        device = info.device
    own = str(device) if device is not None and torch.device(device).type == "cuda" and r.device != "cpu" else None
    ranks = {} if info is None else {"rank": info.rank, "world_size": info.world_size, "group": info.group}
    retriever = from_config(r, tokenizer=tokenizer, corpus=corpus, progress=progress, device=own, **ranks)
    return retriever_searcher(retriever, r.topk, r.max_passage_tokens, cfg.rollout.max_obs_tokens), retriever


def sampling_params(cfg: TrainConfig, tokenizer, greedy: bool = False):
    """The rollout's sampling parameters (``rollout.*``); ``greedy``: temperature 0, as evaluation decodes."""
    from fastcredit.rollout.engines.base import SamplingParams

    r = cfg.rollout
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return SamplingParams(max_tokens=r.max_action_tokens, temperature=0.0 if greedy else r.temperature,
                          top_p=1.0 if greedy else r.top_p, top_k=-1 if greedy else r.top_k,
                          # the sampled tokens' log-probs are the behaviour policy's when turns may lag (offpolicy)
                          stop_token_ids=eos, logprobs=r.max_staleness > 0 and not greedy, seed=None)


def agent_loop(cfg: TrainConfig, engine, searcher, greedy: bool = False, hook=None):
    """The agent loop training and evaluation both roll out with (``rollout.*`` limits and mode,
    ``retrieval.batch_size`` / ``batch_timeout_ms`` for the asynchronous retrieval batcher)."""
    from fastcredit.rollout.agent import AgentLimits, AgentLoop

    r = cfg.retrieval
    params = sampling_params(cfg, engine.tokenizer, greedy)
    return AgentLoop(engine, searcher, AgentLimits.from_config(cfg.rollout), params, mode=cfg.rollout.mode,
                     retrieval_batch=r.batch_size, retrieval_timeout_ms=r.batch_timeout_ms, step_hook=hook)


def prompt_ids(cfg: TrainConfig, tokenizer, examples: list) -> list[list[int]]:
    """The examples' prompt token ids, as ``data.prompt_source`` / ``data.prompt_template`` and
    ``model.chat_template`` make them (rollouts, evaluation and the warm start alike)."""
    d = cfg.data
    return example_prompt_ids(tokenizer, examples, d.prompt_source, d.prompt_template, cfg.model.chat_template)
