"""A lean HTTP/1.1 client for pdgate's engine legs (and the sim decode's bootstrap handshake): asyncio
protocols, httptools (llhttp) parsing.

aiohttp's client costs ~110 µs of CPU per request on this kind of machine, and a PD request
makes two; this one does what the legs need and nothing more: pooled keep-alive connections
per origin with TCP_NODELAY, one ``write`` per request, the body delivered as the parser
hands it over (whole for ``read()``, as it arrives for ``pipe()``), and a connection that
is not at a message boundary is never reused. Errors are ``OSError`` subclasses
(``ConnectFailed``, ``UpstreamClosed``), wrapped by
``pdgate.upstream.wrap`` into the gateway's error tree.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools


class UpstreamClosed(ConnectionError):
    """The engine closed the connection, or sent bytes that are not HTTP, before the answer was complete."""


class ConnectFailed(ConnectionError):
    """No connection to the engine could be made (refused, unreachable, or not within the connect timeout)."""


class Response:
    """One answer; the connection stays with it until the message ends or ``release()``."""

    __slots__ = ("_chunks", "_conn", "_exc", "_sink", "_waiter", "complete", "status")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.status = 0
        self._chunks: list[bytes] = []  # what arrived and was not taken yet (pipe() takes it after every read)
        self._waiter: asyncio.Future[None] | None = None
        self._exc: BaseException | None = None
        self._sink: Callable[[bytes], None] | None = None
        self.complete = False

    # -- fed by the protocol
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._wake()

    def _flush(self) -> None:
        """Hand what arrived in one read to the sink, at once (called at the end of ``data_received``)."""
        if self._sink is not None and self._chunks and self._exc is None:
            try:
                self._sink(self._take())
            except Exception as exc:  # the sink's own error (client gone, error event) ends the exchange
                self._exc = exc
                self.complete = True
                self._wake()

    def _finish(self, exc: BaseException | None = None) -> None:
        self._flush()
        if exc is not None and not self.complete:
            self._exc = exc
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        return data

    # -- used by callers
    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            await self._wait()
        if self._exc is not None:
            raise self._exc
        return self._take()

    async def pipe(self, sink: Callable[[bytes], None]) -> None:
        """Call ``sink`` with the body as it arrives, from the protocol itself (no task switch per chunk),
        until the message ends. An exception from ``sink`` stops the exchange and is raised here."""
        self._sink = sink
        self._flush()
        while not self.complete:
            await self._wait()
        if self._exc is not None:
            raise self._exc

    def pause(self) -> None:
        """Stop reading from the engine (the consumer is behind)."""
        self._conn.pause()

    def resume(self) -> None:
        self._conn.resume()

    def release(self) -> None:
        """Give the connection back if the answer is complete; close it otherwise."""
        self._conn.done(self)


class Connection(asyncio.Protocol):
    __slots__ = (
        "_headers_waiter",
        "_lost",
        "idle_since",
        "keep",
        "loop",
        "parser",
        "paused",
        "pool",
        "resp",
        "transport",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self._headers_waiter: asyncio.Future[None] | None = None
        self._lost = False
        self.keep = True
        self.paused = False
        self.idle_since = 0.0

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"invalid HTTP from {self.pool.origin}: {exc}"))
            self.close()
        if self.resp is not None:
            self.resp._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.pool.forget(self)
        self._fail(UpstreamClosed(f"{self.pool.origin} closed the connection" + (f": {exc}" if exc else "")))

    # -- httptools callbacks
    def on_headers_complete(self) -> None:
        assert self.resp is not None
        self.resp.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()
        w = self._headers_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        if self.resp is not None:
            self.resp._finish()

    # -- ours
    def _fail(self, exc: BaseException) -> None:
        w = self._headers_waiter
        if w is not None and not w.done():
            w.set_exception(exc)
        if self.resp is not None:
            self.resp._finish(exc)

    def _send(self, head: bytes, body: bytes) -> Response:
        assert self.transport is not None
        resp = self.resp = Response(self)
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return resp

    async def request(self, head: bytes, body: bytes) -> Response:
        """Returns once the status line and headers are in."""
        self._headers_waiter = self.loop.create_future()
        resp = self._send(head, body)
        try:
            await self._headers_waiter
        finally:
            self._headers_waiter = None
        return resp

    async def fetch(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        """The whole answer, waited for once (a small answer comes in one read: one wake-up)."""
        resp = self._send(head, body)
        data = await resp.read()
        resp.release()  # complete: back to the pool
        return resp.status, data

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self._lost:
            self.paused = False
            self.transport.resume_reading()

    def done(self, resp: Response) -> None:
        if self.resp is not resp:
            return
        self.resp = None
        if resp.complete and resp._exc is None and self.keep and not self._lost:
            self.resume()
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self._lost = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one origin; the most recently used first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, connect_timeout_s: float,
                 idle_s: float) -> None:
        self.loop = loop
        self.host, self.port = host, port
        self.origin = f"{host}:{port}"
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s  # under the engines' own keep-alive timeout (aiohttp's is 75 s), to avoid the race
        self.idle: list[Connection] = []
        self.all: set[Connection] = set()

    async def acquire(self) -> Connection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn._lost and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await self.loop.create_connection(lambda: Connection(self), self.host, self.port)
        except TimeoutError:
            raise ConnectFailed(f"no connection to {self.origin} within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.origin}: {exc.strerror or exc}") from None
        self.all.add(proto)
        return proto

    def put(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: Connection) -> None:
        self.all.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for conn in list(self.all):
            conn.close()


class Client:
    """Pools by origin, created on first use."""

    def __init__(self, connect_timeout_s: float, idle_s: float = 30.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.pools: dict[str, tuple[Pool, bytes]] = {}  # "http://host:port" -> (pool, Host header value)

    def _pool(self, base: str) -> tuple[Pool, bytes]:
        hit = self.pools.get(base)
        if hit is None:
            u = urlsplit(base)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"only http://host:port origins are supported, got {base!r}")
            port = u.port or 80
            pool = Pool(asyncio.get_running_loop(), u.hostname, port, self.connect_timeout_s, self.idle_s)
            hit = self.pools[base] = (pool, f"{u.hostname}:{port}".encode())
        return hit

    async def request(self, base: str, method: str, target: str, body: bytes = b"",
                      content_type: bytes = b"application/json") -> Response:
        """Send one request to ``base`` (``http://host:port``); returns once the status line and headers are in.

        The caller must ``release()`` the response (``send`` does it for you)."""
        pool, head = self._head(base, method, target, body, content_type)
        conn = await pool.acquire()
        try:
            return await conn.request(head, body)
        except BaseException:
            conn.close()
            raise

    async def fetch(self, base: str, method: str, target: str, body: bytes = b"",
                    content_type: bytes = b"application/json") -> tuple[int, bytes]:
        """Send one request and read the whole answer: (status, body). The connection goes back to the pool."""
        pool, head = self._head(base, method, target, body, content_type)
        conn = await pool.acquire()
        try:
            return await conn.fetch(head, body)
        except BaseException:
            conn.close()
            raise

    def _head(self, base: str, method: str, target: str, body: bytes, content_type: bytes) -> tuple[Pool, bytes]:
        pool, host = self._pool(base)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n" % (
            method.encode(), target.encode(), host, len(body))
        if body:
            head += b"Content-Type: " + content_type + b"\r\n"
        return pool, head + b"\r\n"

    def send(self, base: str, method: str, target: str, body: bytes = b"") -> Exchange:
        """``async with client.send(...) as resp:``: the response, released on exit."""
        return Exchange(self, base, method, target, body)

    def close(self) -> None:
        for pool, _ in self.pools.values():
            pool.close()
        self.pools.clear()


class Exchange:
    __slots__ = ("base", "body", "client", "method", "resp", "target")

    def __init__(self, client: Client, base: str, method: str, target: str, body: bytes) -> None:
        self.client, self.base, self.method, self.target, self.body = client, base, method, target, body
        self.resp: Response | None = None

    async def __aenter__(self) -> Response:
        self.resp = await self.client.request(self.base, self.method, self.target, self.body)
        return self.resp

    async def __aexit__(self, *exc: object) -> None:
        if self.resp is not None:
            self.resp.release()
