"""The same stalled decode in front of pdgate and of the real sglang-router: measured, not claimed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from tests.pdgate.harness import assert_clean, make_config, start_gateway
from tests.procs import Procs
from tests.sglang_router import start_router

STALL = {"SGLANG_SM120_MMA_TARGET_CTAS": "512", "SIM_STALL_THRESHOLD_TOKENS": "100"}
LONG = {"model": "sim-model", "messages": [{"role": "user", "content": "context " * 120}], "max_tokens": 64,
        "stream": True}
IDLE = 1.0


async def first_error_or_timeout(http: aiohttp.ClientSession, url: str, headers: dict[str, str], wait: float) -> tuple[
        float | None, list[bytes]]:
    """Stream ``LONG``; returns (seconds until an error event or the end, events) or (None, events) if still open."""
    events: list[bytes] = []
    t0 = time.monotonic()
    async with http.post(url + "/v1/chat/completions", json=LONG, headers=headers) as r:
        try:
            async with asyncio.timeout(wait):
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events.append(line.strip())
                        if b'"error"' in line:
                            return time.monotonic() - t0, events
                return time.monotonic() - t0, events
        except TimeoutError:
            return None, events


async def test_stalled_decode_pdgate_errors_router_hangs(procs: Procs, http: aiohttp.ClientSession,
                                                         gateways: list[Any]) -> None:
    p, d = procs.sim("prefill"), procs.sim("decode", env=STALL)
    g = await start_gateway(make_config([p], [d]))
    gateways.append(g)
    took, events = await first_error_or_timeout(http, g.url, {"x-pdgate-idle-timeout": str(IDLE)}, wait=IDLE + 5)
    assert took is not None and took <= IDLE + 1.0, f"pdgate: no error event within idle + 1 s ({took})"
    err = orjson.loads(events[-1][6:])["error"]
    assert err["code"] == "deadline_exceeded"
    await assert_clean(http, g.gw, [p, d])

    router = start_router(procs, [p], [d], "--request-timeout-secs", "1800")
    took_router, events_router = await first_error_or_timeout(http, router, {}, wait=IDLE + 3)
    assert took_router is None, "sglang-router was expected to keep the client waiting"
    assert events_router, "the router relayed the first token, then nothing"
    async with http.get(d.url + "/pdgate/v1/requests") as r:
        held = (await r.json())["requests"]
    assert held, "and the decode still holds the stalled request behind the router"
