"""The HTTP guard's server side: HTTP/1.1 connections on asyncio protocols, requests parsed by ``httptools``
(llhttp, the parser of Node.js; uvicorn's HTTP layer), handed whole to an application object.

Why not aiohttp's low-level server (the guard's server before): measured side by side under the front-door
benchmark (256 clients, perf_analyzer, 2 shared cores; the same routing, parse and upstream pool behind
both), aiohttp's server cost the guard's thread 231-244 us per request and left a p99 of 1.5-1.6x Triton's
own port's; this one 160-177 us and 1.1x. The guard reads whole bodies anyway, so the server hands it one
:class:`Request` (method, raw target, headers, body) and writes one :class:`Response`.

What it does for the application (``app``, see :class:`Server`):

* **Refusal before the body**: ``app.head(request)`` is called when the headers are complete (``body``
  still empty); a :class:`Response` it returns is sent at once and the body is not parsed (413 for a
  declared length over the limit, 411 for chunked bodies): what the client still sends of it is read and
  dropped (at most ``max_body_bytes``, for at most :data:`LINGER_S`), then the connection is closed. ``Expect: 100-continue`` is
  answered after that check.
* **Timeouts**: request line and headers must be complete within ``header_timeout_s`` of the connection's
  start or of its previous answer (which also closes idle kept-alive connections); the body within
  ``body_timeout_s`` of the end of the headers, else ``app.error(408, ...)`` is sent and the connection
  closed.
* **Limits**: the request line and headers together at most :data:`MAX_HEAD_BYTES` (431) and
  :data:`MAX_HEADERS` fields (431); the body at most ``max_body_bytes`` bytes as it arrives (413; ``head``
  normally refuses first, from Content-Length).
* **Errors**: a request llhttp refuses gets ``app.error(400, "malformed HTTP request: ...")`` and the
  connection is closed; an exception in ``app.handle`` gets ``app.error(500, ...)`` (logged): every request
  read gets an answer.
* **Keep-alive and pipelining**: one request handled at a time per connection, in order; reading is paused
  while a request is handled. ``Connection: close`` and HTTP/1.0 without keep-alive are honoured.

Header names are lower-cased; a field sent twice is joined with ``", "`` (RFC 9110 §5.3), so a repeated
``Content-Length`` or key header never reads as one clean value.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import httptools

__all__ = ["Request", "Response", "Server", "MAX_HEAD_BYTES", "MAX_HEADERS"]

log = logging.getLogger(__name__)
MAX_HEAD_BYTES = 64 * 2**10   # request line + headers (aiohttp's limits were 8,190 per line, 32,768 fields)
MAX_HEADERS = 128
LINGER_S = 5.0                # after a refusal before the body: how long its bytes are read and dropped


class Request:
    """One request as read: ``method`` (str), ``target`` (the request target as sent, str), ``headers``
    (lower-case name -> value), ``body`` (bytes; empty in ``app.head``), ``content_length`` (int or None)."""

    __slots__ = ("method", "target", "headers", "body", "content_length", "keep_alive", "state")

    def __init__(self, method: str, target: str, headers: dict[str, str], keep_alive: bool):
        self.method, self.target, self.headers, self.keep_alive = method, target, headers, keep_alive
        self.body = b""
        self.state: Any = None   # the application's, from head() to handle()
        length = headers.get("content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None


class Response:
    """What the application answers: status, body (bytes), extra headers as (name, value) pairs, the reason
    phrase (default: the standard one), and whether to close the connection after it."""

    __slots__ = ("status", "body", "headers", "reason", "close")

    def __init__(self, status: int, body: bytes = b"", headers: list[tuple[str, str]] | None = None, *,
                 reason: str | None = None, close: bool = False):
        self.status, self.body, self.headers, self.close = status, body, headers or [], close
        self.reason = reason if reason is not None else _REASONS.get(status, "Unknown")

    def encode(self, keep_alive: bool) -> bytes:
        head = [f"HTTP/1.1 {self.status} {self.reason}\r\n".encode("latin-1"),
                b"Content-Length: %d\r\n" % len(self.body)]
        for k, v in self.headers:
            head.append(f"{k}: {v}\r\n".encode("latin-1", "replace"))
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        return b"".join(head) + self.body


_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large",
            415: "Unsupported Media Type", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


class _Connection(asyncio.Protocol):
    def __init__(self, server: "Server"):
        self.server = server
        self.app = server.app
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.queue: deque[Request] = deque()
        self.busy = False          # a request is being handled
        self.done = False          # closing: nothing more is read or answered
        self.timer: asyncio.TimerHandle | None = None
        self.draining: int | None = None   # bytes still to drop after a refusal before the body
        self.chunk_body = 0
        self._new_message()

    def _new_message(self) -> None:
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.tail = b""
        self.request: Request | None = None
        self.body: list[bytes] = []
        self.body_bytes = 0

    # timers
    def _arm(self, seconds: float, status: int | None, message: str = "") -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(seconds, self._expire, status, message)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self, status: int | None, message: str) -> None:
        self.timer = None
        if self.busy:
            return
        if status is None:
            self._close()   # headers not complete in time (or an idle kept-alive connection): no answer
        else:
            self._answer_and_close(self.app.error(status, message))

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._arm(self.server.header_timeout_s, None)

    def connection_lost(self, exc) -> None:
        self.done = True
        self._disarm()
        self.server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        if self.draining is not None:
            self.draining -= len(data)
            if self.draining <= 0:
                self._close()
            return
        self.chunk_body = 0
        if self.request is None:   # in a request line or headers: bound the bytes they may take
            seen = self.tail + data
            end = seen.find(b"\r\n\r\n")
            self.chunk_body = len(seen) - end - 4 if end >= 0 else 0
            self.head_bytes += len(data) - self.chunk_body
            self.tail = data[-3:]
            if self.head_bytes > MAX_HEAD_BYTES:
                return self._answer_and_close(self.app.error(431, f"the request line and headers are over "
                                                                  f"{MAX_HEAD_BYTES} bytes"))
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._answer_and_close(self.app.error(400, "protocol upgrades (and CONNECT) are not accepted"))
        except httptools.HttpParserCallbackError as err:
            cause = err.__context__
            if isinstance(cause, _Refused):
                if cause.status:
                    self._answer_and_close(self.app.error(cause.status, str(cause)))
            elif not self.done:
                log.error("HTTP guard: a parser callback failed", exc_info=cause)
                self._answer_and_close(self.app.error(500, "internal error of the guard while reading the request"))
        except httptools.HttpParserError as err:
            self._answer_and_close(self.app.error(400, f"malformed HTTP request: {err}"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._new_message()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))
        if len(self.fields) > MAX_HEADERS:
            raise _Refused(431, f"more than {MAX_HEADERS} header fields")

    def on_headers_complete(self) -> None:
        headers: dict[str, str] = {}
        for name, value in self.fields:
            key = name.decode("latin-1").lower()
            text = value.decode("utf-8", "surrogateescape")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        req = Request(self.parser.get_method().decode("ascii", "replace"), self.url.decode("latin-1"), headers,
                      self.parser.should_keep_alive())
        self.request = req
        refusal = self.app.head(req)
        if refusal is not None:
            self._refuse_and_drain(refusal, req)
            raise _Refused(0, "")   # stop parsing this connection
        if headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if req.content_length or "transfer-encoding" in headers:
            self._arm(self.server.body_timeout_s, 408, f"the body did not arrive within "
                                                       f"{self.server.body_timeout_s:g} s")
        else:
            self._disarm()

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.server.max_body_bytes:
            raise _Refused(413, f"request body over the limit of {self.server.max_body_bytes} bytes")
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.done:
            return
        self._disarm()
        req = self.request
        req.body = b"".join(self.body)
        self._new_message()
        self.queue.append(req)
        self.transport.pause_reading()
        if not self.busy:
            self.busy = True
            self.loop.create_task(self._serve())

    # answers
    async def _serve(self) -> None:
        while self.queue and not self.done:
            req = self.queue.popleft()
            try:
                response = await self.app.handle(req)
            except Exception as err:  # noqa: BLE001 - every request read gets an answer
                log.exception("HTTP guard: %s %s failed", req.method, req.target[:80])
                response = self.app.error(500, f"internal error of the guard ({err.__class__.__name__})")
            if self.done:
                break
            keep = req.keep_alive and not response.close
            self.transport.write(response.encode(keep))
            if not keep:
                self._close()
                break
        self.busy = False
        if not self.done:
            self._arm(self.server.header_timeout_s, None)
            self.transport.resume_reading()

    def _refuse_and_drain(self, response: Response, req: Request) -> None:
        """Answer before the body is read, then read and drop what the client still sends of its declared
        body (at most ``max_body_bytes``, at most ``LINGER_S``) before closing: a client that writes its whole
        body before it reads (most do) would otherwise get a reset instead of the answer."""
        self.queue.clear()
        self.transport.write(response.encode(False))
        declared = req.content_length if req.content_length is not None else self.server.max_body_bytes
        self.draining = min(declared, self.server.max_body_bytes) - self.chunk_body
        if self.draining <= 0:
            return self._close()
        self._disarm()
        self.timer = self.loop.call_later(LINGER_S, self._close)

    def _answer_and_close(self, response: Response) -> None:
        if self.done:
            return
        self.queue.clear()
        self.transport.write(response.encode(False))
        self._close()

    def _close(self) -> None:
        self.done = True
        self._disarm()
        self.transport.close()


class _Refused(Exception):
    """Raised from a parser callback to stop reading a connection (the answer is sent by the raiser or by
    data_received from ``status`` and ``message``)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Server:
    """The listening socket and its connections for ``app``, which provides::

        head(request) -> Response | None     # headers complete, body not read: refuse now, or None
        async handle(request) -> Response    # the whole request read
        error(status, message) -> Response   # answers the server makes itself (400, 408, 413, 431, 500)
    """

    def __init__(self, app, *, header_timeout_s: float, body_timeout_s: float, max_body_bytes: int):
        self.app = app
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.max_body_bytes = max_body_bytes
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, *, backlog: int) -> int:
        """Listen on ``host:port`` (0: a free one); the port."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), host, port, backlog=backlog,
                                                     reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn._close()
        if self._server is not None:
            await self._server.wait_closed()
