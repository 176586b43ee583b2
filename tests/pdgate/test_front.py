"""Bad input gets OpenAI-shaped errors and costs the engines nothing; the inspection API."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.engine.simclient import gauge, set_faults
from tests.pdgate.harness import assert_clean, worker_id
from tests.pdgate.test_outcomes import CHAT, gateway, post
from tests.procs import Procs

BAD: list[tuple[str, Any, dict[str, str], int, str]] = [
    ("/v1/chat/completions", b"{not json", {}, 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_json"),
    ("/v1/chat/completions", {"model": "sim-model"}, {}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, {}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, {}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "8"}, {}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, {}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, {}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "temperature": 9}, {}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-nope"}, {}, 404, "model_not_found"),
    ("/v1/chat/completions", {**CHAT, "timeout": -1}, {}, 400, "invalid_deadline"),
    ("/v1/chat/completions", {**CHAT, "timeout": "soon"}, {}, 400, "invalid_deadline"),
    ("/v1/chat/completions", CHAT, {"x-pdgate-timeout": "0"}, 400, "invalid_deadline"),
    ("/v1/chat/completions", CHAT, {"x-pdgate-ttft-timeout": "nan"}, 400, "invalid_deadline"),
    ("/v1/chat/completions", CHAT, {"x-pdgate-idle-timeout": "abc"}, 400, "invalid_deadline"),
    ("/v1/completions", {"model": "sim-model", "prompt": ["a", "b"]}, {}, 400, "invalid_value"),
    ("/generate", {"text": ["a", "b"]}, {}, 400, "invalid_value"),
    ("/generate", {"sampling_params": {}}, {}, 400, "invalid_value"),
    ("/generate", {"input_ids": [1, "x"]}, {}, 400, "invalid_value"),
    ("/v1/embeddings", CHAT, {}, 404, "not_found"),
]


async def test_bad_input_is_rejected_before_the_engines(procs: Procs, http: aiohttp.ClientSession,
                                                        gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], max_body_bytes=4096)
    for path, body, headers, status, code in BAD:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(g.url + path, headers=headers, **kw) as r:
            out = await r.json()
            assert (r.status, out["error"]["code"]) == (status, code), (path, body, headers, out)
            assert set(out["error"]) == {"message", "type", "code", "param"} and out["error"]["message"]
    async with http.post(g.url + "/v1/chat/completions", data=b"x" * 10000) as r:
        assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
    async with http.get(g.url + "/v1/chat/completions") as r:
        assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
    assert await gauge(http, p, "num_requests_total") == 0 and await gauge(http, d, "num_requests_total") == 0
    status, _, _ = await post(http, g, CHAT)  # and the gateway still serves
    assert status == 200
    await assert_clean(http, g.gw, [p, d])


async def test_engine_rejection_is_passed_on_not_retried(procs: Procs, http: aiohttp.ClientSession,
                                                         gateways: list[Any]) -> None:
    p, d = procs.sim("prefill", "--max-context", "64"), procs.sim("decode", "--max-context", "64")
    g = await gateway(gateways, [p], [d])
    status, out, rid = await post(http, g, {**CHAT, "max_tokens": 100})
    assert status == 400 and out["error"]["code"] == "engine_rejected" and "context length" in out["error"]["message"]
    assert len(g.gw.traces.get(rid).attempts) == 1  # type: ignore[union-attr]
    await assert_clean(http, g.gw, [p, d])


async def test_inspection_api(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    await set_faults(http, p, slow_prefill=3)
    task = asyncio.create_task(post(http, g, CHAT, {"x-request-id": "client-42"}))
    while not g.gw.traces.live:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    pid = worker_id(g.gw, p)
    for query, n in [("", 1), ("?phase=prefill%2Btransfer", 1), ("?phase=decode", 0), (f"?worker={pid}", 1),
                     ("?min_age_s=0.2", 1), ("?min_age_s=100", 0)]:
        async with http.get(g.admin + "/v1/requests" + query) as r:
            assert (await r.json())["count"] == n, query
    for query, allowed in (("?worker=d9", "d0, p0"), ("?phase=bogus", "queued, dispatched, prefill+transfer")):
        async with http.get(g.admin + "/v1/requests" + query) as r:  # a filter that can match nothing is a typo
            assert r.status == 400 and allowed in (await r.json())["error"]["message"], query
    rid = next(iter(g.gw.traces.live))
    async with http.get(f"{g.admin}/v1/requests/{rid}") as r:
        t = await r.json()
    assert t["client_request_id"] == "client-42" and t["phase"] == "prefill+transfer"
    assert t["engine"][pid]["queue"] == "forward"  # where the engine holds it, from the extension
    assert t["deadline"]["next"] == "ttft" and 0 < t["deadline"]["left_s"] <= 120
    async with http.get(g.admin + "/v1/requests/nope") as r:
        assert r.status == 404
    status, _, _ = await task
    assert status == 200
    async with http.post(f"{g.admin}/v1/requests/{rid}/abort") as r:
        assert r.status == 409
    async with http.get(g.admin + "/metrics") as r:
        text = await r.text()
    for name in ("pdgate_requests_total", "pdgate_live_requests", "pdgate_ttft_seconds", "pdgate_worker_up",
                 "pdgate_oldest_live_request_age_seconds", "pdgate_phase_duration_seconds"):
        assert name in text, name
    await assert_clean(http, g.gw, [p, d])


async def test_workers_api(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = procs.pair()
    d2 = procs.sim("decode")
    g = await gateway(gateways, [p], [d])
    async with http.post(g.admin + "/v1/workers", json={"role": "decode", "url": d2.url}) as r:
        assert r.status == 201
        added = await r.json()
    assert added["healthy"] and added["identity"]
    async with http.post(g.admin + "/v1/workers", json={"role": "decode", "url": d2.url}) as r:
        assert r.status == 409  # already registered
    async with http.post(g.admin + "/v1/workers", json={"role": "router", "url": d2.url}) as r:
        assert r.status == 400
    for raw in (b"{nope", b"[1, 2]"):  # read as the front door reads a body: the same 400, the same code
        async with http.post(g.admin + "/v1/workers", data=raw, headers={"content-type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json", raw
    for url, why in (("https://127.0.0.1:30000", "https:// workers are not supported"),
                     ("http://127.0.0.1:99999", "not a URL")):  # on cea4624: a 500, and a worker left behind
        async with http.post(g.admin + "/v1/workers", json={"role": "decode", "url": url}) as r:
            assert r.status == 400 and why in (await r.json())["error"]["message"], url
    async with http.get(g.admin + "/v1/workers") as r:
        assert len((await r.json())["workers"]) == 3
    async with http.delete(f"{g.admin}/v1/workers/{added['id']}") as r:
        assert r.status == 200
    async with http.delete(f"{g.admin}/v1/workers/{added['id']}") as r:
        assert r.status == 404
    status, _, _ = await post(http, g, CHAT)
    assert status == 200


@pytest.mark.parametrize("path", ["/v1/models"])
async def test_models(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any], path: str) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    async with http.get(g.url + path) as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["sim-model"]
