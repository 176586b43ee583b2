"""The client side: pooled keep-alive connections to all engines (``h1lite.client``); aborts; small GETs.

Upstream client errors are wrapped once, here, into ``pdgate.errors``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from h1lite.client import Client, ConnectFailed, Exchange
from pdgate import protocol
from pdgate.errors import UpstreamConnectError, UpstreamError


def split_url(url: str) -> tuple[str, str]:
    """``http://h:p/a?b`` -> (``http://h:p``, ``/a?b``)."""
    i = url.find("/", url.find("//") + 2)
    return (url, "/") if i < 0 else (url[:i], url[i:])


class Upstream:
    def __init__(self, connect_timeout_s: float, abort_timeout_s: float) -> None:
        self.client = Client(connect_timeout_s)
        self.abort_timeout_s = abort_timeout_s

    async def close(self) -> None:
        self.client.close()

    def post(self, base: str, path: str, data: bytes) -> Exchange:
        """Start a POST; the caller uses it as an async context manager (for streamed answers)."""
        return self.client.send(base, "POST", path, data)

    async def post_read(self, base: str, path: str, data: bytes) -> tuple[int, bytes]:
        """POST and read the whole answer."""
        return await self.client.fetch(base, "POST", path, data)

    async def abort(self, base_url: str, rid: str) -> int:
        """POST /abort_request (prefix match on the engine; always 200 there)."""
        async with asyncio.timeout(self.abort_timeout_s):
            status, _ = await self.client.fetch(base_url, "POST", protocol.ABORT_PATH, orjson.dumps({"rid": rid}))
            return status

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        base, target = split_url(url)
        async with asyncio.timeout(timeout_s):
            return await self.client.fetch(base, "GET", target)

    async def get_json(self, url: str, timeout_s: float) -> tuple[int, Any]:
        status, raw = await self.get(url, timeout_s)
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
    if isinstance(exc, OSError):
        return UpstreamError(f"{role} worker {worker} connection failed: {exc.__class__.__name__}: {exc}",
                             role=role, worker=worker)
    return UpstreamError(f"{role} worker {worker} failed: {exc!r}", role=role, worker=worker)
