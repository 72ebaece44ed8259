"""What the Trainer is given by its placement: a batch source and a weights sink.

    source, sink = LocalCollect(rollout_parts, cfg, info, run.timer), EngineSync()     # colocated
    source, sink = MailboxCollect(cfg, layout, run, n_train), RolloutStream(...)       # split (trainer.split)
    trainer = Trainer(cfg, run, training_parts, source, sink)

The Trainer (``fastcredit.trainer.loop``) runs one loop whatever the placement: it takes step ``t``'s batch from its
:class:`BatchSource`, trains on it (``fastcredit.trainer.step.learn``), hands the new weights to its
:class:`WeightsSink` and logs the step. Colocated, the source collects the batch on this rank with the rank's own
engine, searcher and judges (:class:`LocalCollect`), and the sink has nothing to do: the update marked the engine's
weights stale and the phase manager streams the policy in before the next rollout (:class:`EngineSync`). In a split
placement the batches come from the rollout ranks over the mailbox and the weights are streamed to them
(``fastcredit.trainer.split``). Held-out evaluation runs where the engine is, so the source answers it too, and the
source says whether the collapse guard may roll back (the rollout ranks of a split placement have rolled out ahead
of the checkpoint).
"""
from __future__ import annotations

from typing import Optional

from fastcredit.config import TrainConfig
from fastcredit.data.sampler import PromptSampler
from fastcredit.distributed.process_group import DistInfo
from fastcredit.runtime.profiling import PhaseTimer
from fastcredit.trainer.parts import RolloutParts
from fastcredit.trainer.step import Collected, collect


class BatchSource:
    """Where the Trainer's batches come from. The hooks default to nothing; a source overrides those it needs."""

    bound: int = 0  # how many versions older than the policy it trains a batch's turns may be
    no_rollback: Optional[str] = None  # why the collapse guard cannot roll back with this source (None: it can)

    def start(self, step: int, sampler: PromptSampler, resume: bool) -> None:
        """The Trainer is ready at ``step`` (the checkpoint's with ``resume``) with the prompt order ``sampler``."""

    def take(self, step: int, sampler: PromptSampler) -> tuple[Collected, PromptSampler]:
        """Step ``step``'s batch, and the prompt order after it (the Trainer checkpoints it)."""
        raise NotImplementedError

    def learned(self, got: Collected, metrics: dict) -> None:
        """The update on ``got`` is done: the source's own figures into the step's ``metrics`` (this rank's, before
        the rank means)."""

    def finish(self, step: int, got: Collected, metrics: dict) -> None:
        """Step ``step``'s ``metrics`` as the Trainer logs them: the source's last figures in, its records kept."""

    def evaluate(self, step: int) -> dict:
        """Held-out scores of the policy after ``step`` steps, as far as they are known now (empty: none)."""
        raise NotImplementedError

    def late_scores(self, version: int) -> dict:
        """Scores of the policy at ``version`` that came after :meth:`evaluate` was asked for them (empty: none)."""
        return {}


class WeightsSink:
    """Where the policy's weights go after an update: to the engines that roll out."""

    def send(self, version: int) -> None:
        """The policy's weights, as version ``version`` (updates done), on their way to the rollout engines."""
        raise NotImplementedError


class LocalCollect(BatchSource):
    """Colocated: this rank collects every batch (``fastcredit.trainer.step.collect``) and evaluates, with its own
    engine, searcher and judges (``parts``), drawing the prompts from the Trainer's prompt order."""

    def __init__(self, parts: RolloutParts, cfg: TrainConfig, info: DistInfo, timer: PhaseTimer):
        self.parts, self.cfg, self.info, self.timer = parts, cfg, info, timer

    def take(self, step: int, sampler: PromptSampler) -> tuple[Collected, PromptSampler]:
        return collect(self.parts, self.cfg, self.info, self.timer, sampler, step), sampler

    def evaluate(self, step: int) -> dict:
        return evaluate_heldout(self.parts, self.cfg, self.info, self.timer)


class EngineSync(WeightsSink):
    """Colocated: the update marked the engine's weights stale (``PhaseManager.mark_updated``) and the phase manager
    streams the policy into the engine before its next rollout; nothing is sent here."""

    def send(self, version: int) -> None:
        return None


def evaluate_heldout(parts: RolloutParts, cfg: TrainConfig, info: DistInfo, timer: PhaseTimer) -> dict:
    """Held-out scores of greedy rollouts over ``eval.questions`` test questions spread evenly over the data
    sources, each rank of ``info`` rolling out its shard, as ``python -m fastcredit.eval`` does under torchrun
    (:func:`~fastcredit.trainer.heldout.evaluate_shard`): ``{"eval/em", "eval/f1", "eval/em/<source>", …}``,
    empty when evaluation is off. ``eval/em`` is the mean over sources, as the papers average."""
    from fastcredit.retrieval.searcher import eval_searcher
    from fastcredit.rollout.agent import searcher_session
    from fastcredit.trainer.heldout import (eval_metrics, evaluate_shard, sample_per_source, score_records,
                                            source_sums, summarize)
    from fastcredit.trainer.sampling import rollout

    test = parts.shared.data.test
    n = min(cfg.eval.questions, len(test))
    if n == 0:
        return {}
    chosen = sample_per_source(test, n, cfg.eval.seed_for(cfg.seed))  # same on every rank

    searcher = eval_searcher(cfg, parts.rollout.searcher, parts.rollout.retriever, parts.shared.tokenizer,
                             info.distributed)

    def roll(idx: list) -> list:
        result, examples = rollout(parts, cfg, idx, test, greedy=True, searcher=searcher)
        return score_records(result.episodes, examples, idx)

    with timer.phase("eval"), searcher_session(parts.rollout.searcher):
        records = evaluate_shard(chosen, info, roll)
    sources = sorted({test[i].data_source for i in chosen})
    seconds = timer.reset().get("eval", 0.0)
    return {**eval_metrics(summarize(source_sums(records), sources)), "time/eval": seconds}

