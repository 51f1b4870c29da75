"""The HTTP guard: the public HTTP port of `e3 serve`, an asynchronous reverse proxy in front of Triton's HTTP
endpoint that forwards only requests it has parsed, checked and re-serialised itself.

``e3 serve`` puts it on the public HTTP port, the gRPC guard (:mod:`e3.deploy.grpc_guard`) on the public gRPC
port, and Triton's own HTTP and gRPC endpoints on Unix sockets in a private folder that only the user who runs
``e3 serve`` reaches (:class:`e3.deploy.server.TritonServer`'s ``private``; no secret on any command line);
``--no-guard`` serves Triton's directly. For each request:

* **Routing** (:func:`e3.deploy.routes.route`): only origin-form targets that spell one of Triton's
  endpoints are forwarded (absolute-form, percent-encoding, query strings: 400; unknown paths: 404; wrong
  method: 405).
* **Key**: with a user API key (``E3_API_HEADER``/``E3_API_KEY``), model repository, model config, shared
  memory, trace and logging calls without it get 403 "This API is restricted" (the guard, not Triton,
  checks it: Triton never sees the key).
* **Body**: ``Content-Length`` required (chunked: 411), over ``max_body_bytes`` (Triton's 64 MiB) or a
  JSON part over ``max_json_bytes``: 413 before a byte is read; the body must arrive within
  ``body_timeout_s`` (408). ``Content-Encoding`` gzip, deflate (zlib or raw) and br bodies are inflated once,
  here (aiohttp's own inflation is off: it inflated without a cap, and the guard inflated again, so every
  compressed body got 400), streaming and stopping past ``max_body_bytes`` (413: a 1 GiB bomb costs the
  guard at most the limit); data that is not what its label says gets 400, other encodings 415. Headers must be complete
  within ``header_timeout_s`` of the connection's start or its previous answer (aiohttp's keep-alive
  timer, which also closes idle kept-alive connections).
* **One parse**: inference bodies become :func:`e3.deploy.request_check.canonical_infer_request`'s bytes,
  repository calls :func:`~e3.deploy.request_check.canonical_repository_request`'s, other JSON bodies
  :func:`e3.deploy.strict_json.dumps_canonical` of a strict parse; anything malformed gets 400 naming the
  problem. Triton receives only those bytes and a handful of headers the guard sets.
* **Parameters**: Triton's own request parameters (``timeout``, ``priority``, ``sequence_*``,
  ``binary_data_output``, ...) must have their types and ranges (:mod:`e3.deploy.request_check`; before,
  Triton answered a malformed one with 500).
* **Never 500**: whatever the guard itself fails on is answered 400 with a message (logged); a client that
  half-closes its connection after sending (``shutdown(SHUT_WR)``) still gets its answer (asyncio closed such
  connections at once). Refused requests are logged at most once per ``BAD_LOG_INTERVAL_S`` with how many
  since (no traceback), and counted in ``e3_guard_bad_requests_total`` on ``/metrics``.
* **Control**: a load or unload through the repository API is told to the supervisor
  (``on_control``), which then leaves the model as the user left it.
* **Faults**: while Triton is unreachable (being restarted by the supervisor) requests get 503 at once;
  :meth:`Guard.abort` ends requests in flight to a model whose stub died with 503; the readiness
  endpoints answer 503 while the supervisor knows a model (or the server) to be down, which Triton 2.51
  does not say itself.
* ``GET /metrics`` is the guard's own Prometheus page: the supervisor's restart counters
  (``e3_tritonserver_*``) and the guard's answers by status (``e3_guard_responses_total``).

Built on aiohttp's low-level server (one event loop thread, no thread per connection), listen backlog
1,024 as Triton's own HTTP server, keep-alive on both sides: upstream calls go through
:class:`e3.deploy.upstream.UpstreamPool` (persistent connections, httptools' response parser; it
replaced aiohttp's ``ClientSession``, which cost more guard CPU per request than the strict parse). Parses
of bodies over 256 KiB (JSON, and inflation) run on one worker thread so that the loop keeps answering small
requests meanwhile; each parse costs work linear in its body (:mod:`e3.deploy.strict_json`). Memory per
request is bounded by about twice ``max_body_bytes`` for the binary extension and about eight times
``max_json_bytes`` for a JSON body's Python objects (one such parse at a time).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

from aiohttp import web, web_protocol

from e3.deploy.loop_thread import LoopThread
from e3.deploy.request_check import RequestError, canonical_infer_request, canonical_repository_request
from e3.deploy.routes import KEYED, Route, RouteError, route
from e3.deploy.strict_json import StrictJSONError, dumps_canonical, loads_strict
from e3.deploy.upstream import UpstreamPool

__all__ = ["Guard", "tune_gc", "inflate", "BadRequestLog", "Control", "DEFAULT_MAX_BODY_BYTES",
           "DEFAULT_MAX_JSON_BYTES", "HEADER_TIMEOUT_S", "BODY_TIMEOUT_S", "ENCODINGS"]

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 64 * 2**20   # Triton's own default limit for an HTTP request body (64 MiB)
DEFAULT_MAX_JSON_BYTES = 8 * 2**20    # JSON parsed into Python objects (~8x its size in memory)
HEADER_TIMEOUT_S = 30.0               # request line and headers complete, from connect or the last answer
BODY_TIMEOUT_S = 60.0                 # the body complete, from the end of the headers
BACKLOG = 1024                        # Triton's HTTP server (evhtp_bind_socket) listens with 1,024
_INLINE_PARSE_BYTES = 256 * 2**10
_PASS_RESPONSE = ("Content-Type", "Content-Encoding", "Inference-Header-Content-Length")
_WANT_RESPONSE = {k.lower(): k for k in _PASS_RESPONSE}
_WANT = frozenset(_WANT_RESPONSE)
_PASS_REQUEST = ("Content-Type", "Accept-Encoding", "Accept")


GC_GEN0_THRESHOLD = 50_000           # net allocations between young collections (CPython's default: 700)
BAD_LOG_INTERVAL_S = 10.0            # at most one log line about refused requests per interval
ENCODINGS = ("gzip", "deflate", "br")   # Content-Encoding the guards inflate
_INFLATE_CHUNK = 64 * 2**10          # compressed bytes fed per step
_INFLATE_STEP = 2**20                # inflated bytes produced per step at most

# the user's load/unload through the control API begins: (model, "load" | "unload") -> call with success
Control = Callable[[str, str], Callable[[bool], None]]


class InflateError(ValueError):
    """A compressed body that cannot be inflated: ``status`` (400, 413 or 415) and a message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` inflated from ``encoding`` (gzip, deflate as zlib or raw, br; "" or identity: as is), once,
    never producing more than ``limit`` bytes (:class:`InflateError` 413 past it, 400 for data that is not
    ``encoding``, 415 for another encoding). Memory: at most ``limit`` plus 1 MiB while inflating (a bomb
    stops there), twice the result for the final join of a body within the limit."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ENCODINGS:
        raise InflateError(415, f"Content-Encoding {encoding[:20]!r} is not supported (use gzip, deflate, br or "
                                "none)")
    over = InflateError(413, f"the body inflates past the limit of {limit} bytes")
    out: list[bytes] = []   # pieces of at most _INFLATE_STEP bytes, joined once at the end (no regrowth copies)
    size = 0
    try:
        if encoding == "br":
            import brotli   # deferred: loaded by the first br body only
            d = brotli.Decompressor()
            for at in range(0, len(body), _INFLATE_CHUNK):
                piece = d.process(body[at:at + _INFLATE_CHUNK], output_buffer_limit=_INFLATE_STEP)
                while True:
                    out.append(piece)
                    size += len(piece)
                    if size > limit:
                        raise over
                    if d.can_accept_more_data():
                        break
                    piece = d.process(b"", output_buffer_limit=_INFLATE_STEP)
            while not d.is_finished():   # output the decoder still holds
                piece = d.process(b"", output_buffer_limit=_INFLATE_STEP)
                if not piece:
                    break
                out.append(piece)
                size += len(piece)
                if size > limit:
                    raise over
            if not d.is_finished():
                raise InflateError(400, "the body is not valid br data: it ends before the stream does")
            return b"".join(out)
        z = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        if encoding == "deflate" and body[:1] and (body[0] & 0x0F != 8 or int.from_bytes(body[:2], "big") % 31):
            z = zlib.decompressobj(wbits=-15)   # raw deflate (no zlib header), as some clients send it
        for at in range(0, len(body), _INFLATE_CHUNK):
            piece = z.decompress(body[at:at + _INFLATE_CHUNK], _INFLATE_STEP)
            while True:
                out.append(piece)
                size += len(piece)
                if size > limit:
                    raise over
                if not z.unconsumed_tail:
                    break
                piece = z.decompress(z.unconsumed_tail, _INFLATE_STEP)
        if not z.eof:
            raise InflateError(400, f"the body is not valid {encoding} data: it ends before the stream does")
        if z.unused_data:
            raise InflateError(400, f"the body holds {len(z.unused_data)} bytes after its {encoding} stream")
    except InflateError:
        raise
    except Exception as err:   # zlib.error, brotli.error
        raise InflateError(400, f"the body is not valid {encoding} data: {err}") from None
    return b"".join(out)


class BadRequestLog:
    """Refused requests, counted by reason, logged at most once per ``interval_s`` (no traceback): 1,000 bad
    requests wrote 0.55 MB of tracebacks in 0.9 s before. Thread-safe enough (counters under the GIL)."""

    def __init__(self, logger: logging.Logger, interval_s: float = BAD_LOG_INTERVAL_S):
        self.logger, self.interval_s = logger, interval_s
        self.counts: Counter = Counter()   # reason -> refused requests (e3_guard_bad_requests_total)
        self._last = -interval_s
        self._quiet = 0

    def __call__(self, reason: str, message: str) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._quiet += 1
            return
        more = f" (and {self._quiet} more since the last line)" if self._quiet else ""
        self.logger.warning("refused a request (%s): %s%s", reason, message[:200], more)
        self._last, self._quiet = now, 0

    def metrics(self, protocol: str) -> list[str]:
        return [f'e3_guard_bad_requests_total{{protocol="{protocol}",reason="{r}"}} {n}'
                for r, n in sorted(self.counts.items())]


class _LogLimit(logging.Filter):
    """On aiohttp's server logger: its "Error handling request" records (a malformed request line or
    header, with a traceback each) go to :class:`BadRequestLog` instead."""

    def __init__(self, bad: BadRequestLog):
        super().__init__()
        self.bad = bad

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.levelno >= logging.ERROR:
            exc = record.exc_info[1]
            self.bad("unparsable", f"{exc.__class__.__name__}: {exc}")
            return False
        return True


class _Handler(web_protocol.RequestHandler):
    """aiohttp's connection handler, except at the client's end of sending (``shutdown(SHUT_WR)``): asyncio
    closed the connection there and the request in flight was never answered. Here the answer to what was
    sent still goes out, then the connection closes."""

    peer_eof = False

    def eof_received(self) -> bool:
        self.peer_eof = True
        # idle (waiting for the next request, none queued): nothing to answer, close (False); else keep the
        # connection open to answer (the guard's handler closes it after the last answer)
        return self._waiter is None or bool(self._messages)


class _Server(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


def tune_gc() -> None:
    """Tune CPython's cyclic garbage collector for a process whose hot path is the guard (``e3 serve``; the
    front-door benchmark does the same): collect once, freeze what exists then (the imported modules, the
    server's state: never traversed again), and start a young collection after GC_GEN0_THRESHOLD net
    allocations instead of 700. Why: with 256 requests in flight each request's objects outlived several
    young collections and were traversed again and again; measured (256 clients, perf_analyzer, 2 shared
    cores) 10-38 us of collection per request with the defaults, none in 6,000 requests after this. A
    request's objects are freed by reference counting when it ends, so the threshold is rarely reached;
    cyclic garbage waits at most that many allocations (a few MB). Process-wide, so the caller decides."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where installed, else asyncio's. Measured (256 clients, 30 s, perf_analyzer, 2
    shared cores): with asyncio's loop the guard served 0.67x the throughput of Triton's own port at 2.6x its
    p99; with uvloop 0.83x at 1.38x (docs/reliability.md)."""
    try:
        import uvloop   # optional: asyncio's loop where it is not installed
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Guard(LoopThread):
    """The guard on ``host:port`` in front of Triton's HTTP endpoint ``upstream`` (``host:port``).

        with Guard("127.0.0.1:18000", port=8000, upstream_headers=server.http_headers):
            ...   # clients call 127.0.0.1:8000 as they would call Triton

    upstream: ``host:port`` or ``unix:/path`` (Triton's private endpoint). upstream_headers: called per
    request, headers Triton's port needs (none for a private endpoint). unhealthy: models known broken right
    now (the supervisor's view; the name ``"tritonserver"`` for the whole server). api_key: (header, key) the
    keyed APIs need, or None. metrics: extra Prometheus text for ``/metrics`` (the supervisor's, the gRPC
    guard's). on_control: told of each load/unload through the repository API (:data:`Control`).
    """

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 8000, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
                 unhealthy: Callable[[], set[str]] | None = None,
                 upstream_headers: Callable[[], Mapping[str, str]] | None = None,
                 api_key: tuple[str, str] | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S, metrics: Callable[[], str] | None = None,
                 on_control: Control | None = None):
        super().__init__()
        if upstream.startswith("unix:"):
            self.upstream: tuple[str, int | None] = (upstream[len("unix:"):], None)
        else:
            up_host, _, up_port = upstream.rpartition(":")
            self.upstream = (up_host, int(up_port))
        self.host, self.port = host, port
        self.max_body_bytes, self.max_json_bytes = max_body_bytes, max_json_bytes
        self.unhealthy = unhealthy or set
        self.upstream_headers = upstream_headers or dict
        self.api_key = api_key
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.metrics = metrics
        self.on_control = on_control
        self.responses: Counter = Counter()   # status -> answers sent
        self.bad = BadRequestLog(log)
        self._runner: web.ServerRunner | None = None
        self._pool: UpstreamPool | None = None
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="e3-guard-parse")
        self._log_limit = _LogLimit(self.bad)

    @property
    def url(self) -> str:
        """``host:port`` clients call."""
        return f"{self.host}:{self.port}"

    # -- lifecycle --------------------------------------------------------------------------------------------
    thread_name = "e3-http-guard"

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        return _new_loop()

    def start(self) -> "Guard":
        logging.getLogger("aiohttp.server").addFilter(self._log_limit)
        super().start()
        log.info("HTTP guard on %s in front of %s", self.url, ":".join(str(p) for p in self.upstream if p))
        return self

    async def _start(self) -> None:
        server = _Server(self._handle, keepalive_timeout=self.header_timeout_s, access_log=None,
                         auto_decompress=False)
        self._runner = web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=BACKLOG, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]   # port 0: the one the system chose
        self._pool = UpstreamPool(*self.upstream, connect_timeout_s=5.0)

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._pool is not None:
            self._pool.close()

    def stop(self) -> None:
        super().stop()
        self._parser.shutdown(wait=False)
        logging.getLogger("aiohttp.server").removeFilter(self._log_limit)

    def abort(self, model: str) -> int:
        """Answer every request in flight to ``model`` with 503 now (from any thread); how many there were."""
        count = super().abort(model)
        if count:
            log.warning("guard: %d request(s) in flight to %s ended with 503", count, model)
        return count

    # -- one request --------------------------------------------------------------------------------------------
    def _reply(self, status: int, message: str, *, close: bool = False) -> web.Response:
        self.responses[status] += 1
        if status not in (403, 503):
            self.bad(str(status), message)
        response = web.json_response({"error": message}, status=status, dumps=lambda v: dumps_canonical(v).decode())
        if close:
            response.force_close()
        return response

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            response = await self._checked(request)
        except asyncio.CancelledError:
            raise
        except Exception as err:   # noqa: BLE001 - never a 500: the client gets why (the traceback at debug level)
            log.debug("guard: unexpected failure", exc_info=True)
            response = self._reply(400, f"the guard could not handle this request ({err.__class__.__name__}: "
                                        f"{str(err)[:200]})", close=True)
        if getattr(request.protocol, "peer_eof", False) and not request.protocol._messages:
            response.force_close()   # the client sends nothing more: close once this answer is out
        return response

    async def _checked(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            r = route(request.method, request.raw_path)   # the request target as sent (raw, not normalised)
        except RouteError as err:
            return self._reply(err.status, str(err), close=err.status == 400)
        if r.kind == "metrics":
            return self._metrics()
        if self.api_key and r.category in KEYED:
            header, key = self.api_key
            if not hmac.compare_digest(request.headers.get(header, "").encode(), key.encode()):
                return self._reply(403, f"This API is restricted, expecting header '{header}'")
        not_ready = self._not_ready(r)
        if not_ready:
            return self._reply(503, not_ready)
        body = await self._read_body(request, r)
        if isinstance(body, web.Response):
            return body
        try:
            forward, header_length = await self._canonical(request, r, body)
        except (RequestError, StrictJSONError) as err:
            what = "malformed inference request" if r.kind == "infer" else "refused"
            return self._reply(400, f"{what}: {err}")
        sent = request.headers
        headers = [(k, sent[k]) for k in _PASS_REQUEST if k in sent]
        headers += self.upstream_headers().items()
        if header_length is not None:
            headers.append(("Inference-Header-Content-Length", str(header_length)))
        if r.kind != "repository" or self.on_control is None:
            return await self._forward(request.method, r, headers, forward)
        done = self.on_control(r.model, r.path.rsplit("/", 1)[1])
        response = None
        try:
            response = await self._forward(request.method, r, headers, forward)
        finally:
            done(response is not None and response.status == 200)
        return response

    def _not_ready(self, r: Route) -> str | None:
        """Why a readiness probe must answer 503 (the supervisor knows better than Triton), or None."""
        if r.category != "health" or r.path.endswith("/live"):
            return None
        bad = self.unhealthy()
        if r.path == "/v2/health/ready" and bad:
            return f"not ready: {', '.join(sorted(bad))} being restored"
        if r.model is not None and (r.model in bad or "tritonserver" in bad):
            return f"model {r.model} is not ready: being restored"
        return None

    async def _read_body(self, request: web.BaseRequest, r: Route) -> bytes | web.Response:
        """The whole body, or the answer that says why it cannot be read."""
        if "chunked" in request.headers.get("Transfer-Encoding", "").lower():
            return self._reply(411, "send the body with a Content-Length (chunked transfer is not accepted)",
                               close=True)
        length = request.content_length or 0
        if length and r.kind in ("plain", "metrics"):
            return self._reply(400, f"{request.method} {r.path} takes no body", close=True)
        if length > self.max_body_bytes:
            return self._reply(413, f"request body of {length} bytes is over the limit of {self.max_body_bytes}",
                               close=True)
        json_part = length if "Inference-Header-Content-Length" not in request.headers else 0
        if json_part > self.max_json_bytes:
            return self._reply(413, f"a JSON body of {length} bytes is over the limit of {self.max_json_bytes} "
                                    "(send large tensors in the binary extension)", close=True)
        if not length:
            return b""
        try:
            if request.content.is_eof():   # the whole body is buffered already: no wait, no timer
                body = await request.content.readexactly(length)
            else:
                async with asyncio.timeout(self.body_timeout_s):
                    body = await request.content.readexactly(length)
        except TimeoutError:
            return self._reply(408, f"the body did not arrive within {self.body_timeout_s:g} s", close=True)
        except asyncio.IncompleteReadError:
            return self._reply(400, "the connection ended before the body did", close=True)
        encoding = request.headers.get("Content-Encoding", "")
        try:
            if len(body) <= _INLINE_PARSE_BYTES:
                return inflate(body, encoding, self.max_body_bytes)
            return await asyncio.get_running_loop().run_in_executor(self._parser, inflate, body, encoding,
                                                                    self.max_body_bytes)
        except InflateError as err:
            return self._reply(err.status, str(err), close=err.status != 400)

    async def _canonical(self, request: web.BaseRequest, r: Route, body: bytes) -> tuple[bytes, int | None]:
        """(bytes to forward, their Inference-Header-Content-Length or None); raises RequestError."""
        if r.kind == "infer":
            header_length = request.headers.get("Inference-Header-Content-Length")
            json_bytes = len(body) if header_length is None else min(len(body), int(header_length.strip() or 0)
                                                                        if header_length.strip().isdigit() else 0)
            if json_bytes > self.max_json_bytes:
                raise RequestError(f"the JSON header of {json_bytes} bytes is over the limit of "
                                   f"{self.max_json_bytes}")
            if json_bytes <= _INLINE_PARSE_BYTES:
                canonical = canonical_infer_request(body, header_length)
            else:
                canonical = await asyncio.get_running_loop().run_in_executor(
                    self._parser, canonical_infer_request, body, header_length)
            return canonical.body, canonical.header_length
        if r.kind == "repository":
            return canonical_repository_request(r.model, body), None
        if r.kind == "json" and body:
            value = loads_strict(body, what="the request body")
            if not isinstance(value, dict):
                raise RequestError("the request body must be a JSON object")
            return dumps_canonical(value), None
        return b"", None

    async def _forward(self, method: str, r: Route, headers: list, body: bytes) -> web.Response:
        task = asyncio.ensure_future(self._pool.request(method, r.path, headers, body, want=_WANT))
        held = self._inflight.setdefault(r.model, set()) if r.kind == "infer" else None
        if held is not None:
            held.add(task)
        try:
            status, reason, out_headers, data = await task
        except asyncio.CancelledError:
            if task not in self._aborted:
                raise
            self._aborted.discard(task)
            return self._reply(503, f"model {r.model} lost its Python stub while this request was in flight; it is "
                                    "being reloaded, retry shortly")
        except OSError as err:   # UpstreamError, refused or timed-out connects
            return self._reply(503, f"tritonserver is not reachable ({err.__class__.__name__}); it may be "
                                    "restarting, retry shortly")
        finally:
            if held is not None:
                held.discard(task)
        self.responses[status] += 1
        return web.Response(status=status, reason=reason, body=data,
                            headers={_WANT_RESPONSE[k]: v for k, v in out_headers.items()})

    def _metrics(self) -> web.Response:
        lines = [self.metrics() if self.metrics else "",
                 "# HELP e3_guard_responses_total Answers of the HTTP guard, by HTTP status.",
                 "# TYPE e3_guard_responses_total counter"]
        lines += [f'e3_guard_responses_total{{code="{code}"}} {n}' for code, n in sorted(self.responses.items())]
        lines += ["# HELP e3_guard_bad_requests_total Requests the guards refused, by protocol and reason (the "
                  "HTTP status, or gRPC code; unparsable: not HTTP).",
                  "# TYPE e3_guard_bad_requests_total counter", *self.bad.metrics("http")]

        return web.Response(text="\n".join(l for l in lines if l) + "\n", content_type="text/plain")
