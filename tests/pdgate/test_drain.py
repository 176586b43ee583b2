"""SIGTERM drains: live requests finish within ``drain_s``; with ``drain_s = 0`` they are cut, answered 503
(gateway_draining) and their legs aborted."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.engine.simclient import engine_requests
from tests.pdgate.test_outcomes import CHAT
from tests.procs import Procs, free_port, wait_http, workers_toml


@pytest.mark.parametrize("drain_s", [10.0, 0.0])
async def test_sigterm_lets_live_requests_finish(procs: Procs, http: aiohttp.ClientSession, tmp_path: Path,
                                                 drain_s: float) -> None:
    p = procs.sim("prefill")
    d = procs.sim("decode", "--speed", "15")  # a 30-token answer takes ~1-2 s
    port = free_port()
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {free_port()}\ndrain_s = {drain_s}\n[reconcile]\nenabled = false\n"
                   + workers_toml([p], [d]))
    g = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg)], name="gateway")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readiness", proc=g.popen)

    async def call() -> Any:
        async with http.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 30}) as r:
            return r.status, await r.json()

    live = asyncio.create_task(call())
    while not await engine_requests(http, d):
        await asyncio.sleep(0.05)
    assert g.popen is not None
    t0 = time.monotonic()
    g.popen.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    with pytest.raises(aiohttp.ClientConnectionError):  # no new connections while draining
        async with http.get(url + "/health"):
            pass
    if drain_s > 0:
        status, body = await live
        assert status == 200 and body["usage"]["completion_tokens"] == 30
    else:  # cut at once, but answered: a 503 that names the drain, never a closed socket
        status, body = await live
        assert status == 503 and body["error"]["code"] == "gateway_draining", body
    assert await asyncio.to_thread(g.popen.wait, 15) == 0
    assert time.monotonic() - t0 < drain_s + 5
    for w in (p, d):  # cut or finished, nothing stays on the engines
        for _ in range(40):
            if not await engine_requests(http, w):
                break
            await asyncio.sleep(0.1)
        assert await engine_requests(http, w) == []
