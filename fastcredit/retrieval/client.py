"""Client for Search-R1's ``POST /retrieve`` (this package's server or Search-R1's own), with
retries and exponential backoff.

    client = RetrievalClient("http://127.0.0.1:8000/retrieve")
    obs = client.observations(["who wrote hamlet"], topk=3)      # Search-R1's observation strings
    docs = await client.aretrieve(["who wrote hamlet"], topk=3)   # from asyncio code (aiohttp)

Connection failures, timeouts, 408, 429 and 5xx answers are retried (honouring ``Retry-After``);
other 4xx answers mean the request itself is wrong and raise :class:`RetrievalRequestError`
with the server's message at once.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

from fastcredit.retrieval.observation import format_observation

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})  # 408: the request arrived too slowly


class RetrievalRequestError(ValueError):
    """The server rejected the request (4xx); ``status`` and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"retrieval server answered {status}: {message}")
        self.status, self.message = status, message


class RetrievalUnavailable(ConnectionError):
    """The server could not be reached or kept failing after every retry."""


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body[:200]))
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


def retry_delay(rng: random.Random, attempt: int, retry_after: Optional[str], backoff_s: float,
                max_backoff_s: float) -> float:
    """Seconds before retry ``attempt`` (0-based): the server's Retry-After when it sent one, else exponential
    backoff with full jitter (clients that failed together do not retry together), capped at ``max_backoff_s``."""
    if retry_after:
        try:
            return min(max_backoff_s, float(retry_after))
        except ValueError:
            pass
    return rng.uniform(0, min(max_backoff_s, backoff_s * 2 ** attempt))


class RetrievalClient:
    """Sync (stdlib) and async (aiohttp) calls to one ``/retrieve`` URL."""

    def __init__(self, url: str = "http://127.0.0.1:8000/retrieve", timeout_s: float = 60.0, retries: int = 4,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0, seed: Optional[int] = None):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._rng = random.Random(seed)

    def _delay(self, attempt: int, retry_after: Optional[str]) -> float:
        return retry_delay(self._rng, attempt, retry_after, self.backoff_s, self.max_backoff_s)

    @staticmethod
    def payload(queries: Sequence[str], topk: int, return_scores: bool) -> bytes:
        return json.dumps({"queries": list(queries), "topk": topk, "return_scores": return_scores}).encode("utf-8")

    def retrieve(self, queries: Sequence[str], topk: int = 3, return_scores: bool = True) -> list:
        """Blocking call; returns the server's ``result`` list (one entry per query)."""
        data = self.payload(queries, topk, return_scores)
        last = ""
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
            retry_after = None
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())["result"]
            except urllib.error.HTTPError as exc:
                body = exc.read()
                if exc.code not in RETRY_STATUSES:
                    raise RetrievalRequestError(exc.code, _message(body)) from None
                last, retry_after = f"HTTP {exc.code}: {_message(body)}", exc.headers.get("Retry-After")
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            if attempt < self.retries:
                time.sleep(self._delay(attempt, retry_after))
        raise RetrievalUnavailable(f"{self.url}: no answer after {self.retries + 1} attempts (last: {last})")

    async def aretrieve(self, queries: Sequence[str], topk: int = 3, return_scores: bool = True, session=None) -> list:
        """The same over aiohttp; pass a shared ``aiohttp.ClientSession`` to reuse connections."""
        import aiohttp

        own = session is None
        session = session or aiohttp.ClientSession()
        data, last = self.payload(queries, topk, return_scores), ""
        try:
            for attempt in range(self.retries + 1):
                retry_after = None
                try:
                    async with session.post(self.url, data=data, headers={"Content-Type": "application/json"},
                                            timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                        body = await resp.read()
                        if resp.status == 200:
                            return json.loads(body)["result"]
                        if resp.status not in RETRY_STATUSES:
                            raise RetrievalRequestError(resp.status, _message(body))
                        last, retry_after = f"HTTP {resp.status}: {_message(body)}", resp.headers.get("Retry-After")
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if attempt < self.retries:
                    await asyncio.sleep(self._delay(attempt, retry_after))
        finally:
            if own:
                await session.close()
        raise RetrievalUnavailable(f"{self.url}: no answer after {self.retries + 1} attempts (last: {last})")

    def observations(self, queries: Sequence[str], topk: int = 3) -> list[str]:
        """Search-R1's observation strings for ``queries`` (``\\n\\n<information>Doc 1(Title: …) …``)."""
        return [format_observation(_contents(doc) for doc in r) for r in self.retrieve(queries, topk, True)]


def _contents(item: dict) -> str:
    """The ``contents`` of a result item, with or without ``return_scores``."""
    return (item["document"] if "document" in item else item)["contents"]
