"""Drive a sim PD pair directly, the way a router does (no gateway in between)."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import aiohttp

from tests.procs import Sim


def pd_body(body: dict[str, Any], prefill: Sim, rid: str | None = None) -> dict[str, Any]:
    out = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
           "bootstrap_room": random.randint(0, 2**63 - 1)}
    if rid is not None:
        out["rid"] = rid
    return out


async def leg(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with http.post(url, json=body) as r:
        return r.status, await r.read()


async def pd(http: aiohttp.ClientSession, prefill: Sim, decode: Sim, path: str, body: dict[str, Any],
             rid: str | None = None) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
    b = pd_body(body, prefill, rid)
    p, d = await asyncio.gather(leg(http, prefill.url + path, b), leg(http, decode.url + path, b))
    return p, d


async def gauge(http: aiohttp.ClientSession, worker: Sim, name: str) -> float:
    async with http.get(worker.url + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"^sglang:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


async def engine_requests(http: aiohttp.ClientSession, worker: Sim) -> list[dict[str, Any]]:
    async with http.get(worker.url + "/pdgate/v1/requests") as r:
        return list((await r.json())["requests"])


async def set_faults(http: aiohttp.ClientSession, worker: Sim, **faults: Any) -> None:
    async with http.post(worker.url + "/pdgate/v1/faults", json=faults) as r:
        assert r.status == 200, await r.text()


async def wait_gauge(http: aiohttp.ClientSession, worker: Sim, name: str, want: float, within: float) -> float:
    """Poll until the gauge equals ``want``; returns the seconds it took (raises on timeout)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        if await gauge(http, worker, name) == want:
            return loop.time() - start
        if loop.time() - start > within:
            raise AssertionError(f"{name} on {worker.role} did not reach {want} within {within}s")
        await asyncio.sleep(0.1)
