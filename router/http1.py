"""A minimal HTTP/1.1 client for the router's whole-answer engine calls: keep-alive, one request at a time per
connection, answers with ``Content-Length``, chunked, or read to the close.

Why: a non-streamed completion relayed through ``aiohttp.ClientSession`` cost the router more CPU than
everything else it does for the request (``benchmarks/bench_router.py``, issue 12). This client writes the
request in one ``write`` and parses the answer's head with ``bytes`` operations on an ``asyncio.Protocol``; the
streamed calls, health probes and scrapes stay on aiohttp (:class:`fulcrum.router.transport.HttpTransport`).

Errors (:class:`Http1Error`, translated by the transport): ``connect`` (refused, unreachable, DNS),
``timeout`` (connect or the whole call past its limit: ``TimeoutError`` is raised as is),
``broken`` (the connection closed or reset before the whole answer, or an answer that is not HTTP/1.x). A
connection taken from the idle pool that the server had closed meanwhile (no byte of the answer came back) is
retried once on a new connection, as browsers and aiohttp do for idle keep-alive races.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from typing import Literal
from urllib.parse import urlsplit

__all__ = ["Http1Client", "Http1Error"]

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024


class Http1Error(Exception):
    """A call failed before its whole answer arrived.

    Attributes:
        cause: "connect" (no connection could be opened) or "broken" (closed, reset or garbled mid-call).
    """

    def __init__(self, cause: Literal["connect", "broken"], message: str) -> None:
        super().__init__(message)
        self.cause: Literal["connect", "broken"] = cause


class _Conn(asyncio.Protocol):
    """One connection: bytes received so far, and a future the reader waits on for more."""

    __slots__ = ("key", "transport", "buf", "waiter", "closed", "error", "reused", "expired")

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.error: BaseException | None = None
        self.reused = False
        self.expired = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def expire(self) -> None:
        """The call's deadline passed: the reader's wait ends in ``TimeoutError``."""
        self.expired = True
        self._wake()

    async def more(self) -> None:
        """Wait for more bytes or the close.

        Raises:
            TimeoutError: the call's deadline passed (:meth:`expire`).
        """
        if self.expired:
            raise TimeoutError
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.expired:
            raise TimeoutError

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Client:
    """Pooled keep-alive connections to any number of ``http``/``https`` origins.

    Args:
        limit: open connections at most, all origins together; a call beyond it waits for one to be free.
    """

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._origins: dict[str, tuple[tuple[str, str, int], bytes, bytes]] = {}
        self._ssl: ssl_module.SSLContext | None = None

    def _origin(self, base: str) -> tuple[tuple[str, str, int], bytes, bytes]:
        """(scheme, host, port), the base's path prefix and the Host header of an instance URL (cached)."""
        got = self._origins.get(base)
        if got is None:
            u = urlsplit(base)
            scheme = u.scheme or "http"
            host = u.hostname or "localhost"
            port = u.port or (443 if scheme == "https" else 80)
            prefix = u.path.rstrip("/")
            netloc = u.netloc.rpartition("@")[2]  # the Host header: as written (IPv6 keeps its brackets)
            got = self._origins[base] = ((scheme, host, port), prefix.encode(), netloc.encode())
        return got

    async def post(self, base: str, path: str, body: bytes, connect_s: float,
                   total_s: float | None) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``base + path``: (status, whole answer body). Cancellation closes the connection
        (the engine then aborts the call).

        Args:
            connect_s: limit to open a connection, seconds.
            total_s: limit for the whole call (waiting for a free connection included), seconds; None = none.
                One timer per call (``loop.call_at``), not an ``asyncio.timeout`` scope: it is on the hot path.

        Raises:
            Http1Error: "connect" or "broken" (module docstring).
            TimeoutError: past ``connect_s`` or ``total_s``.
        """
        key, prefix, host = self._origin(base)
        head = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
            prefix, path.encode(), host, len(body))
        loop = asyncio.get_running_loop()
        deadline = None if total_s is None else loop.time() + total_s
        for attempt in (0, 1):
            conn = self._take_idle(key)
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    conn = await self._acquire(key, connect_s)
            timer = loop.call_at(deadline, conn.expire) if deadline is not None else None
            try:
                conn.transport.write(head + body)  # type: ignore[union-attr]
                status, data, keep = await _read_answer(conn)
            except Http1Error:
                self._drop(conn)
                if conn.reused and attempt == 0 and not conn.buf:
                    continue  # the server closed the idle connection before reading the request: once more
                raise
            except BaseException:
                self._drop(conn)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if keep and not conn.closed and not conn.buf:
                conn.reused = True
                self._idle.setdefault(key, []).append(conn)
                self._wake_one()
            else:
                self._drop(conn)
            return status, data
        raise AssertionError("unreachable")

    async def _acquire(self, key: tuple[str, str, int], connect_s: float) -> _Conn:
        """A new connection to ``key`` once fewer than ``limit`` are open (or an idle one freed meanwhile)."""
        while self._open >= self.limit:
            if self._evict_idle():
                continue
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
            conn = self._take_idle(key)
            if conn is not None:
                return conn
        self._open += 1
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        ssl: ssl_module.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl_module.create_default_context()
            ssl = self._ssl
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: _Conn(key), host, port, ssl=ssl)
        except OSError as err:
            self._release_slot()
            raise Http1Error("connect", f"{type(err).__name__}: {err}") from err
        except BaseException:
            self._release_slot()
            raise
        return conn

    def _take_idle(self, key: tuple[str, str, int]) -> _Conn | None:
        """A kept-alive connection to ``key`` still open and silent (the newest first), or None."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.buf:
                return conn
            self._drop(conn)
        return None

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._release_slot()

    def _evict_idle(self) -> bool:
        """Close the oldest idle connection (of any origin) to free a slot; False when none is idle."""
        for conns in self._idle.values():
            if conns:
                self._drop(conns.pop(0))
                return True
        return False

    def _release_slot(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        """Wake one call waiting for a connection (a slot or an idle connection is free)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def idle_connections(self) -> int:
        """Connections kept open for reuse (all origins)."""
        return sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        """Close every idle connection (calls in flight close theirs when they end)."""
        for conns in self._idle.values():
            for c in conns:
                c.close()
                self._open -= 1
        self._idle.clear()


async def _read_answer(conn: _Conn) -> tuple[int, bytes, bool]:
    """(status, body, whether the connection may be reused) of the next answer on ``conn``.

    Raises:
        Http1Error: "broken".
    """
    while True:
        status, headers, keep = await _read_head(conn)
        if status >= 200:
            break  # 1xx answers (100 Continue) are interim: the real one follows
    if status in (204, 304):
        return status, b"", keep
    te = headers.get(b"transfer-encoding")
    if te is not None and b"chunked" in te:
        return status, await _read_chunked(conn), keep
    cl = headers.get(b"content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise Http1Error("broken", f"bad Content-Length {cl!r}") from None
        buf = conn.buf
        while len(buf) < n:
            if conn.closed:
                raise Http1Error("broken", f"connection closed after {len(buf)} of {n} body bytes")
            await conn.more()
        data = bytes(buf[:n])
        del buf[:n]
        return status, data, keep
    while not conn.closed:  # no length: the body runs to the close
        await conn.more()
    data = bytes(conn.buf)
    conn.buf.clear()
    return status, data, False


def _header(low_head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (``b"\r\ncontent-length:"``, lower case) in a lower-cased head, stripped."""
    i = low_head.find(name)
    if i < 0:
        return None
    j = low_head.find(b"\r\n", i + 2)
    return low_head[i + len(name): j if j >= 0 else len(low_head)].strip()


async def _read_head(conn: _Conn) -> tuple[int, dict[bytes, bytes], bool]:
    """The next answer head: (status, the framing headers found — ``transfer-encoding``, ``content-length`` —
    lower case, whether the connection may be reused).

    Raises:
        Http1Error: "broken": closed before the head, a head over 64 KiB, or not HTTP/1.x.
    """
    buf = conn.buf
    while True:
        i = buf.find(_HEAD_END)
        if i >= 0:
            break
        if conn.closed:
            raise Http1Error("broken", f"connection closed before the answer's head ({conn.error or 'EOF'})")
        if len(buf) > _MAX_HEAD:
            raise Http1Error("broken", "answer head longer than 64 KiB")
        await conn.more()
    head = bytes(buf[:i])
    del buf[: i + 4]
    first = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(first) < 2 or not first[0].startswith(b"HTTP/1.") or not first[1].isdigit():
        raise Http1Error("broken", f"not an HTTP/1.x answer: {head[:80]!r}")
    low = head.lower()
    headers: dict[bytes, bytes] = {}
    for name in (b"transfer-encoding", b"content-length"):
        v = _header(low, b"\r\n" + name + b":")
        if v is not None:
            headers[name] = v
    connection = _header(low, b"\r\nconnection:") or b""
    keep = (b"close" not in connection) if first[0] != b"HTTP/1.0" else (b"keep-alive" in connection)
    return int(first[1]), headers, keep


async def _read_chunked(conn: _Conn) -> bytes:
    buf = conn.buf
    out = bytearray()
    pos = 0
    while True:
        while True:
            j = buf.find(b"\r\n", pos)
            if j >= 0:
                break
            if conn.closed:
                raise Http1Error("broken", "connection closed inside a chunked body")
            await conn.more()
        try:
            size = int(bytes(buf[pos:j]).split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise Http1Error("broken", "bad chunk size") from None
        if size == 0:
            pos = j + 2
            while True:  # trailers, then the empty line
                k = buf.find(b"\r\n", pos)
                if k < 0:
                    if conn.closed:
                        raise Http1Error("broken", "connection closed inside a chunked body's trailer")
                    await conn.more()
                    continue
                if k == pos:
                    del buf[: k + 2]
                    return bytes(out)
                pos = k + 2
        while len(buf) < j + 2 + size + 2:
            if conn.closed:
                raise Http1Error("broken", "connection closed inside a chunk")
            await conn.more()
        out += buf[j + 2 : j + 2 + size]
        pos = j + 2 + size + 2
        if pos > 65536:
            del buf[:pos]
            pos = 0
