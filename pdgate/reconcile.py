"""Reconciliation: the gateway and the engines agree on the set of live requests.

Every rid pdgate issues names the gateway instance that owns it (``pdgate.rid``). Each ``reconcile.interval_s``,
per worker, through its engine adapter:

- **exact mode** (the engine lists the rids it holds: ``Engine.held``): a rid older than ``grace_s`` is an
  *orphan* when its instance is this one and it is not the current attempt of a live request (finished,
  retried away, or its abort was lost), or when its instance is gone: it was in the store's registry and its
  entry expired (``pdgate.store``). Nothing else makes an instance gone: with the embedded store (one process)
  another gateway's rids are never touched, an instance the store never knew is not this store's to judge, and
  while the store cannot be reached nobody is gone. Orphans are aborted by rid.
- **count mode** (an engine that lists nothing, as plain SGLang): the engine's count of what it holds in the
  queues of the worker's role (``Probe.held``, from the last health check) against what every live instance
  holds on it (``Worker.load``: ours and the others' the store reports); an excess seen ``drift_checks`` times
  in a row is drift: the aborts of the worker's recently ended rids are sent again, and drift is shown.

And each pass, with a shared store: the rids a gone instance held at its last heartbeat are aborted on their
workers (one survivor claims each gone instance), in both modes: a killed replica leaves nothing pinned.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from pdgate.config import GatewayConfig
from pdgate.metrics import Metrics
from pdgate.rid import Rid
from pdgate.store.base import Store
from pdgate.traces import Traces
from pdgate.workers import Pool, Worker

log = logging.getLogger("pdgate.reconcile")


class Reconciler:
    def __init__(self, cfg: GatewayConfig, instance: str, pool: Pool, traces: Traces, metrics: Metrics,
                 recent: deque[tuple[str, str, float]], store: Store, clock: Callable[[], float]) -> None:
        self.gcfg, self.cfg = cfg, cfg.reconcile
        self.instance, self.pool, self.traces, self.metrics = instance, pool, traces, metrics
        self.recent, self.store, self.clock = recent, store, clock
        self.gone_now: set[str] = set()  # the gone instances at this pass (empty: the store cannot say)
        self.drift_runs: dict[str, int] = {}
        self.drift_since: dict[str, float] = {}

    def live_rids(self) -> set[str]:
        return {r.attempts[-1].rid for r in self.traces.live.values() if r.attempts}

    def gone(self, inst: str) -> bool:
        """Whether another instance is gone: the store knew it and its entry expired (never a guess)."""
        return inst != self.instance and inst in self.gone_now

    async def run_once(self) -> None:
        self.gone_now = set(await self.store.gone()) if self.store.shared else set()
        await asyncio.gather(*(self.check(w) for w in list(self.pool.by_id.values()) if w.healthy))
        if self.gone_now:
            await self.reap()

    async def reap(self) -> None:
        """Abort what gone instances held (by rid, on the workers it was on), then forget them."""
        for inst in sorted(self.gone_now - {self.instance}):
            rids = await self.store.rids_of(inst)
            if rids is None:  # another survivor claimed it
                continue
            for rid, wids in rids.items():
                for wid in wids:
                    w = self.pool.by_id.get(wid)
                    if w is not None:
                        await self.abort(w, rid, "gone")
            if rids:
                log.warning("gateway instance %s is gone: aborted its %d live requests on the engines", inst, len(rids))
            await self.store.forget(inst)

    async def check(self, w: Worker) -> None:
        if w.info.lists_rids:
            await self.exact(w)
        else:
            await self.count(w)

    async def exact(self, w: Worker) -> None:
        held = await w.engine.held(w.url, 2.0)
        if held is None:
            return
        live = self.live_rids()
        orphans = []
        for h in held:
            rid = Rid.parse(h.rid)
            if rid is None or not rid.attempt or h.age_s < self.cfg.grace_s:
                continue
            if (rid.instance == self.instance and h.rid not in live) or self.gone(rid.instance):
                orphans.append(h)
        w.orphans = len(orphans)
        self.metrics.orphans.labels(w.id).set(len(orphans))
        for h in orphans:
            log.warning("orphan on %s: rid=%s queue=%s age=%.1fs -> abort", w.id, h.rid, h.queue, h.age_s)
            await self.abort(w, h.rid, "exact")

    async def count(self, w: Worker) -> None:
        held = w.info.held or 0
        excess = held - w.load
        w.drift = max(0, excess)
        self.metrics.drift.labels(w.id).set(w.drift)
        runs = self.drift_runs[w.id] = self.drift_runs.get(w.id, 0) + 1 if excess > 0 else 0
        if runs == 1:
            self.drift_since[w.id] = self.clock()
        if runs < self.cfg.drift_checks:
            return
        # rids that ended up to a health refresh and a pass before the excess was first seen
        since = self.drift_since[w.id] - (self.cfg.interval_s + self.gcfg.health.interval_s + self.cfg.grace_s)
        rids = [rid for wid, rid, ended in self.recent if wid == w.id and ended >= since]
        if rids:
            log.warning("drift on %s: engine holds %d, we hold %d; re-aborting %d recent rids", w.id, held, w.load, len(rids))
        for rid in rids:
            await self.abort(w, rid, "count")
        self.drift_runs[w.id] = 0

    async def abort(self, w: Worker, rid: str, mode: str) -> None:
        try:
            await w.engine.abort(w.url, rid)
            result = "ok"
        except Exception:  # refused, reset, timed out: counted, the next pass tries again where it can
            result = "error"
        self.metrics.reconcile_aborts.labels(w.id, mode).inc()
        rec = self.traces.get(rid)
        if rec is not None:
            for a in rec.attempts:
                if a.rid == rid:
                    a.event(self.clock(), "reconcile_abort", f"{w.role} {w.id}: {mode} {result}")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.run_once()
            except Exception:  # a reconciler must survive anything an engine answers
                log.exception("reconcile pass failed")
