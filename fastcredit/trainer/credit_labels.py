"""The step's good / wasted search labels and the credit-accuracy metrics they give, for every estimator.

Legend (shape suffixes): S turns of the batch.

Labels come from the rollout itself, not from the judge phase (outcome-only GRPO has none): on the toy
world, the passages each search retrieved (``StepInfo.retrieved_ids``) against the question's gold hops
(``fastcredit.data.toyqa.new_hop_turns``, the oracle judges' own rule); elsewhere, the labels of the judge
the run already has, named as such (``fastcredit.credit.accuracy.judge_turn_labels``); without either,
no metric.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit.credit.accuracy import credit_accuracy_metrics, judge_turn_labels
from fastcredit.credit.types import CreditInputs, CreditResult, TurnKind
from fastcredit.data.lookup import GOOD, HARMFUL, WASTED, search_labels
from fastcredit.data.toyqa import new_hop_turns, question_hops


def gold_turn_labels(episodes, examples) -> Optional[torch.Tensor]:
    """float64 ``[S]``: 1 where the turn retrieved a gold passage of a hop no earlier turn had found, else 0, over
    the turns of ``episodes`` (``fastcredit.rollout.agent.Episode``) in batch order; None unless every question
    of ``examples`` carries gold hops (the toy world). Non-search turns retrieve nothing, so they get 0; the
    metrics read search turns only."""
    if not examples or not all(question_hops(ex) for ex in examples):
        return None
    labels: list = []
    for e, ex in zip(episodes, examples):
        labels += new_hop_turns(ex, [s.retrieved_ids for s in e.steps])
    return torch.tensor(labels, dtype=torch.float64)


def search_label_metrics(episodes, examples) -> dict:
    """``searches/{good,wasted,harmful}_per_traj``: the step's search turns by their gold label
    (``fastcredit.data.lookup.search_labels``; harmful needs the lookup world's decoys, so the chain world logs 0
    there), per trajectory; empty unless every question carries gold hops."""
    if not examples or not all(question_hops(ex) for ex in examples):
        return {}
    counts = {GOOD: 0, WASTED: 0, HARMFUL: 0}
    for e, ex in zip(episodes, examples):
        labels = search_labels(ex, [s.retrieved_ids for s in e.steps])
        for step, label in zip(e.steps, labels):
            if step.kind == TurnKind.SEARCH:
                counts[label] += 1
    return {f"searches/{label}_per_traj": n / len(episodes) for label, n in counts.items()}


def turn_labels(batch, reward_B: torch.Tensor, episodes, examples, extras: dict) -> Optional[tuple]:
    """``(label_S, source)``: the step's good (1) / wasted (0) turn labels and where they come from: the gold hops
    where the questions have them (``"gold"``), else the judge's; None without either. Computed where the episodes
    are (the rollout side of a split placement), used where the advantages are (:func:`credit_accuracy`)."""
    label_S = gold_turn_labels(episodes, examples)
    if label_S is None:
        return judge_turn_labels(CreditInputs.from_batch(batch, reward_B, **extras))
    if label_S.numel() != batch.num_turns:
        raise ValueError(f"the episodes have {label_S.numel()} turns and the batch {batch.num_turns}: they must align")
    return label_S, "gold"


def credit_accuracy(batch, reward_B: torch.Tensor, extras: dict, credit: CreditResult,
                    labels: Optional[tuple]) -> dict:
    """``credit/*`` credit-accuracy metrics of the step's advantages (``fastcredit.credit.accuracy``) against
    ``labels`` (:func:`turn_labels`; names suffixed ``/<judge>`` for a judge's labels); empty without labels.
    ``extras``: the judge phase's CreditInputs fields."""
    if labels is None:
        return {}
    inputs = CreditInputs.from_batch(batch, reward_B, **extras)
    label_S, source = labels
    return {f"credit/{k}": v for k, v in credit_accuracy_metrics(inputs, credit, label_S, source).items()}
