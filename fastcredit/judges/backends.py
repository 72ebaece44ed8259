"""Judge backends behind one async call, ``await backend.complete(requests) -> [text or None]``.

* :class:`HTTPBackend`: an OpenAI-compatible ``/v1/chat/completions`` endpoint (a judge served
  elsewhere), with a concurrency limit, per-request timeouts and retries with exponential backoff.
* :class:`EngineBackend`: a colocated engine (``generate_text``; the phase manager wakes it).
* :class:`OracleBackend`: the toy world's gold facts answer, in each judge's own verdict format,
  so the oracle path goes through the same parsers as a real judge.

``None`` is a request that failed after the retries. Requests carry the structured item
(for the oracle) besides the prompt (for text backends).
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Optional

from fastcredit.judges.types import JudgeItem


@dataclass
class JudgeRequest:
    prompt: str
    kind: str  # "criticsearch" | "cwgrpo" | "process"
    item: Optional[JudgeItem] = None
    turn: int = -1  # the judged turn (cwgrpo, process)


class HTTPBackend:
    """OpenAI-compatible chat completions over aiohttp."""

    def __init__(self, url: str, model: str, temperature: float = 0.0, max_tokens: int = 1024, concurrency: int = 64,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5):
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/chat/completions") else "/chat/completions")
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        self.failures = 0

    async def complete(self, requests: list[JudgeRequest]) -> list[Optional[str]]:
        import aiohttp

        sem = asyncio.Semaphore(self.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return list(await asyncio.gather(*(self._one(session, sem, r.prompt) for r in requests)))

    async def _one(self, session, sem, prompt: str) -> Optional[str]:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        for attempt in range(self.retries + 1):
            try:
                async with sem, session.post(self.url, json=body) as resp:
                    if resp.status == 200:
                        data = await resp.json(content_type=None)
                        return str(data["choices"][0]["message"]["content"])
                    if 400 <= resp.status < 500 and resp.status != 429:
                        break  # the request itself is wrong: retrying will not help
            except (asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError, Exception):
                pass
            await asyncio.sleep(self.backoff_s * (2 ** attempt) * (0.5 + random.random()))
        self.failures += 1
        return None


class EngineBackend:
    """A colocated engine with frozen weights (``generate_text``)."""

    def __init__(self, engine, temperature: float = 0.0, max_tokens: int = 1024):
        self.engine, self.temperature, self.max_tokens = engine, temperature, max_tokens

    async def complete(self, requests: list[JudgeRequest]) -> list[Optional[str]]:
        return list(await asyncio.to_thread(self.engine.generate_text, [r.prompt for r in requests], self.max_tokens,
                                            self.temperature))


class OracleBackend:
    """The toy world's gold facts as a judge (tests, the demo): verdict text in each judge's format."""

    async def complete(self, requests: list[JudgeRequest]) -> list[Optional[str]]:
        return [self._answer(r) for r in requests]

    @staticmethod
    def new_hops(item: JudgeItem) -> list[bool]:
        """Per turn: did it retrieve a gold passage of a hop no earlier turn had found?"""
        from fastcredit.data.toyworld import hops_found

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

    def _answer(self, r: JudgeRequest) -> str:
        item = r.item
        new = self.new_hops(item)
        if r.kind == "criticsearch":
            labels = [str(int(n)) for s, n in zip(item.steps, new) if s.kind_name == "search"]
            return f"Oracle: a search is good when it retrieves a new gold fact.\n<score>{', '.join(labels)}</score>"
        s = item.steps[r.turn]
        if r.kind == "cwgrpo":
            earlier = {x.query for x in item.steps[:r.turn] if x.query}
            thinking = int(s.kind_name == "search" and s.query not in earlier)
            return ('```json\n{"analysis": "oracle", "thinking_reward": %d, "retrieval_reward": %d}\n```'
                    % (thinking, int(new[r.turn])))
        good = new[r.turn] or (s.kind_name == "answer" and item.em >= 1.0)
        return f"Oracle.\n<rating>{8 if good else 1}</rating>\n<critique>Search for the missing fact of the " \
               f"question directly.</critique>"
