"""Outcome rewards: answer extraction, EM, F1, the format check, and the reward formulas.

Everything here takes untrusted model text and never raises on it: malformed, nested
or unbalanced tags, missing answers, unicode and very long text all give a defined
result (usually "no answer" / "not well formed").
"""
from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

# An answer pair with no answer tag inside it: the innermost pairs, in order.
_ANSWER_PAIR = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)
_TAGS = ("think", "search", "answer", "information")
_ANY_TAG = re.compile(r"</?(?:think|search|answer|information)>")
_INFO_BLOCK = re.compile(r"<information>.*?</information>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
# One well-formed action: optional think, then exactly one search or answer, nothing else.
_ACTION = re.compile(
    r"\s*(?:<think>(?P<think>.*?)</think>\s*)?"
    r"<(?P<tag>search|answer)>(?P<body>.*?)</(?P=tag)>\s*",
    re.DOTALL,
)


def extract_answer(text: Optional[str]) -> Optional[str]:
    """The body of the last complete ``<answer>…</answer>``, stripped; None if there is none.

    With nested or stray openings (``<answer>a <answer>b</answer>``) the innermost opening
    before the last closing tag wins, so the result never contains an ``<answer>`` tag.
    An empty answer counts as no answer.
    """
    if not isinstance(text, str):
        return None
    last = None
    for last in _ANSWER_PAIR.finditer(text):
        pass
    if last is None:
        return None
    body = last.group(1).strip()
    return body or None


def normalize_answer(text: str) -> str:
    """SQuAD normalisation exactly as Search-R1's ``qa_em.normalize_answer``: lower case, drop ASCII punctuation,
    then a/an/the, collapse white space. No unicode folding (NFKC would score "ﬁve" or full-width letters
    differently from the papers' tables)."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golden_answers) -> list[str]:
    if isinstance(golden_answers, str):
        return [golden_answers]
    return [str(g) for g in (golden_answers or [])]


def exact_match(prediction: Optional[str], golden_answers) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(golden_answers)))


def _f1_one(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred), normalize_answer(gold)
    # HotpotQA's rule: yes / no / noanswer only match themselves exactly.
    if (p in ("yes", "no", "noanswer") or g in ("yes", "no", "noanswer")) and p != g:
        return 0.0
    common = Counter(p.split()) & Counter(g.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p.split()), same / len(g.split())
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: Optional[str], golden_answers) -> float:
    """Token-level F1 of the normalised strings, max over gold answers."""
    if prediction is None:
        return 0.0
    return max((_f1_one(prediction, g) for g in _golds(golden_answers)), default=0.0)


def parse_action(action: str) -> Optional[tuple[str, str]]:
    """``("search"|"answer", body)`` when the action is well formed, else None.

    Well formed: optional ``<think>…</think>``, then exactly one ``<search>…</search>`` or
    ``<answer>…</answer>`` with a non-empty body, white space around, and no other tag
    anywhere (nested or stray tags make the action malformed).
    """
    if not isinstance(action, str):
        return None
    m = _ACTION.fullmatch(action)
    if m is None:
        return None
    inner = (m.group("think") or "") + m.group("body")
    if _ANY_TAG.search(inner) or not m.group("body").strip():
        return None
    return m.group("tag"), m.group("body").strip()


def format_ok_actions(actions: Sequence[str]) -> bool:
    """Every action well formed; all but the last are searches; the last is the one answer."""
    if not actions:
        return False
    parsed = [parse_action(a) for a in actions]
    if any(p is None for p in parsed):
        return False
    return all(p[0] == "search" for p in parsed[:-1]) and parsed[-1][0] == "answer"


def split_actions(response: str) -> list[str]:
    """Split a response's text into actions: drop ``<information>`` blocks, cut after each ``</search>``.

    Only for text-only inputs; the rollout knows its turn boundaries and calls
    :func:`format_ok_actions` directly (text alone cannot tell a real observation from
    one the policy wrote itself).
    """
    if not isinstance(response, str):
        return []
    text = _INFO_BLOCK.sub("", response)
    pieces = re.split(r"(?<=</search>)", text)
    return [p for p in pieces if p.strip()]


def format_ok(response: str) -> bool:
    """:func:`format_ok_actions` over :func:`split_actions` of a full response text."""
    return format_ok_actions(split_actions(response))


def criticsearch_reward(em: float, format_ok: bool, lambda_f: float = 0.2) -> float:
    """CriticSearch Eq. 4: 1, 1-λf, λf or 0 by (EM, format)."""
    if em >= 1.0:
        return 1.0 if format_ok else 1.0 - lambda_f
    return lambda_f if format_ok else 0.0


def f1_format_reward(f1: float, format_ok: bool, format_bonus: float = 0.2) -> float:
    """PiCA's outcome ``r_out = F1 + format reward`` (the bonus is paid when the format holds)."""
    return float(f1) + (format_bonus if format_ok else 0.0)


REWARD_KINDS = ("criticsearch", "em", "f1", "f1_format")


@dataclass
class Outcome:
    """What the outcome reward needs to know about one finished trajectory."""

    prediction: Optional[str]
    em: float
    f1: float
    format_ok: bool
    reward: float


def score_trajectory(
    actions: Sequence[str],
    golden_answers,
    kind: str = "criticsearch",
    lambda_f: float = 0.2,
    format_bonus: float = 0.2,
) -> Outcome:
    """Extract the answer from the last action and score it with the chosen reward."""
    if kind not in REWARD_KINDS:
        raise ValueError(f"unknown reward {kind!r}; valid: {', '.join(REWARD_KINDS)}")
    prediction = extract_answer(actions[-1]) if actions else None
    em, f1 = exact_match(prediction, golden_answers), f1_score(prediction, golden_answers)
    fmt = format_ok_actions(actions)
    reward = {
        "criticsearch": lambda: criticsearch_reward(em, fmt, lambda_f),
        "em": lambda: em,
        "f1": lambda: f1,
        "f1_format": lambda: f1_format_reward(f1, fmt, format_bonus),
    }[kind]()
    return Outcome(prediction, em, f1, fmt, float(reward))
