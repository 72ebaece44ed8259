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
means the server's default. Queries longer than ``--max-query-tokens`` encoder tokens
(default: the encoder's max length, 256 — Search-R1's ``retrieval_query_max_length``) are
truncated, as Search-R1's retriever truncates them; a query over ``--max-query-chars``
characters is refused (413) before it is tokenized.
Queries from concurrent requests are batched into one encoder + index call, encoded in
length buckets (one long query never pads a batch of short ones). A batch that raises is
retried in halves, never splitting a request, so only the requests that make it fail get a
500; the rest of the batch is answered. Bad input of any kind (not UTF-8, lone surrogates,
nesting or integers past the parser's limits, wrong types, oversize bodies, out-of-range
``topk``) gets a 4xx for that request alone, with ``{"error": message}``; a full queue 503,
a request past its timeout 504, a body or request head that arrives too slowly 408.
Binds 127.0.0.1 unless ``--host`` says otherwise. ``GET /health`` reports the queue and limits.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from aiohttp import web

from fastcredit.runtime.batching import ItemFailed, MicroBatcher, isolate_failures
from fastcredit.config import command_parser
from fastcredit.retrieval.cli import add_encoder_args
from fastcredit.retrieval.httpserver import (TIMEOUTS, RequestError, ServerThread, Timeouts, add_address_flags,
                                             add_limit_flags, check_positive, json_error, json_errors, read_body,
                                             run_server, serve_forever, submit_batch, text_list, value_type)

__all__ = ["ServerLimits", "RequestError", "parse_request", "retriever_batch_fn", "isolate_failures", "ItemFailed",
           "make_app", "ServerThread", "main"]

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    default_topk: int = 3          # used when a request has no (or a null) topk, as in Search-R1
    max_topk: int = 100
    max_queries: int = 1024        # per request
    max_query_chars: int = 4096    # per query, refused past it (tokens past the encoder's limit are truncated)
    max_body_bytes: int = 4 << 20
    max_queue: int = 8192          # waiting queries across requests
    timeout_s: float = 30.0        # per request, from a whole body to its answer (past it: 504)
    batch_size: int = 256
    batch_timeout_ms: float = 2.0
    header_timeout_s: float = 10.0  # a request head, from its first byte (past it: 408, connection closed)
    body_timeout_s: float = 30.0    # a request body, from the end of its head (past it: 408, connection closed)
    idle_timeout_s: float = 60.0    # an open connection with no request in flight (past it: closed)
    # After refusing a request whose body was not read (413, 415, 408), the rest is read and
    # dropped for at most this long before the connection closes, so the client sees the
    # answer rather than a reset (aiohttp's lingering_time; its default is 10 s).
    linger_s: float = 2.0

    def __post_init__(self):
        check_positive(self)


BATCHER = web.AppKey("batcher", MicroBatcher)


def parse_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a ``/retrieve`` body → ``(queries, topk, return_scores)``; RequestError otherwise."""
    req, queries = text_list(body, "queries", limits.max_queries, limits.max_query_chars,
                             '{"queries": [...], "topk": k}')
    topk = req.get("topk")
    if isinstance(topk, bool) or not isinstance(topk, (int, type(None))):
        raise RequestError(400, f"'topk' must be an integer, got {value_type(topk)}")
    if not topk:  # null or 0: the default, as Search-R1's server does (`if not request.topk`)
        topk = limits.default_topk
    elif not 1 <= topk <= limits.max_topk:
        raise RequestError(400, f"'topk'={topk} is out of range [1, {limits.max_topk}]")
    return_scores = req.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(400, f"'return_scores' must be true or false, got {value_type(return_scores)}")
    return queries, topk, return_scores


def retriever_batch_fn(retriever) -> Callable[[list], list]:
    """Items ``(query, topk)`` → per item ``[(document, score), …]``: one search at the batch's largest k."""
    def run(items: list) -> list:
        k = max(t for _, t in items)
        hits = retriever.search([q for q, _ in items], k)
        return [[(h.document(), h.score) for h in hs[:t]] for hs, (_, t) in zip(hits, items)]
    return run


def make_app(batch_fn: Callable[[list], list], limits: Optional[ServerLimits] = None,
             info: Optional[dict] = None) -> web.Application:
    """The aiohttp application; ``batch_fn`` as in :func:`retriever_batch_fn`."""
    limits = limits or ServerLimits()
    batcher = MicroBatcher(isolate_failures(batch_fn), limits.batch_size, limits.batch_timeout_ms, limits.max_queue)
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[json_errors],
                          handler_args={"auto_decompress": False, "lingering_time": limits.linger_s})
    request_ids = itertools.count()

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
            queries, topk, return_scores = parse_request(body, limits)
        except RequestError as exc:  # an unread or slow body leaves the connection unusable: close it
            return json_error(exc.status, exc.message, close=not request.content.is_eof())
        if not queries:
            return web.json_response({"result": []})
        rid = next(request_ids)
        results, error = await submit_batch(batcher, [(rid, q, topk) for q in queries], limits.timeout_s, "retrieval")
        if error is not None:
            return error
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
    app[TIMEOUTS] = Timeouts(header_s=limits.header_timeout_s, idle_s=limits.idle_timeout_s)
    return app


def parser() -> argparse.ArgumentParser:
    d = ServerLimits()
    p = command_parser("python -m fastcredit.retrieval.serve", __doc__)
    p.add_argument("--index", default=None,
                   help="FAISS index file (Search-R1's e5_Flat.index) or a fastcredit build folder")
    p.add_argument("--corpus", default=None, help="corpus jsonl (needed unless --index is a build folder)")
    add_encoder_args(p, query_prefix_help="E5: 'query: '",
                     passage_prefix_help="E5: 'passage: ' (only used when building)")
    p.add_argument("--max-length", type=int, default=256, help="encoder tokens per passage when building an index")
    p.add_argument("--max-query-tokens", type=int, default=None,
                   help="encoder tokens per query, prefix included; longer queries are truncated as Search-R1's "
                        "retriever does (default: --max-length, Search-R1's retrieval_query_max_length 256)")
    p.add_argument("--num-shards", type=int, default=0, help="GPUs to shard a flat index over (0: all)")
    add_address_flags(p, port=8000)
    p.add_argument("--topk", dest="default_topk", metavar="TOPK", type=int, default=d.default_topk,
                   help="passages per query when a request sets none")
    add_limit_flags(p, d, {
        "max_topk": "largest topk a request may ask for", "max_queries": "queries per request",
        "max_query_chars": "characters per query (more: 413, before tokenizing)",
        "max_body_bytes": "bytes per request body", "max_queue": "queries waiting across requests (more: 503)",
        "batch_size": "queries per encoder + index call",
        "timeout_s": "per-request limit, from a whole body to its answer (past it: 504)",
        "batch_timeout_ms": "how long a batch waits for more queries before it runs",
        "header_timeout_s": "seconds from a request's first byte to the end of its headers "
                            "(past it: 408 and the connection is closed)",
        "body_timeout_s": "seconds to read a request body (past it: 408, connection closed)",
        "idle_timeout_s": "seconds an open connection may sit with no request (keep-alive)",
        "linger_s": "seconds the rest of a refused, unread body is drained before closing"})
    return p


def open_app(a: argparse.Namespace, limits: ServerLimits, p: argparse.ArgumentParser) -> tuple[web.Application, str]:
    """``(app, what it serves)`` for the command line ``a``: the retriever it names, behind ``limits``."""
    if a.max_query_tokens is not None and a.max_query_tokens < 1:
        p.error(f"--max-query-tokens must be at least 1, got {a.max_query_tokens}")
    from fastcredit.retrieval.retriever import open_retriever

    retriever = open_retriever(corpus=a.corpus, index=a.index, encoder=a.encoder, pooling=a.pooling,
                               query_prefix=a.query_prefix, passage_prefix=a.passage_prefix, index_type=a.index_type,
                               device=a.device, dtype=a.dtype, max_length=a.max_length, batch_size=a.batch_size,
                               num_shards=a.num_shards)
    enc = retriever.encoder
    enc.query_max_length = a.max_query_tokens
    model_max = getattr(enc.model.config, "max_position_embeddings", None)
    if a.max_query_tokens and model_max and a.max_query_tokens > model_max:
        p.error(f"--max-query-tokens {a.max_query_tokens} exceeds the encoder's {model_max} positions")
    info = {"num_passages": len(retriever.corpus), "max_query_tokens": enc.query_max_length or enc.max_length}
    return make_app(retriever_batch_fn(retriever), limits, info), f"{len(retriever.corpus)} passages"


def main(argv: Optional[list] = None) -> int:
    p = parser()
    return run_server(p, p.parse_args(argv), ServerLimits, open_app, path="/retrieve", log=log, serve=serve_forever)


if __name__ == "__main__":
    sys.exit(main())
