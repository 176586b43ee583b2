"""The gate: a pair with room at once, or a place in the queue until one frees, or an answer at once; and for
each attempt a lease (``Lease``) that owns what the attempt holds and gives it all back in one place.

The gate keeps the engines' queues short: each worker takes at most its capacity of our live requests
(``Slots.limit``: the config's, or the learned limit within the engine's ``max_running_requests``, lowered for a
while after its 429/503). A request that finds no pair with room waits in the gateway's queue
(``queueing.FairQueue``: priority, then weighted fair share across tenants, then earliest deadline), in phase
``queued``, where its deadline, its client leaving or a drain end it through its cancel scope like anywhere else,
without an engine ever seeing it. A request that cannot reach its first token within its TTFT budget by the queue's
measured drain rate (``queueing.Rates``) is answered at once (``Shed``: 503, or 429 for a tenant over its share),
as is one that finds the queue full. When a slot frees, the next request in order gets that pair, reserved for it.

A lease, like SMG's ``WorkerLoadGuard``, takes its holdings when it is made and gives them back when it is closed:
the slots on both workers (here and in the shared store), the binds that tell it when a worker is lost, the
attempt's rid recorded in the store (for a successor, should this process die), the routing policies'
bookkeeping and the attempt's span. A leg may give its worker back early (``Lease.prefill_answered``);
a leg still running at the close keeps the rid recorded until it ends. The key's claim is the request's, not an
attempt's: a retry keeps it, and the outcome settles it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from h1lite.client import header_lines
from pdgate.core.errors import NoHealthyPair, Shed, WorkerLost
from pdgate.core.queueing import RANKS, Entry, FairQueue, Rates
from pdgate.core.record import Attempt, Phase, Record
from pdgate.core.rid import attempt_rid
from pdgate.path.scope import Cause, Reason, Scope
from pdgate.pool.routing import Pair, Routing
from pdgate.pool.workers import State, Worker

if TYPE_CHECKING:
    from pdgate.core.config import AdmissionConfig
    from pdgate.path.context import Ctx
    from pdgate.path.observers import Observers
    from pdgate.pool.policies import RequestView
    from pdgate.store.base import Store

NO_PAIR = "no healthy prefill+decode pair is available"


class Lease:
    """One attempt's holdings, from the gate's grant to ``close`` (module docstring). A worker it is bound to
    tells it when the worker is lost (``lose``: the attempt's scope is cancelled)."""

    __slots__ = ("att", "ctx", "gate", "headers", "held", "ok", "pair", "retrying", "scope", "span", "tail")

    def __init__(self, gate: Gate, ctx: Ctx, n: int, rid: str, pair: Pair) -> None:
        self.gate, self.ctx, self.pair = gate, ctx, pair
        pw, dw = pair
        rec = ctx.rec
        now = gate.clock()
        rec.dispatched_at = now
        self.att = att = Attempt(n=n, rid=rid, prefill=pw.id, decode=dw.id)
        rec.attempts.append(att)
        self.span: Any = None  # its OpenTelemetry span (None without otel)
        self.held: dict[str, Worker] | None = {pw.id: pw, dw.id: dw}  # bound, a slot taken here and in the store
        self.tail: asyncio.Future[Any] | None = None  # a leg that outlives the attempt (set by the legs): the
        # rid stays recorded until it ends
        self.ok = False  # the attempt succeeded (the routing policies hear it)
        self.retrying = False  # another attempt follows: it takes its slot before the queue does
        pw.bind(self, now)
        dw.bind(self, now)
        view = ctx.view
        try:
            gate.routing.dispatched(pw, dw, view)
        except BaseException:  # a policy that fails on this request: what was taken goes back, the request ends
            self.close()
            raise
        if view.notes:  # why the policy chose as it did (a session that moved, loads out of balance)
            for note in view.notes:
                att.event(now, "routing", note)
            view.notes = None
        gate.obs.move(rec, Phase.DISPATCHED, now)
        self.span = gate.obs.attempt_started(ctx, att, now)
        self.scope = Scope(ctx.scope.task)  # the attempt's own, inside the request's (nothing awaited before it)
        # what both legs carry besides the body: the rid as x-request-id (the engines' logs name it), and W3C trace
        # context: the attempt span's with OpenTelemetry on (an engine's spans join the trace under it), else the
        # client's, passed through (the parser lets no CR, LF or NUL into a header, so header_lines cannot refuse it)
        self.headers = b"x-request-id: %b\r\n" % rid.encode()
        h = ctx.request.headers
        if self.span is not None:
            self.headers += header_lines(gate.obs.traceparent(self.span))
        elif "traceparent" in h:
            self.headers += header_lines({k: h[k] for k in ("traceparent", "tracestate") if k in h})

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what a bound worker says (workers.Bound)
    def lose(self, worker: str, role: str, cause: str) -> None:
        err = WorkerLost(f"attempt {self.att.n} lost its {role} worker {worker}: {cause}", role=role, worker=worker,
                         cause=cause)
        self.scope.cancel(Reason(Cause.WORKER_LOST, error=err))

    def note(self, name: str, info: Any = None) -> None:
        self.att.event(self.gate.clock(), name, info)

    def fail(self, exc: BaseException) -> None:
        """A leg failed: the attempt ends (the request may go on with another pair)."""
        self.scope.cancel(Reason(Cause.LEG_FAILED, error=exc))

    # ---- what the legs give back
    def prefill_answered(self, w: Worker, now: float) -> None:
        """The prefill answered 200: its latency, dispatch to its own answer whatever the engine, is its learned
        limit's sample; then it no longer holds the attempt (load, stall and restart checks) and its slot goes
        back, where a queued request may take it (the sample in first). A first token would also hold the decode's
        step (a paced decode's next tick: 56 ms on a prefill answering in 2 ms, and the prefill's limit fell to 1)
        and, on vLLM, the decode's wait for the KV and the transfer (over NIXL on a busy CPU 0.03-11.7 s: learned
        from that, a pair that serves four at once served one)."""
        gate, rec, held = self.gate, self.ctx.rec, self.held
        if gate.learning and rec.dispatched_at is not None:
            w.slots.sample(now - rec.dispatched_at, rec.deadlines.ttft_s, now)
        if held is not None and held.pop(w.id, None) is not None:  # closed: it went back with the rest
            w.unbind(self)
            gate.give_back((w.id,))

    def close(self) -> None:
        """Everything still held, given back (a second close does nothing)."""
        held, gate = self.held, self.gate
        if held is None:
            return
        self.held = None
        for w in held.values():
            w.unbind(self)
        rid = self.att.rid
        tail = self.tail
        if tail is not None and tail.done():
            tail = None
        gate.give_back(tuple(held), "" if tail is not None else rid, ended=True, pump=not self.retrying)
        if tail is not None:
            tail.add_done_callback(lambda _: gate.give_back((), rid, pump=False))
        pw, dw = self.pair
        gate.routing.completed(pw, dw, self.ctx.view, self.ok)
        gate.obs.attempt_ended(self.ctx.rec, self.att, self.span, gate.clock())

    @property
    def closed(self) -> bool:
        return self.held is None


# the queue's drain rate moves with the limits it drains through: a request admitted on an estimate this much short
# of its budget would more often be answered late (after waiting, ``Gate.too_late``) than served
SHED_MARGIN = 1.2
RUNNING = frozenset({State.UP, State.DEGRADED})  # prefills that run their limit's worth (a half-open one: a probe)

def first_due(rec: Record) -> float:
    """When its first token is due at the latest (its TTFT budget, or its total one if that ends first)."""
    return min(rec.deadlines.ttft_at, rec.deadlines.total_at)


class Gate:
    """Pairs with room, handed out in the queue's order (module docstring)."""

    def __init__(self, cfg: AdmissionConfig, routing: Routing, store: Store, obs: Observers,
                 clock: Callable[[], float]) -> None:
        self.cfg, self.routing, self.store, self.obs, self.clock = cfg, routing, store, obs, clock
        self.metrics = obs.metrics
        self.queue = FairQueue()
        self.rates = Rates(cfg.window_s)
        self.learning = cfg.learns
        self._pumping = False
        self._again = False

    def on_transition(self, rec: Record, frm: Phase, to: Phase, spent: float) -> None:
        """A record observer: dispatch to first token (prefill to decode) is the rate the queue's estimate uses."""
        if to is Phase.DECODE and frm is Phase.PREFILL and rec.dispatched_at is not None:
            self.rates.first_token(rec.phase_since + spent - rec.dispatched_at)

    def held_back(self, now: float) -> None:
        """A request queues: the learned limits of the workers that are full are binding."""
        for w in self.routing.pool.by_id.values():
            if w.slots.learned is not None and not w.has_room(now):
                w.slots.held_back(now)

    def pick(self, avoid: frozenset[int], view: RequestView, limited: bool = True) -> Pair | None:
        return self.routing.pick(avoid, view, self.clock(), limited)

    async def lease(self, ctx: Ctx, avoid: frozenset[int], n: int) -> Lease:
        """Attempt ``n``'s lease: a pair and the store's word for it (``pair_for``), bound and recorded."""
        rid = attempt_rid(ctx.rec.id, n)
        pair = await self.pair_for(ctx, avoid, n > 1, rid)
        return Lease(self, ctx, n, rid, pair)

    async def pair_for(self, ctx: Ctx, avoid: frozenset[int], retry: bool, rid: str = "") -> Pair:
        """A pair for the next attempt, and the store's word for it in one round trip: the key's limits (on the
        first attempt) and a slot on both workers, whatever other gateway processes hold. A worker found full
        there is seen so here too and the request goes first in the queue; a key over its limits is a 429."""
        ask = None if retry else ctx.ask
        while True:
            pair = await self.local_pair(ctx, avoid, retry)
            pw, dw = pair
            on = self.cfg.enabled  # admission off: capacities are not held to (today's routers)
            grant = await self.store.acquire(ask, ((pw.id, pw.slots.capacity if on else None),
                                                   (dw.id, dw.slots.capacity if on else None)), self.clock(), rid)
            for w in pair:
                if w.id in grant.others:
                    w.slots.others = grant.others[w.id]
            if grant.ok:
                break
            if grant.limit != "full":
                assert ctx.tenant is not None and ask is not None
                self.metrics.reject(ctx.tenant.name, "tokens" if grant.limit == "too_large" else grant.limit or "")
                raise ctx.tenant.refused(grant.limit or "", grant.retry_after_s, ask.tokens)
            retry = True  # others hold the last slot: it waits, first in line
        if ask is not None:
            ctx.holds = True
            rec = ctx.rec
            if ask.unbounded:  # it gets what the key had left: its output is capped to that
                for e in self.routing.pool.adapters:
                    e.limit_output(rec.route, ctx.body, max(1, grant.tokens - rec.prompt_estimate))
                rec.estimate = grant.tokens
        return pair

    def give_back(self, workers: tuple[str, ...], rid: str = "", ended: bool = False, pump: bool = True) -> None:
        """Slots a lease no longer holds, here and in the store (``rid``: its rid is over; ``ended``: its attempt
        ended, which the drain rate counts; ``pump=False``: nobody takes them now, or its own retry does)."""
        self.store.release(None, workers, self.clock(), rid)
        if ended and self.queue.n:
            self.rates.free(self.clock())
        if pump:
            self.pump()
            self.rates.waiting(self.clock(), self.queue.n > 0)

    async def local_pair(self, ctx: Ctx, avoid: frozenset[int], retry: bool) -> Pair:
        """A pair with room as this process sees it: at once when one has room and nobody waits before (a retry
        never waits behind the queue), else after queueing."""
        now = self.clock()
        if not self.cfg.enabled:
            pair = self.pick(avoid, ctx.view, limited=False)
            if pair is None:
                raise NoHealthyPair(NO_PAIR)
            return pair
        rec = ctx.rec
        if not self.queue.n or retry:
            pair = self.pick(avoid, ctx.view)
            if pair is not None:
                return pair
        if not self.routing.ready(now):  # nothing to wait for: no healthy pair at all
            raise NoHealthyPair(NO_PAIR)
        rank = RANKS["retry"] if retry else RANKS[rec.priority]
        tenant = ctx.tenant
        name, weight = (tenant.name, tenant.key.weight) if tenant is not None else ("", 1.0)
        if not retry:
            self.refuse_early(rec, rank, name, weight, now)
        if self.learning:
            self.held_back(now)
        self.metrics.queued += 1
        by_id = self.routing.pool.by_id
        try:
            while True:  # until it holds a pair whose workers are still there and serving
                pair = await self.wait(Entry(rank, name, first_due(rec), weight), avoid, ctx.view)
                if all(by_id.get(w.id) is w and w.available(self.clock()) for w in pair):
                    return pair
                rank = RANKS["retry"]  # lost between its grant and now: it goes first next time
        finally:
            self.metrics.queue_wait.observe(self.clock() - now)

    async def wait(self, e: Entry, avoid: frozenset[int], view: RequestView) -> Pair:
        """Queue ``e`` until a pair is handed to it (its reservation released: the caller binds it at once)."""
        fut: asyncio.Future[Pair] = asyncio.get_running_loop().create_future()
        e.item = (fut, avoid, view)
        try:
            self.queue.push(e)
            self.rates.waiting(self.clock(), True)
            self.pump()  # a slot may be free already (a back-off or a breaker's cooldown that ended)
            pair = await fut
        except BaseException:  # its deadline, its client, a drain, no pair left: it leaves the queue now
            self.queue.remove(e)
            self.rates.waiting(self.clock(), self.queue.n > 0)
            if fut.done() and not fut.cancelled() and fut.exception() is None:  # granted just before: pass it on
                for w in fut.result():
                    w.slots.reserved -= 1
                self.pump()
            raise
        for w in pair:
            w.slots.reserved -= 1
        return pair

    def refuse_early(self, rec: Record, rank: int, tenant: str, weight: float, now: float) -> None:
        """Answer now what the queue could only answer late: full, or a first token the budget cannot reach."""
        q, cfg = self.queue, self.cfg
        over = q.over_share(tenant, weight)
        status = 429 if over else 503
        rate = self.rates.drain_rate(now) or self.rates.little(self.running())
        if q.n >= cfg.max_queue:
            wait = q.n / rate if rate else 1.0
            self.shed(rec, "queue_full", status, wait, f"the gateway's queue is full ({q.n} requests wait)"
                      + (" and this key holds more than its share of it" if over else ""))
        due = first_due(rec)
        if cfg.shed and rate:  # to its first token: those ahead of it and itself drained at ``rate``, then a TTFT
            wait = (q.ahead_of(rank, tenant, due, weight) + 1) / rate + (self.rates.ttft or 0.0)
            if now + wait * SHED_MARGIN > due:
                budget = min(rec.deadlines.ttft_s, rec.deadlines.total_s)
                self.shed(rec, "deadline_unmeetable", status, wait,
                          f"the first token would come in about {wait:.2f}s (queue of {q.n} draining at {rate:.1f}/s), "
                          f"past this request's ttft budget of {budget:g}s" + (
                              "; this key holds more than its share of the queue" if over else ""))

    def running(self) -> int:
        """How many the prefills run at a time for us, at their limits (a cold start's drain rate: ``Rates.little``)."""
        now = self.clock()  # not ``available``: that moves a cooled-down breaker to half-open, the routing's step
        return sum(w.limit(now) or 0 for w in self.routing.pool.prefill if w.state in RUNNING)

    def too_late(self, e: Entry) -> Shed | None:
        """A queued request whose turn comes too late: less of its TTFT budget left than a dispatched request now
        takes to its first token (``Rates.ttft``). Sent on, the engine would spend its prefill on an answer nobody
        gets in time, and the requests behind it would wait for that too."""
        now, ttft = self.clock(), self.rates.expected_ttft()
        if not self.cfg.shed or ttft is None or now + ttft <= e.deadline:
            return None
        self.metrics.shed("deadline_unmeetable", e.tenant)
        return Shed(f"the first token would come in about {ttft:.2f}s from now (what a dispatched request takes), "
                    f"past this request's ttft budget, which ends in {max(0.0, e.deadline - now):.2f}s",
                    code="deadline_unmeetable", status=503, retry_after_s=1)

    def cut(self, w: Worker, until: float) -> None:
        """The engine said it is full (429/503): no more than it holds until ``until``; then the queue moves."""
        w.slots.cut_until = until
        self.pump_at(until)

    def shed(self, rec: Record, code: str, status: int, wait: float, message: str) -> None:
        self.metrics.shed(code, rec.tenant or "")
        raise Shed(message, code=code, status=status, retry_after_s=max(1, math.ceil(wait)))

    def pump_at(self, when: float) -> None:
        """Pump again at ``when`` (gateway clock): a back-off or a breaker's cooldown ends then, with no event."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a pure test): nothing waits either
            return
        loop.call_later(max(0.0, when - self.clock()) + 0.001, self.pump)

    def pump(self) -> None:
        """Hand the pairs with room to the requests first in order, reserved until they bind. With no healthy
        pair left at all, every waiter gets its 503 now instead of waiting out its deadline. Not re-entered:
        picking a pair may move a worker's state, whose observer pumps; that pump is done by the running one."""
        if self._pumping:
            self._again = True
            return
        self._pumping = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._pump()
        finally:
            self._pumping = False

    def _pump(self) -> None:
        q = self.queue
        if q.n and not self.routing.ready(self.clock()):
            while q.n:
                e = q.pop()
                assert e is not None
                fut = e.item[0]
                if not fut.done():
                    fut.set_exception(NoHealthyPair(NO_PAIR))
            return
        while q.n:
            e = q.peek()
            assert e is not None
            fut, avoid, view = e.item
            if fut.done():  # its waiter is ending: it leaves the queue in its own finally
                q.remove(e)
                continue
            late = self.too_late(e)
            if late is not None:  # its first token cannot come in time: answered now, no engine's work wasted on it
                q.remove(e)
                fut.set_exception(late)
                continue
            try:
                pair = self.pick(avoid, view)
            except Exception as exc:  # a policy that fails on this request ends this request, not the queue
                q.remove(e)
                fut.set_exception(exc)
                continue
            if pair is None:
                return
            if e.gone or fut.done():  # the pick moved a worker, whose observer's pump changed the queue
                continue
            q.take(e)
            for w in pair:
                w.slots.reserved += 1
            fut.set_result(pair)

