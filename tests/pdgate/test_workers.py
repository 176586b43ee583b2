"""Worker failure handling through the real gateway: gray failures, dead workers, no pair."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from pdgate.config import HealthConfig
from tests.engine.simclient import engine_requests, set_faults
from tests.pdgate.harness import assert_clean, worker_id
from tests.pdgate.test_outcomes import CHAT, LONG_CHAT, STALL, gateway, post, trace
from tests.procs import Procs


@pytest.mark.parametrize("degraded_after_s", [1.0, 1000.0])
async def test_gray_failure_degrades_worker(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                            degraded_after_s: float) -> None:
    """A decode whose /health says 200 but that makes no progress stops getting requests."""
    p, d_bad, d_ok = procs.sim("prefill"), procs.sim("decode", env=STALL), procs.sim("decode")
    g = await gateway(gateways, [p], [d_bad, d_ok], policy="round_robin",
                      health=HealthConfig(interval_s=0.3, timeout_s=0.5, failures=2, degraded_after_s=degraded_after_s))
    bad = worker_id(g.gw, d_bad)
    stuck = asyncio.create_task(post(http, g, LONG_CHAT, {"x-pdgate-timeout": "20"}))
    while not await engine_requests(http, d_bad):
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.8)
    async with http.get(g.url + "/v1/workers") as r:
        view = {w["id"]: w for w in (await r.json())["workers"]}
    results = await asyncio.gather(*(post(http, g, LONG_CHAT, {"x-pdgate-idle-timeout": "1"}) for _ in range(4)))
    statuses = sorted(s for s, _, _ in results)
    if degraded_after_s < 100:
        assert view[bad]["degraded"] and view[bad]["healthy"] and not view[bad]["available"]
        assert statuses == [200] * 4, "new requests must avoid the degraded decode"
        live = g.gw.traces.live
        stuck_id = next(iter(live))
        t = await trace(http, g, stuck_id)
        assert any(e["event"] == "worker_degraded" for a in t["attempts"] for e in a["events"])
    else:
        assert not view[bad]["degraded"]
        assert statuses.count(504) >= 1, "without the mechanism round robin keeps sending to the stalled decode"
    stuck_id = next(iter(g.gw.traces.live))
    async with http.post(f"{g.url}/v1/requests/{stuck_id}/abort") as r:
        assert r.status == 200
    status, out, _ = await stuck
    assert status == 499 and out["error"]["code"] == "request_aborted"
    await assert_clean(http, g.gw, [p, d_bad, d_ok], within=6)  # the sim notices aborted legs at once
    if degraded_after_s < 100:
        await asyncio.sleep(0.7)
        assert not g.gw.pool.by_id[bad].degraded, "recovers once none of our requests is stuck on it"


@pytest.mark.parametrize("detect", [True, False])
async def test_dead_decode_fails_over_at_once(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                              detect: bool) -> None:
    """A decode that freezes mid-request (sockets open): health checks find it dead, the request moves."""
    p, d_frozen, d_ok = procs.sim("prefill"), procs.sim("decode", "--speed", "20"), procs.sim("decode")
    health = HealthConfig(interval_s=0.3 if detect else 1000, timeout_s=0.3, failures=2, degraded_after_s=1000)
    g = await gateway(gateways, [p], [d_frozen, d_ok], policy="round_robin", health=health)
    task = asyncio.create_task(post(http, g, {**CHAT, "max_tokens": 60}, {"x-pdgate-timeout": "6"}))
    while not await engine_requests(http, d_frozen):
        await asyncio.sleep(0.02)
    await set_faults(http, d_frozen, decode_freeze=True)
    status, out, rid = await asyncio.wait_for(task, 10)
    t = await trace(http, g, rid)
    if detect:
        assert status == 200, out
        assert t["attempts"][0]["decode"] == worker_id(g.gw, d_frozen) and "down" in t["attempts"][0]["error"]
        assert t["timings_s"]["e2e"] < 3
    else:
        assert status == 504 and t["outcome"] == "deadline_exceeded"
    await set_faults(http, d_frozen, decode_freeze=False)
    await assert_clean(http, g.gw, [p, d_frozen, d_ok], within=6)


async def test_no_healthy_pair(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p = procs.sim("prefill")
    dead = procs.sim("decode")
    dead.proc.stop()
    g = await gateway(gateways, [p], [dead])
    async with http.get(g.url + "/readiness") as r:
        assert r.status == 503 and (await r.json())["decode_available"] == 0
    status, out, _ = await post(http, g, CHAT)
    assert status == 503 and out["error"]["code"] == "no_healthy_pair"
    async with http.get(g.url + "/health") as r:
        assert r.status == 200
    await assert_clean(http, g.gw, [p])
