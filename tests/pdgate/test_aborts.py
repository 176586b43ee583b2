"""The abort order is the engine's: a decode whose engine lacks the abort-during-transfer fix (A) is aborted once
its KV transfer is over; tearing it down mid-transfer leaks it (the sims model SGLang's hazard, fix A off).
With the deferral switched off (the adapter asked to abort at once), the same requests leak on the decode."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from pdgate.engines.sglang import SGLang
from tests.engine.simclient import engine_requests, gauge, set_faults
from tests.pdgate.harness import assert_clean
from tests.pdgate.test_outcomes import CHAT, gateway, trace
from tests.procs import Procs


async def ttft_expired(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"x-pdgate-ttft-timeout": "0.5"}) as r:
        body = await r.json()
        assert r.status == 504 and body["error"]["code"] == "deadline_exceeded", body
        return r.headers["x-request-id"]


@pytest.mark.parametrize("deferred", [True, False])
async def test_a_decode_without_fix_a_is_aborted_once_its_transfer_is_over(
        procs: Procs, http: aiohttp.ClientSession, gateways: list[Any], monkeypatch: pytest.MonkeyPatch,
        deferred: bool) -> None:
    p, d = procs.pair("--fixes", "B,C")
    await set_faults(http, p, slow_prefill=2.0)  # each TTFT deadline fires while its decode waits for the KV
    if not deferred:
        monkeypatch.setattr(SGLang, "defers_decode_abort", lambda self, fixes: False)
    g = await gateway(gateways, [p], [d])
    assert g.gw.pool.by_id["d0"].info.fixes == ["B", "C"]
    rids = await asyncio.gather(*(ttft_expired(http, g.url) for _ in range(3)))
    if deferred:
        await assert_clean(http, g.gw, [p, d], within=4.0)  # the prefill ends ~1.5 s after the 504s
        events = [e["event"] for e in (await trace(http, g, rids[0]))["attempts"][0]["events"]]
        assert "abort_deferred" in events and events.index("abort_deferred") < events.index("abort_undeferred"), events
        assert await gauge(http, d, "num_leaked_reqs_total") == 0
    else:
        await asyncio.sleep(1.5)
        held = await engine_requests(http, d)
        assert held and all(r["queue"] == "transfer" for r in held), held
        assert await gauge(http, d, "num_leaked_reqs_total") >= 1, "aborted mid-transfer: it leaked"
