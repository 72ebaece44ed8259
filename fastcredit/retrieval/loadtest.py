"""Load test for a ``/retrieve`` server on loopback: concurrent clients for a bounded time,
malformed requests mixed in, long-query and slow-drip clients beside them; QPS, p50 / p99
latency, and a check of every answer.

    python -m fastcredit.retrieval.loadtest --url http://127.0.0.1:8000/retrieve --clients 64 --duration 3
    python -m fastcredit.retrieval.loadtest --clients 32 --long-clients 4 --slow-clients 6 --duration 30

Before the load, the expected top-k (ids and scores) of every query in the pools is fetched
one batch at a time (or passed in, e.g. from a direct retriever call). Under load each valid
request takes 1-4 random pool queries (a long client: 1-2 queries of thousands of
characters), and its answer must match theirs — same ids, scores within ``tol`` (ids may only
swap between near-equal scores) — so a lost, truncated or misrouted response is caught.
Every malformed request must get its 4xx with a JSON error. Slow clients open raw
connections that go idle, drip a request head, or drip a body; each must be cut off (408 or
closed) within the server's timeout plus a margin. Refuses non-loopback URLs: this is not a
tool for other hosts.
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
    """``(name, body, expected status)`` for each kind of bad body the server must refuse."""
    def j(obj) -> bytes:
        return json.dumps(obj).encode()
    depth = max(2000, min(100_000, (limits["max_body_bytes"] - 64) // 2))  # past the parser's limit, under the body's
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
        ("topk_float", j({"queries": ["a query"], "topk": 2.5}), 400),
        ("topk_nan", b'{"queries": ["a query"], "topk": NaN}', 400),
        ("topk_5000_digits", b'{"queries": ["a query"], "topk": 1' + b"0" * 4999 + b"}", 400),
        ("return_scores_string", j({"queries": ["a query"], "return_scores": "yes"}), 400),
        ("lone_surrogate", j({"queries": ["river castle", "a \ud800 b"]}), 400),
        ("invalid_utf8", b'{"queries": ["river \xff\xfe castle"]}', 400),
        ("utf8_encoded_surrogate", b'{"queries": ["a \xed\xa0\x80 b"]}', 400),
        ("deep_nesting", b'{"queries": ["a"], "x": ' + b"[" * depth + b"]" * depth + b"}", 400),
        ("deep_nesting_in_queries", b'{"queries": ' + b"[" * depth + b"]" * depth + b"}", 400),
    ]


def oversize_body(limits: dict) -> tuple[str, bytes, int]:
    return ("oversize_body", b'{"queries": ["' + b"a" * limits["max_body_bytes"] + b'"]}', 413)


def long_queries(n: int, chars: int, seed: int = 0) -> list[str]:
    """``n`` distinct queries of about ``chars`` characters (thousands: far past any encoder's max length)."""
    from fastcredit.retrieval.testing import tiny_passages

    texts = [f"{t} {x}" for _, t, x in tiny_passages(n * 40, seed=seed + 77)]
    return [" ".join(texts[i::n])[:chars] for i in range(n)]


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
        self.long_latency_ms: list = []
        self.slow_cut_s: list = []
        self.counts = dict(ok=0, long_ok=0, wrong=0, server_errors=0, lost=0, shed=0, rejected=0, unexpected=0,
                           queries=0, slow_cut=0, slow_408=0, slow_not_cut=0)
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


async def _valid_call(session, url, rng, pool, expected, stats, tol, timeout_s, max_k, long: bool = False):
    qs = [pool[rng.randrange(len(pool))] for _ in range(rng.randint(1, 2 if long else 4))]
    topk, with_scores = rng.randint(1, max_k), rng.random() < 0.7
    body = json.dumps({"queries": qs, "topk": topk, "return_scores": with_scores}).encode()
    t0 = time.perf_counter()
    try:
        status, data = await _post(session, url, body, timeout_s)
    except Exception as exc:  # any failure to get an answer counts as a lost response
        stats.note("lost", f"{type(exc).__name__}: {exc}")
        return
    (stats.long_latency_ms if long else stats.latency_ms).append((time.perf_counter() - t0) * 1000)
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
        stats.counts["long_ok" if long else "ok"] += 1
        stats.counts["queries"] += len(qs)
    else:
        kind = "server_errors" if status >= 500 else "wrong"
        stats.note(kind, f"status {status} for {[q[:40] for q in qs[:2]]} k={topk}: {data[:200]!r}")


async def _malformed_call(session, url, rng, bad, stats, timeout_s):
    name, body, want = bad[rng.randrange(len(bad))]
    try:
        status, data = await _post(session, url, body, timeout_s)
    except Exception as exc:  # a refused request must still be answered
        stats.note("lost", f"{name}: {type(exc).__name__}: {exc}")
        return
    try:
        ok = status == want and "error" in json.loads(data)
    except ValueError:
        ok = False
    if ok:
        stats.counts["rejected"] += 1
    else:
        stats.note("unexpected", f"{name}: wanted {want}, got {status} {data[:120]!r}")


async def _client(url, seed, pool, expected, bad, deadline, stats, malformed_fraction, tol, timeout_s, max_k, session,
                  long: bool = False):
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        if not long and rng.random() < malformed_fraction:
            await _malformed_call(session, url, rng, bad, stats, timeout_s)
        else:
            await _valid_call(session, url, rng, pool, expected, stats, tol, timeout_s, max_k, long)


async def _drip(writer, parts: list, every_s: float) -> None:
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(every_s)
    except (ConnectionError, OSError):  # the server cut us off: what we want
        pass


SLOW_KINDS = ("idle", "drip_head", "drip_body")


async def _slow_client(url: str, c: int, deadline: float, stats: _Stats, limits: dict, slack_s: float) -> None:
    """Raw connections that go idle, drip a request head, or drip a body, one kind after another;
    each must be closed (a drip with a 408 first) within its timeout plus ``slack_s`` (plus the
    server's ``linger_s`` for a body)."""
    parsed = urllib.parse.urlparse(url)
    body = json.dumps({"queries": ["river castle"], "topk": 1}).encode()
    head = (f"POST {parsed.path} HTTP/1.1\r\nHost: {parsed.hostname}:{parsed.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    i = c
    while time.perf_counter() < deadline:
        kind = SLOW_KINDS[i % len(SLOW_KINDS)]
        i += 1
        limit = limits[{"idle": "idle_timeout_s", "drip_head": "header_timeout_s", "drip_body": "body_timeout_s"}[kind]]
        # A dripped body gets its 408 at the limit; the server then drains it for up to linger_s.
        bound = limit + slack_s + (limits.get("linger_s", 0.0) if kind == "drip_body" else 0.0)
        # One byte per limit/8 seconds: neither a head nor this body can finish in time.
        parts = {"idle": [], "drip_head": [head[k:k + 1] for k in range(len(head))],
                 "drip_body": [head] + [body[k:k + 1] for k in range(len(body))]}[kind]
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
        sender = asyncio.create_task(_drip(writer, parts, limit / 8))
        data, cut = b"", True
        try:
            data = await asyncio.wait_for(reader.read(), bound)  # until the server closes
        except asyncio.TimeoutError:
            cut = False
        except (ConnectionError, OSError):
            pass  # reset by the server: cut off
        finally:
            sender.cancel()
            writer.close()
        took = time.perf_counter() - t0
        if not cut or (kind == "idle" and data) or (data and not data.startswith(b"HTTP/1.1 408")):
            stats.note("slow_not_cut", f"{kind}: open after {took:.1f} s (limit {limit} s), got {data[:80]!r}")
            continue
        stats.counts["slow_cut"] += 1
        stats.counts["slow_408"] += data.startswith(b"HTTP/1.1 408")
        stats.slow_cut_s.append(took)


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


def _pct(values: list, q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if values else 0.0


async def run_load_test(url: str, pool: Sequence[str], clients: int = 64, duration_s: float = 3.0,
                        malformed_fraction: float = 0.15, tol: float = 1e-4, timeout_s: float = 30.0,
                        max_k: int = 3, seed: int = 0, long_pool: Sequence[str] = (), long_clients: int = 0,
                        slow_clients: int = 0, expected: Optional[dict] = None, slack_s: float = 2.0) -> dict:
    """Run the load test against ``url`` (loopback only); returns the report (see module docstring).

    ``expected``: query → ``[(id, score)]`` (at least ``max_k`` each) for every query of both
    pools, e.g. from a direct retriever call; fetched from the server before the load when None.
    """
    import aiohttp

    host = urllib.parse.urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"load tests run against loopback only, not {host!r}")
    if long_clients and not long_pool:
        raise ValueError("long_clients needs a long_pool of queries")
    pool, long_pool = list(dict.fromkeys(pool)), list(dict.fromkeys(long_pool))
    async with aiohttp.ClientSession() as probe:
        async with probe.get(url.rsplit("/", 1)[0] + "/health") as resp:
            limits = (await resp.json())["limits"]
        if expected is None:
            expected = await fetch_expected(probe, url, pool + long_pool, max_k + 2, min(64, limits["max_queries"]))
    bad, stats = malformed_requests(limits) + [oversize_body(limits)], _Stats()
    # Pooled connections are dropped before the server's idle timeout can close them under a request.
    connector = aiohttp.TCPConnector(limit=clients + long_clients,
                                     keepalive_timeout=min(15.0, limits.get("idle_timeout_s", 60.0) / 4))
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        await asyncio.gather(
            *(_client(url, seed * 1000 + c, pool, expected, bad, deadline, stats, malformed_fraction, tol,
                      timeout_s, max_k, session) for c in range(clients)),
            *(_client(url, seed * 1000 + clients + c, long_pool, expected, bad, deadline, stats, 0.0, tol,
                      timeout_s, max_k, session, long=True) for c in range(long_clients)),
            *(_slow_client(url, c, deadline, stats, limits, slack_s) for c in range(slow_clients)))
        elapsed = time.perf_counter() - t0
    c = stats.counts
    answered = c["ok"] + c["long_ok"] + c["wrong"] + c["server_errors"] + c["shed"] + c["rejected"] + c["unexpected"]
    return {
        "clients": clients, "long_clients": long_clients, "slow_clients": slow_clients,
        "duration_s": round(elapsed, 3), "requests": answered + c["lost"],
        "qps": round(answered / elapsed, 1), "valid_qps": round((c["ok"] + c["long_ok"]) / elapsed, 1),
        "queries_per_s": round(c["queries"] / elapsed, 1),
        "p50_ms": _pct(stats.latency_ms, 50), "p99_ms": _pct(stats.latency_ms, 99),
        "long_p50_ms": _pct(stats.long_latency_ms, 50), "long_p99_ms": _pct(stats.long_latency_ms, 99),
        "slow_cut_max_s": round(max(stats.slow_cut_s, default=0.0), 2), **c,
        "passed": c["ok"] > 0 and all(c[k] == 0
                                      for k in ("wrong", "server_errors", "lost", "unexpected", "slow_not_cut")),
        "problems": stats.problems,
    }


def parser():
    """The command's line: the server, the load, the queries."""
    from fastcredit.config import command_parser

    p = command_parser("python -m fastcredit.retrieval.loadtest", __doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000/retrieve")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--long-clients", type=int, default=0, help="clients whose queries run to thousands of characters")
    p.add_argument("--long-chars", type=int, default=4000,
                   help="characters per long query (keep under --max-query-chars)")
    p.add_argument("--slow-clients", type=int, default=0, help="raw connections that go idle or drip a head or body")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of load (bounded: at most 300)")
    p.add_argument("--queries", default=None, help="file with one query per line (default: 200 generated ones)")
    p.add_argument("--malformed-fraction", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Optional[list] = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if not 0 < a.duration <= 300 or not 0 < a.clients <= 1024:
        p.error("--duration must lie in (0, 300] and --clients in (0, 1024]")
    if a.queries:
        with open(a.queries, encoding="utf-8") as fh:
            pool = [line.strip() for line in fh if line.strip()]
    else:
        from fastcredit.retrieval.testing import tiny_passages

        pool = [f"{t} {x[:40]}" for _, t, x in tiny_passages(200, seed=a.seed)]
    long_pool = long_queries(16, a.long_chars, a.seed) if a.long_clients else []
    report = asyncio.run(run_load_test(a.url, pool, a.clients, a.duration, a.malformed_fraction, seed=a.seed,
                                       long_pool=long_pool, long_clients=a.long_clients, slow_clients=a.slow_clients))
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
