"""Defensive parsers of judge output: they never raise; ``None`` means "could not parse" (counted by the runners).

The last verdict in an output wins (judges analyse first, then conclude). A verdict counts
only when the judge wrote it (:mod:`fastcredit.judges.untrusted`):

* its markup is literal ASCII in the output (``<score>``, not ``＜score＞``; CW-GRPO keys spelled
  out, not ``thinking\\u005freward``, which ``json.loads`` would decode);
* it is not inside a copy of the agent text the prompt quoted (``quoted``: the texts as the
  prompt showed them, compared after folding, so a copy the judge NFKC-normalised or decoded
  is recognised). Trajectory text reaches a judge neutralised, so a copy holds no verdict
  anyway; this is the second line.
"""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

from fastcredit.judges.untrusted import blank_echoed_verdicts

_MAX_CHARS = 200_000  # longer outputs are cut (from the front: the verdict comes last)
_SCORE = re.compile(r"<score>(.*?)</score>", re.DOTALL | re.IGNORECASE | re.ASCII)
_RATING = re.compile(r"<rating>\s*(-?\d{1,3})\s*</rating>", re.IGNORECASE | re.ASCII)
_CRITIQUE = re.compile(r"<critique>(.*?)</critique>", re.DOTALL | re.IGNORECASE | re.ASCII)
_LABELS = re.compile(r"<labels>(.*?)</labels>", re.DOTALL | re.IGNORECASE | re.ASCII)
_JSON_OBJ = re.compile(r"\{[^{}]*\}", re.DOTALL)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"(\s*:)?', re.DOTALL)


def _clip(text, quoted: Sequence[str] = ()) -> str:
    """The output's tail, with verdict markup inside copies of ``quoted`` blanked."""
    if not isinstance(text, str):
        return ""
    return blank_echoed_verdicts(text[-_MAX_CHARS:], quoted)


def parse_criticsearch(text, n_search: int, quoted: Sequence[str] = ()) -> Optional[list[int]]:
    """``<score>1, 0, 1</score>`` → ``[1, 0, 1]`` when it holds exactly ``n_search`` labels in {0, 1}."""
    try:
        found = _SCORE.findall(_clip(text, quoted))
        if not found:
            return None
        body = found[-1].strip()
        if not body:
            return [] if n_search == 0 else None
        parts = [p.strip() for p in re.split(r"[,\s]+", body) if p.strip()]
        if len(parts) != n_search or any(p not in ("0", "1") for p in parts):
            return None
        return [int(p) for p in parts]
    except Exception:  # a parser of untrusted text must never raise
        return None


def _as_bit(v) -> Optional[int]:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)) and v in (0, 1):
        return int(v)
    if isinstance(v, str) and v.strip() in ("0", "1"):
        return int(v.strip())
    return None


def _literal_keys(candidate: str) -> bool:
    """No key of a JSON object (``candidate`` parses) is written with an escape: the keys are what they read."""
    return not any(m.group(1) and "\\" in m.group() for m in _JSON_STRING.finditer(candidate))


def parse_cwgrpo(text, quoted: Sequence[str] = ()) -> Optional[tuple[int, int]]:
    """The last JSON object with ``thinking_reward`` and ``retrieval_reward`` in {0, 1} → ``(thinking, retrieval)``.

    Tolerates code fences, surrounding prose, single quotes and ``"1"`` strings; an object with an escaped key
    does not count.
    """
    try:
        for raw in reversed(_JSON_OBJ.findall(_clip(text, quoted))):
            obj = None
            for candidate in (raw, raw.replace("'", '"')):
                try:
                    obj = json.loads(candidate)
                    obj = obj if _literal_keys(candidate) else None
                    break
                except ValueError:
                    continue
            if not isinstance(obj, dict) or "thinking_reward" not in obj or "retrieval_reward" not in obj:
                continue
            t, r = _as_bit(obj["thinking_reward"]), _as_bit(obj["retrieval_reward"])
            if t is not None and r is not None:
                return t, r
        return None
    except Exception:
        return None


def parse_process(text, quoted: Sequence[str] = ()) -> Optional[tuple[int, str]]:
    """``<rating>N</rating>`` (0..10) and the last ``<critique>…</critique>`` (may be empty) → ``(score, critique)``."""
    try:
        text = _clip(text, quoted)
        ratings = _RATING.findall(text)
        if not ratings:
            return None
        score = int(ratings[-1])
        if not 0 <= score <= 10:
            return None
        critiques = _CRITIQUE.findall(text)
        return score, (critiques[-1].strip() if critiques else "")
    except Exception:
        return None


def parse_pivot(text, n_steps: int, quoted: Sequence[str] = ()) -> Optional[list[int]]:
    """``<labels>+, -, +</labels>`` → ``[1, 0, 1]`` when it holds exactly ``n_steps`` labels in {+, -}."""
    try:
        found = _LABELS.findall(_clip(text, quoted))
        if not found:
            return None
        parts = [p for p in re.split(r"[,\s]+", found[-1].strip()) if p]
        if len(parts) != n_steps or any(p not in ("+", "-") for p in parts):
            return None
        return [int(p == "+") for p in parts]
    except Exception:  # a parser of untrusted text must never raise
        return None
