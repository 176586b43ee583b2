"""Reconciliation: the gateway and the engines agree on the set of live requests.

Every rid pdgate issues names the gateway instance that owns it (``pdgate.rid``). Each ``reconcile.interval_s``,
per worker, through its engine adapter:

- **exact mode** (the engine lists the rids it holds: ``Engine.held``): a rid older than
  ``grace_s`` is an *orphan* when its owner is this instance and it is not the current
  attempt of a live request (finished, retried away, or its abort was lost), or when its
  owner is another instance whose lease has lapsed. Orphans are aborted by rid.
- **count mode** (an engine that lists nothing, as plain SGLang): the engine's count of what it holds in the
  queues of the worker's role (``Probe.held``, from the last health check) against our live count on it; an excess seen ``drift_checks`` times in a row is
  drift: the aborts of the worker's recently ended rids are sent again, and drift is shown.
  Count mode cannot tell our requests from others' and never aborts anything it cannot name.

Leases: a gateway's lease is its instance id served at ``GET /v1/lease``; each gateway reads
its ``peers``' leases every pass. Another instance's rids are only touched once that
instance has been seen neither as a peer's current lease nor in this process for ``lease_s``
(a peer that restarted has a new instance id, so its old one lapses). A live gateway keeps
answering with its instance id, so two gateways never abort each other's live requests. The
processes of one ``pdgate serve --workers N`` know each other from their record files
(``pdgate.multi``), and a peer that is such a group names all its instances in its lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from pdgate.config import GatewayConfig
from pdgate.metrics import Metrics
from pdgate.rid import Rid
from pdgate.traces import Traces
from pdgate.upstream import Upstream
from pdgate.workers import Pool, Worker

log = logging.getLogger("pdgate.reconcile")


class Reconciler:
    def __init__(self, cfg: GatewayConfig, instance: str, pool: Pool, traces: Traces, metrics: Metrics,
                 recent: deque[tuple[str, str, float]], upstream: Upstream, clock: Callable[[], float]) -> None:
        self.gcfg, self.cfg = cfg, cfg.reconcile
        self.instance, self.pool, self.traces, self.metrics = instance, pool, traces, metrics
        self.recent, self.upstream, self.clock = recent, upstream, clock
        self.seen: dict[str, float] = {}  # instance id -> last time it was known alive
        self.drift_runs: dict[str, int] = {}
        self.drift_since: dict[str, float] = {}
        # the instance ids of this gateway's sibling processes (``pdgate.multi``: their record files)
        self.siblings: Callable[[], Iterable[str]] = tuple

    # ---- facts ------------------------------------------------------------------------
    def live_rids(self) -> set[str]:
        return {r.attempts[-1].rid for r in self.traces.live.values() if r.attempts}

    async def refresh_leases(self) -> None:
        now = self.clock()
        self.seen[self.instance] = now
        for inst in self.siblings():
            self.seen[inst] = now
        for peer in self.gcfg.peers:
            try:
                status, body = await self.upstream.get_json(peer.rstrip("/") + "/v1/lease", 2.0)
            except OSError:
                continue
            if status == 200 and isinstance(body, dict) and isinstance(body.get("instance"), str):
                self.seen[body["instance"]] = now
                for inst in body.get("instances") or ():  # a peer of several processes names them all
                    if isinstance(inst, str):
                        self.seen[inst] = now

    def lapsed(self, inst: str) -> bool:
        """Whether another instance's lease has lapsed; first sight of an instance starts its clock."""
        if inst == self.instance:
            return False
        now = self.clock()
        return now - self.seen.setdefault(inst, now) >= self.cfg.lease_s

    # ---- one pass --------------------------------------------------------------------------
    async def run_once(self) -> None:
        await self.refresh_leases()
        await asyncio.gather(*(self.check(w) for w in list(self.pool.by_id.values()) if w.healthy))

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
            if (rid.instance == self.instance and h.rid not in live) or self.lapsed(rid.instance):
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
        except OSError:
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


def lease(instance: str, lease_s: float) -> dict[str, Any]:
    return {"instance": instance, "lease_s": lease_s}
