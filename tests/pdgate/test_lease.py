"""An attempt's lease (``pdgate.path.gate.Lease``) gives back everything it holds, whenever the attempt ends: the whole
request path runs in memory (``tests/pdgate/memory.py``: no socket), the test steps each leg, ends the request at
each point of an attempt's life, and then looks from outside the lease: what the workers hold bound, the slots and
rids the store was told of, the routing policies' bookkeeping, the engines' own held requests and the answers the
transport handed out. With the lease's close switched off, the same look finds the attempt still held."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import pytest

from h1lite.server import ClientGone
from pdgate.core.errors import UpstreamError, WorkerLost
from pdgate.path.gate import Lease
from pdgate.path.gateway import Gateway
from pdgate.path.scope import Cause
from pdgate.pool.workers import State
from tests.pdgate.memory import MemoryTransport, Pool, Proto, config, gateway, request

CHAT = {"model": "mem-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Ledger:
    """What the store was told, per worker and rid (``acquire`` / ``release``), and what the routing policies were
    told (``dispatched`` / ``completed``): from outside the lease."""

    def __init__(self, gw: Gateway) -> None:
        self.slots: Counter[str] = Counter()
        self.rids: set[str] = set()
        self.policy: Counter[str] = Counter()
        store, acquire, release = gw.store, gw.store.acquire, gw.store.release

        async def acquire_(tenant: Any, workers: tuple[tuple[str, int | None], ...], now: float, rid: str = "") -> Any:
            grant = await acquire(tenant, workers, now, rid)
            if grant.ok:
                self.slots.update(w for w, _ in workers)
                if rid:
                    self.rids.add(rid)
            return grant

        def release_(tenant: str | None, workers: tuple[str, ...], now: float, rid: str = "") -> None:
            self.slots.subtract(workers)
            self.rids.discard(rid)
            release(tenant, workers, now, rid)

        store.acquire, store.release = acquire_, release_  # type: ignore[method-assign]
        for pol in (gw.routing.prefill, gw.routing.decode):
            dispatched, completed = pol.dispatched, pol.completed

            def dispatched_(worker: str, req: Any, f: Any = dispatched) -> None:
                self.policy[worker] += 1
                f(worker, req)

            def completed_(worker: str, req: Any, ok: bool, f: Any = completed) -> None:
                self.policy[worker] -= 1
                f(worker, req, ok)

            pol.dispatched, pol.completed = dispatched_, completed_  # type: ignore[method-assign]


def held(gw: Gateway, pool: Pool, transport: MemoryTransport, ledger: Ledger) -> dict[str, Any]:
    """Whatever is still held anywhere (empty: nothing)."""
    out: dict[str, Any] = {
        "bound": {w.id: len(w.bound) for w in gw.pool.by_id.values() if w.bound},
        "reserved": {w.id: w.slots.reserved for w in gw.pool.by_id.values() if w.slots.reserved},
        "store slots": {w: n for w, n in ledger.slots.items() if n},
        "store rids": sorted(ledger.rids),
        "policies": {w: n for w, n in ledger.policy.items() if n},
        "engines": sorted(pool.held),
        "answers": len(transport.unreleased()),
        "live": list(gw.live),
        "queued": gw.gate.queue.n,
    }
    return {k: v for k, v in out.items() if v}


async def settle(gw: Gateway, pool: Pool, transport: MemoryTransport, ledger: Ledger, within: float = 2.0) -> dict[str, Any]:
    """What is held once the aborts and the legs' tails had ``within`` seconds to end."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while (left := held(gw, pool, transport, ledger)) and loop.time() < end:
        await asyncio.sleep(0.02)
    return left


def start(gw: Gateway, **headers: str) -> tuple[asyncio.Task[Any], Proto, Any]:
    req, proto = request({**CHAT, "stream": True}, **headers)

    async def answer() -> Any:  # in a task of its own, as h1lite's connection handler
        proto.task = asyncio.current_task()
        return await gw.pipeline.handle(req, "/v1/chat/completions")

    return asyncio.get_running_loop().create_task(answer()), proto, req


def leave(proto: Proto, req: Any) -> None:
    """The client closes its connection."""
    proto.closed = True
    if req.on_gone is not None:
        req.on_gone()


POINTS = ["sent", "prefill_answered", "streaming", "completed", "decode_before_prefill", "prefill_orphaned", "retried",
          "worker_lost", "deadline"]
LATE = ("decode_before_prefill", "prefill_orphaned")  # the decode is done first: the prefill outlives the lease


@pytest.mark.parametrize("point", POINTS)
async def test_a_lease_closed_at_any_point_of_an_attempt_leaves_nothing_held(point: str,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    pool = Pool()
    gw, transport = await gateway(pool, config(prefills=2 if point == "retried" else 1, prefill_grace_s=0.2))
    ledger = Ledger(gw)
    try:
        task, proto, req = start(gw, **({"x_pdgate_ttft_timeout": "0.3"} if point == "deadline" else {}))
        p, d = await pool.next("prefill"), await pool.next("decode")
        bound = held(gw, pool, transport, ledger)["bound"]  # the look sees a live attempt: one prefill, the decode
        assert sorted(bound.values()) == [1, 1] and bound["d0"] == 1, bound
        if point == "retried":  # the first prefill fails before any token: another pair, a new lease
            p.reply(500, b'{"error": {"message": "no"}}')
            p, d = await pool.next("prefill"), await pool.next("decode")
            assert p.rid.endswith(".2") and d.rid == p.rid
        if point in ("prefill_answered", "streaming", "completed", "retried"):
            p.reply()
        if point in ("streaming", "completed", "retried", *LATE):
            d.token("a")
            await asyncio.sleep(0.01)
        if point in ("completed", "retried", *LATE):
            d.done()
        if point == "worker_lost":
            gw.pool.by_id["d0"].transition(State.DOWN, gw.now(), "test: the decode died")
        elif point in ("sent", "prefill_answered", "streaming"):
            leave(proto, req)
        resp = await asyncio.wait_for(task, 5)
        status = getattr(resp, "status", 200)
        if point in LATE:  # the request ended before its prefill answered: the rid stays recorded until it has
            assert gw.live == {} and held(gw, pool, transport, ledger)["store rids"] == [p.rid]
        if point == "decode_before_prefill":  # it answers within prefill_grace_s (else it is aborted: orphaned)
            p.reply()
        rec = gw.traces.get(resp.headers["x-request-id"] if hasattr(resp, "headers") else "")
        assert rec is None or not rec.live
        expect = {"completed": 200, "retried": 200, "decode_before_prefill": 200, "prefill_orphaned": 200, "deadline": 504,
                  "worker_lost": 502}  # a lost worker, no other pair: the loss is the answer
        if point in expect:
            assert status == expect[point], (point, status, b"".join(proto.out)[-300:])
        assert not await settle(gw, pool, transport, ledger)
        if point in ("sent", "deadline", "worker_lost", "prefill_answered", "streaming", "prefill_orphaned"):
            assert any(rid == p.rid for _, rid in pool.aborts), "the legs were aborted on the engines"
        # a leg that outlived its lease ends without an error (a prefill answering after its decode did)
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        await gw.stop()


async def test_without_the_lease_closing_the_same_look_finds_the_attempt_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above, with ``Lease.close`` a no-op: the workers stay bound, the store keeps the slots and the rid,
    the policies never hear the end."""
    monkeypatch.setattr(Lease, "close", lambda self: None)
    pool = Pool()
    gw, transport = await gateway(pool, config())
    ledger = Ledger(gw)
    try:
        task, proto, req = start(gw)
        p, d = await pool.next("prefill"), await pool.next("decode")
        p.reply()
        d.token()
        leave(proto, req)
        await asyncio.wait_for(task, 5)
        left = await settle(gw, pool, transport, ledger, within=0.5)
        assert left.get("bound") == {"d0": 1} and left.get("store slots") == {"d0": 1}, left
        assert left.get("store rids") == [p.rid] and left.get("policies") == {"p0": 1, "d0": 1}, left
    finally:
        await gw.stop()


async def test_closing_twice_gives_back_once() -> None:
    pool = Pool()
    gw, transport = await gateway(pool, config())
    ledger = Ledger(gw)
    try:
        task, _, _ = start(gw)
        p, d = await pool.next("prefill"), await pool.next("decode")
        lease = next(iter(gw.pool.by_id["d0"].bound))
        assert isinstance(lease, Lease)
        p.reply()
        d.token()
        d.done()
        await asyncio.wait_for(task, 5)
        assert lease.closed and not await settle(gw, pool, transport, ledger)
        lease.close()
        assert ledger.slots == Counter({"p0": 0, "d0": 0}) and not ledger.policy["p0"] and not ledger.policy["d0"]
    finally:
        await gw.stop()


async def test_a_lost_worker_cancels_the_attempt_with_what_was_lost() -> None:
    pool = Pool()
    gw, _ = await gateway(pool, config())
    try:
        task, _, _ = start(gw)
        await pool.next("prefill")
        lease = next(iter(gw.pool.by_id["d0"].bound))
        assert isinstance(lease, Lease)
        lease.lose("d0", "decode", "down: ConnectFailed")
        reason = lease.scope.reason
        assert reason is not None and reason.cause is Cause.WORKER_LOST
        err = reason.error
        assert isinstance(err, WorkerLost) and (err.worker, err.role, err.cause) == ("d0", "decode", "down: ConnectFailed")
        lease.fail(RuntimeError("later"))
        assert lease.scope.reason is reason, "first reason wins"
        gw.pipeline.drain()
        await asyncio.wait_for(task, 5)
        assert lease.closed
    finally:
        await gw.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("raised", ["UpstreamError", "ClientGone", "OSError"])
async def test_a_prefill_call_that_raises_is_the_workers_failure_and_is_retried(raised: str, stream: bool) -> None:
    """Whatever a prefill's call raises (the adapter's, or its transport's) counts against the worker's breaker, is
    wrapped as an upstream error and retried, and the request ends in a clean 502 holding nothing (a review found
    an ``UpstreamError`` passed on uncounted, and a ``ClientGone`` ending the request in a 500, when one function
    first ran both roles' legs)."""
    errors = {"UpstreamError": UpstreamError("prefill worker p0 said no", role="prefill", worker="p0"),
              "ClientGone": ClientGone("not the client: the engine's call"), "OSError": OSError("reset")}
    pool = Pool()
    gw, transport = await gateway(pool, config())
    ledger = Ledger(gw)

    sent: list[str] = []  # the prefill calls the engines' side saw, by the rid each carried

    async def prefill_fails(call: Any) -> Any:
        if call.base.startswith("http://prefill") and call.method == "POST" and call.target == "/v1/chat/completions":
            sent.append(call.headers.split(b"x-request-id: ", 1)[1].split(b"\r\n", 1)[0].decode())
            raise errors[raised]
        return await pool(call)

    transport.handler = prefill_fails
    try:
        req, _ = request({**CHAT, "stream": stream})
        resp = await asyncio.wait_for(gw.pipeline.handle(req, "/v1/chat/completions"), 5)
        assert resp.status == 502, (resp.status, getattr(resp, "body", b"")[:300])
        assert len(set(sent)) == len(sent) == gw.cfg.max_attempts, f"retried before the first byte: {sent}"
        assert gw.pool.by_id["p0"].breaker.failures == gw.cfg.max_attempts, "each failed call counted"
        assert not await settle(gw, pool, transport, ledger)
    finally:
        await gw.stop()
