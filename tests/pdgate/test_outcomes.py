"""Every terminal outcome through the real gateway, real sim processes, the real openai SDK.

After each, ``assert_clean``: no engine holds a request and the gateway has no live record.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from h1lite.client import Connection
from pdgate.core.config import HealthConfig, ReconcileConfig
from tests.engine.simclient import engine_requests, set_faults
from tests.pdgate.harness import Running, assert_clean, make_config, start_gateway, worker_id
from tests.procs import Procs, Sim

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}
LONG_CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "context " * 120}], "max_tokens": 64}
STALL = {"SGLANG_SM120_MMA_TARGET_CTAS": "512", "SIM_STALL_THRESHOLD_TOKENS": "100"}


async def gateway(gateways: list[Any], prefills: list[Sim], decodes: list[Sim], **kw: Any) -> Running:
    g = await start_gateway(make_config(prefills, decodes, **kw))
    gateways.append(g)
    return g


async def trace(http: aiohttp.ClientSession, g: Running, rid: str) -> dict[str, Any]:
    async with http.get(f"{g.admin}/v1/requests/{rid}") as r:
        assert r.status == 200
        return dict(await r.json())


async def post(http: aiohttp.ClientSession, g: Running, body: dict[str, Any], headers: dict[str, str] | None = None,
               path: str = "/v1/chat/completions") -> tuple[int, dict[str, Any], str]:
    async with http.post(g.url + path, json=body, headers=headers or {}) as r:
        return r.status, orjson.loads(await r.read()), r.headers["x-request-id"]


async def test_completed_openai_sdk_stream_and_not(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": "say hi"}], max_tokens=8)
        r = raw.parse()
        assert r.usage is not None and r.usage.completion_tokens == 8
        text = r.choices[0].message.content
        assert text and len(text.split()) == 8
        stream = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "say hi"}], max_tokens=8, stream=True,
            stream_options={"include_usage": True})
        parts, usage = [], None
        async for c in stream:
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
            if c.usage:
                usage = c.usage
        assert "".join(parts) == text and usage is not None and usage.completion_tokens == 8
        comp = await client.completions.create(model="sim-model", prompt="hello", max_tokens=4)
        assert comp.choices[0].text and comp.usage is not None and comp.usage.completion_tokens == 4
    finally:
        await client.close()
    t = await trace(http, g, raw.headers["x-request-id"])
    assert t["outcome"] == "completed" and t["status"] == 200
    assert [ph["phase"] for ph in t["phases"]] == ["queued", "dispatched", "prefill+transfer", "decode", "completed"]
    a = t["attempts"][0]
    assert a["rid"] == t["id"] + ".1" and {e["event"] for e in a["events"]} >= {"sent", "prefill_done", "decode_done"}
    await assert_clean(http, g.gw, [p, d])


async def test_generate_native_with_logprobs_merged(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    body = {"text": "hello there friend", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    status, out, _ = await post(http, g, body, path="/generate")
    assert status == 200
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 3
    assert len(meta["input_token_logprobs"]) == 3  # the prefill's list, merged in front of decode's (empty)
    await assert_clean(http, g.gw, [p, d])


@pytest.mark.parametrize("abort_timeout_s", [0.5, 1000.0])
async def test_aborts_to_a_frozen_worker_give_up(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                                 abort_timeout_s: float) -> None:
    """A decode that answers nothing (frozen, sockets open) also answers no /abort_request. Each abort call
    gives up after ``abort_timeout_s``, is recorded on the trace as an error, and the gateway holds no
    pending work for it; with no such bound the abort calls (and their connections) hang on."""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], abort_timeout_s=abort_timeout_s,
                      health=HealthConfig(interval_s=30, timeout_s=0.5, failures=2, degraded_after_s=30))
    await set_faults(http, d, decode_freeze=True)
    try:
        status, body, rid = await post(http, g, CHAT, headers={"x-pdgate-ttft-timeout": "1"})
        assert status == 504 and body["error"]["code"] == "deadline_exceeded"
        await asyncio.sleep(0.5 + 0.25 + 0.5 + 1.0 + 0.5 + 1.0)  # three aborts to decode (first + 2 repeats), each bounded, + slack
        events = [(e["event"], e.get("info")) for e in (await trace(http, g, rid))["attempts"][0]["events"]]
        if abort_timeout_s < 1:
            assert events.count(("abort_error", "decode: TimeoutError")) == 3, events
            assert not g.gw.background, g.gw.background
        else:
            assert ("abort_error", "decode: TimeoutError") not in events
            assert any(not t.done() for t in g.gw.background)  # still waiting on the frozen worker
    finally:
        await set_faults(http, d, decode_freeze=False)
    await assert_clean(http, g.gw, [p, d], within=3)


def pdgate_tasks() -> list[asyncio.Task[Any]]:
    """This process's tasks still running pdgate's code."""
    return [t for t in asyncio.all_tasks() if not t.done() and getattr(t.get_coro(), "cr_frame", None) is not None
            and str(t.get_coro().cr_frame.f_globals.get("__name__", "")).startswith("pdgate.")]  # type: ignore[union-attr]


async def test_a_worker_set_change_reported_after_the_stop_starts_nothing(procs: Procs) -> None:
    """A shared store's listener runs until the store closes, after the gateway's stop: a change of the worker set
    it reported then started a sync, and a health loop for each worker the sync added, that nothing stopped."""
    p, d = procs.pair()
    g = await start_gateway(make_config([p], [d]))
    await g.close()
    ctl = g.runner.control
    ctl.workers_changed()
    ctl.start_health(worker_id(g.gw, p))
    assert pdgate_tasks() == []


@pytest.mark.parametrize("grace_s", [0.3, 30.0])
async def test_a_gateway_stopped_within_a_prefills_grace_aborts_it_and_leaves_nothing_running(
        procs: Procs, http: aiohttp.ClientSession, grace_s: float) -> None:
    """The gateway stops while a prefill outlives its decode, within ``prefill_grace_s``. It used to await the
    prefill only, for its stop's bound (8 s):
    - a grace ending in that time cancelled the prefill and started its abort, and the stop returned with the abort
      still running: it opened a connection in a new pool nothing closed (found by the garbage collector in some
      later test, under load) and went on calling the engine after the stop;
    - a longer grace: the prefill was cancelled at the bound with no abort, and the engine kept it.
    Now the stop ends each grace at once: the abort is sent and awaited."""
    p, d = procs.pair("--fixes", "none")  # no inflight watchdog in the engine: only the gateway's abort frees it
    await set_faults(http, d, ack_loss=True)  # the decode finishes, the prefill waits for the ack forever
    g = await start_gateway(make_config([p], [d], prefill_grace_s=grace_s, reconcile=ReconcileConfig(enabled=False)))
    try:
        status, _, _ = await post(http, g, CHAT)
        assert status == 200
    finally:
        await g.close()  # at once: the prefill is in its grace
    assert pdgate_tasks() == [], "the gateway's tasks run on after its stop"
    gc.collect()
    left = [c for c in gc.get_objects() if isinstance(c, Connection) and c.transport is not None
            and not c.transport.is_closing()]
    assert left == [], "the gateway's connections outlive its stop"
    assert await engine_requests(http, p) == []  # the prefill was aborted, not left pinned


@pytest.mark.parametrize("abort_legs", [True, False])
async def test_prefill_silent_after_decode_finished_is_aborted(procs: Procs, http: aiohttp.ClientSession,
                                                               gateways: list[Any], abort_legs: bool) -> None:
    """The client has its answer but the prefill leg never answered (its KV acknowledgement was lost):
    after ``prefill_grace_s`` the gateway aborts it. Without that abort it stays pinned in the inflight queue."""
    p, d = procs.pair("--fixes", "none")  # no inflight watchdog in the engine: only the gateway can free it
    await set_faults(http, d, ack_loss=True)  # decode takes the KV and finishes, prefill waits for the ack forever
    g = await gateway(gateways, [p], [d], prefill_grace_s=0.5, abort_legs=abort_legs,
                      reconcile=ReconcileConfig(enabled=False))
    status, body, rid = await post(http, g, CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    if abort_legs:
        await assert_clean(http, g.gw, [p, d], within=0.5 + 2)
        events = [(e["event"], e.get("info")) for e in (await trace(http, g, rid))["attempts"][0]["events"]]
        names = [n for n, _ in events]
        assert "prefill_orphaned" in names and ("abort_sent", "prefill") in events, events
        assert ("abort_acked", "prefill: ok") in events, events
    else:
        await asyncio.sleep(2.5)
        assert [r["queue"] for r in await engine_requests(http, p)] == ["inflight"]
        assert "prefill_orphaned" in {e["event"] for e in (await trace(http, g, rid))["attempts"][0]["events"]}


@pytest.mark.parametrize("abort_legs", [True, False])
@pytest.mark.parametrize("failing", ["prefill", "decode"])
async def test_failed_leg_aborts_the_other(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                          failing: str, abort_legs: bool) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], max_attempts=2, abort_legs=abort_legs)
    await set_faults(http, p if failing == "prefill" else d, http_500_rate=1)
    status, out, rid = await post(http, g, CHAT)
    assert status == 502 and out["error"]["code"] == "upstream_5xx", out
    other = d if failing == "prefill" else p
    if abort_legs:
        await assert_clean(http, g.gw, [p, d])
        t = await trace(http, g, rid)
        assert t["outcome"] == "failed" and len(t["attempts"]) == 2
        for a in t["attempts"]:
            acked = {e["info"] for e in a["events"] if e["event"] == "abort_acked"}
            assert acked == {"decode: ok", "prefill: ok"}
    else:  # without the aborts the healthy leg stays pinned on its engine (until it notices the disconnect)
        await asyncio.sleep(1.0)
        assert len(await engine_requests(http, other)) >= 1


@pytest.mark.parametrize("repeat", [(0.25, 1.0), ()])
async def test_abort_that_beats_the_leg_is_repeated(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                                    repeat: tuple[float, ...]) -> None:
    """The prefill fails at once; the decode's request reaches its scheduler 0.5 s later, after the first abort."""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], max_attempts=1, abort_repeat_s=repeat)
    await set_faults(http, p, http_500_rate=1)
    await set_faults(http, d, slow_accept=0.5)
    status, _, rid = await post(http, g, CHAT)
    assert status == 502
    await asyncio.sleep(1.5)  # the decode's request has reached its scheduler by now
    if repeat:
        await assert_clean(http, g.gw, [p, d], within=0.5)
        events = [e["event"] for e in (await trace(http, g, rid))["attempts"][0]["events"]]
        assert events.count("abort_repeat") == 2
    else:
        assert [r["rid"] for r in await engine_requests(http, d)] == [rid + ".1"], "the first abort came too early"


async def test_aborted_mid_stream_and_before_first_token(procs: Procs, http: aiohttp.ClientSession,
                                                         gateways: list[Any]) -> None:
    p, d = procs.sim("prefill"), procs.sim("decode", "--speed", "20")
    g = await gateway(gateways, [p], [d])
    body = {**CHAT, "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(g.url + "/v1/chat/completions", json=body)
        rid = resp.headers["x-request-id"]
        await resp.content.readuntil(b"\n\n")  # got a token
        resp.close()
    await assert_clean(http, g.gw, [p, d])
    t = await trace(http, g, rid)
    assert t["outcome"] == "aborted" and t["reason"] == "client disconnected" and t["ended_phase"] == "decode"
    await set_faults(http, p, slow_prefill=5)
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(g.url + "/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await assert_clean(http, g.gw, [p, d])
    finished = list(g.gw.traces.finished.values())[-1]
    assert finished.outcome is not None and finished.outcome.value == "aborted"
    assert finished.ended_phase is not None and finished.ended_phase.value == "prefill"


async def test_ttft_deadline_with_prefill_stuck(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    await set_faults(http, p, slow_prefill=30)
    t0 = time.monotonic()
    status, out, rid = await post(http, g, CHAT, {"x-pdgate-ttft-timeout": "1"})
    took = time.monotonic() - t0
    assert status == 504 and out["error"]["code"] == "deadline_exceeded"
    assert "ttft deadline of 1s exceeded in phase prefill+transfer" in out["error"]["message"]
    assert 0.9 <= took < 2.0
    await assert_clean(http, g.gw, [p, d])
    assert (await trace(http, g, rid))["outcome"] == "deadline_exceeded"


@pytest.mark.parametrize(("headers", "budget"), [({"x-pdgate-idle-timeout": "1"}, "idle"),
                                                 ({"x-pdgate-timeout": "1.5", "x-pdgate-idle-timeout": "30"}, "total")])
async def test_stream_deadline_with_decode_stalled(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                                   headers: dict[str, str], budget: str) -> None:
    """The seed's long-context stall: the client gets an error event within the budget + 1 s."""
    p, d = procs.sim("prefill"), procs.sim("decode", env=STALL)
    g = await gateway(gateways, [p], [d])
    t0 = time.monotonic()
    async with http.post(g.url + "/v1/chat/completions", json={**LONG_CHAT, "stream": True}, headers=headers) as r:
        assert r.status == 200
        raw = await r.read()
        rid = r.headers["x-request-id"]
    took = time.monotonic() - t0
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = orjson.loads(events[-2][6:])["error"]
    assert err["code"] == "deadline_exceeded" and f"{budget} deadline" in err["message"] and "phase decode" in err["message"]
    limit = 1.0 if budget == "idle" else 1.5
    assert took < limit + 1.0
    await assert_clean(http, g.gw, [p, d])
    assert (await trace(http, g, rid))["outcome"] == "deadline_exceeded"


async def test_retried_then_completed(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p_bad, p_ok, d = procs.sim("prefill"), procs.sim("prefill"), procs.sim("decode")
    g = await gateway(gateways, [p_bad, p_ok], [d], policy="round_robin")
    await set_faults(http, p_bad, http_500_rate=1)
    rids = []
    for _ in range(4):
        status, _, rid = await post(http, g, CHAT)
        assert status == 200
        rids.append(rid)
    traces = [await trace(http, g, r) for r in rids]
    retried = [t for t in traces if len(t["attempts"]) == 2]
    assert retried, "round robin must have sent some first attempts to the failing prefill"
    bad = worker_id(g.gw, p_bad)
    for t in retried:
        assert t["attempts"][0]["prefill"] == bad and t["attempts"][1]["prefill"] != bad
        assert t["attempts"][0]["bootstrap_room"] != t["attempts"][1]["bootstrap_room"]
    async with http.get(g.admin + "/metrics") as r:
        assert 'pdgate_retries_total{reason="500"}' in await r.text()
    await assert_clean(http, g.gw, [p_bad, p_ok, d])


async def test_decode_restart_mid_request(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = procs.sim("prefill"), procs.sim("decode", "--speed", "20")
    g = await gateway(gateways, [p], [d])
    dw = g.gw.pool.by_id[worker_id(g.gw, d)]
    old_identity = dw.identity
    task = asyncio.create_task(post(http, g, {**CHAT, "max_tokens": 40}))
    while not await engine_requests(http, d):
        await asyncio.sleep(0.02)
    d.proc.stop(signal.SIGKILL)
    d2 = procs.sim("decode", "--speed", "0", port=d.port)
    status, out, rid = await asyncio.wait_for(task, 20)
    assert status == 200, out
    t = await trace(http, g, rid)
    assert len(t["attempts"]) >= 2 and t["attempts"][0]["error"]
    for _ in range(40):
        if dw.identity != old_identity:
            break
        await asyncio.sleep(0.1)
    assert dw.identity != old_identity and dw.restarts >= 1
    await assert_clean(http, g.gw, [p, d2])


async def test_a_deadline_after_the_streams_done_adds_nothing(procs: Procs, http: aiohttp.ClientSession,
                                                             gateways: list[Any]) -> None:
    """The decode's [DONE] went out, its response's end comes late (fault done_stall) and the total budget runs
    out meanwhile: the client has its whole answer, one [DONE], and the request completed. (A deadline judged
    after the [DONE] used to append an error event and a second [DONE].)"""
    from tests.pdgate.sse import call

    p, d = procs.pair()
    await set_faults(http, d, done_stall=1.5)
    g = await gateway(gateways, [p], [d])
    seen = await call(http, g.url + "/v1/chat/completions", {**CHAT, "stream": True}, {"x-pdgate-timeout": "0.8"})
    assert seen.status == 200 and seen.done_count == 1 and not seen.error_events, seen.events[-3:]
    assert len(seen.tokens) == 8
    rec = g.gw.traces.get(seen.rid or "")
    assert rec is not None and rec.outcome is not None and rec.outcome.value == "completed", rec
