"""SGLang's Prometheus metrics for the sim, computed from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.sim.worker import Engine
from pdgate.core import protocol as p

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")

# gauge name -> the sim queues it counts, per role
_GAUGES = {
    "prefill": {
        p.GAUGE_PREFILL_BOOTSTRAP: ("bootstrap",),
        p.GAUGE_PREFILL_BOOTSTRAP_OLD: ("bootstrap",),
        p.GAUGE_PREFILL_INFLIGHT: ("inflight",),
        p.GAUGE_RUNNING: ("forward",),
        p.GAUGE_QUEUE: ("waiting",),
    },
    "decode": {
        p.GAUGE_DECODE_PREALLOC: ("prealloc",),
        p.GAUGE_DECODE_TRANSFER: ("transfer",),
        p.GAUGE_RUNNING: ("running",),
        p.GAUGE_QUEUE: ("prealloc", "transfer"),
    },
}

_COUNTERS = {
    "num_requests": ("requests", "Requests received"),
    "num_aborted_requests": ("aborted", "Requests aborted"),
    "num_bootstrap_failed_reqs": ("bootstrap_failed", "Bootstrap failures"),
    "num_transfer_failed_reqs": ("transfer_failed", "KV transfer failures"),
    "num_prefill_inflight_timeout_reqs": ("inflight_timeouts", "Force-failed by the inflight watchdog (fix C)"),
    "num_lost_aborts": ("lost_aborts", "Aborts lost to the abort_race fault"),
    "num_leaked_reqs": ("leaked", "Decode requests leaked by an abort during their KV transfer (fix A off)"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens"),
    "generation_tokens": ("generation_tokens", "Generated tokens"),
    "num_prefill_forwards": ("prefill_forwards", "Prefill forwards computed (the sim's own counter)"),
    "cached_tokens": ("cached_tokens", "Prompt tokens found in the prefix cache"),
}


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        cfg = self.engine.cfg
        labels = [cfg.model, cfg.role, "0", "0"]
        counts = self.engine.queue_counts()
        for name, queues in _GAUGES[cfg.role].items():
            g = GaugeMetricFamily(f"sglang:{name}", name.replace("_", " "), labels=LABELS)
            g.add_metric(labels, float(sum(counts.get(q, 0) for q in queues)))
            yield g
        hit = GaugeMetricFamily("sglang:cache_hit_rate", "Prefix cache hit rate (prompt tokens)", labels=LABELS)
        hit.add_metric(labels, self.engine.cache.hit_rate)
        yield hit
        for name, (attr, doc) in _COUNTERS.items():
            c = CounterMetricFamily(f"sglang:{name}", doc, labels=LABELS)
            c.add_metric(labels, float(getattr(self.engine.counters, attr)))
            yield c


def make_registry(engine: Engine) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
