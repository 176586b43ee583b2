"""The client side: one pooled keep-alive session to all engines; aborts; small GETs.

Upstream client errors are wrapped once, here, into ``pdgate.errors``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from pdgate import protocol
from pdgate.errors import UpstreamConnectError, UpstreamError

JSON = {"Content-Type": "application/json"}


class Upstream:
    def __init__(self, connect_timeout_s: float, abort_timeout_s: float) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
            json_serialize=lambda o: orjson.dumps(o).decode(),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies; skip the per-response jar work
        )
        self._abort_timeout = aiohttp.ClientTimeout(total=abort_timeout_s)

    async def close(self) -> None:
        await self.session.close()

    def post(self, url: str, data: bytes) -> Any:
        """Start a POST; the caller uses it as an async context manager."""
        return self.session.post(url, data=data, headers=JSON)

    async def abort(self, base_url: str, rid: str) -> int:
        """POST /abort_request (prefix match on the engine; always 200 there)."""
        async with self.session.post(base_url + protocol.ABORT_PATH, data=orjson.dumps({"rid": rid}), headers=JSON,
                                     timeout=self._abort_timeout) as r:
            await r.read()
            return r.status

    async def get_json(self, url: str, timeout_s: float) -> tuple[int, Any]:
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.read()
            try:
                return r.status, orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                return r.status, raw.decode(errors="replace")

    async def get_text(self, url: str, timeout_s: float) -> tuple[int, str]:
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, await r.text()


def wrap(exc: BaseException, role: str, worker: str) -> UpstreamError:
    """Map a client-side exception from one leg to the gateway's error tree."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, (aiohttp.ClientConnectorError, ConnectionRefusedError)):
        return UpstreamConnectError(f"{role} worker {worker} unreachable: {exc}", role=role, worker=worker)
    if isinstance(exc, (aiohttp.ClientError, OSError, asyncio.IncompleteReadError)):
        return UpstreamError(f"{role} worker {worker} connection failed: {exc.__class__.__name__}: {exc}",
                             role=role, worker=worker)
    return UpstreamError(f"{role} worker {worker} failed: {exc!r}", role=role, worker=worker)
