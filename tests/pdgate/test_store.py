"""The store seam (``pdgate.store``): one contract, kept by the embedded store (one process) and by Redis (a real
redis-server on a Unix socket), and what only a shared store does: counts across instances, a registry whose
entries expire, a dead instance's rids claimed by one survivor, a versioned worker set, a restarted empty Redis
filled again, an unreachable one answered by the local share."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pdgate.core.config import ResponsesConfig, StoreConfig
from pdgate.core.errors import StoreUnavailable
from pdgate.store.base import Beat, Store, TenantAsk
from pdgate.store.embedded import EmbeddedStore
from pdgate.store.redis import RedisStore
from tests.procs import Procs, Redis

FAST = StoreConfig(timeout_s=0.2, lease_s=1.0, heartbeat_s=0.3)


def ask(name: str = "acme", **kw: Any) -> TenantAsk:
    kw.setdefault("max_concurrent", None)
    kw.setdefault("requests_per_min", None)
    kw.setdefault("tokens_per_min", None)
    return TenantAsk(name, **kw)


def beat(**kw: Any) -> Beat:
    return Beat({"state": "live", "pid": os.getpid(), **kw.pop("info", {})}, kw.pop("rids", {}), kw.pop("held", {}),
                kw.pop("tenants", {}))


class Stores:
    """Stores of one kind: ``new()`` another instance on the same shared state (the embedded kind has none)."""

    def __init__(self, kind: str, redis: Redis | None) -> None:
        self.kind, self.redis = kind, redis
        self.made: list[Store] = []

    async def new(self, instance: str, on_workers: Callable[[], None] = lambda: None, **cfg: Any) -> Any:
        s: Store
        if self.kind == "embedded":
            s = EmbeddedStore()
        else:
            assert self.redis is not None
            s = RedisStore(dataclasses.replace(FAST, url=self.redis.url, **cfg))
        await s.start(instance, on_workers)
        self.made.append(s)
        return s

    async def close(self) -> None:
        for s in self.made:
            await s.close()


@pytest.fixture(params=["embedded", "redis"])
async def stores(request: pytest.FixtureRequest, procs: Procs) -> AsyncIterator[Stores]:
    s = Stores(request.param, procs.redis() if request.param == "redis" else None)
    yield s
    await s.close()


@pytest.fixture
async def shared(procs: Procs) -> AsyncIterator[Stores]:
    s = Stores("redis", procs.redis())
    yield s
    await s.close()


async def settle(*stores: Any) -> None:
    """What the stores batch (give-backs, charges) is sent."""
    for s in stores:
        if isinstance(s, RedisStore):
            await s._flush()


# ---- the contract, both kinds ----------------------------------------------------------------------------------
async def test_max_concurrent_is_held_until_released(stores: Stores) -> None:
    s = await stores.new("aa")
    t = ask(max_concurrent=2)
    got = [await s.acquire(t, (), time.monotonic()) for _ in range(3)]
    assert [g.ok for g in got] == [True, True, False] and got[2].limit == "concurrency"
    s.release("acme", (), time.monotonic())
    await settle(s)
    assert (await s.acquire(t, (), time.monotonic())).ok, "a released request's place is free again"
    assert (await s.acquire(ask("beta", max_concurrent=1), (), time.monotonic())).ok, "another key: its own count"


async def test_requests_per_min_passes_the_burst_then_refills(stores: Stores) -> None:
    s = await stores.new("aa")
    t = ask(requests_per_min=6, hold=False)
    got = [await s.acquire(t, (), time.monotonic()) for _ in range(8)]
    assert [g.ok for g in got] == [True] * 6 + [False, False]
    assert got[6].limit == "requests" and 0 < got[6].retry_after_s <= 10.5, got[6]


async def test_tokens_per_min_charges_in_full_and_gives_an_unbounded_request_what_is_left(stores: Stores) -> None:
    s = await stores.new("aa")
    now = time.monotonic()
    assert (await s.acquire(ask(tokens_per_min=1000, tokens=1001, hold=False), (), now)).limit == "too_large"
    assert (await s.acquire(ask(tokens_per_min=1000, tokens=700, hold=False), (), now)).ok
    assert (await s.acquire(ask(tokens_per_min=1000, tokens=400, hold=False), (), now)).limit == "tokens"
    left = await s.acquire(ask(tokens_per_min=1000, tokens=100, unbounded=True, hold=False), (), now)
    assert left.ok and 299 <= left.tokens <= 301, left
    assert (await s.acquire(ask(tokens_per_min=1000, tokens=10, unbounded=True, hold=False), (), now)).limit == "tokens"
    s.charge("acme", 1000, -600, now)  # the estimate was 600 more than what it used: given back
    await settle(s)
    assert (await s.acquire(ask(tokens_per_min=1000, tokens=500, hold=False), (), time.monotonic())).ok


async def test_an_instance_the_store_never_saw_is_never_gone(stores: Stores) -> None:
    s = await stores.new("aa")
    await s.heartbeat(beat())
    assert await s.gone() == []
    assert await s.rids_of("bb") in (None, {})


# ---- what only a shared store does --------------------------------------------------------------------------------
async def test_limits_and_capacity_hold_across_instances(shared: Stores) -> None:
    a, b = await shared.new("aa"), await shared.new("bb")
    for s in (a, b):
        await s.heartbeat(beat())
    t = ask(max_concurrent=2)
    now = time.monotonic()
    results = [await s.acquire(t, (), now) for s in (a, b, a, b)]
    assert [g.ok for g in results] == [True, True, False, False], "2 across both, not 2 each"
    w = (("p0", 2), ("d0", 3))
    assert (await a.acquire(None, w, now)).ok
    got = await b.acquire(None, w, now)
    assert got.ok and got.others == {"p0": 1, "d0": 1}, "b is told what a holds"
    full = await b.acquire(None, w, now)
    assert not full.ok and full.limit == "full" and full.worker == "p0"
    a.release(None, ("p0", "d0"), now)
    await settle(a)
    assert (await b.acquire(None, w, now)).ok, "a's slot given back is b's to take"


async def test_a_request_with_nothing_to_agree_on_costs_no_round_trip_yet_is_counted_and_recorded(
        shared: Stores) -> None:
    """No limit on its key, no capacity on its workers: nothing to wait for, so no call on its path. What it holds
    and its rid still reach Redis in the next batch (the others' view of the worker, and the survivors' record
    should this instance die), and its give-back clears them."""
    a, b = await shared.new("aa"), await shared.new("bb")
    for s in (a, b):
        await s.heartbeat(beat(held={"p0": 0, "d0": 0}))
    trips = a.round_trips
    now = time.monotonic()
    got = await a.acquire(ask(), (("p0", None), ("d0", None)), now, "pd-aa-1.1")
    assert got.ok and a.round_trips == trips, "granted without a call"
    await settle(a)
    assert a.round_trips == trips + 1, "one batch"
    assert await b.heartbeat(beat(held={"p0": 0, "d0": 0})) == {"p0": 1, "d0": 1}, "b sees what a holds"
    assert (await b.acquire(None, (("p0", 1),), now)).limit == "full", "and a capacity counts it"
    rids = await shared.new("cc")
    assert (await rids.rids_of("aa")) == {"pd-aa-1.1": ("p0", "d0")}, "its rid is recorded"
    await rids.r.delete(rids.prefix + "reap:aa")
    a.release("acme", ("p0", "d0"), now, "pd-aa-1.1")
    await settle(a)
    assert await b.heartbeat(beat(held={"p0": 0, "d0": 0})) == {"p0": 0, "d0": 0}
    assert (await rids.rids_of("aa")) == {}


async def test_requests_that_ask_at_once_share_one_round_trip_and_a_gone_asker_gives_back(shared: Stores) -> None:
    """The acquires of one turn of the loop go in one call, each answered in its order, all or nothing each. An
    asker whose request ended while the call was out gives back what it was granted (else the key's place and
    the worker's slot stayed taken until a heartbeat wrote the counts whole)."""
    a, b = await shared.new("aa"), await shared.new("bb")
    for s in (a, b):
        await s.heartbeat(beat(held={"p0": 0}))
    trips, now, t = a.round_trips, time.monotonic(), ask(max_concurrent=2)
    got = await asyncio.gather(*(a.acquire(t, (("p0", 8),), now, f"pd-aa-1.{i}") for i in range(4)))
    assert [g.ok for g in got] == [True, True, False, False] and a.round_trips == trips + 1, (got, a.round_trips)
    for i in range(2):
        a.release("acme", ("p0",), now, f"pd-aa-1.{i}")
    await settle(a)
    gone = asyncio.ensure_future(a.acquire(t, (("p0", 8),), now, "pd-aa-2.0"))
    await asyncio.sleep(0)  # it asked; it is gone before the answer
    gone.cancel()
    await asyncio.sleep(0.3)
    await settle(a)
    assert await b.heartbeat(beat(held={"p0": 0})) == {"p0": 0}, "the gone asker's slot is given back"
    got = await asyncio.gather(*(b.acquire(t, (), now) for _ in range(3)))
    assert [g.ok for g in got] == [True, True, False], "and its place of the key's 2"


async def test_a_dead_instances_counts_stop_counting_and_its_rids_go_to_one_survivor(shared: Stores) -> None:
    a, b, c = await shared.new("aa"), await shared.new("bb"), await shared.new("cc")
    for s in (a, b, c):
        await s.heartbeat(beat())
    now = time.monotonic()
    assert (await a.acquire(ask(max_concurrent=1), (("p0", 1), ("d0", 1)), now, "pd-aa-1.1")).ok
    assert not (await b.acquire(ask(max_concurrent=1), (), now)).ok
    assert await b.gone() == [], "a lives: nobody is gone"
    # a stops beating (killed): within its lease it still counts, after it, it is gone
    a._tasks, a.close = [], _noop  # (a killed process withdraws nothing)
    end = time.monotonic() + FAST.lease_s + 1.5
    while await b.gone() != ["aa"]:
        assert time.monotonic() < end, "a's entry expires after lease_s"
        await b.heartbeat(beat())
        await c.heartbeat(beat())
        await asyncio.sleep(0.1)
    assert (await b.acquire(ask(max_concurrent=1), (("p0", 1), ("d0", 1)), time.monotonic())).ok, \
        "a dead instance's places come back by themselves"
    claims = await asyncio.gather(b.rids_of("aa"), c.rids_of("aa"))
    assert sorted(claims, key=lambda x: x is None) == [{"pd-aa-1.1": ("p0", "d0")}, None], \
        "one survivor gets its rids, the other nothing"
    await b.forget("aa")
    assert await c.gone() == []
    await a.r.aclose()  # the killed instance's client (its test double withdrew nothing)


async def _noop() -> None:
    return None


async def test_the_worker_set_has_one_id_per_worker_and_is_pushed(shared: Stores) -> None:
    pushed = asyncio.Event()
    a = await shared.new("aa")
    b = await shared.new("bb", pushed.set)
    await a.seed_workers([{"id": "p0", "role": "prefill", "url": "http://p:1"}])
    await b.seed_workers([{"id": "p0", "role": "prefill", "url": "http://other:1"}])  # seeds only an empty store
    ids = await asyncio.gather(a.add_worker({"role": "decode", "url": "http://d:1"}),
                               b.add_worker({"role": "decode", "url": "http://d:2"}))
    assert sorted(ids) == ["d0", "d1"]
    assert await b.add_worker({"role": "decode", "url": "http://d:1"}) is None, "one role and URL: one worker"
    await asyncio.wait_for(pushed.wait(), 2)
    version, specs = await b.worker_set()
    assert version == 3, "seeded once, two added"
    assert {s["id"]: s["url"] for s in specs} == {"p0": "http://p:1", ids[0]: "http://d:1", ids[1]: "http://d:2"}
    assert await a.remove_worker("d0") and not await a.remove_worker("d0")


async def test_a_restarted_empty_redis_is_filled_again_by_the_next_heartbeat(shared: Stores, procs: Procs) -> None:
    a, b = await shared.new("aa"), await shared.new("bb")
    assert (await a.acquire(ask(max_concurrent=2), (("p0", 4),), time.monotonic(), "pd-aa-1.1")).ok
    for s in (a, b):
        await s.heartbeat(beat(held={"p0": 1}, tenants={"acme": 1}, rids={"pd-aa-1.1": ("p0",)}) if s is a else beat())
    assert shared.redis is not None
    shared.redis.proc.stop(signal.SIGKILL)
    shared.redis = procs.redis(shared.redis.sock)  # the same socket, nothing in it
    others = None
    end = time.monotonic() + 3
    while others is None:  # the clients reconnect
        assert time.monotonic() < end
        others = await a.heartbeat(beat(held={"p0": 1}, tenants={"acme": 1}, rids={"pd-aa-1.1": ("p0",)}))
    assert (await b.heartbeat(beat(held={"p0": 0}))) == {"p0": 1}, "a's hold is back"
    got = [await b.acquire(ask(max_concurrent=2), (), time.monotonic()) for _ in range(2)]
    assert [g.ok for g in got] == [True, False], "a's live request counts again: the limit is exact"
    assert "aa" in (await b.instances() or {})


async def test_an_unreachable_store_answers_from_the_local_share_in_bounded_time(shared: Stores) -> None:
    a, b = await shared.new("aa"), await shared.new("bb")
    for s in (a, b, a):
        await s.heartbeat(beat())
    assert a.instances_seen == 2
    assert shared.redis is not None and shared.redis.proc.popen is not None
    os.kill(shared.redis.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = [await a.acquire(ask(max_concurrent=4), (("p0", 8),), time.monotonic()) for _ in range(3)]
        took = time.monotonic() - t0
        assert took < 3 * FAST.timeout_s + 0.3, f"each call bounded by timeout_s: {took:.2f}s"
        assert [g.ok for g in got] == [True, True, False], "4 shared by the 2 instances last seen: 2 here"
        assert await a.heartbeat(beat()) is None and await a.instances() is None
        assert await a.gone() == [], "an unreachable store makes nobody gone"
        assert not a.reachable and a.fallbacks >= 3
    finally:
        os.kill(shared.redis.proc.pid, signal.SIGCONT)
    assert await a.heartbeat(beat()) is not None and a.reachable


async def test_what_the_local_share_gave_while_unreachable_it_takes_back(shared: Stores) -> None:
    """Requests admitted by the local share give their place back to it (it counted them, Redis did not): an
    outage longer than a request admits the next ones. Without that the share stays used up for good, and
    their give-backs would take from the counts of requests Redis admitted."""
    a, b = await shared.new("aa"), await shared.new("bb")
    for s in (a, b, a):
        await s.heartbeat(beat())
    now = time.monotonic()
    t = ask(max_concurrent=4)
    assert (await a.acquire(t, (("p0", 8),), now, "pd-aa-1.1")).ok  # through Redis: a holds 1 there
    assert shared.redis is not None
    os.kill(shared.redis.proc.pid, signal.SIGSTOP)
    try:
        for n in range(3):  # share: 4 // 2 instances = 2 at once, again and again
            got = [await a.acquire(t, (("p0", 8),), now, f"pd-aa-2.{n}{i}") for i in range(3)]
            assert [g.ok for g in got] == [True, True, False], f"round {n}: {got}"
            for i in range(2):
                a.release("acme", ("p0",), now, f"pd-aa-2.{n}{i}")
        assert not a._ops, "nothing of theirs to give back to Redis"
    finally:
        os.kill(shared.redis.proc.pid, signal.SIGCONT)
    await a.heartbeat(beat(held={"p0": 1}, tenants={"acme": 1}, rids={"pd-aa-1.1": ("p0",)}))
    assert await b.heartbeat(beat(held={"p0": 0})) == {"p0": 1}, "the request Redis admitted still counts"
    got = [await b.acquire(t, (), now) for _ in range(4)]
    assert [g.ok for g in got] == [True, True, True, False], "3 left of 4: a's one live request"


async def test_a_lost_answer_makes_the_next_heartbeat_write_the_counts_whole(shared: Stores) -> None:
    """A give-back whose answer is lost may have run or not: the count it changed is rewritten whole at the next
    heartbeat. Without that (the flag switched off) the slot stays held in the store for good."""
    for resync in (True, False):
        a, b = await shared.new(f"a{int(resync)}"), await shared.new(f"b{int(resync)}")
        w = f"w{int(resync)}"
        for s in (a, b):
            await s.heartbeat(beat(held={w: 0}))
        assert (await a.acquire(None, ((w, 1),), time.monotonic())).ok
        assert shared.redis is not None
        probe = aioredis_client(shared.redis.url)
        await probe.script_flush()  # the give-back sent below then does not run when Redis wakes (NOSCRIPT): lost
        await probe.aclose()
        os.kill(shared.redis.proc.pid, signal.SIGSTOP)
        try:
            a.release(None, (w,), time.monotonic())
            await settle(a)  # lost
        finally:
            os.kill(shared.redis.proc.pid, signal.SIGCONT)
        if not resync:
            a.resync = False
        await a.heartbeat(beat(held={w: 0}))
        ok = (await b.acquire(None, ((w, 1),), time.monotonic())).ok
        assert ok is resync, "the slot comes back" if resync else "without the whole write it stays taken"


async def test_stored_responses_per_tenant_bounded_by_count_and_time(stores: Stores) -> None:
    """Both kinds: a tenant reads only its own; the oldest go beyond max_stored; an entry is gone after ttl_s; a
    delete says whether it was there. With Redis, another instance reads what one wrote."""
    a, b = await stores.new("a"), await stores.new("b")
    lim = ResponsesConfig(ttl_s=0.6, max_stored=3)
    now = time.monotonic()
    for i in range(5):
        assert await a.put_response("alice", f"resp_{i}", b"r%d" % i, now, lim)
    reader = b if stores.kind == "redis" else a
    got = [await reader.get_response("alice", f"resp_{i}", now) for i in range(5)]
    assert got == [None, None, b"r2", b"r3", b"r4"]
    assert await reader.get_response("bob", "resp_4", now) is None, "another tenant's id is not found"
    assert await reader.delete_response("bob", "resp_4") is False
    assert await reader.delete_response("alice", "resp_3") is True
    assert await reader.get_response("alice", "resp_3", now) is None
    await asyncio.sleep(0.7)
    assert await reader.get_response("alice", "resp_4", time.monotonic()) is None, "expired after ttl_s"


async def test_an_unreachable_redis_says_so_for_stored_responses(shared: Stores) -> None:
    s = await shared.new("a")
    lim = ResponsesConfig()
    assert await s.put_response("t", "resp_1", b"x", 0.0, lim)
    assert shared.redis is not None
    shared.redis.proc.stop()
    assert await s.put_response("t", "resp_2", b"x", 0.0, lim) is False  # logged; the answer still goes out
    with pytest.raises(StoreUnavailable):
        await s.get_response("t", "resp_1", 0.0)


async def test_a_calls_bound_covers_one_script_run_not_a_connect_and_a_script_load(shared: Stores) -> None:
    """The 50 ms bound of a request-path call is for one EVALSHA: the connection is opened and every script loaded
    at start (a loaded CI box timed out a first call that had to do both), and an operator's change of the worker
    set is bounded as an operator's reply is, not as a request's step (a bound far below a round trip here)."""
    s = await shared.new("aa", timeout_s=0.0005)
    assert shared.redis is not None
    probe = aioredis_client(shared.redis.url)
    try:
        loaded = await probe.script_exists(*(sc.sha for sc in s.scripts.values()))
    finally:
        await probe.aclose()
    assert all(loaded), "every script is in Redis before the first call"
    await s.seed_workers([{"id": "p0", "role": "prefill", "url": "http://p:1"}])
    assert await s.add_worker({"role": "decode", "url": "http://d:1"}) == "d0"
    assert await s.remove_worker("d0")


def aioredis_client(url: str) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url if not url.startswith("unix:") or url.startswith("unix://")
                                   else "unix://" + url[5:])
