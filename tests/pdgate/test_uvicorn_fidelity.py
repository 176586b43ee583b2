"""The gateway against SGLang-shaped workers served by uvicorn, the server SGLang runs on (issue 13).

uvicorn closes keep-alive connections idle for ``timeout_keep_alive`` (SGLang: 5 s; 0.2 s here, so the test
is short): requests spaced around that time hit connections uvicorn is closing or has closed. None of them
may fail, and no worker's breaker may count a failure.
"""

from __future__ import annotations

import asyncio
import random
import sys
from typing import Any

import aiohttp

from pdgate.core.config import GatewayConfig, HealthConfig, WorkerSpec, validate
from tests.pdgate.harness import start_gateway
from tests.procs import Procs, free_port, wait_http


def uvicorn_worker(procs: Procs, role: str, keepalive: float) -> str:
    port = free_port()
    p = procs.spawn([sys.executable, "-m", "tests.engine.uvicorn_worker", "--role", role, "--port", str(port),
                     "--keepalive", str(keepalive)], name=f"uvicorn-{role}")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc=p.popen)
    return url


async def test_idle_connections_expire_without_a_failed_request(procs: Procs, gateways: list[Any]) -> None:
    keepalive = 0.2
    pre, dec = uvicorn_worker(procs, "prefill", keepalive), uvicorn_worker(procs, "decode", keepalive)
    cfg = validate(GatewayConfig(port=free_port(), prefill=(WorkerSpec(url=pre, role="prefill", bootstrap_port=free_port()),),
                                 decode=(WorkerSpec(url=dec, role="decode"),), drain_s=0.5,
                                 health=HealthConfig(interval_s=0.5, timeout_s=0.5, failures=2, degraded_after_s=30)))
    g = await start_gateway(cfg)
    gateways.append(g)
    rng = random.Random(5)
    statuses = []
    async with aiohttp.ClientSession() as http:
        for i in range(40):
            await asyncio.sleep(keepalive * rng.uniform(0.6, 1.4))  # around the moment uvicorn closes
            body = {"model": "uv-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "stream": i % 2 == 0}
            async with http.post(g.url + "/v1/chat/completions", json=body) as r:
                raw = await r.read()
                statuses.append(r.status)
                if body["stream"]:
                    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1, raw
    assert statuses == [200] * 40, statuses
    for w in g.gw.pool.by_id.values():
        assert w.breaker.failures == 0 and w.state.value == "up", (w.id, w.breaker.failures, w.state)
    up = g.gw.upstream.client
    opened = sum(pool.opened for pool, _ in up.pools.values())
    assert opened > 10, "uvicorn closed idle connections and new ones were made"
    async with aiohttp.ClientSession() as http, http.get(g.admin + "/metrics") as r:
        assert f"pdgate_upstream_stale_retries_total {float(up.stale_retries)}" in await r.text()
