"""The toy world as judge: gold facts answer for the critic, the CW-GRPO judge, the process critic, PiCA's pivot
labeller and the PRM.

Tests and the demo run every judged method without a judge model. The oracle backend
answers in each judge's own verdict format, so its answers go through the same parsers,
retries and failure counts as a real judge's; the oracle PRM returns PiCA's ``f`` through
the same interface as a trained PRM (``judges.prm=oracle``). Both read the gold hops the
toy world stores with every question (``fastcredit.data.toyqa.hops_found``).
"""
from __future__ import annotations

from typing import Optional

import torch

from fastcredit.data.toyqa import hops_found
from fastcredit.judges.backends import JudgeRequest
from fastcredit.judges.types import JudgeItem


class OracleBackend:
    """The toy world's gold facts as a judge (tests, the demo): verdict text in each judge's format."""

    async def complete(self, requests: list[JudgeRequest]) -> list[Optional[str]]:
        return [self._answer(r) for r in requests]

    @staticmethod
    def new_hops(item: JudgeItem) -> list[bool]:
        """Per turn: did it retrieve a gold passage of a hop no earlier turn had found?"""
        q = item.meta.get("example")
        if q is None:
            return [False] * len(item.steps)
        seen, found, out = [], 0, []
        for s in item.steps:
            seen += list(s.retrieved_ids)
            now = sum(hops_found(q, seen))
            out.append(now > found)
            found = now
        return out

    @classmethod
    def pivots(cls, item: JudgeItem) -> list[bool]:
        """PiCA's pivot labels on the toy world: per turn, is it a search that retrieved a gold passage of a hop
        no earlier turn had found (the gold sub-answer, reached through its sub-query)?"""
        return [n and s.kind_name == "search" for s, n in zip(item.steps, cls.new_hops(item))]

    def _answer(self, r: JudgeRequest) -> str:
        item = r.item
        new = self.new_hops(item)
        if r.kind == "criticsearch":
            labels = [str(int(n)) for s, n in zip(item.steps, new) if s.kind_name == "search"]
            return f"Oracle: a search is good when it retrieves a new gold fact.\n<score>{', '.join(labels)}</score>"
        if r.kind == "pivot":
            labels = ["+" if p else "-" for p in self.pivots(item)]
            return f"Oracle: a pivot step retrieves a new gold fact.\n<labels>{', '.join(labels)}</labels>"
        s = item.steps[r.turn]
        if r.kind == "cwgrpo":
            earlier = {x.query for x in item.steps[:r.turn] if x.query}
            thinking = int(s.kind_name == "search" and s.query not in earlier)
            return ('```json\n{"analysis": "oracle", "thinking_reward": %d, "retrieval_reward": %d}\n```'
                    % (thinking, int(new[r.turn])))
        good = new[r.turn] or (s.kind_name == "answer" and item.em >= 1.0)
        return f"Oracle.\n<rating>{8 if good else 1}</rating>\n<critique>Search for the missing fact of the " \
               f"question directly.</critique>"


def oracle_prm(examples: list, episodes) -> tuple[torch.Tensor, torch.Tensor]:
    """PiCA's ``f`` from the toy world's gold facts: ``(f0_B, f_S)``.

    ``f(t) = (hops found by turns 1..t + 0.5) / (hops + 1)``: the share of the question's
    gold facts retrieved so far, smoothed into (0, 1); ``f(0) = 0.5 / (hops + 1)``. Used by
    ``judges.prm=oracle`` through the same interface as a trained PRM.
    """
    f0, f = [], []
    for ex, e in zip(examples, episodes):
        n = max(len(ex.metadata.get("hops", [])), 1)
        f0.append(0.5 / (n + 1))
        seen: list = []
        for step in e.steps:
            seen += list(step.retrieved_ids)
            f.append((sum(hops_found(ex, seen)) + 0.5) / (n + 1))
    return torch.tensor(f0, dtype=torch.float32), torch.tensor(f, dtype=torch.float32)
