"""What judges read about a trajectory: text per turn plus the structured facts an oracle needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StepText:
    kind_name: str  # "search" | "answer" | "invalid" | "truncated"
    action: str
    observation: str = ""
    query: Optional[str] = None
    retrieved_ids: list = field(default_factory=list)


@dataclass
class JudgeItem:
    question: str
    golds: list
    steps: list  # [StepText]
    prediction: Optional[str] = None
    em: float = 0.0
    meta: dict = field(default_factory=dict)  # "example": the QAExample (the oracle reads its gold hops)

    def solution(self) -> str:
        """The response as the policy saw it: actions and observations in order."""
        return "".join(s.action + s.observation for s in self.steps)


def items_from_rollout(episodes, examples, em_B, predictions) -> list[JudgeItem]:
    """One :class:`JudgeItem` per rolled-out trajectory (``fastcredit.rollout.agent.Episode``)."""
    items = []
    for e, ex, em, pred in zip(episodes, examples, em_B, predictions):
        steps = [StepText(s.kind.name.lower(), s.action_text, s.obs_text, s.query, list(s.retrieved_ids))
                 for s in e.steps]
        items.append(JudgeItem(ex.question, list(ex.golden_answers), steps, pred, float(em), {"example": ex}))
    return items


def item_from_episode(e) -> JudgeItem:
    """A :class:`JudgeItem` of an episode in progress (ProCeed's critic); ``meta`` holds ``example`` and ``golds``."""
    from fastcredit.credit.rewards import exact_match, extract_answer

    golds = list(e.meta.get("golds") or [])
    steps = [StepText(s.kind.name.lower(), s.action_text, s.obs_text, s.query, list(s.retrieved_ids)) for s in e.steps]
    pred = extract_answer(steps[-1].action) if steps else None
    em = float(exact_match(pred, golds)) if golds else 0.0
    return JudgeItem(e.meta.get("question", ""), golds, steps, pred, em, {"example": e.meta.get("example")})
