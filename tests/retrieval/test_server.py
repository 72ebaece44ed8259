"""The /retrieve server (validation, Search-R1's answer format, overload and failure answers),
the micro-batcher, the client's retries, and the loopback load test."""
import asyncio
import json
import socket
import threading
import time
import urllib.request

import pytest

from fastcredit.runtime.batching import MicroBatcher, QueueFull
from fastcredit.retrieval.client import RetrievalClient, RetrievalRequestError, RetrievalUnavailable
from fastcredit.retrieval.loadtest import malformed_requests, run_load_test
from fastcredit.retrieval.serve import (RequestError, ServerLimits, ServerThread, make_app, parse_request,
                                        retriever_batch_fn)
from fastcredit.retrieval.testing import tiny_passages

LIMITS = ServerLimits(max_topk=10, max_queries=16, max_query_chars=200, max_body_bytes=64 * 1024)


@pytest.fixture(scope="module")
def retriever(toy_search):
    return toy_search["retriever"]


@pytest.fixture(scope="module")
def server(retriever):
    with ServerThread(make_app(retriever_batch_fn(retriever), LIMITS, {"num_passages": 200})) as url:
        yield url


def post(url, body: bytes):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode()


@pytest.mark.parametrize("name,body,status", malformed_requests(LIMITS.__dict__),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_bad_requests_get_a_4xx_with_a_message(server, name, body, status):
    with pytest.raises(RequestError) as info:
        parse_request(body, LIMITS)
    assert info.value.status == status
    got, answer = post(server, body)
    assert got == status and answer["error"] == info.value.message


def test_answers_follow_searchr1s_format(server, retriever):
    queries = ["river castle", "walnut prism summit"]
    status, scored = post(server, json.dumps({"queries": queries, "topk": 4, "return_scores": True}).encode())
    assert status == 200 and len(scored["result"]) == 2
    want = retriever.search(queries, 4)
    for got, hs in zip(scored["result"], want):
        assert [x["document"] for x in got] == [h.document() for h in hs]
        assert [x["score"] for x in got] == pytest.approx([h.score for h in hs], abs=1e-6)
        assert set(got[0]["document"]) == {"id", "contents"}
    status, plain = post(server, json.dumps({"queries": queries, "topk": 2}).encode())
    assert plain["result"] == [[x["document"] for x in r[:2]] for r in scored["result"]]
    status, default = post(server, json.dumps({"queries": queries, "topk": None}).encode())
    assert status == 200 and [len(r) for r in default["result"]] == [LIMITS.default_topk] * 2
    assert post(server.replace("/retrieve", "/nope"), b"{}")[0] == 404
    with urllib.request.urlopen(server.replace("/retrieve", "/health")) as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok" and health["limits"]["max_topk"] == 10 and health["num_passages"] == 200


def test_oversize_body_is_refused(server):
    status, answer = post(server, b'{"queries": ["' + b"a" * (65 * 1024) + b'"]}')
    assert status == 413 and "request body over" in answer["error"]


def run_app(fn, limits, check):
    with ServerThread(make_app(fn, limits)) as url:
        check(url)


def test_overload_timeout_and_failure_answers():
    gate = threading.Event()

    def blocked(items):
        gate.wait(10)
        return [[({"id": q, "contents": q}, 1.0)] for q, _ in items]

    def background(url, body, into):
        t = threading.Thread(target=lambda: into.append(post(url, body)))
        t.start()
        time.sleep(0.3)
        return t

    def check_overload(url):
        done = []
        busy = background(url, json.dumps({"queries": ["a", "b"]}).encode(), done)  # occupies the worker
        queued = background(url, json.dumps({"queries": ["c", "d"]}).encode(), done)  # waits: 2 of 3 slots
        status, answer = post(url, json.dumps({"queries": ["e", "f"]}).encode())
        assert status == 503 and "queue is full" in answer["error"]
        gate.set()
        busy.join()
        queued.join()
        assert [s for s, _ in done] == [200, 200]

    run_app(blocked, ServerLimits(max_queue=3, batch_timeout_ms=1), check_overload)
    gate.clear()

    def check_timeout(url):
        status, answer = post(url, json.dumps({"queries": ["a"]}).encode())
        gate.set()
        assert status == 504 and "within 0.3 s" in answer["error"]

    run_app(blocked, ServerLimits(timeout_s=0.3), check_timeout)

    calls = []

    def flaky(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("index on fire")
        return [[] for _ in items]

    def check_failure(url):
        assert post(url, json.dumps({"queries": ["a"]}).encode()) == (
            500, {"error": "retrieval failed: RuntimeError: index on fire"})
        assert post(url, json.dumps({"queries": ["a"]}).encode()) == (200, {"result": [[]]})  # still serving

    run_app(flaky, ServerLimits(), check_failure)


def test_microbatcher_batches_and_routes():
    seen = []

    def fn(items):
        seen.append(len(items))
        time.sleep(0.02)
        return [f"r-{x}" for x in items]

    async def main():
        b = MicroBatcher(fn, max_batch=8, timeout_ms=5, max_queue=40)
        b.start()
        reqs = [[f"{i}-{j}" for j in range(1 + i % 3)] for i in range(20)]
        out = await asyncio.gather(*(b.submit(r) for r in reqs))
        assert out == [[f"r-{x}" for x in r] for r in reqs]
        assert max(seen) <= 8 and len(seen) < 20 and sum(seen) == 39  # batched, never split, none lost
        with pytest.raises(QueueFull):
            await asyncio.gather(*(b.submit(["x"] * 20) for _ in range(3)))
        await b.close()

    asyncio.run(main())


def test_client_retries_then_gives_up_or_raises(server):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"
    t0 = time.perf_counter()
    with pytest.raises(RetrievalUnavailable, match="after 3 attempts"):
        RetrievalClient(dead, retries=2, backoff_s=0.01, seed=0).retrieve(["a"])
    assert time.perf_counter() - t0 < 5
    with pytest.raises(RetrievalRequestError, match="400: 'topk'=-1 is out of range"):
        RetrievalClient(server).retrieve(["a"], topk=-1)
    client = RetrievalClient(server)
    obs = client.observations(["river castle"], topk=2)[0]
    assert obs.startswith("\n\n<information>Doc 1(Title: \"") and "\nDoc 2(Title: " in obs
    assert asyncio.run(client.aretrieve(["river castle"], 2)) == client.retrieve(["river castle"], 2)

    attempts = []

    def busy_then_ok(items):
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("warming up")  # a 500: retried
        return [[({"id": "0", "contents": "\"T\"\nx"}, 0.5)] for _ in items]

    run_app(busy_then_ok, ServerLimits(),
            lambda url: RetrievalClient(url, retries=3, backoff_s=0.01).observations(["q"], 1)
            == ["\n\n<information>Doc 1(Title: \"T\") x</information>\n\n"])
    assert len(attempts) == 3


@pytest.mark.slow
def test_load_test_64_clients_loses_nothing(server, retriever):
    pool = [f"{t} {x[:30]}" for _, t, x in tiny_passages(120, seed=8)]
    report = asyncio.run(run_load_test(server, pool, clients=64, duration_s=3.0, malformed_fraction=0.15))
    assert report["passed"], report["problems"]
    assert report["lost"] == report["wrong"] == report["unexpected"] == report["shed"] == 0
    assert report["ok"] > 50 and report["rejected"] > 5
    print(json.dumps({k: report[k] for k in ("qps", "valid_qps", "queries_per_s", "p50_ms", "p99_ms", "requests")}))


def _searchr1_observation(result: list) -> str:
    """What Search-R1's client (llm_agent/generation.py, ``_passages2string``) reads from one query's result."""
    out = ""
    for idx, item in enumerate(result):
        content = item["document"]["contents"]
        out += f"Doc {idx + 1}(Title: {content.split(chr(10))[0]}) {chr(10).join(content.split(chr(10))[1:])}\n"
    return out


@pytest.mark.parametrize("queries", [[], [""], ["", "   ", "river castle"], ["river castle"] * 3])
@pytest.mark.parametrize("topk", [3, 5, None, 0])
@pytest.mark.parametrize("return_scores", [True, False, None])
def test_every_payload_searchr1s_client_builds_gets_searchr1s_answer(server, retriever, queries, topk, return_scores):
    """Search-R1's client posts {"queries", "topk", "return_scores": True} every turn, with an empty list on a turn
    where no trajectory searches and whatever string the policy put between <search> tags; its server answers
    each as below (``if not request.topk`` → the default; blank strings are searched; ``[]`` → ``[]``)."""
    body = {"queries": queries, "topk": topk}
    if return_scores is not None:
        body["return_scores"] = return_scores
    status, answer = post(server, json.dumps(body).encode())
    assert status == 200 and set(answer) == {"result"} and len(answer["result"]) == len(queries)
    k = topk or LIMITS.default_topk
    want = retriever.search(queries, k) if queries else []
    for got, hits in zip(answer["result"], want):
        docs = [item["document"] for item in got] if return_scores else got
        assert [d["id"] for d in docs] == [h.id for h in hits] and len(docs) == k
        assert all(set(d) == {"id", "contents"} for d in docs)
        if return_scores:
            assert [item["score"] for item in got] == pytest.approx([h.score for h in hits], abs=1e-5)
            assert _searchr1_observation(got).startswith("Doc 1(Title: ")
    if return_scores and queries:
        assert [_searchr1_observation(r) for r in answer["result"]]  # the client's parse does not raise
