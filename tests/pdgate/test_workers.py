"""Worker failure handling through the real gateway: gray failures, dead workers, no pair."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from pdgate.core.config import BreakerConfig, HealthConfig
from tests.engine.simclient import engine_requests, set_faults
from tests.pdgate.harness import assert_clean, start_gateway, worker_id
from tests.pdgate.test_outcomes import CHAT, LONG_CHAT, STALL, gateway, post, trace
from tests.procs import Procs, free_port


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
    async with http.get(g.admin + "/v1/workers") as r:
        view = {w["id"]: w for w in (await r.json())["workers"]}
    results = await asyncio.gather(*(post(http, g, LONG_CHAT, {"x-pdgate-timeout": "3"}) for _ in range(4)))
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
    async with http.post(f"{g.admin}/v1/requests/{stuck_id}/abort") as r:
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


@pytest.mark.parametrize("breaker_on", [True, False])
async def test_breaker_stops_sending_to_a_failing_prefill(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                                          breaker_on: bool) -> None:
    """A prefill that answers 500 to everything but passes /health: after ``breaker.failures`` failures its
    breaker opens and it gets no more requests for the cooldown. Without the breaker (a threshold nobody
    reaches) every other request is first sent to it and must be retried."""
    bad, good, d = procs.sim("prefill"), procs.sim("prefill"), procs.sim("decode")
    await set_faults(http, bad, http_500_rate=1.0)
    g = await gateway(gateways, [bad, good], [d], policy="round_robin",
                      breaker=BreakerConfig(failures=2 if breaker_on else 10_000, cooldown_s=60))
    rids = []
    for _ in range(20):
        status, _, rid = await post(http, g, CHAT)
        assert status == 200  # the retry on the other prefill hides the failure from the client
        rids.append(rid)
    on_bad = 0
    for rid in rids:
        on_bad += sum(a["prefill"] == worker_id(g.gw, bad) for a in (await trace(http, g, rid))["attempts"])
    async with http.get(g.admin + "/v1/workers") as r:
        states = {w["id"]: w["breaker"] for w in (await r.json())["workers"]}
    if breaker_on:
        assert on_bad == 2, on_bad
        assert states[worker_id(g.gw, bad)] == "open" and states[worker_id(g.gw, good)] == "closed"
    else:
        assert on_bad >= 9, on_bad  # round robin keeps choosing it
        assert states[worker_id(g.gw, bad)] == "closed"
    await assert_clean(http, g.gw, [bad, good, d])


class PlainSGLang:
    """A stand-in for a real SGLang worker started by engine/sglang: SGLang's own /server_info (no pdgate
    fields), and identity and fixes at /pdgate/v1/info (or, with ``ext=False``, a 404 there)."""

    def __init__(self, ext: bool) -> None:
        self.ext = ext
        self.identity = "100-1"
        self.info_calls = 0
        self.port = free_port()
        self.bootstrap_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self) -> aiohttp.web.AppRunner:
        web = aiohttp.web

        async def info(_: web.Request) -> web.Response:
            self.info_calls += 1
            if not self.ext:
                return web.json_response({"detail": "Not Found"}, status=404)
            return web.json_response({"pdgate_identity": self.identity, "pdgate_fixes": ["A", "B", "C"]})

        def static(body: Any) -> Any:
            async def handler(_: web.Request) -> web.Response:
                return web.json_response(body)
            return handler

        app = web.Application()
        app.router.add_get("/health", static({}))
        app.router.add_get("/server_info", static({"model_path": "sim-model"}))
        app.router.add_get("/v1/loads", static({"loads": []}))
        app.router.add_get("/pdgate/v1/info", info)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


@pytest.mark.parametrize("ext", [True, False])
async def test_sglang_worker_identity_from_the_extension(gateways: list[Any], ext: bool) -> None:
    """A quick restart (never seen down) is caught by the identity of /pdgate/v1/info; a worker without
    it is asked once per up period, and only down->up can reveal its restarts."""
    p, d = PlainSGLang(ext), PlainSGLang(ext)
    runners = [await p.start(), await d.start()]
    try:
        g = await gateway(gateways, [p], [d],  # type: ignore[list-item]
                          health=HealthConfig(interval_s=0.1, timeout_s=0.5, failures=2, degraded_after_s=30))
        await asyncio.sleep(0.5)
        w = g.gw.pool.by_id[worker_id(g.gw, d)]  # type: ignore[arg-type]
        assert w.info.fixes == (["A", "B", "C"] if ext else None)
        assert w.identity == ("100-1" if ext else None)
        d.identity = "200-2"  # restarted between two checks
        await asyncio.sleep(0.5)
        assert w.restarts == (1 if ext else 0) and w.healthy
        if not ext:
            assert d.info_calls == 1, "a worker without the extension is not asked on every check"
    finally:
        for r in runners:
            await r.cleanup()


@pytest.mark.parametrize("counted", [False, True])
async def test_health_checks_a_busy_gateway_answers_late_do_not_take_workers_down(
        procs: Procs, http: aiohttp.ClientSession, gateways: list[Any], monkeypatch: pytest.MonkeyPatch,
        counted: bool) -> None:
    """A saturated gateway reads every answer late and its timers fire before the reads: the health checks of
    healthy workers time out. Such a check is not counted (``health.late_not_lost``); with that switched off
    (``counted``) the same stalls take both workers down and the stream on them is failed."""
    from pdgate.adapters.upstream import Upstream
    from pdgate.pool import health
    from pdgate.pool.workers import State, Worker

    p, d = procs.sim("prefill"), procs.sim("decode", "--speed", "15")  # 100 tokens: several seconds of stream
    g = await gateway(gateways, [p], [d], max_attempts=1,
                      health=HealthConfig(interval_s=0.2, timeout_s=0.3, failures=2, degraded_after_s=30))
    if counted:
        monkeypatch.setattr(health, "late_not_lost", lambda *_: False)
    stalls = [0]
    real_get = Upstream.get

    async def stalled(self: Upstream, url: str, timeout_s: float) -> tuple[int, bytes]:
        if url.endswith("/health") and stalls[0] > 0:  # the loop stops right after the check is sent
            stalls[0] -= 1
            asyncio.get_running_loop().call_soon(time.sleep, timeout_s * 2)
        return await real_get(self, url, timeout_s)

    monkeypatch.setattr(Upstream, "get", stalled)
    downs: list[str] = []
    real_transition = Worker.transition

    def seen(self: Worker, state: State, now: float, why: str) -> None:
        if state is State.DOWN:
            downs.append(self.id)
        real_transition(self, state, now, why)

    monkeypatch.setattr(Worker, "transition", seen)
    body = {**CHAT, "max_tokens": 100, "stream": True}
    async with http.post(g.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        stalls[0] = 4  # two checks of each worker (health.failures) stall the loop past their timeout
        text = (first + await r.content.read()).decode()
    assert stalls[0] == 0, "the stalls happened while the stream ran"
    if counted:
        assert downs, "without the mechanism the stalls count as failed checks: healthy workers taken down"
    else:
        assert not downs, f"workers taken down by a late loop: {downs}"
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text


async def test_checks_that_always_end_late_still_take_a_hung_worker_down(
        procs: Procs, http: aiohttp.ClientSession, gateways: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgiving late checks has a bound (health.UNCOUNTED_FACTOR x failures in a row): a worker that never answers
    on a loop that is always late goes down all the same, a little later."""
    from pdgate.adapters.upstream import LoopLate, Upstream
    from pdgate.pool import health

    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], health=HealthConfig(interval_s=0.1, timeout_s=0.3, failures=2,
                                                               degraded_after_s=30))
    real_get = Upstream.get

    async def late(self: Upstream, url: str, timeout_s: float) -> tuple[int, bytes]:
        if url.startswith(d.url) and url.endswith("/health"):
            raise LoopLate("no answer within 0.3s, but this gateway's loop ran 0.50s behind")
        return await real_get(self, url, timeout_s)

    monkeypatch.setattr(Upstream, "get", late)
    w = g.gw.pool.by_id[worker_id(g.gw, d)]
    checks = (health.UNCOUNTED_FACTOR + 1) * 2
    for _ in range(int(checks * 0.1 / 0.05) + 40):
        if w.state.value == "down":
            break
        await asyncio.sleep(0.05)
    assert w.state.value == "down", w.view(g.gw.now())
    assert w.checks.uncounted == health.UNCOUNTED_FACTOR * 2


@pytest.mark.parametrize("counted", [False, True])
async def test_a_slow_health_answer_from_a_worker_streaming_our_tokens_is_not_counted(
        procs: Procs, http: aiohttp.ClientSession, gateways: list[Any], monkeypatch: pytest.MonkeyPatch,
        counted: bool) -> None:
    """The other half of health.late_not_lost: the loop is on time, but the decode's /health does not answer
    within its timeout while the decode keeps sending our tokens (an SGLang under load answers /health late).
    Not counted; with the mechanism switched off (``counted``) the streaming decode is taken down."""
    from pdgate.adapters.upstream import Upstream
    from pdgate.pool import health
    from pdgate.pool.workers import State, Worker

    p, d = procs.sim("prefill"), procs.sim("decode", "--speed", "15")
    g = await gateway(gateways, [p], [d], max_attempts=1,
                      health=HealthConfig(interval_s=0.2, timeout_s=0.3, failures=2, degraded_after_s=30))
    if counted:
        monkeypatch.setattr(health, "late_not_lost", lambda *_: False)
    slow = [0]
    real_get = Upstream.get

    async def slow_health(self: Upstream, url: str, timeout_s: float) -> tuple[int, bytes]:
        if url.startswith(d.url) and url.endswith("/health") and slow[0] > 0:
            slow[0] -= 1
            await asyncio.sleep(timeout_s)  # the answer does not come in time; the loop is not late
            raise TimeoutError
        return await real_get(self, url, timeout_s)

    monkeypatch.setattr(Upstream, "get", slow_health)
    downs: list[str] = []
    real_transition = Worker.transition

    def seen(self: Worker, state: State, now: float, why: str) -> None:
        if state is State.DOWN:
            downs.append(self.id)
        real_transition(self, state, now, why)

    monkeypatch.setattr(Worker, "transition", seen)
    async with http.post(g.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True}) as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        slow[0] = 2  # health.failures of them: enough to take it down if counted
        text = (first + await r.content.read()).decode()
    assert slow[0] == 0, "the slow answers happened while the stream ran"
    if counted:
        assert worker_id(g.gw, d) in downs, "without the mechanism the streaming decode is taken down"
    else:
        assert not downs, downs
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text


@pytest.mark.parametrize(("protocol", "counted"), [("sglang", False), ("vllm", False), ("vllm", True)])
async def test_an_engine_slow_to_give_its_counts_stays_up_and_serves(
        procs: Procs, http: aiohttp.ClientSession, gateways: list[Any], monkeypatch: pytest.MonkeyPatch,
        protocol: str, counted: bool) -> None:
    """What a check reads only to inform (identity, queue counts) does not decide whether an engine is up: real
    vLLM's ``/metrics`` took 8 and 22 s on a loaded 2-core box while its ``/health`` answered within 3 s, and read
    as a failed check that took a serving decode down in CI (its request failed over, then waited for a decode).
    A decode whose ``/metrics`` (SGLang: ``/v1/loads``) answers 3 s late to checks that wait 1 s comes up, serves
    every request and stays up, its row saying what went unanswered. With the mechanism off (``counted``:
    an unanswered count fails the check, as before) the same decode is never up and the requests fail."""
    from pdgate.adapters import base, sglang, vllm
    from tests.pdgate.test_vllm import vllm_config

    extra = ("--protocol", "vllm") if protocol == "vllm" else ()
    p, d = procs.sim("prefill", *extra), procs.sim("decode", *extra, "--fault", "slow_metrics=3")
    health = HealthConfig(interval_s=0.2, timeout_s=1.0, failures=3, degraded_after_s=30)
    if counted:
        kind: Any = vllm.VLLM if protocol == "vllm" else sglang.SGLang
        real = kind.probe

        async def strict(self: Any, url: str, role: str, timeout_s: float) -> base.Probe:
            got = await real(self, url, role, timeout_s)
            return base.Probe(False, got.partial, timed_out=True) if got.partial else got

        monkeypatch.setattr(kind, "probe", strict)
    if protocol == "vllm":
        g = await start_gateway(vllm_config([p], [d], health=health))
        gateways.append(g)
    else:
        g = await gateway(gateways, [p], [d], health=health)
    wid = worker_id(g.gw, d)
    states: list[str] = []
    errors: set[str] = set()
    end = time.monotonic() + 6.0
    while time.monotonic() < end and not (states and states[-1] == "up"):
        async with http.get(g.admin + "/v1/workers") as r:
            states += [w["state"] for w in (await r.json())["workers"] if w["id"] == wid]
        await asyncio.sleep(0.1)
    served: list[int] = []
    end = time.monotonic() + 4.0  # three checks or more, each met by a count 2 s too late
    while time.monotonic() < end:
        async with http.post(g.url + "/v1/chat/completions", headers={"x-pdgate-ttft-timeout": "2"}, json={
                "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": True}) as r:
            body = await r.read()
        served.append(r.status if b"data: [DONE]" in body and b'"error"' not in body else -r.status)
        async with http.get(g.admin + "/v1/workers") as r:
            row = next(w for w in (await r.json())["workers"] if w["id"] == wid)
        states.append(row["state"])
        errors.add(row["last_error"] or "")
    if counted:
        assert "up" not in states and not any(s == 200 for s in served), (states, served)
        return
    assert states[-1] == "up" and "down" not in states[states.index("up"):], states
    assert len(served) >= 5 and all(s == 200 for s in served), served
    path = "/metrics" if protocol == "vllm" else "/v1/loads"
    assert f"TimeoutError: {path}: no answer within 1s (up: its counts read unknown)" in errors, errors
