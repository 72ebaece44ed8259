"""PiCA's reward server for a fastcredit PRM: ``POST /get_reward``, dynamically batched.

    python -m fastcredit.prm.serve --model runs/prm/export                  # http://127.0.0.1:5000/get_reward
    python -m fastcredit.prm.serve --model runs/prm/export --host 0.0.0.0 --special-token "<|vision_start|>" \\
        --output hazard --batch-tokens 32768

A drop-in for the server PiCA released (novdream/PiCA, ``OpenRLHF/openrlhf/cli/serve_rm.py``),
which its trainer's reward manager (``Search-R1/verl/trainer/main_ppo.py``) calls. Request
``{"query": [text, …], "prompts": […]}`` (``prompts`` is ignored there and here); answer
``{"rewards": [[score per special token] per query], "scores": <same>, "extra_logs":
{"dummy_scores": <same>}}``. PiCA's flag spellings ``--reward_pretrain``, ``--max_len``,
``--special_token`` and ``--batch_size`` are accepted.

Scoring positions. Each text is split on the special-token string (``--special-token``;
default the PRM's own placeholder from ``prm.json``); the pieces are tokenized as the PRM's
segments (``fastcredit.models.prm_inputs.PRMEncoder``: a piece that spells the PRM's placeholder gets
plain tokens, never a placeholder) and the placeholder id is inserted at every split, so the
k-th score is read exactly where the k-th special-token string stood; look-alikes (a
full-width spelling, say) are plain text. Text after the last special token is dropped (the
model is causal: it changes no score). A text with no special token gets ``[]``, as PiCA's
server answers it. A text over ``--max-len`` tokens has every piece cut to one common cap,
as in training, so every special token keeps its score (PiCA's server cuts the text's end
and loses the scores past it).

Output (``--output``). The PRM reads ``f_k``, the success probability after the k-th
piece. PiCA's client uses the server's score ``s`` as a hazard, the probability of failing
at that step (its step reward is ``1 − s − b``), so ``hazard`` (the default) answers
``h_k = clamp(1 − f_k / f_{k−1}, 0, 1)`` with ``f_0 := 1``. The PiCA format puts no special
token after the question (the first follows the first search), so ``f_{k−1}`` does not
exist for the first one; ``f_0 := 1`` is the survival convention of a hazard model (nothing
has failed before the first step): ``h_1 = 1 − f_1``. ``success`` answers ``f_k`` itself.

Bad input (not JSON, no ``query``, a query that is not a list of strings, too many or too
long texts, too many special tokens in one) gets a 4xx for that request alone, with
``{"error": message}``; a full queue 503, a request past ``--timeout-s`` 504. Queries from
concurrent requests are scored together in packed micro-batches of ``--batch-tokens``
tokens; a batch that raises is retried in halves so only the failing request gets a 500.
Binds 127.0.0.1 unless ``--host`` says otherwise. ``GET /health`` reports the queue, the
special token, the output and the limits.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from aiohttp import web

from fastcredit.runtime.batching import MicroBatcher, isolate_failures
from fastcredit.config import command_parser
from fastcredit.retrieval.httpserver import (TIMEOUTS, RequestError, ServerThread, Timeouts, add_address_flags,
                                             add_limit_flags, check_positive, json_error, json_errors, read_body,
                                             run_server, serve_forever, submit_batch, text_list)

log = logging.getLogger(__name__)

OUTPUTS = ("hazard", "success")
PATH = "/get_reward"
DEFAULT_PORT = 5000  # PiCA's


@dataclass
class RewardServerLimits:
    max_queries: int = 1024          # texts per request
    max_query_chars: int = 262144    # characters per text (more: 413, before tokenizing)
    max_placeholders: int = 4096     # special tokens per text (more: 413); at most --max-len
    max_body_bytes: int = 32 << 20
    max_queue: int = 4096            # texts waiting across requests (more: 503)
    timeout_s: float = 120.0         # per request, from a whole body to its answer (past it: 504)
    batch_size: int = 256            # texts per batch (then split into packed micro-batches by tokens)
    batch_timeout_ms: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    linger_s: float = 2.0            # a refused, unread body is drained this long before closing

    def __post_init__(self):
        check_positive(self)


BATCHER = web.AppKey("prm_batcher", MicroBatcher)


def parse_request(body: bytes, limits: RewardServerLimits, special: str) -> list[str]:
    """Validate a ``/get_reward`` body → its texts; RequestError otherwise."""
    _, texts = text_list(body, "query", limits.max_queries, limits.max_query_chars,
                         '{"query": [text, ...], "prompts": [...]}')
    for i, q in enumerate(texts):
        n = q.count(special)
        if n > limits.max_placeholders:
            raise RequestError(413, f"'query[{i}]' has {n} special tokens {special!r}; at most "
                                    f"{limits.max_placeholders}")
    return texts


def survival_hazards(f_K: torch.Tensor) -> torch.Tensor:
    """``h_k = clamp(1 − f_k/f_{k−1}, 0, 1)`` with ``f_0 := 1`` for one text's ``f`` at its ``K`` special tokens."""
    from fastcredit.models.prm import hazards

    K = f_K.numel()
    return hazards(torch.ones(1), f_K.float(), torch.zeros(K, dtype=torch.long), torch.arange(1, K + 1))


def prm_batch_fn(scorer, special: str, output: str = "hazard") -> Callable[[list], list]:
    """Items ``(text,)`` → per text its scores (a list of floats, one per ``special``), with ``scorer`` a
    :class:`fastcredit.judges.prm.PRMScorer`: the pieces between special tokens are its segments."""
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r}: choose one of {OUTPUTS}")
    if not special:
        raise ValueError("the special token must be a non-empty string")

    def run(items: list) -> list:
        pieces = [text.split(special) for (text,) in items]
        todo = [i for i, p in enumerate(pieces) if len(p) > 1]
        f = scorer.score_texts([(pieces[i][0], pieces[i][1:-1]) for i in todo]) if todo else []  # the tail: no score
        out: list = [[] for _ in items]
        for i, f_K in zip(todo, f):
            out[i] = (f_K if output == "success" else survival_hazards(f_K)).tolist()
        return out
    return run


def make_app(batch_fn: Callable[[list], list], special: str, limits: Optional[RewardServerLimits] = None,
             info: Optional[dict] = None) -> web.Application:
    """The aiohttp application; ``batch_fn`` as in :func:`prm_batch_fn` with the same ``special``."""
    limits = limits or RewardServerLimits()
    batcher = MicroBatcher(isolate_failures(batch_fn), limits.batch_size, limits.batch_timeout_ms, limits.max_queue)
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[json_errors],
                          handler_args={"auto_decompress": False, "lingering_time": limits.linger_s})
    request_ids = itertools.count()
    served = {"requests": 0, "texts": 0}

    async def get_reward(request: web.Request) -> web.Response:
        try:
            body = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
            texts = parse_request(body, limits, special)
        except RequestError as exc:  # an unread or slow body leaves the connection unusable: close it
            return json_error(exc.status, exc.message, close=not request.content.is_eof())
        rewards: list = []
        if texts:
            rid = next(request_ids)
            rewards, error = await submit_batch(batcher, [(rid, t) for t in texts], limits.timeout_s, "scoring")
            if error is not None:
                return error
        served["requests"] += 1
        served["texts"] += len(texts)
        return web.json_response({"rewards": rewards, "scores": rewards, "extra_logs": {"dummy_scores": rewards}})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "special_token": special, "queued": batcher.queued,
                                  "batches": batcher.batches, **served, "limits": dataclasses.asdict(limits),
                                  **(info or {})})

    async def on_startup(app):
        batcher.start()

    async def on_cleanup(app):
        await batcher.close()

    app.router.add_post(PATH, get_reward)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app[BATCHER] = batcher
    app[TIMEOUTS] = Timeouts(header_s=limits.header_timeout_s, idle_s=limits.idle_timeout_s)
    return app


def reward_server_thread(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> ServerThread:
    """``with reward_server_thread(app) as url: ...`` — the app on its own thread (tests, inside a trainer);
    ``url`` ends in ``/get_reward``."""
    return ServerThread(app, host, port, path=PATH, name="prm-reward-server")


def load_reward_app(folder: str, device="cpu", special: Optional[str] = None, output: str = "hazard",
                    max_len: Optional[int] = None, batch_tokens: int = 16384,
                    limits: Optional[RewardServerLimits] = None) -> tuple[web.Application, dict]:
    """``(app, info)`` serving the PRM folder ``folder`` (the defaults as on the command line)."""
    from fastcredit.models.prm import load_prm
    from fastcredit.judges.prm import PRMScorer

    device = torch.device(device)
    model, tok, meta = load_prm(folder, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    max_len = int(max_len or meta["max_tokens"])
    special = special or meta["placeholder"]
    limits = limits or RewardServerLimits()
    limits = dataclasses.replace(limits, max_placeholders=min(max_len, limits.max_placeholders))
    scorer = PRMScorer(model, tok, dict(meta, max_tokens=max_len), device, micro_batch_tokens=batch_tokens)
    info = {"model": folder, "placeholder": meta["placeholder"], "output": output, "max_len": max_len,
            "batch_tokens": batch_tokens, "device": str(device)}
    return make_app(prm_batch_fn(scorer, special, output), special, limits, info), info


def parser() -> argparse.ArgumentParser:
    d = RewardServerLimits()
    p = command_parser("python -m fastcredit.prm.serve", __doc__)
    p.add_argument("--model", "--reward_pretrain", dest="model", required=True,
                   help="PRM folder (python -m fastcredit.prm.train exports one)")
    add_address_flags(p, port=DEFAULT_PORT)
    p.add_argument("--special-token", "--special_token", dest="special_token", default=None,
                   help="the string whose every occurrence in a text is a scoring position (default: the PRM's "
                        "placeholder from prm.json; PiCA's client writes <|vision_start|>)")
    p.add_argument("--output", default="hazard", choices=OUTPUTS,
                   help="hazard: 1 - f_k/f_(k-1) with f_0 = 1, what PiCA's client expects; success: f_k")
    p.add_argument("--max-len", "--max_len", dest="max_len", type=int, default=None,
                   help="PRM tokens per text; longer texts have every piece cut to a common cap "
                        "(default: the PRM's max_tokens)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per packed forward pass")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (auto: cuda when there is one)")
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=d.batch_size,
                   help="texts per batch across requests (split into --batch-tokens forward passes)")
    add_limit_flags(p, d, {
        "max_queries": "texts per request", "max_query_chars": "characters per text (more: 413)",
        "max_body_bytes": "bytes per request body", "max_queue": "texts waiting across requests (more: 503)",
        "timeout_s": "per-request limit, from a whole body to its answer (past it: 504)",
        "batch_timeout_ms": "how long a batch waits for more texts before it runs"})
    return p


def open_app(a: argparse.Namespace, limits: RewardServerLimits,
             p: argparse.ArgumentParser) -> tuple[web.Application, str]:
    """``(app, what it serves)`` for the command line ``a``: the PRM folder it names, behind ``limits``."""
    if a.max_len is not None and a.max_len < 1 or a.batch_tokens < 1:
        p.error(f"--max-len ({a.max_len}) and --batch-tokens ({a.batch_tokens}) must be at least 1")
    if a.special_token == "":
        p.error("--special-token must not be empty")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    log.info("loading the PRM %s on %s", a.model, device)
    try:
        app, info = load_reward_app(a.model, device, a.special_token, a.output, a.max_len, a.batch_tokens, limits)
    except ValueError as exc:
        p.error(str(exc))
    special = a.special_token or info["placeholder"]
    return app, f"{a.model} ({a.output} at every {special!r}, up to {info['max_len']} tokens per text)"


def main(argv: Optional[list] = None) -> int:
    p = parser()
    return run_server(p, p.parse_args(argv), RewardServerLimits, open_app, path=PATH, log=log, serve=serve_forever)


if __name__ == "__main__":
    sys.exit(main())
