"""Reconciliation: the gateway and the engines agree on the set of live requests.

Every rid pdgate issues is ``pdg-<instance>-<seq><random>.<attempt>``: the instance id tags its owner.
Each ``reconcile.interval_s``, per worker:

- **exact mode** (the worker offers ``GET /pdgate/v1/requests``): a rid older than
  ``grace_s`` is an *orphan* when its owner is this instance and it is not the current
  attempt of a live request (finished, retried away, or its abort was lost), or when its
  owner is another instance whose lease has lapsed. Orphans are aborted by rid.
- **count mode** (plain SGLang): the engine's queue counts (``/v1/loads?include=disagg``)
  against our live count on that worker; an excess seen ``drift_checks`` times in a row is
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
import re
from collections.abc import Callable, Iterable
from typing import Any

from pdgate import protocol
from pdgate.gateway import Gateway
from pdgate.workers import Worker

log = logging.getLogger("pdgate.reconcile")
RID = re.compile(r"^pdg-([0-9a-f]+)-[0-9a-f]{24}\.[1-9]$")
PREFILL_COUNTS = ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs")
DECODE_COUNTS = ("decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "num_running_reqs")


def owner(rid: str) -> str | None:
    m = RID.match(rid)
    return m.group(1) if m else None


class Reconciler:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.cfg = gw.cfg.reconcile
        self.seen: dict[str, float] = {}  # instance id -> last time it was known alive
        self.drift_runs: dict[str, int] = {}
        self.drift_since: dict[str, float] = {}
        # the instance ids of this gateway's sibling processes (``pdgate.multi``: their record files)
        self.siblings: Callable[[], Iterable[str]] = tuple

    # ---- facts ------------------------------------------------------------------------
    def live_rids(self) -> set[str]:
        return {r.attempts[-1].rid for r in self.gw.traces.live.values() if r.attempts}

    async def refresh_leases(self) -> None:
        now = self.gw.now()
        self.seen[self.gw.instance] = now
        for inst in self.siblings():
            self.seen[inst] = now
        for peer in self.gw.cfg.peers:
            try:
                status, body = await self.gw.up().get_json(peer.rstrip("/") + "/v1/lease", 2.0)
            except OSError:
                continue
            if status == 200 and isinstance(body, dict) and isinstance(body.get("instance"), str):
                self.seen[body["instance"]] = now
                for inst in body.get("instances") or ():  # a peer of several processes names them all
                    if isinstance(inst, str):
                        self.seen[inst] = now

    def lapsed(self, inst: str) -> bool:
        """Whether another instance's lease has lapsed; first sight of an instance starts its clock."""
        if inst == self.gw.instance:
            return False
        now = self.gw.now()
        return now - self.seen.setdefault(inst, now) >= self.cfg.lease_s

    # ---- one pass --------------------------------------------------------------------------
    async def run_once(self) -> None:
        await self.refresh_leases()
        await asyncio.gather(*(self.check(w) for w in list(self.gw.pool.by_id.values()) if w.healthy))

    async def check(self, w: Worker) -> None:
        if w.has_extension:
            await self.exact(w)
        else:
            await self.count(w)

    async def exact(self, w: Worker) -> None:
        try:
            status, body = await self.gw.up().get_json(w.url + protocol.EXT_REQUESTS_PATH, 2.0)
        except OSError:
            return
        if status != 200 or not isinstance(body, dict):
            return
        live = self.live_rids()
        orphans = []
        for r in body.get("requests", []):
            rid = str(r.get("rid", ""))
            age = float(r.get("age_s", r.get("since_s", 0.0)))
            inst = owner(rid)
            if inst is None or age < self.cfg.grace_s:
                continue
            if (inst == self.gw.instance and rid not in live) or self.lapsed(inst):
                orphans.append((rid, r.get("queue"), age))
        w.orphans = len(orphans)
        self.gw.metrics.orphans.labels(w.id).set(len(orphans))
        for rid, queue, age in orphans:
            log.warning("orphan on %s: rid=%s queue=%s age=%.1fs -> abort", w.id, rid, queue, age)
            await self.abort(w, rid, "exact")

    async def count(self, w: Worker) -> None:
        keys = PREFILL_COUNTS if w.role == "prefill" else DECODE_COUNTS
        held = sum(int(w.engine.get(k) or 0) for k in keys)
        excess = held - w.load
        w.drift = max(0, excess)
        self.gw.metrics.drift.labels(w.id).set(w.drift)
        runs = self.drift_runs[w.id] = self.drift_runs.get(w.id, 0) + 1 if excess > 0 else 0
        if runs == 1:
            self.drift_since[w.id] = self.gw.now()
        if runs < self.cfg.drift_checks:
            return
        # rids that ended up to a health refresh and a pass before the excess was first seen
        since = self.drift_since[w.id] - (self.cfg.interval_s + self.gw.cfg.health.interval_s + self.cfg.grace_s)
        rids = [rid for wid, rid, ended in self.gw.recent if wid == w.id and ended >= since]
        if rids:
            log.warning("drift on %s: engine holds %d, we hold %d; re-aborting %d recent rids", w.id, held, w.load, len(rids))
        for rid in rids:
            await self.abort(w, rid, "count")
        self.drift_runs[w.id] = 0

    async def abort(self, w: Worker, rid: str, mode: str) -> None:
        try:
            await self.gw.up().abort(w.url, rid)
            result = "ok"
        except OSError:
            result = "error"
        self.gw.metrics.reconcile_aborts.labels(w.id, mode).inc()
        rec = self.gw.traces.get(rid.rsplit(".", 1)[0])
        if rec is not None:
            for a in rec.attempts:
                if a.rid == rid:
                    a.event(self.gw.now(), "reconcile_abort", f"{w.role} {w.id}: {mode} {result}")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.run_once()
            except Exception:  # a reconciler must survive anything an engine answers
                log.exception("reconcile pass failed")


def lease(gw: Gateway) -> dict[str, Any]:
    return {"instance": gw.instance, "lease_s": gw.cfg.reconcile.lease_s}
