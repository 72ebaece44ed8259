"""The trainer's client of PiCA's reward server (``judges.prm=http://host:5000/get_reward``).

    client = PiCARewardClient("http://127.0.0.1:5000/get_reward", timeout_s=30, concurrency=16)
    f0_B, f_S, hazard_S = client.score(examples, episodes)    # CreditInputs' prm_f0_B / prm_f_S / prm_hazard_S
    client.take_stats()   # {"requests", "failures", "count_mismatches", ...} since the last call

The server is PiCA's released one (``OpenRLHF/openrlhf/cli/serve_rm.py``) or ours
(``python -m fastcredit.prm.serve``, hazard output). Each trajectory is written as PiCA's
reward manager writes it (``Search-R1/verl/trainer/main_ppo.py``, ``comupute_step_reward``):
the question and every turn's action and observation text, compacted (newlines to spaces,
whitespace runs to one space, stripped), the special token and a newline after every
``</search>`` followed by ``<information>`` (not inside ``<warning>…</warning>``), and one
special token at the end; posted alone as ``{"query": [text], "prompts": []}``.

Mapping the answer onto turns. The scores come back one per special token, in order. The
token after the ``</search>`` that ends a search turn's action is that turn's; the one at
the end is the last turn's when it is not a search turn (an answer, a truncated or an
invalid turn). A ``</search>`` + ``<information>`` that the policy wrote inside its own
text also gets a special token in PiCA's format (so the text stays exactly theirs), but its
score belongs to no turn and is dropped (``extra_placeholders``). Any special-token string
the trajectory itself spells is deleted after compaction (as often as it takes: a deletion
can join the halves of another), so the server sees exactly the tokens we inserted
(``forged``). PiCA gives an invalid turn in the middle no score; it gets ``h = 0`` here. A
turn that should have a score and got none (the server answered fewer scores than it was
sent special tokens, or a non-number) gets ``h = 0`` and is counted (``unscored_turns``;
``count_mismatches`` counts trajectories answered with the wrong count).

The score is a hazard ``h_t`` (PiCA's client rewards ``1 − h_t − b``), clamped to [0, 1];
``f(0) := 1`` and ``f(t) = Π_{k≤t} (1 − h_k)``, so ``f(t)/f(t−1) = 1 − h_t``: the log-ratio
step reward is ``log(1 − h_t)`` and the linear one ``1 − h_t − b``, the latter as PiCA's client.
Connection failures, timeouts, 408, 429 and 5xx are retried with jittered exponential
backoff; another 4xx, or a server still failing after the retries, raises
:class:`RewardServerError` naming the URL.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from fastcredit.credit.types import TurnKind

PICA_TOKEN = "<|vision_start|>"
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# main_ppo.process_sequences_robust: a </search> followed by <information>, never inside a <warning> span
_SEARCH_END = re.compile(r"(<warning>.*?</warning>)|(</search>)(?=\s*<information>)", re.DOTALL)
_SPACE = re.compile(r"\s+")


class RewardServerError(RuntimeError):
    """The reward server refused a request (4xx), answered in another format, or kept failing."""


def compact_text(text: str) -> str:
    """PiCA's ``compact_text``: newlines to spaces, whitespace runs to one space, stripped."""
    return _SPACE.sub(" ", text.replace("\n", " ").replace("\r", " ")).strip()


@dataclass
class PiCAText:
    """One trajectory in PiCA's format: the text, and for each special token in it the turn it scores (-1: none)."""

    text: str
    owners: list = field(default_factory=list)
    forged: int = 0


def _scrub(text: str, special: str) -> tuple[str, int]:
    """``text`` without any ``special`` (deleting one can join the pieces of another), and how many were deleted."""
    n = 0
    while special in text:
        n += text.count(special)
        text = text.replace(special, "")
    return text, n


def pica_text(question: str, steps: Sequence, special: str = PICA_TOKEN) -> PiCAText:
    """``question`` and ``steps`` (``.kind``, ``.action_text``, ``.obs_text``) as PiCA's client writes them."""
    raw, search_ends = question, {}
    for t, s in enumerate(steps):
        if s.kind == TurnKind.SEARCH:  # where its action's own </search> ends, in the final text's characters
            search_ends[len(_scrub(compact_text(raw + s.action_text.rstrip()), special)[0])] = t
        raw += s.action_text + s.obs_text
    text, forged = _scrub(compact_text(raw), special)
    out, owners, at = [], [], 0
    for m in _SEARCH_END.finditer(text):
        if m.group(2) is None:
            continue
        out.append(text[at:m.end()] + special + "\n")
        owners.append(search_ends.get(m.end(), -1))
        at = m.end()
    last = len(steps) - 1
    owners.append(last if steps and steps[-1].kind != TurnKind.SEARCH else -1)
    return PiCAText("".join(out) + text[at:] + special, owners, forged)


def hazards_to_turns(scores, owners: Sequence[int], kinds: Sequence) -> tuple[torch.Tensor, dict]:
    """A server's ``scores`` for the special tokens of :func:`pica_text` → ``(h_T, stats)`` per turn."""
    h = torch.zeros(len(kinds), dtype=torch.float64)
    scored = set()
    for j, owner in enumerate(owners):
        if owner < 0 or j >= len(scores):
            continue
        s = scores[j]
        if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s):
            h[owner] = min(max(float(s), 0.0), 1.0)
            scored.add(owner)
    expected = {o for o in owners if o >= 0}
    return h, {"count_mismatches": int(len(scores) != len(owners)), "unscored_turns": len(expected - scored),
               "extra_placeholders": sum(o < 0 for o in owners)}


class PiCARewardClient:
    """PiCA's ``/get_reward`` server as the trainer's PRM (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 30.0, concurrency: int = 16, special_token: str = PICA_TOKEN,
                 retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 8.0, seed: Optional[int] = None):
        if not special_token:
            raise ValueError("special_token must be a non-empty string")
        self.url, self.timeout_s, self.concurrency, self.special = url, timeout_s, concurrency, special_token
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self._rng = random.Random(seed)
        self._stats = self._zero()

    @staticmethod
    def _zero() -> dict:
        return {"requests": 0, "failures": 0, "retries": 0, "count_mismatches": 0, "unscored_turns": 0,
                "extra_placeholders": 0, "forged": 0}

    def take_stats(self) -> dict:
        """Counts since the last call: requests posted, requests that failed for good, retries, trajectories
        answered with the wrong count of scores, turns left unscored, scores that belong to no turn, and
        special-token strings deleted from trajectories."""
        out, self._stats = self._stats, self._zero()
        return out

    def score(self, examples, episodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(f0_B, f_S, hazard_S)`` float32 of rolled-out episodes (turns in the batch's order), ``f0 = 1``."""
        texts = [pica_text(ex.question, e.steps, self.special) for ex, e in zip(examples, episodes)]
        answers = asyncio.run(self._post_all([t.text for t in texts])) if texts else []
        f0, f, h = [], [], []
        for t, e, scores in zip(texts, episodes, answers):
            h_T, stats = hazards_to_turns(scores, t.owners, [s.kind for s in e.steps])
            for k, v in stats.items():
                self._stats[k] += v
            self._stats["forged"] += t.forged
            f0.append(1.0)
            f.append(torch.cumprod(1.0 - h_T, 0))
            h.append(h_T)
        def cat(xs: list) -> torch.Tensor:
            return torch.cat(xs).float() if xs else torch.zeros(0)

        return torch.tensor(f0, dtype=torch.float32), cat(f), cat(h)

    async def _post_all(self, texts: list[str]) -> list[list]:
        import aiohttp

        sem = asyncio.Semaphore(self.concurrency)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            tasks = [asyncio.ensure_future(self._post(session, sem, t)) for t in texts]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()

    def _delay(self, attempt: int, retry_after: Optional[str]) -> float:
        from fastcredit.retrieval.client import retry_delay

        return retry_delay(self._rng, attempt, retry_after, self.backoff_s, self.max_backoff_s)

    async def _post(self, session, sem, text: str) -> list:
        import aiohttp

        body, last = json.dumps({"query": [text], "prompts": []}).encode("utf-8"), ""
        for attempt in range(self.retries + 1):
            retry_after = None
            self._stats["requests"] += 1
            try:
                async with sem, session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as r:
                    raw = await r.read()
                    if r.status == 200:
                        return self._rewards(raw)
                    last, retry_after = f"HTTP {r.status}: {raw[:300].decode('utf-8', 'replace')}", \
                        r.headers.get("Retry-After")
                    if r.status not in RETRY_STATUSES:
                        self._stats["failures"] += 1
                        raise RewardServerError(f"reward server {self.url} refused a request: {last}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                self._stats["retries"] += 1
                await asyncio.sleep(self._delay(attempt, retry_after))
        self._stats["failures"] += 1
        raise RewardServerError(f"reward server {self.url}: no answer after {self.retries + 1} attempts "
                                f"(timeout {self.timeout_s} s; last: {last})")

    def _rewards(self, raw: bytes) -> list:
        try:
            rewards = json.loads(raw)["rewards"]
            if not isinstance(rewards, list) or len(rewards) != 1 or not isinstance(rewards[0], list):
                raise ValueError(f"'rewards' is not one list of scores: {str(rewards)[:200]}")
            return rewards[0]
        except (ValueError, KeyError, TypeError) as exc:
            self._stats["failures"] += 1
            raise RewardServerError(f"reward server {self.url} answered in another format than PiCA's "
                                    f"{{'rewards': [[score, ...]]}}: {exc}") from None
