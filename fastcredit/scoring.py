"""The trainer's judge phase: critic labels, CW-GRPO verdicts or PRM outputs for the estimator, plus ProCeed's hook.

``build_scoring(cfg, trainer)`` picks the backend (``judges.backend``: ``oracle`` / ``http`` /
``colocated``) and the judges the estimator needs; ``score(result, examples, reward)``
returns the extra :class:`~fastcredit.credit.registry.CreditInputs` fields and metrics.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit.config import TrainConfig


def make_backend(cfg: TrainConfig, trainer):
    """The judge backend of ``judges.backend`` (None for ``none``)."""
    from fastcredit.judges.backends import EngineBackend, HTTPBackend, OracleBackend

    j = cfg.judges
    if j.backend == "none":
        return None
    if j.backend == "oracle":
        if cfg.data.source != "toy":
            raise ValueError("judges.backend=oracle answers from the toy world's gold facts: it needs data.source=toy")
        return OracleBackend()
    if j.backend == "http":
        return HTTPBackend(j.url, j.model or "judge", j.temperature, j.max_tokens, j.concurrency, j.timeout_s)
    if not j.model:  # colocated self-critic: the policy's own engine
        return EngineBackend(trainer.engine, j.temperature, j.max_tokens)
    from fastcredit.rollout.engines import make_engine
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(j.model, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(j.model, local_files_only=True).to(trainer.info.device).eval()
    return EngineBackend(make_engine(cfg.rollout.engine, lm, tok, cfg.rollout, trainer.info.device), j.temperature,
                         j.max_tokens)


class Scoring:
    """Runs the judges an estimator needs after each rollout."""

    def __init__(self, cfg: TrainConfig, backend, trainer):
        from fastcredit.judges.runner import CriticSearchCritic, CWGRPOJudge

        self.cfg, self.backend = cfg, backend
        est = cfg.credit.estimator
        self.engine = getattr(backend, "engine", None)
        if self.engine is trainer.engine:
            self.engine = None  # the policy's engine: the phase manager already keeps it awake for rollouts
        self.critic = CriticSearchCritic(backend, cfg.credit.critic.retries, cfg.credit.criticsearch.gold_answer) \
            if est == "criticsearch" else None
        self.judge = CWGRPOJudge(backend, cfg.credit.critic.retries) if est == "cwgrpo" else None
        self.prm = cfg.judges.prm if est == "pica" else None
        if self.prm not in (None, "oracle"):
            raise ValueError(f"judges.prm={self.prm!r}: only 'oracle' (the toy world's gold facts) is available until "
                             "the PRM training work lands")

    def score(self, result, examples, reward: torch.Tensor) -> tuple[dict, dict]:
        from fastcredit.judges.runner import run_sync
        from fastcredit.judges.types import items_from_rollout

        extras, metrics = {}, {}
        if self.critic is None and self.judge is None and self.prm is None:
            return extras, metrics
        items = items_from_rollout(result.episodes, examples, result.batch.em_B.tolist(), result.batch.predictions)
        if self.critic is not None:
            label, ok, stats = run_sync(self.critic.score(items))
            extras.update(critic_label_S=label, critic_ok_B=ok)
            metrics.update({f"critic/{k}": float(v) for k, v in stats.items()})
        if self.judge is not None:
            success = (reward > 0).tolist()  # the released code judges only rewarded trajectories
            u, v, ok, stats = run_sync(self.judge.score(items, success))
            extras.update(judge_u_S=u, judge_v_S=v, judge_ok_B=ok)
            metrics.update({f"judge/{k}": float(x) for k, x in stats.items()})
        if self.prm == "oracle":
            from fastcredit.components import oracle_prm

            f0, f = oracle_prm(examples, result.episodes)
            extras.update(prm_f0_B=f0, prm_f_S=f)
        return extras, metrics


def build_scoring(cfg: TrainConfig, trainer) -> Optional[Scoring]:
    """The judge phase of a run, and ``trainer.proceed_hook`` for ProCeed rollouts."""
    backend = make_backend(cfg, trainer)
    trainer.proceed_hook = None
    if cfg.rollout.proceed.enabled:
        from fastcredit.judges.backends import EngineBackend
        from fastcredit.judges.prompts import refine_prompt
        from fastcredit.judges.runner import ProcessCritic
        from fastcredit.rollout.proceed import ProceedHook

        critic_backend = backend or EngineBackend(trainer.engine, cfg.judges.temperature, cfg.judges.max_tokens)
        p = cfg.rollout.proceed
        self_refine = p.refiner == "self"
        refiner = trainer.engine if self_refine else getattr(critic_backend, "engine", None)
        if refiner is None:
            raise ValueError("rollout.proceed.refiner=external needs a colocated judges.model to write refinements")
        trainer.proceed_hook = ProceedHook(ProcessCritic(critic_backend, cfg.credit.critic.retries), refine_prompt,
                                           refiner, trainer.tokenizer, p.tau, p.max_rewinds, self_refine)
    return Scoring(cfg, backend, trainer) if backend is not None or cfg.judges.prm else None
