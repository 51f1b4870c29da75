"""The HTTP guard's upstream client: a pool of persistent keep-alive HTTP/1.1 connections to Triton's HTTP
endpoint, responses parsed by ``httptools`` (llhttp, the parser of Node.js, uvicorn's HTTP layer).

Why not aiohttp's ``ClientSession`` (the guard's upstream client before): profiled under the front-door
benchmark (256 clients, perf_analyzer, one event loop thread), building each request through the session
(URL, cookie and header machinery, request and response objects, a payload writer) was the largest part
of the guard's own per-request CPU after the strict parse. The guard talks to exactly one upstream it
knows (Triton's loopback port), with paths and headers it built itself, so a request here is one
``transport.write`` of bytes assembled in one ``join``, and a response one ``feed_data`` into the parser.

Decisions (written here because nothing above says them):

* **Connections**: idle ones are kept (last used first) without a limit on their number, as aiohttp's
  ``TCPConnector(limit=0)`` did; one that the server closes while idle is dropped from the pool when its
  close arrives. Each request takes an idle connection or opens a new one (``connect_timeout_s``).
* **One retry**: a request sent on a *reused* connection that closes before any byte of the answer comes
  back (the server closed an idle keep-alive connection as the request left) is sent once more on a new
  connection, as the guard did before. A request on a new connection is never resent.
* **Answers**: status, reason, the headers the caller asks for (by lower-case name) and the whole body
  (``Content-Length`` or chunked, as Triton sends them; an answer delimited only by the end of the
  connection is not complete before the connection is gone and is refused). An answer the parser refuses,
  or a connection that ends mid-answer, raises :class:`UpstreamError` (the guard answers 503). A
  connection whose answer says ``Connection: close`` (or whose request was cancelled mid-way) is closed,
  never reused.
"""

from __future__ import annotations

import asyncio

import httptools

__all__ = ["UpstreamPool", "UpstreamError"]


class UpstreamError(ConnectionError):
    """The upstream connection failed or sent an answer that is not HTTP/1.1 (the guard answers 503)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time."""

    __slots__ = ("pool", "loop", "transport", "parser", "waiter", "want", "status", "reason", "headers", "body",
                 "received", "closed", "_name")

    def __init__(self, pool: "UpstreamPool"):
        self.pool = pool
        self.loop = asyncio.get_running_loop()   # made by create_connection on the pool's loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.want: frozenset = frozenset()
        self.received = False
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.reason = b""
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self._name = ""

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(UpstreamError(f"the upstream answer is not valid HTTP/1.1: {err}"))
            self.transport.close()

    def eof_received(self) -> None:
        return None   # close the transport: the server ended the connection

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        self._fail(UpstreamError("the upstream connection closed before its answer was complete"))

    def _fail(self, err: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(err)

    # httptools callbacks
    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        if key in self.want:
            self.headers[key] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), self.reason.decode("latin-1"), self.headers,
                                    b"".join(self.body), self.parser.should_keep_alive()))


class UpstreamPool:
    """Keep-alive connections to ``host:port``, or to the Unix socket ``host`` when ``port`` is None (one event
    loop; create and use it on that loop).

        pool = UpstreamPool("127.0.0.1", 8001)
        status, reason, headers, body = await pool.request("POST", "/v2/models/m/infer", [("X", "1")], body,
                                                           want=("content-type",))
    """

    def __init__(self, host: str, port: int | None, *, connect_timeout_s: float = 5.0):
        self.host, self.port = host, port
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._host_header = (b"Host: localhost\r\n" if port is None
                             else f"Host: {host}:{port}\r\n".encode("latin-1"))

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            if self.port is None:
                _, conn = await loop.create_unix_connection(lambda: _Connection(self), self.host)
            else:
                _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        self._open.add(conn)
        return conn

    async def request(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, *,
                      want: frozenset[str] = frozenset()) -> tuple[int, str, dict[str, str], bytes]:
        """(status, reason, the ``want`` headers by lower-case name, body); raises :class:`UpstreamError` or
        OSError when Triton cannot be reached or answers with something that is not HTTP."""
        head = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), self._host_header]
        for k, v in headers:
            if "\r" in v or "\n" in v or "\0" in v:
                raise UpstreamError(f"header {k[:40]!r} holds a line break or NUL")   # never sent
            head.append(f"{k}: {v}\r\n".encode("utf-8", "surrogateescape"))
        if body or method == "POST":
            head.append(b"Content-Length: %d\r\n" % len(body))
        head.append(b"\r\n")
        message = b"".join(head)
        if len(body) <= 65536:
            message, body = message + body, b""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                try:
                    return await self._exchange(conn, message, body, want)
                except UpstreamError:
                    if conn.received:
                        raise
                break   # a stale kept-alive connection: once more on a new one
        return await self._exchange(await self._connect(), message, body, want)

    async def _exchange(self, conn: _Connection, message: bytes, body: bytes,
                        want: frozenset[str]) -> tuple[int, str, dict[str, str], bytes]:
        conn._reset()
        conn.received = False
        conn.want = want
        conn.waiter = conn.loop.create_future()
        if body:
            conn.transport.writelines((message, body))
        else:
            conn.transport.write(message)
        try:
            status, reason, headers, data, keep_alive = await conn.waiter
        except BaseException:
            conn.waiter = None
            conn.transport.close()   # cancelled or failed mid-answer: the connection's state is unknown
            raise
        conn.waiter = None
        if keep_alive and not conn.closed:
            self._idle.append(conn)
        else:
            conn.transport.close()
        return status, reason, headers, data

    def close(self) -> None:
        """Close every connection (idle or in use)."""
        for conn in list(self._open):
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
