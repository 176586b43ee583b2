"""The transport to the engines: pooled keep-alive connections (``h1lite.client``), the legs' POSTs, small
bounded calls (probes, aborts). What is said over it is the engine adapter's (``pdgate.adapters``).

The seam is ``Transport``, what h1lite's ``Client`` is: the default, and what a test replaces with one in memory
to drive the whole request path without a socket (as httpx's ``MockTransport``). A future gRPC or ZMQ engine is an
adapter and a transport.

Upstream client errors are wrapped once, here, into ``pdgate.core.errors``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from h1lite.client import BodyTooLarge, Client, ConnectFailed, header_lines
from pdgate.core.errors import LoopLate as LoopLate
from pdgate.core.errors import UpstreamConnectError, UpstreamError

SMALL_BODY = 1 << 20  # health, server info, loads, probes, aborts: answers are small; more is refused


LATE_S = 0.1  # a timeout handled this much (or a quarter of it) after it was due: the loop was behind


def split_url(url: str) -> tuple[str, str]:
    """``http://h:p/a?b`` -> (``http://h:p``, ``/a?b``)."""
    i = url.find("/", url.find("//") + 2)
    return (url, "/") if i < 0 else (url[:i], url[i:])


class Answer(Protocol):
    """An answer whose head came (h1lite's ``ClientResponse``): read whole, or piped to a sink as it comes (the
    sink's exception ends it); released when done with."""

    status: int
    complete: bool
    async def read(self) -> bytes: ...
    async def pipe(self, sink: Callable[[bytes], None]) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def release(self) -> None: ...


class Transport(Protocol):
    """What carries every call to the engines (module docstring; h1lite's ``Client``)."""

    stale_retries: int
    async def request(self, base: str, method: str, target: str, body: bytes = b"", content_type: bytes = ...,
                      headers: dict[str, str] | bytes | None = None) -> Answer: ...
    async def fetch(self, base: str, method: str, target: str, body: bytes = b"", content_type: bytes = ...,
                    headers: dict[str, str] | bytes | None = None, limit: int | None = None) -> tuple[int, bytes]: ...
    def limit(self, base: str, max_open: int) -> None: ...
    def drop(self, base: str) -> None: ...
    def close(self) -> None: ...


class Upstream:
    """The transport to the engines. Every call that is not a stream has a bound: legs by the request's
    deadlines, the rest by its own timeout; every answer read whole by a size limit."""

    def __init__(self, connect_timeout_s: float, abort_timeout_s: float, idle_s: float = 4.0,
                 max_open: int = 1024, max_idle: int = 256, max_body: int = 64 << 20,
                 api_key: str | None = None, transport: Transport | None = None) -> None:
        self.client: Transport = transport or Client(connect_timeout_s, idle_s, max_open, max_idle, max_body)
        self.abort_timeout_s = abort_timeout_s
        # engines started with --api-key want it on every call (encoded once, checked once)
        self.auth = header_lines({"Authorization": f"Bearer {api_key}"}) if api_key else b""

    async def close(self) -> None:
        self.client.close()

    def conns(self, url: str, n: int) -> None:
        """At most ``n`` open connections to the engine at ``url`` (its capacity and headroom)."""
        self.client.limit(split_url(url)[0], n)

    # a leg's two calls hand back the transport's own awaitable: no coroutine of ours between the leg and the
    # socket, which every resumption would pass through
    def open(self, base: str, path: str, data: bytes, headers: bytes = b"") -> Awaitable[Answer]:
        """POST; done once the status line and headers are in (a streamed answer). The caller releases it.
        ``headers``: encoded header lines (``h1lite.client.header_lines``)."""
        return self.client.request(base, "POST", path, data, headers=self.auth + headers)

    def post_read(self, base: str, path: str, data: bytes, headers: bytes = b"") -> Awaitable[tuple[int, bytes]]:
        """POST and read the whole answer (at most ``max_body`` bytes)."""
        return self.client.fetch(base, "POST", path, data, headers=self.auth + headers)

    async def post_within(self, base: str, path: str, data: bytes, timeout_s: float) -> tuple[int, bytes] | None:
        """POST and read the whole answer within ``timeout_s``; None when the engine did not answer (a best-effort
        question: ``/tokenize``)."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self.post_read(base, path, data)
        except (OSError, TimeoutError, ValueError):
            return None

    async def post_small(self, base: str, path: str, data: bytes) -> int:
        """A small POST (an abort) within ``abort_timeout_s``; its status."""
        async with asyncio.timeout(self.abort_timeout_s):
            status, _ = await self.client.fetch(base, "POST", path, data, headers=self.auth, limit=SMALL_BODY)
            return status

    async def get(self, url: str, timeout_s: float, auth: bool = True) -> tuple[int, bytes]:
        """A small GET within ``timeout_s`` (``auth``: with the engines' key); past it ``TimeoutError``, or
        ``LoopLate`` when this process's own loop ran so far behind that the timeout was noticed late (the answer
        may have been waiting in the socket)."""
        base, target = split_url(url)
        loop = asyncio.get_running_loop()
        due = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(due):
                return await self.client.fetch(base, "GET", target, headers=self.auth if auth else b"",
                                               limit=SMALL_BODY)
        except TimeoutError:
            late = loop.time() - due
            if late > max(LATE_S, timeout_s / 4):
                raise LoopLate(f"no answer within {timeout_s:g}s, but this gateway's loop ran {late:.2f}s behind") \
                    from None
            raise

    async def get_json(self, url: str, timeout_s: float, auth: bool = True) -> tuple[int, Any]:
        status, raw = await self.get(url, timeout_s, auth)
        try:
            return status, orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return status, raw.decode(errors="replace")


def wrap(exc: BaseException, role: str, worker: str) -> UpstreamError:
    """Map a client-side exception from one leg to the gateway's error tree."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, ConnectFailed):
        return UpstreamConnectError(f"{role} worker {worker} unreachable: {exc}", role=role, worker=worker)
    if isinstance(exc, BodyTooLarge):
        return UpstreamError(f"{role} worker {worker}'s answer is too large: {exc}", role=role, worker=worker)
    if isinstance(exc, OSError):
        return UpstreamError(f"{role} worker {worker} connection failed: {exc.__class__.__name__}: {exc}",
                             role=role, worker=worker)
    return UpstreamError(f"{role} worker {worker} failed: {exc!r}", role=role, worker=worker)
