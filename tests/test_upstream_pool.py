"""The guard's upstream client (e3.deploy.upstream.UpstreamPool) against a small HTTP/1.1 server on loopback
that answers with bytes written here: keep-alive reuse, the one retry on a stale kept-alive connection,
``Connection: close``, chunked answers, answers that are not HTTP, and headers that would split a request."""

from __future__ import annotations

import asyncio

import pytest

from e3.deploy.upstream import UpstreamError, UpstreamPool


class _Upstream:
    """Counts connections and requests; ``answers`` are sent in turn (the last one repeats), each after one
    request's bytes arrive (requests here carry no body, so a request ends at its blank line)."""

    def __init__(self, answers: list[bytes], close_after_answer: bool = False):
        self.answers, self.close_after_answer = answers, close_after_answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                writer.write(self.answers[min(len(self.requests), len(self.answers)) - 1])
                await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def _run(answers: list[bytes], body, *, close_after_answer: bool = False):
    async def main():
        up = _Upstream(answers, close_after_answer)
        server = await asyncio.start_server(up.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool("127.0.0.1", port)
        try:
            return await body(pool, up), up
        finally:
            pool.close()
            server.close()

    return asyncio.run(main())


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Other: dropped\r\nContent-Length: 2\r\n\r\n{}"


def test_answers_are_read_and_connections_kept_alive():
    async def body(pool, up):
        out = []
        for _ in range(3):
            out.append(await pool.request("GET", "/v2/health/ready", [("Accept", "*/*")], b"",
                                          want=frozenset({"content-type"})))
        return out

    out, up = _run([OK], body)
    assert out == [(200, "OK", {"content-type": "application/json"}, b"{}")] * 3   # only the headers asked for
    assert up.connections == 1 and len(up.requests) == 3                          # one kept-alive connection
    assert up.requests[0].startswith(b"GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Accept: */*\r\n" in up.requests[0]


def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async def body(pool, up):
        first = await pool.request("GET", "/v2", [], b"")
        for w in up.writers:      # the server closes the idle connection
            w.close()
        await asyncio.sleep(0.05)
        second = await pool.request("GET", "/v2", [], b"")
        return first, second

    (first, second), up = _run([OK], body)
    assert first[0] == second[0] == 200 and up.connections == 2


def test_connection_close_and_chunked_answers():
    chunked = (b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               b"3\r\n{\"e\r\n4\r\n\":1}\r\n0\r\n\r\n")

    async def body(pool, up):
        a = await pool.request("POST", "/v2/models/m/infer", [], b"")
        b = await pool.request("POST", "/v2/models/m/infer", [], b"")
        return a, b

    (a, b), up = _run([chunked], body, close_after_answer=True)
    assert a == b == (400, "Bad Request", {}, b'{"e":1}')
    assert up.connections == 2                            # "Connection: close": never reused
    assert b"Content-Length: 0\r\n" in up.requests[0]     # a POST always says its length


def test_an_answer_that_is_not_http_is_an_upstream_error():
    async def body(pool, up):
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await pool.request("GET", "/v2", [], b"")
        return None

    _run([b"SSH-2.0-OpenSSH\r\n\r\n"], body)


def test_a_header_that_would_split_the_request_is_never_sent():
    async def body(pool, up):
        with pytest.raises(UpstreamError, match="line break"):
            await pool.request("GET", "/v2", [("Accept", "x\r\nX-Injected: 1")], b"")
        return None

    _, up = _run([OK], body)
    assert up.requests == []


def test_a_unix_socket_upstream(tmp_path):
    """Triton's private endpoint in `e3 serve`: the pool connects to a Unix socket (port None)."""
    async def main():
        up = _Upstream([OK])
        path = str(tmp_path / "http")
        server = await asyncio.start_unix_server(up.serve, path)
        pool = UpstreamPool(path, None)
        try:
            out = [await pool.request("GET", "/v2/health/ready", [], b"") for _ in range(2)]
        finally:
            pool.close()
            server.close()
        return out, up

    out, up = asyncio.run(main())
    assert [o[0] for o in out] == [200, 200] and up.connections == 1
    assert up.requests[0].startswith(b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\n")
