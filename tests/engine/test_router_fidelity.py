"""Fidelity check: the unmodified sglang-router (PD mode) works in front of sim workers."""

from __future__ import annotations

import aiohttp
import orjson

from tests.procs import Procs
from tests.sglang_router import start_router


async def test_sglang_router_pd_in_front_of_sim(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill, decode = procs.pair()
    router = start_router(procs, [prefill], [decode])
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}
    async with http.post(router + "/v1/chat/completions", json=chat) as r:
        assert r.status == 200
        body = await r.json()
    assert len(body["choices"][0]["message"]["content"].split()) == 8

    async with http.post(router + "/v1/chat/completions", json={**chat, "stream": True}) as r:
        assert r.status == 200
        raw = await r.read()
    events = [e for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    content = "".join(orjson.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert len(content.split()) == 8

    gen = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    async with http.post(router + "/generate", json=gen) as r:
        assert r.status == 200
        meta = (await r.json())["meta_info"]
    assert meta["completion_tokens"] == 4
