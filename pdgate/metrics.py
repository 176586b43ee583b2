"""Every gateway metric, declared here (prefix ``pdgate_``, units in names, no request ids).

Request metrics come from record transitions (``Metrics.on_transition``) and a few
explicit hooks (aborts, retries, deadlines); worker gauges are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdgate.record import LIVE, Phase, Record

disable_created_metrics()  # type: ignore[no-untyped-call]  # the *_created series double the scrape size and nobody reads them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdgate_requests", "Finished requests by route and outcome", ["route", "outcome"], registry=r)
        self.live = Gauge("pdgate_live_requests", "Live requests by phase", ["phase"], registry=r)
        self.phase_seconds = Histogram("pdgate_phase_duration_seconds", "Time spent in each phase", ["phase"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pdgate_ttft_seconds", "Admission to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdgate_e2e_seconds", "Admission to terminal outcome", ["outcome"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.deadlines = Counter("pdgate_deadline_expired", "Deadline expiries by budget and phase", ["budget", "phase"],
                                 registry=r)
        self.aborts = Counter("pdgate_aborts_sent", "Aborts sent to engines by role and result", ["role", "result"],
                              registry=r)
        self.retries = Counter("pdgate_retries", "Retries by reason", ["reason"], registry=r)
        self.restarts = Counter("pdgate_worker_restarts", "Worker restarts detected", ["worker"], registry=r)
        self.lost = Counter("pdgate_worker_lost_requests", "Live requests failed or retried at once because their worker was lost",
                            ["worker"], registry=r)
        self.orphans = Gauge("pdgate_engine_orphans", "Orphaned requests found on the worker in the last reconcile pass",
                             ["worker"], registry=r)
        self.drift = Gauge("pdgate_worker_drift", "Engine-held requests above our live count (count mode)", ["worker"],
                           registry=r)
        self.reconcile_aborts = Counter("pdgate_reconcile_aborts", "Aborts sent by reconciliation", ["worker", "mode"],
                                        registry=r)
        self._live = {p: self.live.labels(p.value) for p in LIVE}
        self._phase = {p: self.phase_seconds.labels(p.value) for p in LIVE}
        for p in LIVE:
            self._live[p].set(0)

    def on_transition(self, rec: Record, frm: Phase, to: Phase, spent: float) -> None:
        if frm in self._live:
            self._live[frm].dec()
            self._phase[frm].observe(spent)
        if to in self._live:
            self._live[to].inc()
        elif to.terminal:
            self.requests.labels(rec.route, to.value).inc()
            self.e2e.labels(to.value).observe((rec.finished_at or 0.0) - rec.created)
            if rec.first_token_at is not None:
                self.ttft.observe(rec.first_token_at - rec.created)

    def on_admit(self, rec: Record) -> None:
        self._live[Phase.QUEUED].inc()

    def add_collector(self, fn: Callable[[], Iterator[Metric]]) -> None:
        class _C(Collector):
            def collect(self) -> Iterator[Metric]:
                return fn()

        self.registry.register(_C())

    def render(self) -> bytes:
        return generate_latest(self.registry)


def worker_families(workers: list[Any], now: float, oldest_age: float) -> Iterator[Metric]:
    up = GaugeMetricFamily("pdgate_worker_up", "1 if the worker passes health checks", labels=["worker", "role"])
    br = GaugeMetricFamily("pdgate_worker_breaker_open", "1 if the worker's circuit breaker is open", labels=["worker"])
    dg = GaugeMetricFamily("pdgate_worker_degraded", "1 if the worker holds our requests without progress",
                           labels=["worker"])
    ld = GaugeMetricFamily("pdgate_worker_live_requests", "Our live requests bound to the worker", labels=["worker"])
    for w in workers:
        up.add_metric([w.id, w.role], 1.0 if w.healthy else 0.0)
        br.add_metric([w.id], 0.0 if w.breaker.state.value == "closed" else 1.0)
        dg.add_metric([w.id], 1.0 if w.degraded else 0.0)
        ld.add_metric([w.id], float(w.load))
    yield from (up, br, dg, ld)
    old = GaugeMetricFamily("pdgate_oldest_live_request_age_seconds", "Age of the oldest live request")
    old.add_metric([], oldest_age)
    yield old
