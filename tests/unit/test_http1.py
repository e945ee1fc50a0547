"""The lean HTTP/1.1 client of whole-answer engine calls, against a FAKE scripted HTTP server on localhost."""

from __future__ import annotations

import asyncio
import socket

import pytest

pytest.importorskip("pytest_asyncio")

from fulcrum.router.http1 import Http1Client, Http1Error  # noqa: E402

pytestmark = pytest.mark.asyncio


class FakeHttpServer:
    """A FAKE HTTP/1.1 server: reads one request head and body (Content-Length) at a time and writes what
    ``answer(request_number, head, body)`` returns: bytes, or (bytes, True) to close the connection after them, or
    None to write nothing and wait for the client to close."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.eofs = 0
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def __aenter__(self) -> "FakeHttpServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.eofs += 1
                    return
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                body = await reader.readexactly(n)
                self.requests.append((head, body))
                out = self.answer(len(self.requests), head, body)
                if out is None:
                    if await reader.read(1) == b"":
                        self.eofs += 1
                    return
                data, close = out if isinstance(out, tuple) else (out, False)
                writer.write(data)
                await writer.drain()
                if close:
                    return
        finally:
            writer.close()


def ok(body: bytes = b'{"x": 1}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_keep_alive_reuses_one_connection_and_sends_the_body_as_given():
    async with FakeHttpServer(lambda i, h, b: ok(b'{"n": %d}' % i)) as srv:
        c = Http1Client()
        assert await c.post(srv.base, "/v1/completions", b'{"a": 1}', 1.0, 5.0) == (200, b'{"n": 1}')
        assert await c.post(srv.base, "/v1/completions", b'{"a": 2}', 1.0, 5.0) == (200, b'{"n": 2}')
        assert srv.connections == 1 and c.idle_connections() == 1
        head, body = srv.requests[1]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Host: 127.0.0.1:" in head
        assert body == b'{"a": 2}'
        await c.close()


async def test_a_chunked_answer_is_reassembled():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\n{\"a\":\r\n3;ext=1\r\n 1}\r\n0\r\nX-Trailer: y\r\n\r\n")
    async with FakeHttpServer(lambda i, h, b: chunked) as srv:
        c = Http1Client()
        assert await c.post(srv.base, "/p", b"{}", 1.0, 5.0) == (200, b'{"a": 1}')
        assert await c.post(srv.base, "/p", b"{}", 1.0, 5.0) == (200, b'{"a": 1}')
        assert srv.connections == 1
        await c.close()


async def test_connection_close_is_honoured_and_an_answer_without_length_runs_to_the_close():
    no_length = b"HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\nnot here"
    async with FakeHttpServer(lambda i, h, b: (no_length, True)) as srv:
        c = Http1Client()
        assert await c.post(srv.base, "/p", b"{}", 1.0, 5.0) == (404, b"not here")
        assert c.idle_connections() == 0
        assert await c.post(srv.base, "/p", b"{}", 1.0, 5.0) == (404, b"not here")
        assert srv.connections == 2


async def test_an_idle_connection_the_server_closed_is_replaced_once_without_failing_the_call():
    def answer(i, head, body):
        return ok(extra=b"Connection: keep-alive\r\n") if i != 1 else ok()

    async with FakeHttpServer(answer) as srv:
        c = Http1Client()
        assert (await c.post(srv.base, "/p", b"{}", 1.0, 5.0))[0] == 200
        conn = c._idle[("http", "127.0.0.1", srv.port)][0]
        conn.transport.abort()  # the server side went away while the connection was idle, unnoticed
        conn.closed = False
        assert (await c.post(srv.base, "/p", b"{}", 1.0, 5.0))[0] == 200
        assert srv.connections == 2
        await c.close()


async def test_a_refused_connection_is_a_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Http1Client()
    with pytest.raises(Http1Error) as err:
        await c.post(f"http://127.0.0.1:{port}", "/p", b"{}", 1.0, 5.0)
    assert err.value.cause == "connect"


async def test_no_answer_within_the_total_limit_is_a_timeout_and_the_connection_is_closed():
    async with FakeHttpServer(lambda i, h, b: None) as srv:
        c = Http1Client()
        with pytest.raises(TimeoutError):
            await c.post(srv.base, "/p", b"{}", 1.0, 0.1)
        await asyncio.sleep(0.05)
        assert srv.eofs == 1 and c.idle_connections() == 0


async def test_an_answer_cut_mid_body_is_broken():
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial"
    async with FakeHttpServer(lambda i, h, b: (cut, True)) as srv:
        c = Http1Client()
        with pytest.raises(Http1Error) as err:
            await c.post(srv.base, "/p", b"{}", 1.0, 5.0)
        assert err.value.cause == "broken" and c.idle_connections() == 0


async def test_calls_beyond_the_connection_limit_wait_for_a_free_connection():
    async with FakeHttpServer(lambda i, h, b: ok()) as srv:
        c = Http1Client(limit=1)
        got = await asyncio.gather(*(c.post(srv.base, "/p", b"{}", 1.0, 5.0) for _ in range(5)))
        assert [g[0] for g in got] == [200] * 5 and srv.connections == 1
        await c.close()


async def test_at_the_limit_an_idle_connection_to_another_origin_is_closed_to_make_room():
    async with FakeHttpServer(lambda i, h, b: ok()) as a, FakeHttpServer(lambda i, h, b: ok()) as b:
        c = Http1Client(limit=1)
        assert (await c.post(a.base, "/p", b"{}", 1.0, 5.0))[0] == 200
        assert (await asyncio.wait_for(c.post(b.base, "/p", b"{}", 1.0, 5.0), 2))[0] == 200
        await asyncio.sleep(0.05)
        assert a.eofs == 1 and c.idle_connections() == 1
        await c.close()
