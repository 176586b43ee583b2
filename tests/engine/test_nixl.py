"""The sim's NIXL backend (UCX, DRAM) with real agents in real processes; skipped without the nixl extra."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import orjson
import pytest

from engine.sim import nixl_kv
from tests.engine.simclient import engine_requests, gauge, leg, pd, pd_body, set_faults, wait_gauge
from tests.procs import Procs

pytestmark = pytest.mark.skipif(not nixl_kv.available(),
                                reason="nixl not importable (pip install --no-deps nixl nixl-cu12 numpy)")
NIXL = ("--transfer-backend", "nixl")
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}


async def test_round_trip_over_nixl(procs: Procs, http: aiohttp.ClientSession) -> None:
    p, d = procs.pair(*NIXL)
    for _ in range(3):  # the remote agent is added once, then reused
        (ps, _), (ds, db) = await pd(http, p, d, "/v1/chat/completions", CHAT)
        assert (ps, ds) == (200, 200)
        assert len(orjson.loads(db)["choices"][0]["message"]["content"].split()) == 8
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}]}  # 1.3 MB of KV
    (ps, _), (ds, _) = await pd(http, p, d, "/v1/chat/completions", {**long_prompt, "stream": True})
    assert (ps, ds) == (200, 200)
    assert await engine_requests(http, p) == [] and await engine_requests(http, d) == []
    async with http.get(d.url + "/server_info") as r:
        assert (await r.json())["disaggregation_transfer_backend"] == "nixl"


async def test_killed_decode_fails_the_transfer_fast(procs: Procs, http: aiohttp.ClientSession) -> None:
    p, d = procs.pair(*NIXL)
    await set_faults(http, p, slow_prefill=1.0)  # the decode has registered its slot; then it dies
    b = pd_body(CHAT, p)
    p_leg = asyncio.create_task(leg(http, p.url + "/v1/chat/completions", b))
    d_leg = asyncio.create_task(leg(http, d.url + "/v1/chat/completions", b))
    while [r["queue"] for r in await engine_requests(http, p)] != ["forward"]:
        await asyncio.sleep(0.02)
    d.proc.stop(signal.SIGKILL)
    t0 = time.monotonic()
    status, body = await asyncio.wait_for(p_leg, 10)
    assert status == 500 and b"NIXL" in body, body
    assert time.monotonic() - t0 < 3
    assert await gauge(http, p, "num_transfer_failed_reqs_total") == 1
    with pytest.raises(aiohttp.ClientError):
        await d_leg


@pytest.mark.parametrize("fixes", ["none", "A,B,C"])
async def test_frozen_decode_pins_inflight_unless_the_watchdog(procs: Procs, http: aiohttp.ClientSession,
                                                               fixes: str) -> None:
    """SIGSTOP (a real freeze, sockets open): NIXL leaves the WRITE in PROC; only fix C ends it."""
    env = {"SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT": "1"}
    p = procs.sim("prefill", *NIXL, "--fixes", fixes, env=env)
    d = procs.sim("decode", *NIXL, "--fixes", fixes, env=env)
    await set_faults(http, p, slow_prefill=0.5)
    b = pd_body(CHAT, p)
    p_leg = asyncio.create_task(leg(http, p.url + "/v1/chat/completions", b))
    d_leg = asyncio.create_task(leg(http, d.url + "/v1/chat/completions", b))
    try:
        while [r["queue"] for r in await engine_requests(http, p)] != ["forward"]:
            await asyncio.sleep(0.02)
        os.kill(d.proc.pid, signal.SIGSTOP)
        await wait_gauge(http, p, "num_prefill_inflight_queue_reqs", 1, within=2)
        if fixes == "none":
            await asyncio.sleep(3)
            assert await gauge(http, p, "num_prefill_inflight_queue_reqs") == 1 and not p_leg.done()
        else:
            status, body = await asyncio.wait_for(p_leg, 1 + 2)
            assert status == 500 and b"timed out in inflight queue" in body
            assert await gauge(http, p, "num_prefill_inflight_queue_reqs") == 0
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        p_leg.cancel()
        d_leg.cancel()
