"""What an action is: where a generated turn is cut, and whether it searches, answers or is invalid.

Two rules, by ``rollout.stop_at_tags``:

* **stopped at tags** (``true``, the default): the engine stops generating at ``</search>`` or ``</answer>``, so a
  turn's text ends at its tag. :func:`classify_action`: ``answer`` when it ends with ``</answer>``, ``search`` when
  it ends with ``</search>`` around a non-empty query (the last ``<search>`` opening wins), else ``invalid``.
* **Search-R1's turns** (``false``): the engine decodes to the token cap, as Search-R1's veRL rollout does, and the
  turn is cut afterwards (``search_r1/llm_agent/generation.py``). :func:`cut_at_first_tag` keeps the text up to the
  first ``</search>`` if the turn holds one anywhere, else up to the first ``</answer>``, else all of it
  (``_postprocess_responses``); :func:`classify_searchr1` then takes the **first complete pair**
  ``<search>…</search>`` or ``<answer>…</answer>`` of the kept text (``postprocess_predictions``: the regex
  ``<(search|answer)>(.*?)</\\1>``, DOTALL; its content stripped). So ``<answer>P</answer> x <search>q</search>``
  is an answer, ``… </answer> … </search>`` with no ``<search>`` opening is an answer when an ``<answer>`` opens
  before it, and ``<search></search>`` searches for the empty string, as it does there.

An invalid turn gets Search-R1's corrective observation (:data:`INVALID_OBSERVATION`) and the trajectory goes on.
"""
from __future__ import annotations

import re
from typing import Optional

from fastcredit.rollout.engines.base import GenOutput
from fastcredit.rollout.trajectory import TurnKind

# Search-R1's corrective observation for an action with neither tag (llm_agent/generation.py).
INVALID_OBSERVATION = ("\nMy previous action is invalid. If I want to search, I should put the query between "
                       "<search> and </search>. If I want to give the final answer, I should put the answer "
                       "between <answer> and </answer>. Let me try again.\n")
STOP_STRINGS = ("</search>", "</answer>")
SEARCH_BODY = re.compile(r"<search>(.*?)</search>\s*$", re.DOTALL)
# Search-R1's postprocess_predictions: the first complete pair, the same tag opening and closing it
FIRST_PAIR = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def cut_at_first_tag(ids: list, tokenizer) -> tuple[int, bool]:
    """``(kept, tagged)``: how many of ``ids`` Search-R1 keeps of an action generated without stop strings,
    up to the token that completes the first ``</search>`` if there is one, else the first ``</answer>``,
    else all of them (``search_r1/llm_agent/generation.py``, ``_postprocess_responses``: the text is split at
    ``</search>`` first); shortest prefix by bisection over decodes (a prefix holding a tag only grows)."""
    full = tokenizer.decode(ids, skip_special_tokens=False)
    tag = next((t for t in STOP_STRINGS if t in full), None)
    if tag is None:
        return len(ids), False
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if tag in tokenizer.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo, True


def classify_action(text: str, out: GenOutput) -> tuple[TurnKind, Optional[str]]:
    """``(kind, query)`` of an action that stopped for ``out.finish_reason`` at a stop string.

    ``answer`` when it ends with ``</answer>``; ``search`` when it ends with ``</search>``
    around a non-empty query (the last ``<search>`` opening wins); anything else is
    ``invalid`` (Search-R1 answers it with a corrective message and goes on).
    """
    stripped = text.rstrip()
    if out.finish_reason == "stop" and stripped.endswith("</answer>"):
        return TurnKind.ANSWER, None
    if out.finish_reason == "stop" and stripped.endswith("</search>"):
        body = SEARCH_BODY.search(stripped[stripped.rfind("<search>"):]) if "<search>" in stripped else None
        query = body.group(1).strip() if body else ""
        if query:
            return TurnKind.SEARCH, query
    return TurnKind.INVALID, None


def classify_searchr1(text: str) -> tuple[TurnKind, Optional[str]]:
    """``(kind, query)`` of a turn's kept text (:func:`cut_at_first_tag`) by Search-R1's first-complete-pair rule:
    the first ``<search>q</search>`` or ``<answer>…</answer>`` anywhere in it; none: ``invalid``. A search's query
    is its content stripped, empty included (Search-R1 sends it to the retriever as it is)."""
    match = FIRST_PAIR.search(text)
    if match is None:
        return TurnKind.INVALID, None
    if match.group(1) == "answer":
        return TurnKind.ANSWER, None
    return TurnKind.SEARCH, match.group(2).strip()
