"""engine/sim against itself: real worker processes on loopback, driven like a router."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import orjson
import pytest

from tests.engine.simclient import engine_requests, gauge, leg, pd, pd_body, set_faults, wait_gauge
from tests.procs import Procs

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}
SHORT = {"SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT": "1", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1",
         "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}
INFLIGHT = "num_prefill_inflight_queue_reqs"
BOOTSTRAP = "num_prefill_bootstrap_queue_reqs"


async def test_chat_round_trip(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill, decode = procs.pair()
    (ps, pb), (ds, db) = await pd(http, prefill, decode, "/v1/chat/completions", CHAT, rid="r-1")
    assert (ps, ds) == (200, 200)
    p, d = orjson.loads(pb), orjson.loads(db)
    assert p["usage"]["completion_tokens"] == 1
    assert d["usage"]["completion_tokens"] == 8 and d["choices"][0]["finish_reason"] == "length"
    text = d["choices"][0]["message"]["content"]
    assert text.startswith(p["choices"][0]["message"]["content"] + " ")  # first token came with the KV
    assert len(text.split()) == 8
    # deterministic: the same prompt gives the same text
    (_, _), (_, db2) = await pd(http, prefill, decode, "/v1/chat/completions", CHAT)
    assert orjson.loads(db2)["choices"][0]["message"]["content"] == text
    assert await engine_requests(http, prefill) == [] and await engine_requests(http, decode) == []


async def test_chat_stream_and_generate(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill, decode = procs.pair()
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    (ps, _), (ds, db) = await pd(http, prefill, decode, "/v1/chat/completions", body)
    assert (ps, ds) == (200, 200)
    events = [e for e in db.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"]) == 8
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    gen = {"text": "hello there", "sampling_params": {"max_new_tokens": 5}, "return_logprob": True}
    (ps, pb), (ds, db) = await pd(http, prefill, decode, "/generate", gen)
    assert (ps, ds) == (200, 200)
    meta_p, meta_d = orjson.loads(pb)["meta_info"], orjson.loads(db)["meta_info"]
    assert meta_d["completion_tokens"] == 5 and meta_d["finish_reason"]["type"] == "length"
    assert len(meta_p["input_token_logprobs"]) == 2 and meta_d["input_token_logprobs"] == []


async def test_stop_and_bad_input(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill, decode = procs.sim("prefill", "--max-context", "64"), procs.sim("decode", "--max-context", "64")
    (_, _), (_, db) = await pd(http, prefill, decode, "/v1/chat/completions", CHAT)
    words = orjson.loads(db)["choices"][0]["message"]["content"].split()
    tokens = [words[0]] + [" " + w for w in words[1:]]
    stop = " " + words[3]
    expect = next(k for k in range(1, 9) if stop in "".join(tokens[:k]))
    (_, _), (_, db) = await pd(http, prefill, decode, "/v1/chat/completions", {**CHAT, "stop": [stop]})
    d = orjson.loads(db)
    assert d["choices"][0]["finish_reason"] == "stop" and d["usage"]["completion_tokens"] == expect
    for bad, msg in [({**CHAT, "n": 2}, "n > 1"), ({**CHAT, "max_tokens": 0}, "positive"),
                     ({**CHAT, "messages": [{"role": "user", "content": "x " * 80}]}, "context length")]:
        status, body = await leg(http, decode.url + "/v1/chat/completions", pd_body(bad, prefill))
        assert status == 400 and msg in orjson.loads(body)["message"]
    async with http.post(decode.url + "/v1/chat/completions", data=b"{nope") as r:
        assert r.status == 400
    assert await engine_requests(http, prefill) == [] and await engine_requests(http, decode) == []


@pytest.mark.parametrize(
    ("fault", "target", "queue"),
    [("ack_loss", "decode", INFLIGHT), ("decode_freeze", "decode", INFLIGHT), ("bootstrap_loss", "decode", BOOTSTRAP)],
)
@pytest.mark.parametrize("fixes", ["none", "A,B,C"])
async def test_fault_pins_without_fixes_and_clears_with_them(
    procs: Procs, http: aiohttp.ClientSession, fault: str, target: str, queue: str, fixes: str
) -> None:
    prefill, decode = procs.pair("--fixes", fixes, env=SHORT)
    if fault == "decode_freeze":  # freeze mid-request: after the handshake, before the KV arrives
        await set_faults(http, prefill, slow_prefill=0.5)
    else:
        await set_faults(http, decode if target == "decode" else prefill, **{fault: True})
    b = pd_body(CHAT, prefill, rid="pinned-1")
    p_leg = asyncio.create_task(leg(http, prefill.url + "/v1/chat/completions", b))
    d_leg = asyncio.create_task(leg(http, decode.url + "/v1/chat/completions", b))
    try:
        if fault == "decode_freeze":
            while [r["queue"] for r in await engine_requests(http, prefill)] != ["forward"]:
                await asyncio.sleep(0.02)
            await set_faults(http, decode, decode_freeze=True)
        await wait_gauge(http, prefill, queue, 1, within=2)
        if fixes == "none":
            await asyncio.sleep(3)  # three times the timeout the fixes would apply
            assert await gauge(http, prefill, queue) == 1, "without the fixes the request should stay pinned"
            assert not p_leg.done()
        else:
            took = await wait_gauge(http, prefill, queue, 0, within=1 + 2)
            status, body = await asyncio.wait_for(p_leg, 1)
            assert status == 500, body
            assert took <= 3
    finally:
        p_leg.cancel()
        d_leg.cancel()
        await set_faults(http, decode, decode_freeze=False)


@pytest.mark.parametrize("fixes", ["none", "A,B"])
async def test_abort_race(procs: Procs, http: aiohttp.ClientSession, fixes: str) -> None:
    """An abort lost in the transfer window pins the request; fix A makes every abort land."""
    prefill, decode = procs.pair("--fixes", fixes, env=SHORT)
    await set_faults(http, decode, ack_loss=True)  # holds the request in the inflight queue
    await set_faults(http, prefill, abort_race=True)
    b = pd_body(CHAT, prefill, rid="race-1")
    p_leg = asyncio.create_task(leg(http, prefill.url + "/v1/chat/completions", b))
    d_leg = asyncio.create_task(leg(http, decode.url + "/v1/chat/completions", b))
    try:
        await wait_gauge(http, prefill, INFLIGHT, 1, within=2)
        async with http.post(prefill.url + "/abort_request", json={"rid": "race"}) as r:  # prefix match
            assert r.status == 200
        if fixes == "none":
            await asyncio.sleep(2)
            assert await gauge(http, prefill, INFLIGHT) == 1
            assert await gauge(http, prefill, "num_lost_aborts_total") == 1
            async with http.post(prefill.url + "/abort_request", json={"rid": "race-1"}) as r:
                assert r.status == 200  # a later abort still applies: it is a race, not a broken path
        await wait_gauge(http, prefill, INFLIGHT, 0, within=1)
        status, _ = await asyncio.wait_for(p_leg, 1)
        assert status == 500
        assert (await d_leg)[0] == 200  # the decode got its KV (only the ack was lost)
    finally:
        p_leg.cancel()
        d_leg.cancel()


@pytest.mark.parametrize(("role", "queue"), [("prefill", "bootstrap"), ("prefill", "forward"), ("decode", "transfer"),
                                           ("decode", "running")])
async def test_abort_ends_the_request_in_every_queue(procs: Procs, http: aiohttp.ClientSession, role: str,
                                                     queue: str) -> None:
    """/abort_request reaches a request wherever it waits: it leaves the engine and its answer names the queue."""
    prefill, decode = procs.pair()
    if queue == "forward":
        await set_faults(http, prefill, slow_prefill=30)
    body = pd_body({**CHAT, "max_tokens": 5000} if queue == "running" else CHAT, prefill, rid=f"ab-{queue}")
    legs = {"prefill": asyncio.create_task(leg(http, prefill.url + "/v1/chat/completions", body))}
    if queue != "bootstrap":  # without a decode partner the prefill waits in bootstrap
        legs["decode"] = asyncio.create_task(leg(http, decode.url + "/v1/chat/completions", body))
    worker = prefill if role == "prefill" else decode
    try:
        if queue == "transfer":
            await set_faults(http, prefill, slow_prefill=30)  # the KV never comes while we look
        for _ in range(200):
            if [r["queue"] for r in await engine_requests(http, worker)] == [queue]:
                break
            await asyncio.sleep(0.02)
        assert [r["queue"] for r in await engine_requests(http, worker)] == [queue]
        async with http.post(worker.url + "/abort_request", json={"rid": f"ab-{queue}"}) as r:
            assert r.status == 200
        status, answer = await asyncio.wait_for(legs[role], 2)
        assert status == 500 and f"Request aborted in {queue}".encode() in answer, answer
        assert await engine_requests(http, worker) == []
    finally:
        for t in legs.values():
            t.cancel()
        await set_faults(http, prefill, slow_prefill=0)


async def test_decode_crash_fails_the_prefill_fast(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill, decode = procs.pair("--fault", "decode_crash=1")
    b = pd_body(CHAT, prefill)
    d_leg = asyncio.create_task(leg(http, decode.url + "/v1/chat/completions", b))
    status, body = await asyncio.wait_for(leg(http, prefill.url + "/v1/chat/completions", b), 5)
    assert status == 500 and b"KV transfer" in body
    with pytest.raises(aiohttp.ClientError):
        await d_leg
    assert decode.proc.popen is not None and decode.proc.popen.wait(5) == 3
    assert await gauge(http, prefill, "num_transfer_failed_reqs_total") == 1


async def test_http_500_fault_and_identity(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill, decode = procs.pair()
    await set_faults(http, prefill, http_500_rate=1)
    status, _ = await leg(http, prefill.url + "/v1/chat/completions", pd_body(CHAT, prefill))
    assert status == 500
    async with http.post(prefill.url + "/pdgate/v1/faults", json={"http_500_rate": 7}) as r:
        assert r.status == 400
    async with http.get(decode.url + "/server_info") as r:
        ident = (await r.json())["pdgate_identity"]
    decode.proc.stop(signal.SIGKILL)
    again = procs.sim("decode", port=decode.port)
    async with http.get(again.url + "/get_server_info") as r:
        assert (await r.json())["pdgate_identity"] != ident


async def test_unsafe_kernel_profile_stalls_long_context(procs: Procs, http: aiohttp.ClientSession) -> None:
    env = {"SGLANG_SM120_MMA_TARGET_CTAS": "512", "SIM_STALL_THRESHOLD_TOKENS": "200"}
    prefill, decode = procs.sim("prefill"), procs.sim("decode", env=env)
    short = await asyncio.wait_for(pd(http, prefill, decode, "/v1/chat/completions", CHAT), 5)
    assert short[1][0] == 200
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 300}]}
    task = asyncio.create_task(pd(http, prefill, decode, "/v1/chat/completions", long_chat, rid="long-1"))
    await asyncio.sleep(1.5)
    assert not task.done(), "a long context must stall under the unsafe profile"
    reqs = await engine_requests(http, decode)
    assert [r["queue"] for r in reqs] == ["running"]
    async with http.post(decode.url + "/abort_request", json={"rid": "long-1"}) as r:
        assert r.status == 200
    (_, _), (ds, _) = await asyncio.wait_for(task, 3)
    assert ds == 500
    assert await engine_requests(http, decode) == []
