"""Soak: the /retrieve server on loopback under a mix of valid, malformed, long-query and
slow-drip clients for a bounded time (about 30 s), then ``python -m fastcredit.retrieval.serve``
itself (flags, SIGTERM) under a short load of the same mix."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from fastcredit.retrieval.loadtest import long_queries, run_load_test
from fastcredit.retrieval.serve import ServerLimits, ServerThread, make_app, retriever_batch_fn

MAX_K = 3
# Short timeouts so slow clients are cut many times; the idle timeout stays above the clients'
# pool keep-alive (idle / 4) plus the scheduling lag of a loaded 2-core machine, else a pooled
# connection can be closed as idle just as a client reuses it (HTTP keep-alive's known race).
LIMITS = ServerLimits(max_body_bytes=256 * 1024, header_timeout_s=1.0, body_timeout_s=1.0, idle_timeout_s=5.0,
                      linger_s=1.0)
CLI_FLAGS = ["--max-length", "64", "--device", "cpu", "--max-body-bytes", str(256 * 1024), "--header-timeout-s", "1",
             "--body-timeout-s", "1", "--idle-timeout-s", "5", "--linger-s", "1"]
SLACK_S = 3.0  # a slow client must be cut within its timeout plus this, on a machine shared with other work
# The process holds the server and the load test's clients (which keep only counters and
# latencies). Python's allocator keeps freed arenas, and caches (tokenizer, parsers) still
# fill after a short warm-up: growth up to this bound is allowed. Leaking one request body,
# response or connection per request (thousands of them, 200 KB bodies among them) is far more.
RSS_GROWTH_BOUND = 24 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pools(toy_search):
    pool = [f"{t} {x[:30]}" for _, t, x in toy_search["passages"][:120]]
    long_pool = long_queries(8, 4000)
    # The expected answers come from a direct retriever call, not from the server.
    hits = toy_search["retriever"].search(pool + long_pool, MAX_K + 2)
    return pool, long_pool, {q: [(h.id, h.score) for h in hs] for q, hs in zip(pool + long_pool, hits)}


def load(url, toy_search, duration_s, clients, long_clients, slow_clients, seed):
    pool, long_pool, expected = pools(toy_search)
    return asyncio.run(run_load_test(url, pool, clients=clients, duration_s=duration_s, malformed_fraction=0.2,
                                     max_k=MAX_K, seed=seed, long_pool=long_pool, long_clients=long_clients,
                                     slow_clients=slow_clients, expected=expected, slack_s=SLACK_S))


def check(report):
    assert report["passed"], report["problems"]
    assert report["lost"] == report["wrong"] == report["server_errors"] == report["unexpected"] == 0
    assert report["shed"] == 0 and report["slow_not_cut"] == 0


@pytest.fixture(scope="module")
def cli_server(toy_search, tmp_path_factory):
    """The CLI server, started first: it imports torch while the in-process soak runs."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("soak") / "server.log", "w+")
    # One intra-op thread: on a shared 2-core machine torch's spinning threads starve the clients.
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "fastcredit.retrieval.serve", "--index", toy_search["build"],
                             "--encoder", toy_search["enc_dir"], "--port", str(port), *CLI_FLAGS],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    yield proc, f"http://127.0.0.1:{port}/retrieve", log
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
    log.close()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_soak_mixed_clients_lose_nothing_and_keep_memory_flat(toy_search, cli_server):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in cli_server: the clients share this process's two cores
    try:
        with ServerThread(make_app(retriever_batch_fn(toy_search["retriever"]), LIMITS)) as url:
            warm = load(url, toy_search, 5.0, 16, 2, 3, seed=1)
            rss_warm = rss_bytes(os.getpid())
            soak = load(url, toy_search, 20.0, 32, 4, 6, seed=2)
            rss_end = rss_bytes(os.getpid())
            health = json.loads(urllib.request.urlopen(url.replace("/retrieve", "/health"), timeout=5).read())
            alive = any(t.name == "retrieval-server" and t.is_alive() for t in threading.enumerate())
    finally:
        torch.set_num_threads(threads)
    keys = ("requests", "ok", "long_ok", "rejected", "slow_cut", "slow_408", "qps", "p50_ms", "p99_ms",
            "long_p50_ms", "long_p99_ms", "slow_cut_max_s")
    print(json.dumps({**{k: soak[k] for k in keys}, "rss_warm_mb": round(rss_warm / 2**20, 1),
                      "rss_end_mb": round(rss_end / 2**20, 1)}))
    check(warm)
    check(soak)
    assert soak["ok"] > 200 and soak["long_ok"] > 10 and soak["rejected"] > 50 and soak["slow_408"] > 5
    assert alive and health["status"] == "ok" and health["queued"] == 0
    assert rss_end - rss_warm < RSS_GROWTH_BOUND, (rss_warm, rss_end)


@pytest.mark.slow
def test_the_serve_command_under_the_same_mix_then_sigterm(cli_server, toy_search):
    proc, url, log = cli_server
    deadline = time.time() + 120
    while True:
        try:
            health = json.loads(urllib.request.urlopen(url.replace("/retrieve", "/health"), timeout=2).read())
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                pytest.fail(f"the server did not start:\n{log.read()[-3000:]}")
            time.sleep(0.3)
    assert health["limits"]["header_timeout_s"] == 1.0 and health["limits"]["linger_s"] == 1.0
    assert health["max_query_tokens"] == 64  # --max-length, as Search-R1's retrieval_query_max_length
    report = load(url, toy_search, 4.0, 16, 2, 3, seed=3)
    print(json.dumps({k: report[k] for k in ("requests", "ok", "long_ok", "rejected", "slow_cut", "p50_ms", "p99_ms")}))
    check(report)
    assert report["ok"] > 20 and report["slow_cut"] > 0 and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
