"""Admission control (issue 15): capacity per worker, the gateway's queue (priority, fair share, deadline),
deadline-aware shedding, queued deadlines, the engines' own signals. Real sims, the real gateway on loopback.

The prefill sim runs at ``--speed 50``: its forwards are serialised at about 0.2 s each, so a pair serves
about 5 requests/s however many it is sent (what an engine's queue does to everyone's TTFT)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from typing import Any

import aiohttp
import pytest

from pdgate.core.config import AdmissionConfig, HealthConfig, KeyConfig, hash_key
from pdgate.core.queueing import RANKS, Entry, FairQueue, Rates
from tests.pdgate.harness import Running, make_config, start_gateway
from tests.procs import Procs, Sim

HIGH, NORM, A, B = "pdg-sk-high-key", "pdg-sk-normal-key", "pdg-sk-tenant-a", "pdg-sk-tenant-b"
KEYS = (KeyConfig("hi", hash_key(HIGH), priority="high"), KeyConfig("norm", hash_key(NORM)),
        KeyConfig("a", hash_key(A)), KeyConfig("b", hash_key(B)))


def chat(max_tokens: int = 2, text: str = "say hi") -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


async def gateway(gateways: list[Any], p: Sim, d: Sim, **admission: Any) -> Running:
    g = await start_gateway(make_config([p], [d], keys=KEYS, admission=AdmissionConfig(**admission)))
    gateways.append(g)
    return g


async def post(http: aiohttp.ClientSession, g: Running, key: str, body: dict[str, Any],
               **headers: str) -> tuple[int, dict[str, Any], float, Any]:
    t0 = time.monotonic()
    hdrs = {"Authorization": f"Bearer {key}", **{k.replace("_", "-"): v for k, v in headers.items()}}
    async with http.post(g.url + "/v1/chat/completions", json=body, headers=hdrs) as r:
        out = await r.json()
        return r.status, out, time.monotonic() - t0, r.headers  # case-insensitive


def sims(procs: Procs, *prefill: str) -> tuple[Sim, Sim]:
    return procs.sim("prefill", "--speed", "50", *prefill), procs.sim("decode", "--speed", "1")


# ---- the queue's order, without a loop ------------------------------------------------------------------
def test_priority_then_deadline_then_fair_share() -> None:
    q = FairQueue()
    for rank, tenant, deadline in ((2, "x", 1.0), (1, "x", 9.0), (1, "x", 5.0), (0, "y", 50.0), (-1, "z", 99.0)):
        q.push(Entry(rank, tenant, deadline))
    assert [(e.rank, e.deadline) for e in iter(q.pop, None)] == [(-1, 99.0), (0, 50.0), (1, 5.0), (1, 9.0), (2, 1.0)]
    for i in range(6):
        q.push(Entry(1, "burst", float(i)))
    for i in range(2):
        q.push(Entry(1, "light", 100.0 + i, weight=1.0))
    order = [e.tenant for e in iter(q.pop, None)]
    assert order[:4] == ["burst", "light", "burst", "light"], order  # a later deadline, yet served in turn
    # weight 2 gets two turns for one; a tenant that was idle banks no credit
    for i in range(4):
        q.push(Entry(1, "heavy", float(i), weight=2.0))
        q.push(Entry(1, "plain", float(i)))
    assert [e.tenant for e in iter(q.pop, None)][:6].count("heavy") == 4
    for i in range(3):
        q.push(Entry(1, "plain", float(i)))
    q.push(Entry(1, "heavy", 0.5, weight=2.0))
    assert q.pop().tenant == "heavy" or q.pop().tenant == "heavy"


def test_a_request_parked_in_another_class_banks_no_credit() -> None:
    """A tenant keeping one low request waiting while others are served must not then jump a whole burst of
    normal ones ahead of them (fair-queuing state is per class)."""
    q = FairQueue()
    q.push(Entry(RANKS["low"], "lurker", 0.0))
    for i in range(50):
        q.push(Entry(1, "a", float(i)))
        q.push(Entry(1, "b", float(i)))
    for _ in range(100):
        assert q.pop().tenant in ("a", "b")  # type: ignore[union-attr]
    for i in range(12):
        q.push(Entry(1, "lurker", 100.0 + i))
        q.push(Entry(1, "a", 100.0 + i))
    first = [q.pop().tenant for _ in range(6)]  # type: ignore[union-attr]
    assert 2 <= first.count("lurker") <= 4, first


def test_the_wait_estimate_follows_fair_queuings_order() -> None:
    """``ahead_of`` against the order ``pop`` really takes, on random queues: never below it (a tie counts as
    ahead), and for a newcomer among tenants already served, zero (it goes first)."""
    rng = random.Random(7)
    for _ in range(300):
        q = FairQueue()
        for _ in range(rng.randint(0, 30)):
            q.push(Entry(rng.choice((0, 1, 2)), rng.choice("abcd"), rng.random() * 10, weight=rng.choice((1.0, 2.0))))
        for _ in range(rng.randint(0, 5)):
            q.pop()
        rank, tenant, deadline = rng.choice((0, 1, 2)), rng.choice("abcde"), rng.random() * 10
        weight = next((t.weight for (r, n), t in q._tenants.items() if n == tenant and r == rank), 1.0)
        estimate = q.ahead_of(rank, tenant, deadline, weight)
        mark = Entry(rank, tenant, deadline, weight)
        q.push(mark)
        actual = 0
        while q.pop() is not mark:
            actual += 1
        others = len({n for (r, n) in q._tenants if r == rank})
        assert actual <= estimate <= actual + others + 1, (estimate, actual)
    q = FairQueue()
    for name in "abcdefghij":
        q.push(Entry(1, name, 0.0))
        q.push(Entry(1, name, 1.0))
    for _ in range(10):
        q.pop()  # every tenant served once: their virtual times moved on
    assert q.ahead_of(1, "new", 5.0) == 0
    q.push(Entry(1, "new", 5.0))
    assert q.pop().tenant == "new"  # type: ignore[union-attr]


def test_a_cold_start_has_an_estimate_from_its_first_answers() -> None:
    """Before a drain rate is measured (5 slots freed while requests wait): the prefills' limits over the time to a
    first token (Little's law), taken as the latest answer's where that is longer than the average (at a cold start
    the engine's queue grows answer by answer). Before it, nothing was shed until the rate was measured, and those
    queued meanwhile were answered late or sent to miss their budget (a 10 s cold start at 3x: shed answers up to
    0.9 s after queueing, some 504s; BENCHMARKS.md run W)."""
    r = Rates(window_s=10)
    assert r.little(4) is None and r.expected_ttft() is None, "nothing answered yet: no estimate"
    for s in (0.2, 0.4, 0.6, 0.8):  # four sent at once to an engine serving one at a time in 0.2 s
        r.first_token(s)
    assert r.expected_ttft() == pytest.approx(0.8) and r.little(4) == pytest.approx(5.0)
    assert r.drain_rate(1.0) is None  # the gate drains at little(4): 9 ahead and 0.8 s are 2.8 s, past a 1.5 s budget


def test_estimates_and_shares() -> None:
    r = Rates(window_s=10)
    assert r.drain_rate(0.0) is None and r.little(4) is None, "nothing measured yet: no estimate, no shedding"
    r.waiting(0.0, True)
    for i in range(10):
        r.free(i * 0.2)
    r.first_token(0.3)
    assert r.drain_rate(2.0) == pytest.approx(5.0) and r.ttft == pytest.approx(0.3)
    # slots freed while nobody waits (the queue empty) say how fast requests came, not how fast they are served
    r.waiting(2.0, False)
    for i in range(10):
        r.free(3.0 + i * 2.0)
    assert r.drain_rate(21.0) == pytest.approx(5.0)
    assert r.drain_rate(40.0) is None, "an estimate not renewed within the window is not used"
    q = FairQueue()
    for i in range(8):
        q.push(Entry(1, "a", float(i)))
    assert q.over_share("a", 1.0) is False, "alone in the queue: the gateway is saturated, not the tenant"
    q.push(Entry(1, "b", 0.0))
    assert q.over_share("a", 1.0) and not q.over_share("b", 1.0)
    assert q.ahead_of(1, "b", 100.0) == 1 + 2, "b waits for its own one and two of a's turns, not all eight"
    assert q.ahead_of(RANKS["high"], "c", 100.0) == 0


def test_a_workers_limit_follows_its_engine() -> None:
    from pdgate.core.config import BreakerConfig, WorkerSpec
    from pdgate.pool.workers import CircuitBreaker, Worker

    w = Worker("d0", WorkerSpec("http://127.0.0.1:1", "decode"), CircuitBreaker(BreakerConfig()), None)  # type: ignore[arg-type]
    assert w.limit(0.0) is None and w.has_room(0.0), "no capacity known: no cap"
    w.slots.reported = 8
    assert w.limit(0.0) == 8
    w.slots.configured = 4
    assert w.limit(0.0) == 4, "the config's capacity wins"
    w.slots.foreign = 3  # the engine holds three requests that are not ours
    assert w.limit(0.0) == 1
    w.slots.foreign, w.slots.cut_until = 0, 5.0  # it said 503 at 0: no more than it holds (at least one) until 5
    w.slots.reserved = 2
    assert w.limit(1.0) == 2 and not w.has_room(1.0) and w.limit(5.0) == 4


# ---- real sims -----------------------------------------------------------------------------------------
async def test_queue_order_is_priority_then_deadline(procs: Procs, http: aiohttp.ClientSession,
                                                     gateways: list[Any]) -> None:
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1)
    blocker = asyncio.create_task(post(http, g, NORM, chat(300)))  # holds the pair ~1.4 s
    await asyncio.sleep(0.4)
    sent = []
    for key, prio, ttft in ((NORM, "low", "20"), (NORM, "normal", "10"), (NORM, "normal", "5"), (HIGH, "high", "20")):
        sent.append(asyncio.create_task(post(http, g, key, chat(), x_pdgate_priority=prio, x_pdgate_ttft_timeout=ttft)))
        await asyncio.sleep(0.05)
    assert g.gw.gate.queue.n == 4, "all four wait: the pair is full"
    results = await asyncio.gather(blocker, *sent)
    assert [r[0] for r in results] == [200] * 5
    recs = {r[3]["x-request-id"]: g.gw.traces.get(r[3]["x-request-id"]) for r in results[1:]}
    order = sorted(recs, key=lambda i: recs[i].dispatched_at)  # type: ignore[union-attr]
    names = {results[i + 1][3]["x-request-id"]: n for i, n in enumerate(("low", "normal-10", "normal-5", "high"))}
    assert [names[i] for i in order] == ["high", "normal-5", "normal-10", "low"]
    for rec in recs.values():
        assert rec is not None and rec.history[0][1] == "queued" and rec.history[1][0] - rec.created > 0.3


@pytest.mark.parametrize("enabled", [True, False])
async def test_a_burst_does_not_delay_another_tenant_beyond_its_share(procs: Procs, http: aiohttp.ClientSession,
                                                                      gateways: list[Any], enabled: bool) -> None:
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1, enabled=enabled)
    burst = [asyncio.create_task(post(http, g, A, chat(1, f"a{i}"))) for i in range(10)]
    await asyncio.sleep(0.1)
    light = [asyncio.create_task(post(http, g, B, chat(1, f"b{i}"))) for i in range(3)]
    done = await asyncio.gather(*burst, *light)
    assert all(r[0] == 200 for r in done)
    firsts = sorted((g.gw.traces.get(r[3]["x-request-id"]).first_token_at, who)  # type: ignore[union-attr]
                    for r, who in zip(done, ["a"] * 10 + ["b"] * 3, strict=True))
    b_places = [i + 1 for i, (_, who) in enumerate(firsts) if who == "b"]
    if enabled:
        assert max(b_places) <= 8, f"b is served in turn with the burst: places {b_places} of 13"
    else:  # the mechanism off: the engine's own queue is first come, first served
        assert min(b_places) >= 10, f"without admission b waits behind the whole burst: places {b_places}"


async def engine_waiting(http: aiohttp.ClientSession, sim: Sim) -> int:
    async with http.get(sim.url + "/pdgate/v1/requests") as r:
        held = (await r.json())["requests"]
    return len(held)


@pytest.mark.parametrize("enabled", [True, False])
async def test_overload_is_shed_at_once_instead_of_timing_out_late(procs: Procs, http: aiohttp.ClientSession,
                                                                   gateways: list[Any], enabled: bool) -> None:
    """15 requests/s offered to a pair that serves 5, every one with a 1 s TTFT budget. With admission:
    every answer within its budget, the ones that cannot make it answered at once (503 deadline_unmeetable),
    the engine holding one at a time. Off: the engine's queue grows and requests wait out their budget."""
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1, enabled=enabled)
    # warm-up: a short burst, so the queue's drain rate is measured
    warm = await asyncio.gather(*(post(http, g, NORM, chat(1)) for _ in range(8)))
    assert all(r[0] == 200 for r in warm)
    results: list[tuple[int, dict[str, Any], float, Any]] = []
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, await engine_waiting(http, p))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())

    async def one() -> None:
        results.append(await post(http, g, NORM, chat(1), x_pdgate_ttft_timeout="1"))

    tasks = []
    for _ in range(36):  # 2.4 s at 15/s
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(1 / 15)
    await asyncio.gather(*tasks)
    sampler.cancel()
    codes = [r[1].get("error", {}).get("code") if r[0] != 200 else "ok" for r in results]
    late = [r for r in results if r[2] > 1.15]
    if not enabled:
        assert codes.count("deadline_exceeded") >= 12 and peak >= 4, (codes, peak)
        assert all(r[2] >= 0.95 for r in results if r[0] == 504), "each one waited out its whole budget"
        return
    assert late == [], f"every answer within its budget: {[(r[0], round(r[2], 3)) for r in late]}"
    shed = [r for r in results if r[0] == 503 and r[1]["error"]["code"] == "deadline_unmeetable"]
    assert len(shed) >= 10 and codes.count("ok") >= 8, codes
    waits = sorted(r[2] for r in shed)
    assert waits[len(waits) // 2] < 0.05, f"shed answers come at once: median {waits[len(waits) // 2]:.3f}s"
    assert all(int(r[3]["Retry-After"]) >= 1 for r in shed)
    assert peak <= 1, f"the engine never holds more than its capacity: {peak}"
    async with http.get(g.admin + "/metrics") as r:
        text = await r.text()
    assert f'pdgate_shed_total{{reason="deadline_unmeetable",tenant="norm"}} {len(shed)}.0' in text


async def test_a_queued_request_ends_at_its_deadline_without_touching_an_engine(
        procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1, shed=False)
    blocker = asyncio.create_task(post(http, g, NORM, chat(300)))
    await asyncio.sleep(0.4)
    status, body, took, headers = await post(http, g, NORM, chat(), x_pdgate_ttft_timeout="0.5")
    assert status == 504 and body["error"]["code"] == "deadline_exceeded" and "phase queued" in body["error"]["message"]
    assert 0.45 <= took <= 0.65, took
    rec = g.gw.traces.get(headers["x-request-id"])
    assert rec is not None and rec.attempts == [] and [h[1] for h in rec.history] == ["queued", "deadline_exceeded"]
    assert g.gw.gate.queue.n == 0, "it left the queue"
    assert (await blocker)[0] == 200


async def test_queue_full_and_tenant_share(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1, max_queue=4, shed=False)
    blocker = asyncio.create_task(post(http, g, A, chat(300)))
    await asyncio.sleep(0.4)
    a_waiting = [asyncio.create_task(post(http, g, A, chat())) for _ in range(3)]
    await asyncio.sleep(0.1)
    b_one = asyncio.create_task(post(http, g, B, chat()))
    await asyncio.sleep(0.1)
    status, body, took, headers = await post(http, g, A, chat())
    assert status == 429 and body["error"]["code"] == "queue_full" and "more than its share" in body["error"]["message"]
    assert took < 0.1 and int(headers["Retry-After"]) >= 1
    assert [r[0] for r in await asyncio.gather(blocker, b_one, *a_waiting)] == [200] * 5


async def test_an_engine_that_says_it_is_full_gets_no_more_than_it_holds(procs: Procs, http: aiohttp.ClientSession,
                                                                           gateways: list[Any]) -> None:
    p = procs.sim("prefill")
    d = procs.sim("decode", "--max-running-requests", "64", "--fault", "queue_full_rate=1")
    g = await gateway(gateways, p, d, engine_backoff_s=1.0, learn=False)  # the engine's own figure
    w = g.gw.pool.by_id["d0"]
    assert w.slots.capacity == 64, "read from the engine's /server_info"
    status, _, _, _ = await post(http, g, NORM, chat())
    assert status == 502
    assert w.limit(g.gw.now()) == 1, "after its 503: no more than it holds (at least one)"
    async with http.post(d.url + "/pdgate/v1/faults", json={"queue_full_rate": 0}) as r:
        assert r.status == 200
    results = await asyncio.gather(*(post(http, g, NORM, chat()) for _ in range(3)))
    assert [r[0] for r in results] == [200] * 3 and g.gw.metrics.queued >= 2, "one at a time while it recovers"
    await asyncio.sleep(1.1)
    assert w.limit(g.gw.now()) == 64


async def test_drain_answers_queued_requests(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1)
    blocker = asyncio.create_task(post(http, g, NORM, chat(300)))
    await asyncio.sleep(0.4)
    queued = asyncio.create_task(post(http, g, NORM, chat()))
    await asyncio.sleep(0.1)
    assert g.gw.gate.queue.n == 1
    g.gw.drain("test")
    status, body, _, _ = await queued
    assert status == 503 and body["error"]["code"] == "gateway_draining" and "phase queued" in body["error"]["message"]
    await blocker


async def test_waiters_are_answered_when_no_pair_is_left(procs: Procs, http: aiohttp.ClientSession,
                                                         gateways: list[Any]) -> None:
    """The only decode dies while requests wait: they get their 503 as soon as it is found down, not a 504
    after their whole budget."""
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1)
    blocker = asyncio.create_task(post(http, g, NORM, chat(300)))
    await asyncio.sleep(0.4)
    waiting = [asyncio.create_task(post(http, g, NORM, chat(), x_pdgate_ttft_timeout="8")) for _ in range(3)]
    await asyncio.sleep(0.2)
    assert g.gw.gate.queue.n == 3
    d.proc.stop(signal.SIGKILL)
    results = await asyncio.gather(*waiting)
    codes = [(r[0], r[1]["error"]["code"]) for r in results]
    # the one the blocker's freed slot went to fails its attempts (502); the rest are told no pair is left
    assert (503, "no_healthy_pair") in codes and all(c[0] in (502, 503) for c in codes), codes
    assert max(r[2] for r in results) < 4.0, "answered when the worker was found down, not at the deadline"
    await blocker
    assert g.gw.gate.queue.n == 0 and all(w.slots.reserved == 0 for w in g.gw.pool.by_id.values())


async def test_the_queue_moves_when_an_engines_backoff_ends(procs: Procs, http: aiohttp.ClientSession,
                                                            gateways: list[Any]) -> None:
    p = procs.sim("prefill")
    d = procs.sim("decode", "--max-running-requests", "4")
    g = await start_gateway(make_config([p], [d], keys=KEYS, admission=AdmissionConfig(),
                                        health=HealthConfig(interval_s=5, timeout_s=1, failures=2)))
    gateways.append(g)
    long = asyncio.create_task(post(http, g, NORM, chat(600)))  # ~2.6 s on d0
    await asyncio.sleep(0.3)
    w = g.gw.pool.by_id["d0"]
    g.gw.gate.cut(w, g.gw.now() + 0.5)  # as after its 503: no more than the one it holds, for 0.5 s
    t0 = time.monotonic()
    status, _, took, headers = await post(http, g, NORM, chat())
    rec = g.gw.traces.get(headers["x-request-id"])
    assert status == 200 and rec is not None and rec.history[1][0] - rec.created >= 0.3, "it waited for the cut"
    assert time.monotonic() - t0 < 1.2, f"dispatched when the back-off ended, not at a health check: {took:.2f}s"
    assert (await long)[0] == 200


async def test_a_retry_takes_its_own_slot_before_the_queue(procs: Procs, http: aiohttp.ClientSession,
                                                           gateways: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from pdgate.core.errors import UpstreamStatus
    from pdgate.path import legs

    real = legs.Legs.fly
    failed: list[str] = []

    async def first_fails(self: Any, ctx: Any, lease: Any) -> bytes:
        if not failed and ctx.rec.model == "sim-model" and b"retry me" in ctx.request.body:
            failed.append(lease.att.rid)
            await asyncio.sleep(0.3)
            raise UpstreamStatus("injected", role="decode", worker=lease.pair[1].id, upstream_status=500)
        return await real(self, ctx, lease)

    monkeypatch.setattr(legs.Legs, "fly", first_fails)
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1)
    r = asyncio.create_task(post(http, g, NORM, chat(2, "retry me")))
    await asyncio.sleep(0.1)
    q = asyncio.create_task(post(http, g, NORM, chat()))
    (rs, _, _, rh), (qs, _, _, qh) = await asyncio.gather(r, q)
    assert failed and rs == 200 and qs == 200
    r_rec, q_rec = g.gw.traces.get(rh["x-request-id"]), g.gw.traces.get(qh["x-request-id"])
    assert r_rec is not None and q_rec is not None and len(r_rec.attempts) == 2
    assert r_rec.first_token_at < q_rec.first_token_at, "the retry went first, the queued request after it"  # type: ignore[operator]


async def test_a_granted_pair_whose_worker_went_down_is_not_used(procs: Procs, http: aiohttp.ClientSession,
                                                                 gateways: list[Any],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from pdgate.path.gate import Gate
    from pdgate.pool.workers import State

    p, d = sims(procs)
    d2 = procs.sim("decode", "--speed", "1")
    g = await start_gateway(make_config([p], [d, d2], keys=KEYS, admission=AdmissionConfig(capacity=1)))
    gateways.append(g)
    real = Gate._pump
    downed: list[str] = []

    def pump_then_down(self: Gate) -> None:
        granted = [e for e in list(self.queue._tenants.values()) for _, e in e.heap if not e.gone]
        real(self)
        for e in granted:
            fut = e.item[0]
            if e.gone and fut.done() and not fut.cancelled() and fut.exception() is None and not downed:
                w = fut.result()[1]
                downed.append(w.id)
                w.transition(State.DOWN, self.clock(), "test: down between its grant and its bind")

    monkeypatch.setattr(Gate, "_pump", pump_then_down)
    blockers = [asyncio.create_task(post(http, g, NORM, chat(200))) for _ in range(2)]
    await asyncio.sleep(0.5)
    status, _, _, headers = await post(http, g, NORM, chat(), x_pdgate_ttft_timeout="10")
    rec = g.gw.traces.get(headers["x-request-id"])
    assert downed and rec is not None and status == 200
    assert all(a.decode != downed[0] for a in rec.attempts), (downed, [a.decode for a in rec.attempts])
    for b in blockers:
        await b


async def prefill_forwards(http: aiohttp.ClientSession, sim: Sim) -> float:
    from loadtest.overload import prefill_forwards as read

    return await read(http, sim.url)


@pytest.mark.parametrize("check", [True, False])
async def test_a_queued_request_whose_turn_comes_too_late_is_answered_not_sent(
        procs: Procs, http: aiohttp.ClientSession, gateways: list[Any], monkeypatch: pytest.MonkeyPatch,
        check: bool) -> None:
    """Its turn comes with less of its TTFT budget left than a dispatched request takes to its first token: a 503
    before its budget ends, and the engine computes nothing for it. With the check off (``Gate.too_late``), it is
    sent, ends 504 at its budget, and the prefill's work for it is wasted."""
    from pdgate.path.gate import Gate

    # the early shed's cold-start estimate (``Rates.little``, from the one slot over the TTFT) would answer it at
    # once, before its turn: off here, so the check at its turn is what answers it
    monkeypatch.setattr(Rates, "little", lambda self, running: None)
    if not check:
        monkeypatch.setattr(Gate, "too_late", lambda self, e: None)
    p, d = sims(procs)
    g = await gateway(gateways, p, d, capacity=1)
    for _ in range(3):  # what a dispatched request takes to its first token, measured
        assert (await post(http, g, NORM, chat()))[0] == 200
    ttft = g.gw.gate.rates.ttft
    assert ttft is not None and 0.15 < ttft < 0.6, ttft
    before = await prefill_forwards(http, p)
    blocker = asyncio.create_task(post(http, g, NORM, chat()))
    await asyncio.sleep(0.05)
    budget = ttft + 0.1  # its turn comes after the blocker's prefill (~ttft): too little is left by then
    status, body, took, _ = await post(http, g, NORM, chat(), x_pdgate_ttft_timeout=f"{budget:.3f}")
    assert (await blocker)[0] == 200
    await asyncio.sleep(0.3)
    computed = await prefill_forwards(http, p) - before
    if check:
        assert status == 503 and body["error"]["code"] == "deadline_unmeetable" and took < budget, (status, body, took)
        assert computed == 1, "only the blocker was computed"
    else:  # sent on: it reached the engine and ended at its budget, not before
        assert status == 504 and "phase prefill" in body["error"]["message"] and took >= budget - 0.02, (status, took)


@pytest.mark.parametrize("serving", [True, False])
def test_the_cold_start_estimate_counts_serving_prefills_and_moves_no_breaker(serving: bool) -> None:
    """``Gate.running`` (what ``Rates.little`` divides): the limits of the prefills serving now. A prefill whose
    breaker is open and has cooled down is not counted and stays as it was: an estimate must not move it to half-open
    (``Worker.available`` does, the routing's own step), nor count it as running a full limit."""
    from types import SimpleNamespace

    from pdgate.path.gateway import Gateway
    from pdgate.pool.workers import Breaker, State

    p = SimpleNamespace(url="http://127.0.0.1:1", bootstrap_port=2)
    d = SimpleNamespace(url="http://127.0.0.1:3", bootstrap_port=None)
    gw = Gateway(make_config([p, SimpleNamespace(url="http://127.0.0.1:4", bootstrap_port=5)], [d]),  # type: ignore[list-item]
                 clock=lambda: 100.0)
    p0, p1 = gw.pool.prefill
    p0.state = State.UP
    if serving:
        p1.state = State.UP
    else:
        p1.state, p1.breaker.state, p1.breaker.opened_at = State.BREAKER_OPEN, Breaker.OPEN, 0.0  # cooled down long ago
    assert gw.gate.running() == (8 if serving else 4)  # the initial limit, 4, on each prefill serving
    assert p1.state is (State.UP if serving else State.BREAKER_OPEN) and (serving or p1.breaker.state is Breaker.OPEN)


@pytest.mark.parametrize("measured", [True, False])
def test_the_shed_estimate_is_those_ahead_and_itself_at_the_drain_rate_then_a_first_token(measured: bool) -> None:
    """``Gate.refuse_early``: nine queued ahead and itself, drained at the measured rate (5/s: a slot every 0.2 s
    while requests waited) or, before one is measured, at the cold start's (``Rates.little``: the prefill's initial
    limit of 4 over the latest first token's 0.8 s, 5/s), then a first token's time: past a 1.5 s budget it is
    answered at once, Retry-After the estimate rounded up; with nobody ahead it queues."""
    import math
    from types import SimpleNamespace

    from pdgate.core.errors import Shed
    from pdgate.path.gateway import Gateway
    from pdgate.pool.workers import State

    now = 100.0
    gw = Gateway(make_config([SimpleNamespace(url="http://127.0.0.1:1", bootstrap_port=2)],  # type: ignore[list-item]
                             [SimpleNamespace(url="http://127.0.0.1:3", bootstrap_port=None)]), clock=lambda: now)
    gw.pool.prefill[0].state = State.UP
    gate, normal = gw.gate, RANKS["normal"]
    rec = SimpleNamespace(tenant="", deadlines=SimpleNamespace(ttft_s=1.5, total_s=60.0, ttft_at=now + 1.5,
                                                               total_at=now + 60.0))
    if measured:
        gate.rates.waiting(now - 2.0, True)
        for i in range(10):
            gate.rates.free(now - 2.0 + i * 0.2)
        gate.rates.first_token(0.3)
    else:
        for s in (0.2, 0.4, 0.6, 0.8):
            gate.rates.first_token(s)
    gate.refuse_early(rec, normal, "", 1.0, now)  # type: ignore[arg-type]  # nobody ahead: 0.2 s + a first token
    for i in range(9):
        gate.queue.push(Entry(normal, "", now + 1.0 + i * 0.01))
    with pytest.raises(Shed) as shed:
        gate.refuse_early(rec, normal, "", 1.0, now)  # type: ignore[arg-type]
    assert gate.rates.ttft is not None
    expect = (9 + 1) / 5.0 + gate.rates.ttft
    assert shed.value.code == "deadline_unmeetable" and shed.value.headers == {"Retry-After": str(math.ceil(expect))}
    assert f"about {expect:.2f}s (queue of 9 draining at 5.0/s)" in shed.value.message, shed.value.message
