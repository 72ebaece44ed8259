"""Load test for a ``/retrieve`` server on loopback: concurrent clients for a bounded time,
malformed requests mixed in; QPS, p50 / p99 latency, and a check of every answer.

    python -m fastcredit.retrieval.loadtest --url http://127.0.0.1:8000/retrieve --clients 64 --duration 3

Before the load, the expected top-k (ids and scores) of every query in the pool is fetched
one batch at a time. Under load each valid request takes 1-4 random pool queries, and its
answer must match theirs — same ids, scores within ``tol`` (ids may only swap between
near-equal scores) — so a lost, truncated or misrouted response is caught. Every malformed
request must get its 4xx. Refuses non-loopback URLs: this is not a tool for other hosts.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import urllib.parse
from typing import Optional, Sequence

import numpy as np

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def malformed_requests(limits: dict) -> list[tuple[str, bytes, int]]:
    """``(name, body, expected status)`` for each kind of bad input the server must refuse."""
    def j(obj) -> bytes:
        return json.dumps(obj).encode()
    return [
        ("empty_body", b"", 400),
        ("bad_json", b'{"queries": ["unterminated', 400),
        ("not_an_object", j(["a query"]), 400),
        ("missing_queries", j({"topk": 3}), 400),
        ("queries_not_list", j({"queries": "a query"}), 400),
        ("query_not_string", j({"queries": ["a query", 7]}), 400),
        ("oversize_query", j({"queries": ["x" * (limits["max_query_chars"] + 1)]}), 413),
        ("too_many_queries", j({"queries": ["q"] * (limits["max_queries"] + 1)}), 413),
        ("topk_negative", j({"queries": ["a query"], "topk": -1}), 400),
        ("topk_too_large", j({"queries": ["a query"], "topk": limits["max_topk"] + 1}), 400),
        ("topk_string", j({"queries": ["a query"], "topk": "3"}), 400),
        ("topk_bool", j({"queries": ["a query"], "topk": True}), 400),
        ("return_scores_string", j({"queries": ["a query"], "return_scores": "yes"}), 400),
    ]


def answer_matches(got: list, exp: list, with_scores: bool, tol: float) -> bool:
    """One query's answer against its expected ``[(id, score)]`` (expected has at least as many)."""
    exp_score = dict(exp)
    for j, item in enumerate(got):
        doc = item["document"] if with_scores else item
        gid = doc.get("id") if isinstance(doc, dict) else None
        if j >= len(exp) or gid not in exp_score or abs(exp_score[gid] - exp[j][1]) > tol:
            return False
        if with_scores and abs(float(item["score"]) - exp[j][1]) > tol:
            return False
    return True


class _Stats:
    def __init__(self):
        self.latency_ms: list = []
        self.counts = dict(ok=0, wrong=0, lost=0, shed=0, rejected=0, unexpected=0, queries=0)
        self.problems: list = []

    def note(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {detail}")


async def _post(session, url: str, body: bytes, timeout_s: float):
    import aiohttp

    async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, await resp.read()


async def _valid_call(session, url, rng, pool, expected, stats, tol, timeout_s, max_k):
    qs = [pool[rng.randrange(len(pool))] for _ in range(rng.randint(1, 4))]
    topk, with_scores = rng.randint(1, max_k), rng.random() < 0.7
    body = json.dumps({"queries": qs, "topk": topk, "return_scores": with_scores}).encode()
    t0 = time.perf_counter()
    try:
        status, data = await _post(session, url, body, timeout_s)
    except Exception as exc:  # any failure to get an answer counts as a lost response
        stats.note("lost", f"{type(exc).__name__}: {exc}")
        return
    stats.latency_ms.append((time.perf_counter() - t0) * 1000)
    if status == 503:
        stats.note("shed", data[:120].decode("utf-8", "replace"))
        return
    try:
        result = json.loads(data)["result"] if status == 200 else None
        good = result is not None and len(result) == len(qs) and all(
            len(r) == topk and answer_matches(r, expected[q], with_scores, tol) for r, q in zip(result, qs))
    except (ValueError, KeyError, TypeError):
        good = False
    if good:
        stats.counts["ok"] += 1
        stats.counts["queries"] += len(qs)
    else:
        stats.note("wrong", f"status {status} for {qs[:2]} k={topk}: {data[:200]!r}")


async def _client(url, seed, pool, expected, bad, deadline, stats, malformed_fraction, tol, timeout_s, max_k, session):
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        if rng.random() < malformed_fraction:
            name, body, want = bad[rng.randrange(len(bad))]
            try:
                status, data = await _post(session, url, body, timeout_s)
            except Exception as exc:  # a refused request must still be answered
                stats.note("lost", f"{name}: {type(exc).__name__}: {exc}")
                continue
            try:
                ok = status == want and "error" in json.loads(data)
            except ValueError:
                ok = False
            if ok:
                stats.counts["rejected"] += 1
            else:
                stats.note("unexpected", f"{name}: wanted {want}, got {status} {data[:120]!r}")
        else:
            await _valid_call(session, url, rng, pool, expected, stats, tol, timeout_s, max_k)


async def fetch_expected(session, url: str, pool: Sequence[str], k: int, per_request: int = 64,
                         timeout_s: float = 120.0) -> dict:
    """query → ``[(id, score)] * k``, ``per_request`` queries at a time (before any load)."""
    out = {}
    for s in range(0, len(pool), per_request):
        batch = list(pool[s:s + per_request])
        body = json.dumps({"queries": batch, "topk": k, "return_scores": True}).encode()
        status, data = await _post(session, url, body, timeout_s)
        if status != 200:
            raise RuntimeError(f"{url}: expected results request failed with {status}: {data[:200]!r}")
        for q, r in zip(batch, json.loads(data)["result"]):
            out[q] = [(item["document"]["id"], float(item["score"])) for item in r]
    return out


async def run_load_test(url: str, pool: Sequence[str], clients: int = 64, duration_s: float = 3.0,
                        malformed_fraction: float = 0.15, tol: float = 1e-4, timeout_s: float = 30.0,
                        max_k: int = 3, seed: int = 0) -> dict:
    """Run the load test against ``url`` (loopback only); returns the report (see module docstring)."""
    import aiohttp

    host = urllib.parse.urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"load tests run against loopback only, not {host!r}")
    pool = list(dict.fromkeys(pool))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        async with session.get(url.rsplit("/", 1)[0] + "/health") as resp:
            limits = (await resp.json())["limits"]
        expected = await fetch_expected(session, url, pool, max_k + 2, min(64, limits["max_queries"]))
        bad, stats = malformed_requests(limits), _Stats()
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(url, seed * 1000 + c, pool, expected, bad, t0 + duration_s, stats,
                                       malformed_fraction, tol, timeout_s, max_k, session) for c in range(clients)))
        elapsed = time.perf_counter() - t0
    lat = np.array(stats.latency_ms) if stats.latency_ms else np.zeros(1)
    c = stats.counts
    answered = c["ok"] + c["wrong"] + c["shed"] + c["rejected"] + c["unexpected"]
    return {
        "clients": clients, "duration_s": round(elapsed, 3), "requests": answered + c["lost"],
        "qps": round(answered / elapsed, 1), "valid_qps": round(c["ok"] / elapsed, 1),
        "queries_per_s": round(c["queries"] / elapsed, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2), "p99_ms": round(float(np.percentile(lat, 99)), 2),
        **c, "passed": c["wrong"] == 0 and c["lost"] == 0 and c["unexpected"] == 0 and c["ok"] > 0,
        "problems": stats.problems,
    }


def main(argv: Optional[list] = None) -> int:
    from fastcredit.cli import argparser

    p = argparser("python -m fastcredit.retrieval.loadtest", __doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000/retrieve")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=3.0, help="seconds of load (bounded: at most 300)")
    p.add_argument("--queries", default=None, help="file with one query per line (default: 200 generated ones)")
    p.add_argument("--malformed-fraction", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not 0 < a.duration <= 300 or not 0 < a.clients <= 1024:
        p.error("--duration must lie in (0, 300] and --clients in (0, 1024]")
    if a.queries:
        with open(a.queries, encoding="utf-8") as fh:
            pool = [line.strip() for line in fh if line.strip()]
    else:
        from fastcredit.retrieval.testing import tiny_passages

        pool = [f"{t} {x[:40]}" for _, t, x in tiny_passages(200, seed=a.seed)]
    report = asyncio.run(run_load_test(a.url, pool, a.clients, a.duration, a.malformed_fraction, seed=a.seed))
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
