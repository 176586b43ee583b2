"""Reconciliation: the gateway and the engines agree on the set of live requests.

Every rid pdgate issues names the gateway instance that owns it (``pdgate.core.rid``). Each ``reconcile.interval_s``,
per worker, through its engine adapter:

- **exact mode** (the engine lists the rids it holds: ``Engine.held``): a rid older than ``grace_s`` is an
  *orphan* when its instance is this one and it is not the current attempt of a live request (finished,
  retried away, or its abort was lost), or when its instance is gone: it was in the store's registry and its
  entry expired (``pdgate.store``), or it is a predecessor, a process of this state directory that is not running
  any more (``pdgate.pool.lineage``). Nothing else makes an instance gone: a live replica's rids (another process on
  the same state directory, or any process on another) are never touched, an instance neither the store nor the
  state directory knew is not ours to judge, and while the store cannot be reached nobody is gone by its word.
  Orphans are aborted by rid, on every pass while they are listed (an abort an engine without fix A lost is sent
  again).
- **count mode** (an engine that lists nothing, as plain SGLang): the engine's count of what it holds in the
  queues of the worker's role (``Probe.held``, from the last health check) against what every live instance
  holds on it (``Worker.load``: ours and the others' the store reports); an excess seen ``drift_checks`` times
  in a row is drift: the aborts of the worker's recently ended rids are sent again, and drift is shown.

And each pass: the rids a gone instance held (at its last heartbeat in a shared store; at its last record in the
state directory: live ones and those that ended lately) are aborted on their workers, in both modes (one survivor
or successor claims each gone instance); on a worker that lists nothing they are sent again on the next
``REPEATS`` passes unless its count shows nothing above what the live instances hold: a killed gateway, a
restarted one's predecessor, leaves nothing pinned.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from pdgate.core.config import GatewayConfig
from pdgate.core.rid import Rid
from pdgate.observe.metrics import Metrics
from pdgate.observe.traces import Traces
from pdgate.pool.lineage import Lineage
from pdgate.pool.workers import Pool, Worker
from pdgate.store.base import Store

log = logging.getLogger("pdgate.reconcile")
REPEATS = 5  # count mode: a gone instance's aborts are sent again on this many passes at most
DEPARTED = 256  # gone instances remembered (their rids stay orphans while an engine lists them)
PENDING = 50_000  # bound on the aborts waiting to be sent again


class Reconciler:
    def __init__(self, cfg: GatewayConfig, instance: str, pool: Pool, traces: Traces, metrics: Metrics,
                 recent: deque[tuple[str, str, float]], store: Store, clock: Callable[[], float],
                 lineage: Lineage | None = None) -> None:
        self.gcfg, self.cfg = cfg, cfg.reconcile
        self.instance, self.pool, self.traces, self.metrics = instance, pool, traces, metrics
        self.recent, self.store, self.clock = recent, store, clock
        self.lineage = lineage or Lineage(None, instance)
        self.gone_now: set[str] = set()  # the gone instances found at this pass
        self.departed: dict[str, None] = {}  # every gone instance found so far, oldest first (bounded)
        self.again: dict[tuple[str, str], int] = {}  # (worker id, rid) of a gone instance -> sends left (count mode)
        self.drift_runs: dict[str, int] = {}
        self.drift_since: dict[str, float] = {}
        self.drift_seq: dict[str, int] = {}  # worker id -> the health check whose count was judged last

    def live_rids(self) -> set[str]:
        return {r.attempts[-1].rid for r in self.traces.live.values() if r.attempts}

    def gone(self, inst: str) -> bool:
        """Whether another instance is gone: the store knew it and its entry expired, or it is a predecessor whose
        process is not running any more (never a guess)."""
        return inst != self.instance and (inst in self.gone_now or inst in self.departed)

    async def run_once(self) -> None:
        self.gone_now = set(await self.store.gone()) if self.store.shared else set()
        self.gone_now |= set(self.lineage.predecessors())
        self.gone_now.discard(self.instance)
        for inst in self.gone_now:
            self.departed[inst] = None
        while len(self.departed) > DEPARTED:
            del self.departed[next(iter(self.departed))]
        await asyncio.gather(*(self.check(w) for w in list(self.pool.by_id.values()) if w.healthy))
        if self.again:
            await self.repeat()
        if self.gone_now:
            await self.reap()

    async def reap(self) -> None:
        """Abort what gone instances held (by rid, on the workers it was on), then forget them. Those on a worker
        that lists nothing are sent again on later passes (``repeat``)."""
        by_url = {(w.url, w.id): w for w in self.pool.by_id.values()}
        for inst in sorted(self.gone_now):
            targets: dict[tuple[str, str], Worker] = {}
            stored = await self.store.rids_of(inst) if self.store.shared else None
            for rid, wids in (stored or {}).items():
                for wid in wids:
                    if (w := self.pool.by_id.get(wid)) is not None:
                        targets[(w.id, rid)] = w
            recorded = self.lineage.claim(inst)
            for rid, urls in (recorded or {}).items():
                for (url, _), w in by_url.items():
                    if url in urls:
                        targets[(w.id, rid)] = w
            if stored is None and recorded is None:  # another survivor claimed it, or nothing is known of it
                continue
            for (wid, rid), w in targets.items():
                w.reaped[inst] = w.reaped.get(inst, 0) + 1
                while len(w.reaped) > 16:
                    del w.reaped[next(iter(w.reaped))]
                await self.abort(w, rid, "gone")
                if not w.info.lists_rids and len(self.again) < PENDING:
                    self.again[(wid, rid)] = REPEATS
            rids = {rid for _, rid in targets}
            log.warning("gateway instance %s is gone (%s): aborted its %d requests on the engines (%d aborts)", inst,
                        "a predecessor: its process is not running" if recorded is not None else "its lease expired",
                        len(rids), len(targets))
            if self.store.shared:
                await self.store.forget(inst)

    async def repeat(self) -> None:
        """A gone instance's aborts on workers that list nothing, sent again (an engine without fix A loses an
        abort that lands in its inflight queue) until the worker holds no more than the live instances do, or
        ``REPEATS`` passes."""
        for (wid, rid), left in list(self.again.items()):
            w = self.pool.by_id.get(wid)
            if w is None or w.info.lists_rids or left <= 0 or (w.probe_held is not None and w.probe_held <= w.probe_load):
                del self.again[(wid, rid)]
                continue
            self.again[(wid, rid)] = left - 1
            if w.healthy:
                await self.abort(w, rid, "gone")

    async def check(self, w: Worker) -> None:
        if w.info.lists_rids:
            await self.exact(w)
        else:
            await self.count(w)

    async def exact(self, w: Worker) -> None:
        held = await w.adapter.held(w.url, 2.0)
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
        if self.drift_seq.get(w.id) == w.probe_seq:
            return  # no new engine count since the last pass: one reading is judged once
        self.drift_seq[w.id] = w.probe_seq
        held = w.probe_held or 0
        excess = held - w.probe_load  # against what we held while that count was taken, not a later moment's
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
            log.warning("drift on %s: engine holds %d, we held %d; re-aborting %d recent rids", w.id, held, w.probe_load,
                        len(rids))
        for rid in rids:
            await self.abort(w, rid, "count")
        self.drift_runs[w.id] = 0

    async def abort(self, w: Worker, rid: str, mode: str) -> None:
        try:
            await w.adapter.abort(w.url, rid)
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
