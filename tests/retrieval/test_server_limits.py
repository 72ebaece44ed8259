"""The /retrieve server under hostile input: refusals aiohttp makes before the handler, read
and idle timeouts against slow clients, a failing batch retried so only its bad request fails,
query truncation in tokens and length-bucketed encoding."""
import json
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fastcredit.retrieval.encoders import length_buckets
from fastcredit.retrieval.loadtest import long_queries
from fastcredit.retrieval.serve import ServerLimits, ServerThread, isolate_failures, make_app, retriever_batch_fn

LIMITS = ServerLimits(max_topk=10, max_queries=16, max_body_bytes=64 * 1024,
                      header_timeout_s=0.6, body_timeout_s=0.6, idle_timeout_s=1.2, linger_s=0.5)
SLACK_S = 1.0


@pytest.fixture(scope="module")
def retriever(toy_search):
    return toy_search["retriever"]


@pytest.fixture(scope="module")
def server(retriever):
    with ServerThread(make_app(retriever_batch_fn(retriever), LIMITS)) as url:
        yield url


def post(url, body: bytes, timeout: float = 30):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def address(url):
    host, port = url.split("//")[1].split("/")[0].split(":")
    return host, int(port)


def raw_exchange(url, parts, every_s: float = 0.0, wait_s: float = 10.0):
    """Send ``parts`` on a raw socket (``every_s`` apart), read until the server closes:
    ``(status or None, JSON body or None, seconds until closed)``."""
    t0 = time.perf_counter()
    with socket.create_connection(address(url), timeout=wait_s) as s:
        def send():
            try:
                for p in parts:
                    s.sendall(p)
                    time.sleep(every_s)
            except OSError:
                pass  # cut off
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        took = time.perf_counter() - t0
    if not data:
        return None, None, took
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else None, took


def head(url, extra: str = "", length: int = 0) -> bytes:
    host, port = address(url)
    return (f"POST /retrieve HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def test_refusals_before_the_handler_are_json(server):
    status, answer, _ = raw_exchange(server, [b"NOT HTTP AT ALL\r\n\r\n"])
    assert status == 400 and answer["error"].startswith("malformed HTTP request")
    status, answer, _ = raw_exchange(server, [b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"])
    assert status == 400 and "malformed HTTP request" in answer["error"]
    body = json.dumps({"queries": ["river castle"]}).encode()
    status, answer, _ = raw_exchange(server, [head(server, "Content-Encoding: gzip\r\n", len(body)) + body])
    assert status == 415 and "gzip" in answer["error"]
    status, answer, took = raw_exchange(server, [head(server, length=10 << 20)])  # refused before any body byte
    assert status == 413 and "request body over 65536 bytes" in answer["error"] and took < 5
    status, answer, _ = raw_exchange(server, [head(server).replace(b"POST /retrieve", b"GET /retrieve")
                                              .replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1)])
    assert status == 405 and answer == {"error": "Method Not Allowed: GET /retrieve"}
    chunked = head(server, "Transfer-Encoding: chunked\r\n").replace(b"Content-Length: 0\r\n", b"")
    status, answer, _ = raw_exchange(server, [chunked + b"zz\r\nnot a chunk\r\n"])
    assert status == 400 and answer["error"]


def test_slow_clients_are_cut_off_while_others_are_served(server, retriever):
    body = json.dumps({"queries": ["river castle"], "topk": 2}).encode()
    whole = head(server, length=len(body))
    drips = {  # kind → (parts, seconds apart, its limit)
        "idle": ([], 0.0, LIMITS.idle_timeout_s),
        "drip_head": ([whole[i:i + 1] for i in range(len(whole))], 0.1, LIMITS.header_timeout_s),
        "drip_body": ([whole] + [body[i:i + 1] for i in range(len(body))], 0.1, LIMITS.body_timeout_s),
    }
    with ThreadPoolExecutor(len(drips)) as pool:
        opened = time.perf_counter()  # (each slow connection opens just after)
        slow = {k: pool.submit(raw_exchange, server, parts, every) for k, (parts, every, _) in drips.items()}
        time.sleep(0.2)
        want = [h.id for h in retriever.search(["river castle"], 2)[0]]
        for _ in range(5):  # served while three slow connections are open
            status, answer = post(server, body)
            assert status == 200 and [d["id"] for d in answer["result"][0]] == want
        served = time.perf_counter() - opened
        results = {k: f.result() for k, f in slow.items()}
    # every one of the five was answered before the first slow connection was cut (a server that served one
    # connection at a time would have answered them only after): an order, not a time limit
    assert served < min(took for _, _, took in results.values()), (served, results)
    status, answer, took = results["idle"]
    assert status is None and LIMITS.idle_timeout_s - 0.1 < took < LIMITS.idle_timeout_s + SLACK_S
    status, answer, took = results["drip_head"]
    assert status == 408 and "request headers did not arrive within 0.6 s" in answer["error"]
    assert took < LIMITS.header_timeout_s + SLACK_S
    status, answer, took = results["drip_body"]
    assert status == 408 and answer["error"] == "request body did not arrive within 0.6 s"
    assert took < LIMITS.body_timeout_s + LIMITS.linger_s + SLACK_S  # the unread body is drained, then closed
    health = json.loads(urllib.request.urlopen(server.replace("/retrieve", "/health")).read())
    assert health["limits"]["header_timeout_s"] == 0.6 and health["limits"]["idle_timeout_s"] == 1.2


def test_a_keep_alive_connection_survives_between_requests_within_the_idle_timeout(server):
    body = json.dumps({"queries": ["river castle"]}).encode()
    with socket.create_connection(address(server), timeout=10) as s:
        for _ in range(3):
            s.sendall(head(server, length=len(body)) + body)
            data = s.recv(65536)
            assert data.startswith(b"HTTP/1.1 200")
            time.sleep(LIMITS.idle_timeout_s / 2)


def test_isolate_failures_pins_the_bad_request():
    calls = []

    def fn(items):
        calls.append([q for q, _ in items])
        if any(q == "poison" for q, _ in items):
            raise ValueError("cannot encode poison")
        return [f"r-{q}-{t}" for q, t in items]

    items = [(rid, q, 2) for rid, qs in enumerate([["a"], ["b", "c"], ["d", "poison"], ["e"], ["f"], ["g", "h"]])
             for q in qs]
    out = isolate_failures(fn)(items)
    assert [o if isinstance(o, str) else "X" for o in out] == \
        ["r-a-2", "r-b-2", "r-c-2", "X", "X", "r-e-2", "r-f-2", "r-g-2", "r-h-2"]
    assert str(out[3].exc) == "cannot encode poison" and out[3] is out[4]
    assert len(calls) <= 2 * 3 + 1 and calls[0] == [q for _, q, _ in items]  # 6 requests: whole, then halves
    assert all("d" not in c or "poison" in c for c in calls)  # a request is never split
    calls.clear()
    assert isolate_failures(fn)([(0, "a", 1)]) == ["r-a-1"] and len(calls) == 1


def test_a_failing_batch_fails_only_its_bad_request(retriever):
    gate, calls = threading.Event(), []
    search = retriever_batch_fn(retriever)

    def fn(items):
        calls.append(len(items))
        gate.wait(10)
        if any("\x00poison" in q for q, _ in items):
            raise TypeError("TextEncodeInput must be Union[...]")  # what a tokenizer raises on bad text
        return search(items)

    queries = [["river castle"], ["walnut prism"], ["\x00poison", "summit"], ["ember glacier", "violet"], ["orbit"]]
    with ServerThread(make_app(fn, ServerLimits(batch_timeout_ms=50))) as url:
        with ThreadPoolExecutor(len(queries)) as pool:
            futures = [pool.submit(post, url, json.dumps({"queries": qs, "topk": 3}).encode()) for qs in queries]
            time.sleep(0.3)  # all five queue behind the first batch
            gate.set()
            answers = [f.result() for f in futures]
    assert max(calls) > 2  # requests really were merged before the failure split them
    for qs, (status, answer) in zip(queries, answers):
        if "\x00poison" in qs:
            assert status == 500 and answer == {
                "error": "retrieval failed: TypeError: TextEncodeInput must be Union[...]"}
            continue
        assert status == 200
        want = retriever.search(qs, 3)
        assert [[d["id"] for d in r] for r in answer["result"]] == [[h.id for h in hs] for hs in want]


def test_length_buckets_bound_padding():
    lengths = [3, 250, 17, 16, 40, 33, 64, 8, 9, 120, 31, 200, 5] * 7
    buckets = length_buckets(lengths, batch_size=10)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        longest, shortest = max(lengths[i] for i in b), min(max(lengths[i], 16) for i in b)
        assert len(b) <= 10 and longest <= 2 * shortest
    assert length_buckets([], 4) == [] and length_buckets([5, 5, 5], 2) == [[0, 1], [2]]


def test_a_long_query_does_not_pad_the_short_ones(retriever):
    enc = retriever.encoder
    short = [f"river castle {i}" for i in range(127)]
    long = long_queries(1, 4096)[0]
    widths = []
    hook = enc.model.register_forward_pre_hook(lambda m, a, kw: widths.append(tuple(kw["input_ids"].shape)),
                                               with_kwargs=True)
    try:
        got = enc.encode([*short[:60], long, *short[60:]])
    finally:
        hook.remove()
    assert widths[0] == (1, enc.max_length), widths  # the long query, truncated, alone
    assert sorted(n for n, _ in widths[1:]) == [63, 64] and all(w <= 8 for _, w in widths[1:]), widths
    alone = torch.cat([enc.encode([q]) for q in (short[0], long)])
    torch.testing.assert_close(got[[0, 60]], alone, atol=2e-5, rtol=0)


def test_queries_are_truncated_in_tokens_as_searchr1_does(retriever):
    enc = retriever.encoder
    long = long_queries(1, 4096)[0]
    ids = enc.tokenizer([long], max_length=12, truncation=True)["input_ids"][0]
    cut = enc.tokenizer.decode(ids[1:-1])  # the text of the first 10 word pieces
    enc.query_max_length = 12
    try:
        torch.testing.assert_close(enc.encode_queries([long]), enc.encode_queries([cut]), atol=2e-5, rtol=0)
        assert not torch.allclose(enc.encode_passages([long]), enc.encode_passages([cut]), atol=1e-3)
    finally:
        enc.query_max_length = None
    with ServerThread(make_app(retriever_batch_fn(retriever), ServerLimits())) as url:
        status, answer = post(url, json.dumps({"queries": [long, "river castle"], "topk": 3}).encode())
    assert status == 200
    assert [[d["id"] for d in r] for r in answer["result"]] == \
        [[h.id for h in hs] for hs in retriever.search([long, "river castle"], 3)]
