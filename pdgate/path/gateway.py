"""The gateway assembled: every part of the request path made once, each given the few others it uses
(``docs/architecture.md``, "Parts"). Nothing on the request path reaches back here; ``server.App`` starts and
stops it, the admin plane and the health checks read its parts.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pdgate.adapters.kinds import Engines, Factory
from pdgate.adapters.upstream import Transport, Upstream
from pdgate.core.config import AdmissionConfig, ConfigError, GatewayConfig, Role, policy_names
from pdgate.core.limits import LimitRules
from pdgate.core.rid import Ids
from pdgate.observe import otel
from pdgate.observe.metrics import Metrics, policy_families, worker_families
from pdgate.observe.traces import Traces
from pdgate.path import auth
from pdgate.path.aborts import Aborts
from pdgate.path.admission import Admission
from pdgate.path.attempt import Attempts
from pdgate.path.gate import Gate
from pdgate.path.legs import Legs
from pdgate.path.messages_routes import MessagesRoute
from pdgate.path.observers import Observers
from pdgate.path.outcome import Outcomes
from pdgate.path.proxy import Pipeline
from pdgate.path.responses_routes import ResponsesRoute
from pdgate.path.scope import Tasks
from pdgate.pool import policies
from pdgate.pool.capacity import CONN_HEADROOM, UNKNOWN_MAX
from pdgate.pool.health import Health
from pdgate.pool.lineage import Lineage
from pdgate.pool.routing import Routing
from pdgate.pool.workers import Pool, State, Worker
from pdgate.store import kinds as store_kinds

log = logging.getLogger("pdgate")


def limit_rules(a: AdmissionConfig) -> dict[str, LimitRules] | None:
    """Each role's rules for a learned limit (None: not learned, ``AdmissionConfig.learns``): the prefill's only. A
    decode holds what it reports it can run (``pdgate.core.limits``: its gaps are the gateway's, the host's and the
    reader's pace as much as its own)."""
    if not a.learns:
        return None
    return {Role.PREFILL: LimitRules(initial=a.learn_initial, cap=a.learn_cap or None, tolerance=a.learn_tolerance,
                                  window_s=a.learn_window_s)}


class Gateway:
    def __init__(self, cfg: GatewayConfig, engines: dict[str, Factory] | None = None,
                 clock: Callable[[], float] = time.monotonic, transport: Transport | None = None) -> None:
        self.cfg = c = cfg
        self.clock = clock  # every part's (a test gives its own to let a minute pass)
        self.instance = cfg.instance_id or secrets.token_hex(4)
        self.upstream = Upstream(c.connect_timeout_s, c.abort_timeout_s, c.upstream_idle_s,
                                 c.upstream_max_conns or UNKNOWN_MAX + CONN_HEADROOM,
                                 c.upstream_max_idle, c.max_upstream_body_bytes, c.worker_api_key, transport)
        self.adapters = Engines(self.upstream, engines)
        self.pool = Pool(cfg.breaker, self.adapters, frozenset(cfg.models), (self._on_worker,), cfg.admission.capacity,
                         limit_rules(cfg.admission))
        self.traces = Traces(cfg.trace_ring)
        self.metrics = Metrics(self.traces.live_phases)
        # recently ended (worker id, rid, time), bounded: count-mode reconciliation re-aborts these
        self.recent: deque[tuple[str, str, float]] = deque(maxlen=cfg.reconcile.recent_rids)
        self.otel = otel.make(cfg.otel)  # None: no OpenTelemetry
        self.obs = Observers(self.metrics, self.traces, self.otel, cfg.access_log, cfg.log_format, self.recent)
        # what this process owns, where its successor finds it (the state directory: a restarted gateway aborts
        # what a killed one left pinned); kept while ended rids are within a reconciliation's reach
        rc = cfg.reconcile
        self.lineage = Lineage(cfg.state_dir, self.instance, 2 * (rc.interval_s + rc.grace_s) + cfg.health.interval_s,
                               rc.recent_rids)
        pname, dname = policy_names(cfg)
        self.store = store_kinds.make(cfg.store)  # what several gateway processes share (or this one alone)
        self.routing = Routing(self.pool, policies.make(pname, cfg.routing, self.store.shared),
                               policies.make(dname, cfg.routing, self.store.shared))
        self.gate = Gate(cfg.admission, self.routing, self.store, self.obs, self.clock)  # pairs with room, or the queue
        self.obs.watch(self.gate.on_transition)
        self.tasks = Tasks()
        self.health = Health(cfg.health, self.pool, self.gate.pump, self.clock, self._probed)
        self.tenants = auth.tenants(cfg.keys, cfg.deadlines)  # None: an open front door
        self.admins = auth.admins(cfg.admin_keys)  # None: an open admin plane (loopback only)
        aborts = Aborts(cfg, self.obs, self.tasks, self.clock)
        self.legs = legs = Legs(cfg, self.gate, self.obs, aborts, self.tasks, self.health.kick, self.clock)
        attempts = Attempts(cfg.max_attempts, self.gate, legs, self.obs, self.clock)
        self.pipeline = Pipeline(Admission(cfg, self.pool, Ids(self.instance), self.clock), attempts,
                                 Outcomes(self.obs, self.store, self.clock), self.obs, cfg.routing.session_header,
                                 self.clock)
        self.responses = ResponsesRoute(self.pipeline, self.store, cfg.responses, self.clock)
        self.messages = MessagesRoute(self.pipeline, self.pool, cfg.messages.normalise_billing, self.clock)
        self.live = self.pipeline.live
        self.metrics.queue_depth = lambda: self.gate.queue.n
        self.metrics.models = self.pool.models
        for spec in (*cfg.prefill, *cfg.decode):
            try:
                self.pool.add(spec)
            except KeyError:
                raise ConfigError(f"{spec.role}.engine", spec.engine, "no such engine kind; known: "
                                  + ", ".join(sorted(self.adapters.kinds))) from None
        self.metrics.add_collector(lambda: policy_families({Role.PREFILL: self.routing.prefill,
                                                            Role.DECODE: self.routing.decode}))
        self.metrics.add_collector(lambda: worker_families(
            list(self.pool.by_id.values()), self.now(), self.traces.oldest_age(self.now()),
            self.upstream.client.stale_retries))

    def _probed(self, w: Worker) -> None:
        """A health check passed: its connections follow what it can run now (never below its limit)."""
        self.upstream.conns(w.url, max(self.cfg.upstream_max_conns, w.slots.conns()))

    def _on_worker(self, w: Worker, frm: State, to: State, cause: str) -> None:
        """What follows a worker's move, in one place: its live requests failed over at once when it goes
        down or restarted, traces told when it degrades, metrics and a log line for every move."""
        self.metrics.worker_transitions.labels(w.id, to.value).inc()
        if to in (State.RESTARTED, State.REMOVED):  # its cache is gone (back after down is restarted too)
            self.routing.forget(w)
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

    def drain(self, detail: str | None = None) -> int:
        return self.pipeline.drain(detail)

    @property
    def background(self) -> set[asyncio.Task[Any]]:
        return self.tasks.running

    async def stop(self) -> None:
        self.drain()
        self.legs.end_graces()
        await self.tasks.stop(self.cfg.abort_timeout_s + 1 + self.cfg.abort_defer_s)
        if self.otel is not None:  # the spans still batched go out now (bounded: pdgate.observe.otel.SHUTDOWN_S)
            try:
                await self.otel.shutdown()
            except Exception:
                log.exception("OpenTelemetry shutdown failed")
        await self.upstream.close()
