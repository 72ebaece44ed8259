"""The HTTP layer under the ``/retrieve`` and ``/get_reward`` apps (``fastcredit.retrieval.serve``,
``fastcredit.prm.serve``): aiohttp with read and idle timeouts, JSON error bodies for requests
aiohttp itself refuses, request-body and JSON helpers that turn bad input into a
:class:`RequestError` (a 4xx for that request alone), and the ways to run an app (a thread,
or the foreground process, as both servers' ``main``: :func:`run_server`).

    with ServerThread(make_app(...)) as url: ...          # tests, benchmarks, inside a trainer
    serve_forever(make_app(...), "127.0.0.1", 8000)      # the foreground, until SIGINT / SIGTERM
    return run_server(p, p.parse_args(argv), ServerLimits, open_app, path="/retrieve", log=log)   # a server's main

Connection timeouts (:class:`Timeouts`): a request head (request line and headers) must
arrive within ``header_s`` of its first byte, else the server answers 408 and closes; an
idle connection (before its first request or between requests) is closed after
``idle_s`` (aiohttp's keep-alive timeout). The body's read timeout is the handler's
(``serve.py``). A slow-drip client holds one socket and one idle task, never the worker.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import threading
from http import HTTPStatus
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from fastcredit.runtime.batching import ItemFailed, QueueFull

log = logging.getLogger(__name__)


@dataclass
class Timeouts:
    header_s: float = 10.0   # from a request's first byte to the end of its headers (past it: 408, closed)
    idle_s: float = 60.0     # an open connection with no request in flight (past it: closed)


TIMEOUTS = web.AppKey("timeouts", Timeouts)
MAX_INT_DIGITS = 18  # any JSON integer longer is refused before Python converts it


class RequestError(ValueError):
    """Bad input of one request: answered with ``status`` (4xx) and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def value_type(v) -> str:
    """A JSON value's type for an error message."""
    return "null" if v is None else type(v).__name__


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise RequestError(400, f"a JSON integer has {len(text.lstrip('-'))} digits; at most {MAX_INT_DIGITS}")
    return int(text)


def _parse_constant(name: str):
    raise RequestError(400, f"{name} is not valid JSON")


def load_json(body: bytes):
    """A request body parsed as strict JSON (UTF-8, no NaN, bounded integers), or RequestError (400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        return json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except RecursionError:
        raise RequestError(400, "invalid JSON: nested too deeply") from None
    except RequestError:
        raise
    except ValueError as exc:
        raise RequestError(400, f"invalid JSON: {exc}") from None


def check_positive(limits) -> None:
    """Every field of a limits dataclass a positive number (ValueError naming the others)."""
    bad = [f"{f.name}={getattr(limits, f.name)!r}" for f in dataclasses.fields(limits)
           if not isinstance(getattr(limits, f.name), (int, float)) or not getattr(limits, f.name) > 0]
    if bad:
        raise ValueError(f"server limits must be positive numbers: {', '.join(bad)}")


def text_list(body: bytes, key: str, max_items: int, max_chars: int, expected: str) -> tuple[dict, list]:
    """``(request object, its list of strings under key)``: the body a JSON object (``expected`` shows its shape
    in the error), the list at most ``max_items`` long, each string at most ``max_chars`` characters of valid
    Unicode; RequestError (400 / 413) naming the field otherwise."""
    if not body.strip():
        raise RequestError(400, f"empty request body; expected JSON {expected}")
    req = load_json(body)
    if not isinstance(req, dict):
        raise RequestError(400, f"the body must be a JSON object, got {value_type(req)}")
    if key not in req:
        raise RequestError(400, f"missing field {key!r} (a list of strings)")
    items = req[key]
    if not isinstance(items, list):
        raise RequestError(400, f"{key!r} must be a list of strings, got {value_type(items)}")
    if len(items) > max_items:
        raise RequestError(413, f"{key!r} has {len(items)} entries; at most {max_items} per request")
    for i, q in enumerate(items):
        if not isinstance(q, str):
            raise RequestError(400, f"'{key}[{i}]' must be a string, got {value_type(q)}")
        if len(q) > max_chars:
            raise RequestError(413, f"'{key}[{i}]' has {len(q)} characters; at most {max_chars}")
        if not q.isascii():
            try:
                q.encode("utf-8")
            except UnicodeEncodeError as exc:  # json.loads accepts "\ud800"; no tokenizer does
                raise RequestError(400, f"'{key}[{i}]' is not valid Unicode: a lone surrogate "
                                        f"U+{ord(q[exc.start]):04X} at character {exc.start}") from None
    return req, items


async def read_body(request: web.Request, max_body_bytes: int, timeout_s: float) -> bytes:
    """The request body, or RequestError (408 slow, 413 too large, 415 compressed, 400 unreadable)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise RequestError(415, f"Content-Encoding {encoding!r} is not supported; send the JSON body uncompressed")
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise RequestError(413, f"request body over {max_body_bytes} bytes")
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(413, f"request body over {max_body_bytes} bytes") from None
    except asyncio.TimeoutError:
        raise RequestError(408, f"request body did not arrive within {timeout_s} s") from None
    except Exception as exc:  # a broken chunked encoding, a reset connection: the client's side
        raise RequestError(400, f"could not read the request body: {type(exc).__name__}: {exc}") from None


def json_error(status: int, message: str, headers: Optional[dict] = None, close: bool = False) -> web.Response:
    """``{"error": message}`` with ``status``; ``close``: the connection is closed after it."""
    resp = web.json_response({"error": message}, status=status, headers=headers)
    if close:
        resp.force_close()
    return resp


async def submit_batch(batcher, items: list, timeout_s: float, what: str):
    """``(results, None)`` from a :class:`~fastcredit.runtime.batching.MicroBatcher`, or ``(None, error response)``:
    503 when its queue is full, 504 past ``timeout_s``, 500 when the batcher or one of ``items`` failed
    (``what`` names the work in the message: "retrieval", "scoring"). Never raises: a server answers."""
    try:
        results = await asyncio.wait_for(batcher.submit(items), timeout_s)
    except QueueFull as exc:
        return None, json_error(503, str(exc), {"Retry-After": "1"})
    except asyncio.TimeoutError:
        return None, json_error(504, f"{what} did not finish within {timeout_s} s")
    except Exception as exc:  # the batcher itself failed
        log.exception("%s batch failed", what)
        return None, json_error(500, f"{what} failed: {type(exc).__name__}: {exc}")
    failed = next((r for r in results if isinstance(r, ItemFailed)), None)
    if failed is not None:
        return None, json_error(500, f"{what} failed: {type(failed.exc).__name__}: {failed.exc}")
    return results, None


@web.middleware
async def json_errors(request: web.Request, handler):
    """aiohttp's own refusals (404 unknown path, 405 wrong method) with a JSON ``{"error"}`` body."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return json_error(exc.status, f"{exc.reason}: {request.method} {request.path}", headers)


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _TimedRequestHandler(RequestHandler):
    """aiohttp's connection protocol plus a header read timeout and JSON error bodies.

    NOTE: reads aiohttp's ``_request_count`` (requests parsed on this connection) and
    ``_waiter`` (set while the connection waits for its next request); an aiohttp without
    them gets no header timeout (a warning says so; the idle timeout still holds), and the
    tests in ``tests/retrieval/test_server_limits.py`` fail.
    """

    __slots__ = ("header_s", "_head_timer", "_head_count")
    PRIVATE = ("_request_count", "_waiter", "_loop")

    def data_received(self, data: bytes) -> None:
        if not self.header_s:
            return super().data_received(data)
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a whole request head arrived
            self._cancel_head_timer()
        waiting = self._waiter is not None and not self._waiter.done()
        if data and waiting and self._head_timer is None and self.transport is not None:
            self._head_count = self._request_count
            self._head_timer = self._loop.call_later(self.header_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._request_count == self._head_count and self.transport is not None:
            msg = f"request headers did not arrive within {self.header_s} s of their first byte"
            self.transport.write(_raw_json_response(408, "Request Timeout", msg))
            self.force_close()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        """Requests aiohttp refuses before any handler (a bad request line, oversize headers):
        a JSON ``{"error"}`` body; 5xx are logged and say nothing about the internals."""
        if request.writer.output_size > 0:  # the response has started: nothing more to send
            raise ConnectionError("response already started; cannot send an error")
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            text = HTTPStatus(status).phrase.lower()
        else:
            log.debug("refused a malformed HTTP request from %s: %s", request.remote, message)
            text = f"malformed HTTP request: {message or exc or 'unreadable'}"
        resp = web.json_response({"error": text}, status=status)
        resp.force_close()
        return resp


class _TimedServer(Server):
    header_s = Timeouts.header_s

    def __call__(self) -> RequestHandler:
        handler = _TimedRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.header_s, handler._head_timer, handler._head_count = self.header_s, None, 0
        if handler.header_s and not all(hasattr(handler, a) for a in _TimedRequestHandler.PRIVATE):
            log.warning("this aiohttp lacks %s: request heads get no read timeout", _TimedRequestHandler.PRIVATE)
            self.header_s = handler.header_s = 0.0
        return handler


class TimedAppRunner(web.AppRunner):
    """An ``AppRunner`` whose connections follow ``app[TIMEOUTS]`` (defaults when unset)."""

    def __init__(self, app: web.Application, **kwargs):
        self.timeouts = app.get(TIMEOUTS) or Timeouts()
        kwargs.setdefault("access_log", None)
        super().__init__(app, keepalive_timeout=self.timeouts.idle_s, **kwargs)

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _TimedServer  # same state, our protocol factory
        server.header_s = self.timeouts.header_s
        return server


class ServerThread:
    """Run an app on its own event loop in a daemon thread (tests, benchmarks, embedding in a trainer).

    ``with ServerThread(app) as url: ...`` — port 0 picks a free port; ``url`` ends in ``path``; the
    thread is called ``name``.
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0, path: str = "/retrieve",
                 name: str = "retrieval-server"):
        self.app, self.host, self.port, self.path = app, host, port, path
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._runner: Optional[web.AppRunner] = None
        self._error: Optional[BaseException] = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = TimedAppRunner(self.app)
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
        return f"http://{self.host}:{self.port}{self.path}"

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise RuntimeError(f"{self.path} server failed to start on {self.host}:{self.port}: {self._error}")
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


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = TimedAppRunner(app, handle_signals=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await asyncio.Event().wait()  # until SIGINT / SIGTERM
    finally:
        await runner.cleanup()


def serve_forever(app: web.Application, host: str, port: int) -> None:
    """Serve ``app`` in the foreground until SIGINT or SIGTERM."""
    try:
        asyncio.run(_serve(app, host, port))
    except (web.GracefulExit, KeyboardInterrupt):
        pass


def add_address_flags(p: argparse.ArgumentParser, port: int) -> None:
    """``--host`` (127.0.0.1 unless it says otherwise) and ``--port`` (default ``port``)."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=port, help="TCP port")


def add_limit_flags(p: argparse.ArgumentParser, limits, flags: Mapping[str, str]) -> None:
    """``--max-queries``-style flags, one per field of the limits dataclass ``limits`` named in ``flags`` (field →
    help), typed and defaulted from ``limits``; :func:`run_server` builds the limits from them."""
    for name, what in flags.items():
        default = getattr(limits, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=what)


def run_server(parser: argparse.ArgumentParser, a: argparse.Namespace, limits_type: type, open_app: Callable, *,
               path: str, log: logging.Logger, serve: Callable = serve_forever) -> int:
    """A server command's ``main`` after it read its line ``a`` with ``parser`` (the server's own flags, plus those
    of :func:`add_address_flags` and :func:`add_limit_flags`): build ``limits_type`` from every flag named after one
    of its fields (a refused value is a usage error), then ``open_app(a, limits, parser)`` → ``(app, what)`` (its
    own checks end in ``parser.error``), log ``serving <what> on http://host:port<path>`` to ``log`` and
    ``serve(app, host, port)`` in the foreground until SIGINT or SIGTERM. Returns 0."""
    given = vars(a)
    try:
        limits = limits_type(**{f.name: given[f.name] for f in dataclasses.fields(limits_type) if f.name in given})
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, what = open_app(a, limits, parser)
    log.info("serving %s on http://%s:%d%s", what, a.host, a.port, path)
    serve(app, a.host, a.port)
    return 0
