"""A split placement's parts: what the training ranks build, what the rollout ranks build.

The training ranks build the models and their training engines (policy, value model, reference) and no
rollout engine, retriever or judge; the rollout ranks build the engine, the retriever, the judges and
ProCeed's hook, and hold the policy's weights only as the engine's copy plus a host copy of the latest
version received (:class:`WeightMirror`, what a critic switch loads back). Both read the same data and
tokenizer (the job's rank 0 writes generated ones). See ``fastcredit.trainer.parts`` for each builder.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from fastcredit.config import TrainConfig
from fastcredit.trainer.parts import (Parts, build_models, load_data, load_policy, load_tokenizer, make_rollout_engine,
                                      make_searcher, warm_start)


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


def build_train_parts(cfg: TrainConfig, layout, out_dir: str, say: Callable[[str], None]) -> Parts:
    """The training ranks' parts: data, tokenizer, the policy (warm-started here: a retriever is opened for the
    warm start's observations only), value model and reference with their training engines."""
    from fastcredit.distributed.colocate import PhaseManager

    info = layout.info
    data = load_data(cfg, layout.global_rank)
    tokenizer = load_tokenizer(cfg, data, out_dir, layout.global_rank)
    lm = load_policy(cfg, tokenizer, info)
    if cfg.warmstart.enabled:
        opened: list = []

        def searcher(queries):  # a retriever for the warm start's observations, opened only if it is not cached
            if not opened:
                opened.append(make_searcher(cfg, tokenizer, data.corpus, device=info.device,
                                            progress=cfg.logging.progress and info.is_main)[0])
            return opened[0](queries)

        warm_start(lm, cfg, data, tokenizer, searcher, info, say)
        lm.cpu()
        opened.clear()
    policy, value, ref, _ = build_models(cfg, info, lm, tokenizer, out_dir, engine=False)
    train_state = [policy] + ([value] if value is not None else [])
    # nothing to colocate with: the training state stays on the device, no engine sleeps
    phases = PhaseManager(None, None, train_state, info.device, colocate=False, move_state=False)
    return Parts(data, tokenizer, None, None, policy, value, ref, None, None, None, phases, {})


def build_rollout_parts(cfg: TrainConfig, layout, out_dir: str, say: Callable[[str], None]) -> Parts:
    """The rollout ranks' parts: data, tokenizer, the searcher, the rollout engine (its weights come from the
    training rank before the first rollout), the judges and ProCeed's hook; ``policy`` is a :class:`WeightMirror`."""
    from fastcredit.distributed.build import compute_dtype
    from fastcredit.distributed.colocate import PhaseManager
    from fastcredit.judges.phase import build_judge_phase, build_proceed_hook, make_backend
    from fastcredit.trainer.parts import EngineStart, frozen_copy, vllm_start_folder

    info = layout.info
    data = load_data(cfg, layout.global_rank)
    tokenizer = load_tokenizer(cfg, data, out_dir, layout.global_rank)
    # retrieval.across_ranks=shard: the index split over the rollout ranks, searched in rounds among them
    searcher, retriever = make_searcher(cfg, tokenizer, data.corpus, progress=False, device=info.device, info=info)
    # the architecture; the training rank streams the weights (vLLM: not even read from the files)
    lm = load_policy(cfg, tokenizer, None, meta=cfg.rollout.engine == "vllm")
    dtype = compute_dtype(cfg.distributed, info, cfg.model.dtype)
    if cfg.rollout.engine == "hf":
        start = EngineStart(lm=frozen_copy(lm, dtype))
    else:
        folder, load_format = vllm_start_folder(cfg, lm, tokenizer, out_dir, layout.global_rank, modified=True)
        start = EngineStart(folder=folder, load_format=load_format)
    engine, _ = make_rollout_engine(cfg, info, tokenizer, start, [], say)
    backend = make_backend(cfg, engine, info.device, policy_config=lm.config)
    proceed_hook = build_proceed_hook(cfg, backend, engine, tokenizer)
    judges = build_judge_phase(cfg, backend, engine, info.device)
    mirror = WeightMirror()
    phases = PhaseManager(engine, getattr(judges, "engine", None), [], info.device, cfg.rollout.sleep_level,
                          cfg.judges.sleep_level, colocate=False,
                          sync_fn=lambda w: engine.update_weights(w.full_state(engine.weight_dtype)),
                          judge_weights=getattr(backend, "weights", None), move_state=False)
    phases.mark_updated()  # nothing loaded until the training rank's first weights arrive
    return Parts(data, tokenizer, searcher, retriever, mirror, None, None, engine, proceed_hook, judges, phases, {})
