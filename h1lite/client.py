"""A lean HTTP/1.1 client for pdgate's engine legs (and the sim decode's bootstrap handshake): asyncio
protocols, httptools (llhttp) parsing.

aiohttp's client costs ~110 µs of CPU per request on this kind of machine, and a PD request
makes two; this one does what the legs need and nothing more: pooled keep-alive connections
per origin with TCP_NODELAY (capped, open and idle), one ``write`` per request, the body
delivered as the parser hands it over (whole for ``read()``, bounded by ``max_body``; as it
arrives for ``pipe()``), response headers kept, and a connection that is not at a message
boundary is never reused.

Idle connections expire after ``idle_s`` (4 s by default: SGLang's uvicorn closes keep-alive
connections idle for 5 s, ``SGLANG_TIMEOUT_KEEP_ALIVE``), and one the engine closed anyway is
not reused (checked before reuse). A request on a connection that sat idle ``STALE_IDLE_S`` or
more and that the engine closed before a byte of the answer came (its keep-alive close racing
our request: it never read it) is sent once more on a fresh connection, counted in
``Client.stale_retries``, and never surfaces as a failure.

Errors are ``OSError`` subclasses (``ConnectFailed``, ``UpstreamClosed``, ``BodyTooLarge``),
wrapped by ``pdgate.adapters.upstream.wrap`` into the gateway's error tree.
"""

from __future__ import annotations

import asyncio
import re
import select
import time
from collections import deque
from collections.abc import Awaitable, Callable
from itertools import chain
from typing import TypeVar, cast
from urllib.parse import urlsplit

import httptools


class UpstreamClosed(ConnectionError):
    """The engine closed the connection, or sent bytes that are not HTTP, before the answer was complete."""


class ConnectFailed(ConnectionError):
    """No connection to the engine could be made (refused, unreachable, not within the connect timeout, or
    none free in a full pool within it)."""


class BodyTooLarge(UpstreamClosed):
    """The answer's body passed the caller's limit; the connection was closed."""


T = TypeVar("T")


def header_lines(headers: dict[str, str]) -> bytes:
    """``Name: value\\r\\n`` lines; a name or value with a control character (CR, LF: header injection) is a
    ``ValueError``."""
    if BAD_HEADER.search("\t".join(chain.from_iterable(headers.items()))):  # one search for all of them
        raise ValueError(f"invalid request header in {list(headers)}")
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
BAD_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class ClientResponse:
    """One answer; the connection stays with it until the message ends or ``release()``."""

    __slots__ = ("_chunks", "_conn", "_exc", "_headers", "_raw", "_sink", "_size", "_waiter", "complete", "limit",
                 "status")

    def __init__(self, conn: Connection, limit: int | None = None) -> None:
        self._conn = conn
        self.status = 0
        self._raw: list[tuple[bytes, bytes]] = []  # as parsed; decoded on first use of ``headers``
        self._headers: dict[str, str] | None = None
        self.limit = limit  # most body bytes read() takes (pipe() is not bounded: it consumes as it goes)
        self._size = 0
        self._chunks: list[bytes] = []  # what arrived and was not taken yet (pipe() takes it after every read)
        self._waiter: asyncio.Future[None] | None = None
        self._exc: BaseException | None = None
        self._sink: Callable[[bytes], None] | None = None
        self.complete = False

    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names; a repeated header keeps its last value."""
        if self._headers is None:
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._raw}
        return self._headers

    # -- fed by the protocol
    def _feed(self, data: bytes) -> None:
        if self.limit is not None and self._sink is None:
            self._size += len(data)
            if self._size > self.limit:
                self._chunks.clear()
                self._finish(BodyTooLarge(f"{self._conn.pool.origin} answered more than {self.limit} bytes"))
                self._conn.close()
                return
        self._chunks.append(data)  # nobody is woken: read() and pipe() wait for the end of the message alone

    def _flush(self) -> None:
        """Hand what arrived in one read to the sink, at once (called at the end of ``data_received``)."""
        chunks = self._chunks
        if self._sink is not None and chunks and self._exc is None:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # _take, inlined: once a token
            chunks.clear()
            try:
                self._sink(data)
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
        "reused_after",
        "transport",
        "uses",
    )

    def __init__(self, pool: OriginPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: ClientResponse | None = None
        self._headers_waiter: asyncio.Future[None] | None = None
        self._lost = False
        self.keep = True
        self.paused = False
        self.idle_since = 0.0
        self.uses = 0  # requests sent on it
        self.reused_after = 0.0  # seconds it sat idle before its latest request

    @property
    def usable(self) -> bool:
        """Open as far as we can tell, before reuse: not closed, and no close from the engine waiting unread in
        the socket (as httpcore checks ``is_readable`` before reusing a connection)."""
        t = self.transport
        if self._lost or t is None or t.is_closing():
            return False
        sock = t.get_extra_info("socket")
        if sock is None:
            return True
        try:  # an idle connection with something to read holds the engine's close (or junk between answers)
            readable, _, _ = select.select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # TCP_NODELAY is already set by the loop on every TCP transport (uvloop's TCPTransport.new, asyncio's
        # _SelectorSocketTransport since 3.6); asking for the socket here would cost uvloop five syscalls and an
        # object per connection
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

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
        resp = self.resp
        if resp is not None and exc is None and not resp.complete and resp.status and self._until_close(resp):
            resp._finish()  # a body delimited by the close: complete now
            return
        self._fail(UpstreamClosed(f"{self.pool.origin} closed the connection" + (f": {exc}" if exc else "")))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        if resp is not None and len(resp._raw) < 100:
            resp._raw.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.resp is not None
        resp = self.resp
        resp.status = self.parser.get_status_code()
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
    @staticmethod
    def _until_close(resp: ClientResponse) -> bool:
        """The answer has neither a length nor chunks: its body ends where the connection does (asked only at
        a close before the message ended; such a connection is never pooled, since its message never ends)."""
        return resp.status >= 200 and resp.status not in (204, 304) and not any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in resp._raw)

    def _fail(self, exc: BaseException) -> None:
        w = self._headers_waiter
        if w is not None and not w.done():
            w.set_exception(exc)
        if self.resp is not None:
            self.resp._finish(exc)

    def _send(self, head: bytes, body: bytes, limit: int | None = None) -> ClientResponse:
        assert self.transport is not None
        self.uses += 1
        resp = self.resp = ClientResponse(self, limit)
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return resp

    async def request(self, head: bytes, body: bytes) -> ClientResponse:
        """Returns once the status line and headers are in."""
        self._headers_waiter = self.loop.create_future()
        resp = self._send(head, body)
        try:
            await self._headers_waiter
        finally:
            self._headers_waiter = None
        return resp

    async def fetch(self, head: bytes, body: bytes, limit: int | None = None) -> tuple[ClientResponse, bytes]:
        """The whole answer, waited for once (a small answer comes in one read: one wake-up)."""
        resp = self._send(head, body, limit)
        data = await resp.read()
        resp.release()  # complete: back to the pool
        return resp, data

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self._lost:
            self.paused = False
            self.transport.resume_reading()

    def done(self, resp: ClientResponse) -> None:
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


class OriginPool:
    """Keep-alive connections to one origin, the most recently used first; at most ``max_open`` open (a
    request beyond waits for one, within the connect timeout) and ``max_idle`` kept idle."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, connect_timeout_s: float,
                 idle_s: float, max_open: int = 1024, max_idle: int = 256) -> None:
        self.loop = loop
        self.host, self.port = host, port
        self.origin = f"{host}:{port}"
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s  # under the engines' own keep-alive timeout, to avoid racing their close
        self.max_open, self.max_idle = max_open, max_idle
        self.idle: list[Connection] = []
        self.all: set[Connection] = set()
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.opened = 0  # connections made, over the pool's life
        self.closed = False  # closed: no connection is made or kept from now on

    def _refuse(self) -> ConnectFailed:
        return ConnectFailed(f"no connection to {self.origin}: its pool is closed")

    async def acquire(self, fresh: bool = False) -> Connection:
        if self.closed:
            raise self._refuse()
        now = time.monotonic()
        while self.idle and not fresh:
            conn = self.idle.pop()
            idle = now - conn.idle_since
            # the socket is looked at only after a pause: a keep-alive close comes after seconds of idleness,
            # and a connection back in the pool a moment ago (under load: all of them) is spared the syscall
            if idle < self.idle_s and (conn.usable if idle >= CHECK_AFTER_S else not conn._lost):
                conn.reused_after = idle
                return conn
            conn.close()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                while len(self.all) >= self.max_open:
                    if self.idle:  # make room: an idle connection goes before a new one is opened
                        self.idle.pop(0).close()
                        continue
                    fut = self.loop.create_future()
                    self.waiters.append(fut)
                    try:
                        await fut
                    finally:
                        if fut in self.waiters:
                            self.waiters.remove(fut)
                    if self.closed:
                        raise self._refuse()
                    if self.idle and not fresh:
                        conn = self.idle.pop()
                        if conn.usable:
                            return conn
                        conn.close()
                _, proto = await self.loop.create_connection(lambda: Connection(self), self.host, self.port)
            if self.closed:  # closed while it was being made: a connection no close() would reach again
                proto.close()
                raise self._refuse()
        except ConnectFailed:
            raise
        except TimeoutError:
            raise ConnectFailed(f"no connection to {self.origin} within {self.connect_timeout_s:g}s"
                                + (f" ({len(self.all)} open, the pool's limit)" if len(self.all) >= self.max_open
                                   else "")) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.origin}: {exc.strerror or exc}") from None
        self.all.add(proto)
        self.opened += 1
        return proto

    def _wake(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def put(self, conn: Connection) -> None:
        if self.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)
        if len(self.idle) > self.max_idle:
            self.idle.pop(0).close()  # the least recently used
        self._wake()

    def forget(self, conn: Connection) -> None:
        if conn in self.all:
            self.all.discard(conn)
            self._wake()
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        self.closed = True
        for conn in list(self.all):
            conn.close()
        self.idle.clear()
        while self.waiters:  # those waiting for room learn at once that there is none
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)


CHECK_AFTER_S = 0.1  # idle this long or more: the socket is checked for the engine's close before reuse
STALE_IDLE_S = 1.0  # servers close idle keep-alive connections after a second or more (uvicorn: 5 s by default)


def _stale(conn: Connection, resp: ClientResponse | None, exc: BaseException) -> bool:
    """Whether a failure is the engine's keep-alive close racing our request: the connection sat idle long
    enough to be closed for it, was reused, closed before a byte of the answer came. Then the engine closed it
    before reading our request, which can be sent again. A connection busy a moment ago that closes is an
    engine that died with our request: that is a failed attempt, never sent again here."""
    return (conn.uses > 1 and conn.reused_after >= STALE_IDLE_S and isinstance(exc, UpstreamClosed)
            and not isinstance(exc, BodyTooLarge) and (resp is None or resp.status == 0))


class Client:
    """Pools by origin, created on first use."""

    def __init__(self, connect_timeout_s: float, idle_s: float = 4.0, max_open: int = 1024, max_idle: int = 256,
                 max_body: int | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.max_open, self.max_idle = max_open, max_idle
        self.max_body = max_body  # default limit of a read() answer
        self.pools: dict[str, tuple[OriginPool, bytes]] = {}  # "http://host:port" -> (pool, Host header value)
        self.limits: dict[str, int] = {}  # "http://host:port" -> its own max_open (else the client's)
        self.stale_retries = 0  # requests sent again after a reused connection turned out closed
        self.closed = False

    def _pool(self, base: str) -> tuple[OriginPool, bytes]:
        hit = self.pools.get(base)
        if hit is None:
            if self.closed:  # a late call (a task that outlived its owner's stop) opens nothing no close() reaches
                raise ConnectFailed(f"no connection to {base}: the client is closed")
            u = urlsplit(base)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"only http://host:port origins are supported, got {base!r}")
            port = u.port or 80
            pool = OriginPool(asyncio.get_running_loop(), u.hostname, port, self.connect_timeout_s, self.idle_s,
                              self.limits.get(base, self.max_open), self.max_idle)
            hit = self.pools[base] = (pool, f"{u.hostname}:{port}".encode())
        return hit

    def limit(self, base: str, max_open: int) -> None:
        """At most ``max_open`` connections open to ``base`` from now on (raised: its waiters go on)."""
        self.limits[base] = max_open
        hit = self.pools.get(base)
        if hit is not None:
            pool = hit[0]
            more = max_open - pool.max_open
            pool.max_open = max_open
            for _ in range(max(0, more)):
                pool._wake()

    async def request(self, base: str, method: str, target: str, body: bytes = b"",
                      content_type: bytes = b"application/json", headers: dict[str, str] | bytes | None = None) -> ClientResponse:
        """Send one request to ``base`` (``http://host:port``); returns once the status line and headers are in.

        The caller must ``release()`` the response (``send`` does it for you)."""
        pool, head = self._head(base, method, target, body, content_type, headers)
        return await self._send(pool, lambda conn: conn.request(head, body))

    async def fetch(self, base: str, method: str, target: str, body: bytes = b"",
                    content_type: bytes = b"application/json", headers: dict[str, str] | bytes | None = None,
                    limit: int | None = None) -> tuple[int, bytes]:
        """Send one request and read the whole answer: (status, body). The connection goes back to the pool."""
        pool, head = self._head(base, method, target, body, content_type, headers)
        limit = self.max_body if limit is None else limit
        resp, data = await self._send(pool, lambda conn: conn.fetch(head, body, limit))
        return resp.status, data

    async def fetch_response(self, base: str, method: str, target: str, body: bytes = b"",
                             content_type: bytes = b"application/json", headers: dict[str, str] | bytes | None = None,
                             limit: int | None = None) -> tuple[ClientResponse, bytes]:
        """As ``fetch``, with the response (status, headers) itself. ``limit``: most body bytes taken
        (default ``max_body``); past it ``BodyTooLarge``."""
        pool, head = self._head(base, method, target, body, content_type, headers)
        limit = self.max_body if limit is None else limit
        return await self._send(pool, lambda conn: conn.fetch(head, body, limit))

    async def _send(self, pool: OriginPool, exchange: Callable[[Connection], Awaitable[T]]) -> T:
        """Run ``exchange`` on a pooled connection; once more on a fresh one if the pooled one was stale."""
        conn = await pool.acquire()
        try:
            return await exchange(conn)
        except BaseException as exc:
            conn.close()
            if not _stale(conn, conn.resp, exc):
                raise
        self.stale_retries += 1
        conn = await pool.acquire(fresh=True)
        try:
            return await exchange(conn)
        except BaseException:
            conn.close()
            raise

    def _head(self, base: str, method: str, target: str, body: bytes, content_type: bytes,
              headers: dict[str, str] | bytes | None) -> tuple[OriginPool, bytes]:
        """The request head. ``headers``: a dict (checked for control characters), or header lines already
        encoded and checked by the caller (``header_lines``: the hot path builds them once)."""
        pool, host = self._pool(base)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n" % (
            method.encode(), target.encode(), host, len(body))
        if body:
            head += b"Content-Type: " + content_type + b"\r\n"
        if headers:
            head += headers if isinstance(headers, bytes) else header_lines(headers)
        return pool, head + b"\r\n"

    def send(self, base: str, method: str, target: str, body: bytes = b"",
             headers: dict[str, str] | bytes | None = None) -> Exchange:
        """``async with client.send(...) as resp:``: the response, released on exit."""
        return Exchange(self, base, method, target, body, headers)

    def drop(self, base: str) -> None:
        """Close and forget the pool of one origin (an engine removed, or one that was never added)."""
        hit = self.pools.pop(base, None)
        if hit is not None:
            hit[0].close()

    def close(self) -> None:
        self.closed = True
        for pool, _ in self.pools.values():
            pool.close()
        self.pools.clear()


class Exchange:
    __slots__ = ("base", "body", "client", "headers", "method", "resp", "target")

    def __init__(self, client: Client, base: str, method: str, target: str, body: bytes,
                 headers: dict[str, str] | bytes | None = None) -> None:
        self.client, self.base, self.method, self.target, self.body = client, base, method, target, body
        self.headers = headers
        self.resp: ClientResponse | None = None

    async def __aenter__(self) -> ClientResponse:
        self.resp = await self.client.request(self.base, self.method, self.target, self.body, headers=self.headers)
        self.body = b""  # sent: a long stream does not keep its request body
        return self.resp

    async def __aexit__(self, *exc: object) -> None:
        if self.resp is not None:
            self.resp.release()
