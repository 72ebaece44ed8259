"""A Search-R1-compatible retrieval server: ``POST /retrieve``, dynamically batched.

    python -m fastcredit.retrieval.serve --index runs/toyworld/index            # a fastcredit build
    python -m fastcredit.retrieval.serve --corpus wiki-18.jsonl --index e5_Flat.index \\
        --encoder /models/e5-base-v2 --query-prefix "query: " --passage-prefix "passage: " --topk 3

Request ``{"queries": [str], "topk": int (optional), "return_scores": bool (optional)}``;
answer ``{"result": [[doc, …] per query]}`` with ``doc = {"id", "contents"}``, or with
``return_scores`` ``[[{"document": doc, "score": float}, …]]`` — Search-R1's format. Every
input Search-R1's client sends is answered as its own server answers it: an empty query list
gets ``{"result": []}`` (the client posts one on a turn where no trajectory searches), an
empty or blank query string is searched like any other, and a missing, null or 0 ``topk``
means the server's default.
Queries from concurrent requests are batched into one encoder + index call. Bad input gets
a 4xx answer with ``{"error": message}``; a full queue 503, a request past its timeout 504.
Binds 127.0.0.1 unless ``--host`` says otherwise. ``GET /health`` reports the queue.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from aiohttp import web

from fastcredit.batching import MicroBatcher, QueueFull
from fastcredit.cli import argparser
from fastcredit.retrieval.cli import add_encoder_args

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    default_topk: int = 3          # used when a request has no (or a null) topk, as in Search-R1
    max_topk: int = 100
    max_queries: int = 1024        # per request
    max_query_chars: int = 4096
    max_body_bytes: int = 4 << 20
    max_queue: int = 8192          # waiting queries across requests
    timeout_s: float = 30.0        # per request, queueing included
    batch_size: int = 256
    batch_timeout_ms: float = 2.0


BATCHER = web.AppKey("batcher", MicroBatcher)


class RequestError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _type(v) -> str:
    return "null" if v is None else type(v).__name__


def parse_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a ``/retrieve`` body → ``(queries, topk, return_scores)``; RequestError otherwise."""
    if not body.strip():
        raise RequestError(400, "empty request body; expected JSON {\"queries\": [...], \"topk\": k}")
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"invalid JSON: {exc}") from None
    if not isinstance(req, dict):
        raise RequestError(400, f"the body must be a JSON object, got {_type(req)}")
    if "queries" not in req:
        raise RequestError(400, "missing field 'queries'")
    queries = req["queries"]
    if not isinstance(queries, list):
        raise RequestError(400, f"'queries' must be a list of strings, got {_type(queries)}")
    if len(queries) > limits.max_queries:
        raise RequestError(413, f"'queries' has {len(queries)} entries; at most {limits.max_queries} per request")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(400, f"'queries[{i}]' must be a string, got {_type(q)}")
        if len(q) > limits.max_query_chars:
            raise RequestError(413, f"'queries[{i}]' has {len(q)} characters; at most {limits.max_query_chars}")
    topk = req.get("topk")
    if isinstance(topk, bool) or not isinstance(topk, (int, type(None))):
        raise RequestError(400, f"'topk' must be an integer, got {_type(topk)}")
    if not topk:  # null or 0: the default, as Search-R1's server does (`if not request.topk`)
        topk = limits.default_topk
    elif not 1 <= topk <= limits.max_topk:
        raise RequestError(400, f"'topk'={topk} is out of range [1, {limits.max_topk}]")
    return_scores = req.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(400, f"'return_scores' must be true or false, got {_type(return_scores)}")
    return queries, topk, return_scores


def retriever_batch_fn(retriever) -> Callable[[list], list]:
    """Items ``(query, topk)`` → per item ``[(document, score), …]``: one search at the batch's largest k."""
    def run(items: list) -> list:
        k = max(t for _, t in items)
        hits = retriever.search([q for q, _ in items], k)
        return [[(h.document(), h.score) for h in hs[:t]] for hs, (_, t) in zip(hits, items)]
    return run


def _error(status: int, message: str, headers: Optional[dict] = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def make_app(batch_fn: Callable[[list], list], limits: Optional[ServerLimits] = None,
             info: Optional[dict] = None) -> web.Application:
    """The aiohttp application; ``batch_fn`` as in :func:`retriever_batch_fn`."""
    limits = limits or ServerLimits()
    batcher = MicroBatcher(batch_fn, limits.batch_size, limits.batch_timeout_ms, limits.max_queue)
    app = web.Application(client_max_size=limits.max_body_bytes)

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {limits.max_body_bytes} bytes")
        try:
            queries, topk, return_scores = parse_request(body, limits)
        except RequestError as exc:
            return _error(exc.status, exc.message)
        if not queries:
            return web.json_response({"result": []})
        try:
            results = await asyncio.wait_for(batcher.submit([(q, topk) for q in queries]), limits.timeout_s)
        except QueueFull as exc:
            return _error(503, str(exc), {"Retry-After": "1"})
        except asyncio.TimeoutError:
            return _error(504, f"retrieval did not finish within {limits.timeout_s} s")
        except Exception as exc:  # a failed batch must answer its requests, never kill the server
            log.exception("retrieval batch failed")
            return _error(500, f"retrieval failed: {type(exc).__name__}: {exc}")
        if return_scores:
            payload = [[{"document": d, "score": s} for d, s in r] for r in results]
        else:
            payload = [[d for d, _ in r] for r in results]
        return web.json_response({"result": payload})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "queued": batcher.queued, "batches": batcher.batches,
                                  "limits": dataclasses.asdict(limits), **(info or {})})

    async def on_startup(app):
        batcher.start()

    async def on_cleanup(app):
        await batcher.close()

    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app[BATCHER] = batcher
    return app


class ServerThread:
    """Run an app on its own event loop in a daemon thread (tests, benchmarks, embedding in a trainer).

    ``with ServerThread(app) as url: ...`` — port 0 picks a free port; ``url`` ends in ``/retrieve``.
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="retrieval-server")
        self._runner: Optional[web.AppRunner] = None
        self._error: Optional[BaseException] = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = web.AppRunner(self.app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
        except BaseException as exc:  # report start-up failures to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/retrieve"

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise RuntimeError(f"retrieval server failed to start on {self.host}:{self.port}: {self._error}")
        return self.url

    def stop(self) -> None:
        if self._runner is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _parser() -> argparse.ArgumentParser:
    d = ServerLimits()
    p = argparser("python -m fastcredit.retrieval.serve", __doc__)
    p.add_argument("--index", default=None, help="FAISS index file (Search-R1's e5_Flat.index) or a fastcredit build folder")
    p.add_argument("--corpus", default=None, help="corpus jsonl (needed unless --index is a build folder)")
    add_encoder_args(p, query_prefix_help="E5: 'query: '", passage_prefix_help="E5: 'passage: ' (only used when building)")
    p.add_argument("--num-shards", type=int, default=0, help="GPUs to shard a flat index over (0: all)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--topk", type=int, default=d.default_topk, help="passages per query when a request sets none")
    for name, what in (("max_topk", "largest topk a request may ask for"), ("max_queries", "queries per request"),
                       ("max_query_chars", "characters per query"), ("max_body_bytes", "bytes per request body"),
                       ("max_queue", "queries waiting across requests (more: 503)"),
                       ("batch_size", "queries per encoder + index call")):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=what)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s,
                   help="per-request limit, queueing included (past it: 504)")
    p.add_argument("--batch-timeout-ms", type=float, default=d.batch_timeout_ms,
                   help="how long a batch waits for more queries before it runs")
    return p


def main(argv: Optional[list] = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from fastcredit.retrieval.retriever import open_retriever

    retriever = open_retriever(corpus=a.corpus, index=a.index, encoder=a.encoder, pooling=a.pooling,
                               query_prefix=a.query_prefix, passage_prefix=a.passage_prefix, index_type=a.index_type,
                               device=a.device, dtype=a.dtype, batch_size=a.batch_size, num_shards=a.num_shards)
    limits = ServerLimits(a.topk, a.max_topk, a.max_queries, a.max_query_chars, a.max_body_bytes, a.max_queue,
                          a.timeout_s, a.batch_size, a.batch_timeout_ms)
    app = make_app(retriever_batch_fn(retriever), limits, {"num_passages": len(retriever.corpus)})
    log.info("serving %d passages on http://%s:%d/retrieve", len(retriever.corpus), a.host, a.port)
    web.run_app(app, host=a.host, port=a.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
