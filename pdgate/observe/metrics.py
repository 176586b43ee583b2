"""Every gateway metric, declared here (prefix ``pdgate_``, units in names, no request ids).

Request metrics come from record transitions (``Metrics.on_transition``) and a few
explicit hooks (aborts, retries, deadlines); worker gauges are read at scrape time.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from pdgate.core.record import LIVE, Phase, Record, phase_label

disable_created_metrics()  # type: ignore[no-untyped-call]  # the *_created series double the scrape size and nobody reads them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
OTHER_MODEL = "other"  # a model label for names the workers do not serve (labels stay bounded)


class Hist:
    """A histogram kept as plain counts: the per-request path must not take prometheus_client's lock.

    prometheus_client's ``Histogram.observe`` costs a label lookup and a mutex per bucket
    update; the request path makes five to eight observations per request. These counts
    are turned into a ``HistogramMetricFamily`` at scrape time (prometheus_client's own
    custom-collector API), so the exposition is the library's."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.total += v

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, n in zip((*(str(float(b)) for b in self.bounds), "+Inf"), self.counts, strict=True):
            acc += n
            out.append((bound, float(acc)))
        return out


def hist_family(name: str, doc: str, labels: list[str], hists: dict[tuple[str, ...], Hist]) -> Metric:
    fam = HistogramMetricFamily(name, doc, labels=labels)
    for key, h in hists.items():
        fam.add_metric(list(key), h.buckets(), h.total)
    return fam


# In a group of processes on one host (``pdgate serve --workers N``) each process writes its series into
# prometheus-client's multiprocess files (its own, by pid) and any process's /metrics merges the directory with the
# library's MultiProcessCollector: counters and histograms summed; these gauges summed or their maximum taken, every
# other gauge kept per process (a ``pid`` label: a worker's state is each process's view, not a sum).
GAUGE_MODES = {"pdgate_live_requests": "livesum", "pdgate_queue_depth": "livesum", "pdgate_tenant_live_requests": "livesum",
               "pdgate_oldest_live_request_age_seconds": "livemax"}
FLUSH_S = 1.0  # how often a process of a group writes its files (what another process's scrape shows is this old)


class SharedFiles:
    """This process's series in a multiprocess directory: written whole at each ``flush``, off the request path
    (the request path keeps plain counts: ``Hist``)."""

    def __init__(self, directory: Path, registry: CollectorRegistry) -> None:
        self.dir, self.registry, self.pid = directory, registry, os.getpid()
        self.files: dict[str, MmapedDict] = {}
        self.keys: dict[tuple[str, str, tuple[tuple[str, str], ...]], str] = {}

    def _file(self, typ: str) -> MmapedDict:
        f = self.files.get(typ)
        if f is None:
            f = self.files[typ] = MmapedDict(str(self.dir / f"{typ}_{self.pid}.db"))  # type: ignore[no-untyped-call]
        return f

    def _key(self, metric: Metric, sample: str, labels: dict[str, str]) -> str:
        k = (metric.name, sample, tuple(labels.items()))
        key = self.keys.get(k)
        if key is None:
            key = self.keys[k] = mmap_key(metric.name, sample, list(labels), list(labels.values()), metric.documentation)
        return key

    def flush(self) -> None:
        for typ, key, value in self._values():
            self._file(typ).write_value(key, value, 0.0)  # type: ignore[no-untyped-call]

    def _values(self) -> Iterator[tuple[str, str, float]]:
        for m in self.registry.collect():
            if m.type in ("counter", "gauge"):
                typ = "counter" if m.type == "counter" else "gauge_" + GAUGE_MODES.get(m.name, "liveall")
                for smp in m.samples:
                    yield typ, self._key(m, smp.name, smp.labels), smp.value
            elif m.type == "histogram":  # the files hold each bucket's own count (the collector accumulates)
                below: dict[tuple[tuple[str, str], ...], float] = {}
                for smp in m.samples:
                    if smp.name.endswith("_bucket"):
                        rest = tuple((k, v) for k, v in smp.labels.items() if k != "le")
                        yield "histogram", self._key(m, smp.name, smp.labels), smp.value - below.get(rest, 0.0)
                        below[rest] = smp.value
                    elif smp.name.endswith("_sum"):
                        yield "histogram", self._key(m, smp.name, smp.labels), smp.value

    def close(self) -> None:
        for f in self.files.values():
            f.close()  # type: ignore[no-untyped-call]
        self.files.clear()

    def render(self) -> bytes:
        self.flush()
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=str(self.dir))  # type: ignore[no-untyped-call]
        return generate_latest(merged)


def process_gone(directory: Path, pid: int) -> None:
    """A group's process exited: its live gauges go (its counters stay in the sums, as counters do)."""
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


class Metrics:
    def __init__(self, live_phases: Callable[[], dict[Phase, int]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.shared: SharedFiles | None = None  # set in a process of a group (``share``)
        r = self.registry
        # per-request series: plain counts, rendered at scrape time (see Hist)
        self.finished: dict[tuple[str, str], int] = {}  # (route, outcome) -> count
        self.phase_hist = {p: Hist() for p in LIVE}
        self.ttft_hist: dict[str, Hist] = {}  # by model
        self.e2e_hist: dict[str, Hist] = {}
        # by model (a served model's name, "" for none given, OTHER_MODEL for any other: bounded)
        self.models: Callable[[], frozenset[str]] = frozenset
        self.model_finished: dict[tuple[str, str], int] = {}  # (model, outcome) -> count
        self.tokens: dict[tuple[str, str], int] = {}  # (model, prompt|completion) -> tokens
        self.tpot_hist: dict[str, Hist] = {}
        self.live_phases = live_phases or dict
        self.deadlines = Counter("pdgate_deadline_expired", "Deadline expiries by budget and phase", ["budget", "phase"],
                                 registry=r)
        self.aborts = Counter("pdgate_aborts_sent", "Aborts sent to engines by role and result", ["role", "result"],
                              registry=r)
        self.retries = Counter("pdgate_retries", "Retries by reason", ["reason"], registry=r)
        self.worker_transitions = Counter("pdgate_worker_transitions", "Worker state changes by the state entered",
                                          ["worker", "state"], registry=r)
        self.restarts = Counter("pdgate_worker_restarts", "Worker restarts detected", ["worker"], registry=r)
        self.lost = Counter("pdgate_worker_lost_requests", "Live requests failed or retried at once because their worker was lost",
                            ["worker"], registry=r)
        self.orphans = Gauge("pdgate_engine_orphans", "Orphaned requests found on the worker in the last reconcile pass",
                             ["worker"], registry=r)
        self.drift = Gauge("pdgate_worker_drift", "Engine-held requests above our live count (count mode)", ["worker"],
                           registry=r)
        self.reconcile_aborts = Counter("pdgate_reconcile_aborts", "Aborts sent by reconciliation", ["worker", "mode"],
                                        registry=r)
        # by tenant: key names from the config only (never a key, never an id); plain counts like the above
        self.tenant_finished: dict[tuple[str, str], int] = {}  # (tenant, outcome) -> count
        self.tenant_tok: dict[tuple[str, str], int] = {}  # (tenant, prompt|completion) -> tokens
        self.rejected: dict[tuple[str, str], int] = {}  # (tenant, reason) -> count
        # admission control
        self.queued = 0  # requests that waited in the gateway's queue
        self.queue_wait = Hist()
        self.sheds: dict[tuple[str, str], int] = {}  # (reason, tenant) -> count
        self.queue_depth: Callable[[], int] = lambda: 0
        self.admin_actions = Counter("pdgate_admin_actions", "Admin-plane actions by actor (admin key name), action "
                                     "and HTTP status", ["actor", "action", "status"], registry=r)
        self.add_collector(self._request_families)

    def on_transition(self, rec: Record, frm: Phase, to: Phase, spent: float) -> None:
        h = self.phase_hist.get(frm)
        if h is not None:
            h.observe(spent)
        if to.terminal:
            if to is Phase.DEADLINE_EXCEEDED:
                self.deadlines.labels(rec.budget or "", phase_label(frm)).inc()
            outcome: str = to._value_  # ``to.value`` without the property's calls (once a request, on every one)
            key = (rec.route, outcome)
            self.finished[key] = self.finished.get(key, 0) + 1
            e2e = self.e2e_hist.get(outcome)
            if e2e is None:
                e2e = self.e2e_hist[outcome] = Hist()
            e2e.observe((rec.finished_at or 0.0) - rec.created)
            model = self.model_label(rec.model)
            mk = (model, outcome)
            self.model_finished[mk] = self.model_finished.get(mk, 0) + 1
            if rec.first_token_at is not None:
                self._hist(self.ttft_hist, model).observe(rec.first_token_at - rec.created)
                n = rec.completion_tokens if rec.completion_tokens is not None else rec.chunks
                if rec.last_token_at is not None and n > 1:  # time per output token after the first
                    self._hist(self.tpot_hist, model, TPOT_BUCKETS).observe(
                        (rec.last_token_at - rec.first_token_at) / (n - 1))
            for kind, n in (("prompt", rec.prompt_tokens or 0),
                            ("completion", rec.completion_tokens if rec.completion_tokens is not None else rec.chunks)):
                if n:
                    self.tokens[(model, kind)] = self.tokens.get((model, kind), 0) + n
            if rec.tenant is not None:
                tk = (rec.tenant, outcome)
                self.tenant_finished[tk] = self.tenant_finished.get(tk, 0) + 1

    def model_label(self, model: str | None) -> str:
        if model is None:
            return ""
        return model if model in self.models() else OTHER_MODEL

    @staticmethod
    def _hist(table: dict[str, Hist], key: str, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> Hist:
        h = table.get(key)
        if h is None:
            h = table[key] = Hist(bounds)
        return h

    def tenant_tokens(self, tenant: str | None, prompt: int, completion: int) -> None:
        if tenant is not None:
            for kind, n in (("prompt", prompt), ("completion", completion)):
                self.tenant_tok[(tenant, kind)] = self.tenant_tok.get((tenant, kind), 0) + n

    def shed(self, reason: str, tenant: str) -> None:
        self.sheds[(reason, tenant)] = self.sheds.get((reason, tenant), 0) + 1

    def reject(self, tenant: str, reason: str) -> None:
        """A request refused before admission: ``reason`` is unauthenticated, forbidden, concurrency, requests
        or tokens (tenant ``unknown`` when no valid key came)."""
        self.rejected[(tenant, reason)] = self.rejected.get((tenant, reason), 0) + 1

    def _request_families(self) -> Iterator[Metric]:
        req = CounterMetricFamily("pdgate_requests", "Finished requests by route and outcome", labels=["route", "outcome"])
        for (route, outcome), n in sorted(self.finished.items()):
            req.add_metric([route, outcome], float(n))
        yield req
        live = GaugeMetricFamily("pdgate_live_requests", "Live requests by phase", labels=["phase"])
        counts = self.live_phases()
        for p in LIVE:
            live.add_metric([p.value], float(counts.get(p, 0)))
        yield live
        yield hist_family("pdgate_phase_duration_seconds", "Time spent in each phase", ["phase"],
                          {(p.value,): h for p, h in self.phase_hist.items()})
        yield hist_family("pdgate_ttft_seconds", "Admission to first token, by model", ["model"],
                          {(k,): h for k, h in sorted(self.ttft_hist.items())})
        yield hist_family("pdgate_tpot_seconds", "Time per output token after the first (streams), by model", ["model"],
                          {(k,): h for k, h in sorted(self.tpot_hist.items())})
        yield hist_family("pdgate_e2e_seconds", "Admission to terminal outcome", ["outcome"],
                          {(k,): h for k, h in sorted(self.e2e_hist.items())})
        depth = GaugeMetricFamily("pdgate_queue_depth", "Requests waiting in the gateway's admission queue")
        depth.add_metric([], float(self.queue_depth()))
        yield depth
        queued = CounterMetricFamily("pdgate_queued", "Requests that waited in the admission queue")
        queued.add_metric([], float(self.queued))
        yield queued
        yield hist_family("pdgate_queue_wait_seconds", "Time spent waiting in the admission queue", [],
                          {(): self.queue_wait})
        tables: tuple[tuple[str, str, list[str], dict[tuple[str, str], int]], ...] = (
                ("pdgate_shed", "Requests answered at once by admission control, by reason and tenant",
                 ["reason", "tenant"], self.sheds),
                ("pdgate_tenant_requests", "Finished requests by tenant (client key name) and outcome",
                 ["tenant", "outcome"], self.tenant_finished),
                ("pdgate_tenant_tokens", "Tokens by tenant and kind (prompt, completion)", ["tenant", "kind"],
                 self.tenant_tok),
                ("pdgate_tenant_rejected", "Requests refused before admission by tenant and reason", ["tenant", "reason"],
                 self.rejected),
                ("pdgate_model_requests", "Finished requests by model and outcome", ["model", "outcome"],
                 self.model_finished),
                ("pdgate_tokens", "Tokens by model and kind (prompt: from the engines' usage, when they report it; "
                 "completion: from usage, or the events a stream relayed)", ["model", "kind"], self.tokens))
        for name, doc, labels, table in tables:
            fam = CounterMetricFamily(name, doc, labels=labels)
            for key, n in sorted(table.items()):
                fam.add_metric(list(key), float(n))
            yield fam

    def add_collector(self, fn: Callable[[], Iterator[Metric]]) -> None:
        class _C(Collector):
            def collect(self) -> Iterator[Metric]:
                return fn()

        self.registry.register(_C())

    def share(self, directory: Path) -> None:
        """Write this process's series into the group's multiprocess directory; render the merge."""
        directory.mkdir(mode=0o700, exist_ok=True)
        self.shared = SharedFiles(directory, self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry) if self.shared is None else self.shared.render()


def worker_families(workers: list[Any], now: float, oldest_age: float, stale_retries: int = 0) -> Iterator[Metric]:
    up = GaugeMetricFamily("pdgate_worker_up", "1 if the worker passes health checks", labels=["worker", "role"])
    br = GaugeMetricFamily("pdgate_worker_breaker_open", "1 if the worker's circuit breaker is open", labels=["worker"])
    dg = GaugeMetricFamily("pdgate_worker_degraded", "1 if the worker holds our requests without progress",
                           labels=["worker"])
    ld = GaugeMetricFamily("pdgate_worker_live_requests", "Our live requests bound to the worker", labels=["worker"])
    lim = GaugeMetricFamily("pdgate_worker_limit", "Requests the worker may hold now (admission: configured, learned or "
                            "reported capacity; absent: no cap)", labels=["worker", "source"])
    base = GaugeMetricFamily("pdgate_worker_baseline_latency_seconds", "The learned limit's no-load latency (prefill: "
                             "dispatch to first token; decode: gap between events)", labels=["worker"])
    for w in workers:
        cap = w.limit(now)
        learned = w.slots.learned
        if cap is not None:
            lim.add_metric([w.id, "configured" if w.slots.configured else "learned" if learned else "engine"], float(cap))
        if learned is not None and learned.baseline is not None:
            base.add_metric([w.id], learned.baseline)
        up.add_metric([w.id, w.role], 1.0 if w.healthy else 0.0)
        br.add_metric([w.id], 0.0 if w.breaker.state.value == "closed" else 1.0)
        dg.add_metric([w.id], 1.0 if w.degraded else 0.0)
        ld.add_metric([w.id], float(w.load))
    yield from (up, br, dg, ld, lim, base)
    old = GaugeMetricFamily("pdgate_oldest_live_request_age_seconds", "Age of the oldest live request")
    old.add_metric([], oldest_age)
    yield old
    st = CounterMetricFamily("pdgate_upstream_stale_retries", "Requests sent again on a fresh connection because the "
                             "reused one had been closed by the engine (its keep-alive close racing ours)")
    st.add_metric([], float(stale_retries))
    yield st


def policy_families(policies: dict[str, Any]) -> Iterator[Metric]:
    """Each role's policy decisions (session: sticky, moved, new, none; cache_aware: cache, new, balance, only)."""
    c = CounterMetricFamily("pdgate_policy_decisions", "Worker choices by the request-aware policies, by what decided",
                            labels=["role", "policy", "decision"])
    for role, pol in policies.items():
        for decision, n in pol.decisions.items():
            c.add_metric([role, pol.name, decision], float(n))
    yield c
