"""Judge backends behind one async call, ``await backend.complete(requests) -> [text or None]``.

* :class:`HTTPBackend`: an OpenAI-compatible ``/v1/chat/completions`` endpoint (a judge served
  elsewhere), with a concurrency limit, per-request timeouts and retries with exponential backoff.
* :class:`EngineBackend`: a colocated engine (``generate_text``; the phase manager wakes it).
* ``fastcredit.judges.oracle.OracleBackend``: the toy world's gold facts, in each judge's own
  verdict format, so the oracle path goes through the same parsers as a real judge.

``None`` is a request that failed after the retries. Requests carry the structured item
(for the oracle) besides the prompt (for text backends).

Text backends answer a first attempt at ``temperature`` (greedy by default) and a re-ask
(``attempt > 0``, from the runner after a parse failure) at ``retry_temperature`` with a seed
of its own: a greedy re-ask of the same prompt would return the same text. ``constrained``
decodes under the verdict grammar (``fastcredit.judges.grammar``), so the verdict parses:
engines mask logits (HF) or use structured outputs (vLLM); an ``http`` judge gets the grammar
as vLLM's ``structured_outputs`` request field, so it must be a vLLM server.
"""
from __future__ import annotations

import asyncio
import random
import zlib
from dataclasses import dataclass
from typing import Optional

from fastcredit.runtime.devices import on_device
from fastcredit.judges.types import JudgeItem


@dataclass
class JudgeRequest:
    prompt: str
    kind: str  # "criticsearch" | "cwgrpo" | "process" | "pivot"
    item: Optional[JudgeItem] = None
    turn: int = -1  # the judged turn (cwgrpo, process)
    n_labels: Optional[int] = None  # the labels a verdict must hold (criticsearch: search turns; pivot: turns)
    attempt: int = 0  # 0: first ask; k > 0: the k-th re-ask after a parse failure


def retry_seed(request: JudgeRequest) -> Optional[int]:
    """None on a first attempt; on a re-ask a seed of its own (from the prompt and the attempt), so runs repeat."""
    if request.attempt == 0:
        return None
    return (zlib.crc32(request.prompt.encode()) + 1_000_003 * request.attempt) % (2**31 - 1)


def grammar_of(request: JudgeRequest, max_tokens: int):
    """The verdict grammar a request's answer must follow within ``max_tokens`` (a critique gets up to a third of
    them, at most 128); None when even its markup cannot fit (the request is then asked unconstrained)."""
    from fastcredit.judges.grammar import verdict_grammar

    g = verdict_grammar(request.kind, request.n_labels, critique_tokens=max(1, min(128, max_tokens // 3)))
    return g if g.reserve() <= max_tokens else None


def temperature_of(backend, request: JudgeRequest) -> float:
    """A text backend's temperature for this attempt."""
    return backend.temperature if request.attempt == 0 else backend.retry_temperature


class HTTPBackend:
    """OpenAI-compatible chat completions over aiohttp (``retries``: transport failures, not parse failures)."""

    def __init__(self, url: str, model: str, temperature: float = 0.0, max_tokens: int = 1024, concurrency: int = 64,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5, constrained: bool = False,
                 retry_temperature: float = 0.7):
        self.constrained, self.retry_temperature = constrained, retry_temperature
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/chat/completions") else "/chat/completions")
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        self.failures = 0

    async def complete(self, requests: list[JudgeRequest]) -> list[Optional[str]]:
        import aiohttp

        sem = asyncio.Semaphore(self.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return list(await asyncio.gather(*(self._one(session, sem, self._body(r)) for r in requests)))

    def _body(self, r: JudgeRequest) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": r.prompt}],
                "temperature": temperature_of(self, r), "max_tokens": self.max_tokens}
        if r.attempt:
            body["seed"] = retry_seed(r)
        if self.constrained:  # vLLM's OpenAI server (0.32: ChatCompletionRequest.structured_outputs)
            g = grammar_of(r, self.max_tokens)
            if g is not None:
                body["structured_outputs"] = {"regex": g.regex(self.max_tokens)}
        return body

    async def _one(self, session, sem, body: dict) -> Optional[str]:
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
    """A colocated engine (``generate_text``): the policy's own (a self-critic), the policy's with a critic's
    ``weights`` switched in for the judge phase (``fastcredit.judges.switch``), or the critic's own HF engine.

    ``tokenizer``: the critic's, when it is not the policy (its EOS ends a verdict); a
    tokenizer with a chat template gets the prompt as one user turn, as an OpenAI-compatible
    server (the ``http`` backend) would send it.
    """

    def __init__(self, engine, temperature: float = 0.0, max_tokens: int = 1024, tokenizer=None, weights=None,
                 constrained: bool = False, retry_temperature: float = 0.7):
        self.engine, self.temperature, self.max_tokens = engine, temperature, max_tokens
        self.tokenizer, self.weights = tokenizer, weights
        self.constrained, self.retry_temperature = constrained, retry_temperature

    def _text(self, prompt: str) -> str:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return prompt
        return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)

    async def complete(self, requests: list[JudgeRequest]) -> list[Optional[str]]:
        kw = {} if self.tokenizer is None else {"tokenizer": self.tokenizer}
        if self.constrained:
            kw["constraints"] = [grammar_of(r, self.max_tokens) for r in requests]
        generate = on_device(getattr(self.engine, "device", None), self.engine.generate_text)
        return list(await asyncio.to_thread(generate, [self._text(r.prompt) for r in requests],
                                            self.max_tokens, [temperature_of(self, r) for r in requests],
                                            seeds=[retry_seed(r) for r in requests], **kw))
