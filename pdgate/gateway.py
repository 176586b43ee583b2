"""The gateway's shared state, owned by ``server.App`` (started and stopped with it)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from pdgate import auth, otel, policies
from pdgate.admission import Gate
from pdgate.config import GatewayConfig, policy_names
from pdgate.metrics import Metrics, policy_families, worker_families
from pdgate.record import Attempt, Observer, Phase, Record, transition
from pdgate.scope import Cause, Reason
from pdgate.traces import Traces
from pdgate.upstream import Upstream
from pdgate.workers import Pool, State, Worker

if TYPE_CHECKING:
    from pdgate.proxy import Ctx

log = logging.getLogger("pdgate")
T = TypeVar("T")


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.instance = cfg.instance_id or secrets.token_hex(4)
        self._seq = itertools.count(1)
        self.pool = Pool(cfg.breaker, frozenset(cfg.models), (self._on_worker,), cfg.admission.capacity)
        self.traces = Traces(cfg.trace_ring)
        self.metrics = Metrics(self.traces.live_phases)
        self.observers: tuple[Observer, ...] = (self.metrics.on_transition,)
        pname, dname = policy_names(cfg)
        self.prefill_policy = policies.make(pname, cfg.routing)
        self.decode_policy = policies.make(dname, cfg.routing)
        self.live: dict[str, Ctx] = {}  # live request id -> its context (and cancel scope)
        self.background: set[asyncio.Task[Any]] = set()
        self.upstream: Upstream | None = None
        self.kicks: dict[str, asyncio.Event] = {}  # worker id -> "check me now"
        # recently ended (worker id, rid, time), bounded: count-mode reconciliation re-aborts these
        self.recent: deque[tuple[str, str, float]] = deque(maxlen=cfg.reconcile.recent_rids)
        self.clock = time.monotonic
        self.gate = Gate(self)  # admission control: pairs with room, or the queue
        self.metrics.queue_depth = lambda: self.gate.queue.n
        self.metrics.models = self.known_models
        self.tenants = auth.tenants(cfg.keys, cfg.deadlines, self.clock)  # None: an open front door
        self.admins = auth.admins(cfg.admin_keys)  # None: an open admin plane (loopback only)
        self.otel = otel.make(cfg.otel)  # None: no OpenTelemetry
        self.session_header = cfg.routing.session_header.lower()  # h1lite's header names are lower case
        for spec in (*cfg.prefill, *cfg.decode):
            self.pool.add(spec)
        self.metrics.add_collector(lambda: policy_families({"prefill": self.prefill_policy, "decode": self.decode_policy}))
        self.metrics.add_collector(lambda: worker_families(
            list(self.pool.by_id.values()), self.now(), self.traces.oldest_age(self.now()),
            self.upstream.client.stale_retries if self.upstream is not None else 0))

    def _on_worker(self, w: Worker, frm: State, to: State, cause: str) -> None:
        """What follows a worker's move, in one place: its live requests failed over at once when it goes
        down or restarted, traces told when it degrades, metrics and a log line for every move."""
        self.metrics.worker_transitions.labels(w.id, to.value).inc()
        if to in (State.RESTARTED, State.REMOVED):  # its cache is gone (back after down is restarted too)
            (self.prefill_policy if w.role == "prefill" else self.decode_policy).forget(w.id)
        if to is State.DOWN or to is State.RESTARTED:
            lost = w.lose_all(f"{to.value}: {cause}")
            self.metrics.lost.labels(w.id).inc(lost)
            if to is State.RESTARTED:
                self.metrics.restarts.labels(w.id).inc()
            if frm is not State.UNKNOWN:
                log.warning("worker %s (%s) %s: %s; %d live requests failed over", w.id, w.url, to.value, cause, lost)
        elif to is State.DEGRADED:
            for b in list(w.bound):
                b.note("worker_degraded", f"{w.id}: {cause}")
            log.warning("worker %s degraded: %s", w.id, cause)
        elif to is State.BREAKER_OPEN:
            log.warning("worker %s: %s", w.id, cause)
            self.gate.pump_at(self.now() + w.breaker.cfg.cooldown_s)  # its half-open probe may take a queued one
        else:
            log.info("worker %s %s -> %s: %s", w.id, frm.value, to.value, cause)
        self.gate.pump()  # room may have come back, or no pair be left for those who wait

    def now(self) -> float:
        return self.clock()

    def otel_safely(self, fn: Callable[..., T], *args: Any) -> T | None:
        """An OpenTelemetry call on the request path: whatever the SDK raises is logged, never the request's end."""
        try:
            return fn(*args)
        except Exception:
            log.exception("OpenTelemetry failed (the request goes on without its span)")
            return None

    def new_id(self) -> str:
        # fixed width (no id is a prefix of another: engines abort by rid prefix), in order, and unguessable:
        # a sequence number and 64 random bits (one client's id tells nothing of the next one's)
        return f"pdg-{self.instance}-{next(self._seq) & 0xFFFFFFFF:08x}{secrets.randbits(64):016x}"

    def kick(self, w: Worker) -> None:
        """Ask for an immediate health check of ``w`` (after a connection failure)."""
        ev = self.kicks.get(w.id)
        if ev is not None:
            ev.set()

    def known_models(self) -> frozenset[str]:
        return self.pool.models()

    def up(self) -> Upstream:
        assert self.upstream is not None, "gateway not started"
        return self.upstream

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Background work owned by the gateway (aborts, tails); awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())

    def move(self, rec: Record, to: Phase, reason: str | None = None) -> None:
        transition(rec, to, self.now(), self.observers, reason)

    def abort_leg(self, att: Attempt, w: Worker, answered: bool) -> None:
        """Send /abort_request for ``att`` to ``w`` in the background; results go on the trace.

        An abort that reaches the engine before the leg's own request is a no-op there
        (unknown rid), and the leg then runs orphaned. So for a leg that has not answered
        yet, the abort is repeated after ``abort_repeat_s`` delays."""
        if self.cfg.abort_legs:
            self.spawn(self._abort_repeated(att, w, () if answered else self.cfg.abort_repeat_s))

    async def _abort_repeated(self, att: Attempt, w: Worker, delays: tuple[float, ...]) -> None:
        await self._abort(att, w)
        for delay in delays:
            await asyncio.sleep(delay)
            await self._abort(att, w, "abort_repeat")

    async def _abort(self, att: Attempt, w: Worker, name: str = "abort_sent") -> None:
        att.event(self.now(), name, w.role)
        try:
            status = await self.up().abort(w.url, att.rid)
            result = "ok" if status == 200 else f"http_{status}"
        except Exception as exc:  # any failure of the call (refused, reset, timeout) goes on the trace
            result = "error"
            att.event(self.now(), "abort_error", f"{w.role}: {exc.__class__.__name__}")
        else:
            att.event(self.now(), "abort_acked", f"{w.role}: {result}")
        self.metrics.aborts.labels(w.role, result).inc()

    async def start(self) -> None:
        c = self.cfg
        self.upstream = Upstream(c.connect_timeout_s, c.abort_timeout_s, c.upstream_idle_s, c.upstream_max_conns,
                                 c.upstream_max_idle, c.max_upstream_body_bytes, c.worker_api_key)

    def drain(self, detail: str | None = None) -> int:
        """End every live request now with a terminal answer (outcome aborted, cause drain); their
        legs are aborted on the engines. Returns how many were live."""
        live = list(self.live.values())
        for ctx in live:
            ctx.cancel(Reason(Cause.DRAIN, detail=detail))
        return len(live)

    async def stop(self) -> None:
        self.drain()
        if self.background:
            await asyncio.wait(list(self.background), timeout=self.cfg.abort_timeout_s + 1)
        if self.otel is not None:  # the spans still batched go out now (bounded: pdgate.otel.SHUTDOWN_S)
            try:
                await self.otel.shutdown()
            except Exception:
                log.exception("OpenTelemetry shutdown failed")
        if self.upstream is not None:
            await self.upstream.close()
