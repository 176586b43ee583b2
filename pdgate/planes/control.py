"""The operator's side of a running gateway: its workers' health checks, registrations and removals, the
reconciler, the store's heartbeat and worker set, and (under ``pdgate up``) the supervisor that runs the workers.
The admin plane's handlers act through it (``pdgate.planes.admin``); ``server.App`` owns it next to its listeners.

With a shared store (``pdgate.store``) the worker set is the store's: a registration or a removal made through
any process's admin plane is written there, with the id the store gives it, and every process applies it (pushed,
and checked against the set's version at each heartbeat); the config's workers seed an empty store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

from pdgate.core.config import GatewayConfig, Role, WorkerSpec, worker_hosts_allowed
from pdgate.observe.metrics import FLUSH_S, SharedFiles
from pdgate.path.gateway import Gateway
from pdgate.path.scope import cancelled
from pdgate.pool.lineage import RECORD_S
from pdgate.pool.reconcile import Reconciler
from pdgate.pool.workers import Worker
from pdgate.store.base import Beat

log = logging.getLogger("pdgate.server")
LAG_TICK_S = 0.05  # the loop's lag is measured this often (20 wakeups a second, while limits are learned)
QUEUED_BEAT_S = 0.1  # requests wait for slots other processes hold: what they hold is asked this often


class WorkerSupervisor(Protocol):
    """What runs the workers, when this gateway runs them (``pdgate up``)."""

    async def restart_url(self, url: str) -> dict[str, Any]: ...

    async def view(self) -> list[dict[str, Any]]: ...


def spec_of(w: Worker) -> dict[str, Any]:
    s = w.spec
    return {"id": w.id, "role": s.role, "url": s.url, "bootstrap_port": s.bootstrap_port, "engine": s.engine}


class Control:
    def __init__(self, gw: Gateway, supervisor: WorkerSupervisor | None) -> None:
        self.gw = gw
        self.cfg: GatewayConfig = gw.cfg
        self.store = gw.store
        self.supervisor = supervisor
        self.health_tasks: dict[str, asyncio.Task[None]] = {}
        self.lineage = gw.lineage
        self.reconciler = Reconciler(gw.cfg, gw.instance, gw.pool, gw.traces, gw.metrics, gw.recent, gw.store,
                                     gw.clock, self.lineage)
        self.tasks: list[asyncio.Task[None]] = []
        self.worker_hosts = worker_hosts_allowed(gw.cfg)
        self.registering: set[tuple[str, str]] = set()  # (role, url) of registrations being probed
        self.draining = False
        # this gateway's own listeners, as worker URLs would spell them (never registered as a worker): set by App
        self.own_urls: Callable[[], set[str]] = set
        self.reachable: dict[str, str] = {}  # plane -> where the other instances reach this one's (set by App)
        self._syncing: asyncio.Task[None] | None = None
        self.stopping = False  # from the start of stop(): no loop is started again
        self._sync_again = False

    async def start(self) -> None:
        gw = self.gw
        await self.store.start(gw.instance, self.workers_changed)
        self.lineage.start()
        if self.lineage.enabled:  # before the front door listens: every attempt is told to it from the first
            gw.obs.lineage = self.lineage
        if self.store.shared:
            await self.sync_workers()  # the config's workers seed an empty store
        await asyncio.gather(*(gw.health.check(w) for w in gw.pool.by_id.values()))
        for wid in list(gw.pool.by_id):
            self.start_health(wid)

    def run(self) -> None:
        """The background work of a listening gateway: reconciliation, and the store's heartbeat (where the
        others reach this instance is known now)."""
        gw, loop = self.gw, asyncio.get_running_loop()
        if gw.cfg.reconcile.enabled:
            self.tasks.append(loop.create_task(self.reconciler.run()))
        if self.store.shared:
            self.tasks.append(loop.create_task(self.beats()))
        if gw.metrics.shared is not None:
            self.tasks.append(loop.create_task(self.flush_metrics(gw.metrics.shared)))
        if self.lineage.enabled:
            self.tasks.append(loop.create_task(self.record()))
        if gw.cfg.admission.learns:
            self.tasks.append(loop.create_task(self.watch_lag()))

    async def watch_lag(self, every_s: float = LAG_TICK_S) -> None:
        """How late the loop runs a timer, every ``every_s``: what the learned limits take for the gateway's and the
        host's load (``pdgate.core.limits.Lag``), never for the engine's. And while requests wait, the full workers'
        limits are told so: they bind though no new request came (all queued at once, none answered: without it a
        limit never grew past its first value, and 30 streams on two prefills that answer late never all started)."""
        gw, clock = self.gw, time.monotonic
        while True:
            due = clock() + every_s
            await asyncio.sleep(every_s)
            now = gw.clock()  # the gateway's clock, as the limits read it
            gw.pool.lag.note(clock() - due, now)
            if gw.gate.queue.n:
                gw.gate.held_back(now)

    async def record(self) -> None:
        """What this process owns, written to the state directory while it changes (``pdgate.pool.lineage``): the
        request path has told the lineage what begins and ends since ``start``; it stops telling when this ends."""
        gw, lineage = self.gw, self.lineage
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    lineage.record(gw.now(), {w.id: w.url for w in gw.pool.by_id.values()})
                except Exception:  # a full disk must not stop the gateway
                    log.exception("could not record this process's requests")
                # at most 5% of the loop: a whole record of thousands of rids is written less often than a few
                await asyncio.sleep(max(RECORD_S, 20 * (time.perf_counter() - t0)))
        finally:
            gw.obs.lineage = None

    async def flush_metrics(self, files: SharedFiles) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                files.flush()
            except Exception:  # a full disk must not stop the gateway
                log.exception("could not write the metrics files")

    def start_health(self, wid: str) -> None:
        if self.stopping:
            return
        self.health_tasks[wid] = asyncio.get_running_loop().create_task(self.gw.health.run(self.gw.pool.by_id[wid]))

    # ---- the worker set ---------------------------------------------------------------------------
    async def register(self, spec: WorkerSpec) -> Worker | None:
        """Add ``spec`` (with a shared store: to the store's set, which names it), check it once, watch it from
        now on. None: it is there already."""
        gw = self.gw
        wid = None
        if self.store.shared:
            wid = await self.store.add_worker({"role": spec.role, "url": spec.url, "bootstrap_port": spec.bootstrap_port,
                                               "engine": spec.engine})
            if wid is None:
                return None
            if wid in gw.pool.by_id:  # the store's push came first
                return gw.pool.by_id[wid]
        w = gw.pool.add(spec, wid)
        self.start_health(w.id)
        await gw.health.check(w)
        return w

    async def same_address(self, spec: WorkerSpec, timeout_s: float) -> Worker | None:
        """A registered worker that ``spec``'s URL reaches too (its host resolved as the client will connect: both
        spellings of one engine, ``localhost`` and ``127.0.0.1``), within ``timeout_s``."""
        loop = asyncio.get_running_loop()

        async def addresses(url: str) -> set[tuple[str, int]]:
            u = urlsplit(url)
            try:
                found = await loop.getaddrinfo(u.hostname, u.port or 80, type=socket.SOCK_STREAM)
            except OSError:
                return set()
            return {(str(a[4][0]), int(a[4][1])) for a in found}

        workers = list(self.gw.pool.by_id.values())
        try:
            async with asyncio.timeout(timeout_s):
                mine, *theirs = await asyncio.gather(addresses(spec.url), *(addresses(w.url) for w in workers))
        except TimeoutError:  # a name that does not resolve in time: the probe says the rest
            return None
        return next((w for w, addrs in zip(workers, theirs, strict=True) if mine & addrs), None)

    async def remove(self, wid: str) -> Worker:
        if self.store.shared:
            await self.store.remove_worker(wid)
        return self.drop(wid)

    def drop(self, wid: str) -> Worker:
        gw = self.gw
        w = gw.pool.remove(wid, gw.now())
        task = self.health_tasks.pop(wid, None)
        if task is not None:
            task.cancel()
        w.adapter.forget(w.url)
        if not any(o.url == w.url for o in gw.pool.by_id.values()):
            gw.upstream.client.drop(w.url)  # its connections go with it
        return w

    def workers_changed(self) -> None:
        """Another process changed the worker set (pushed, or a newer version seen): apply it, once at a time."""
        if self.stopping:  # the store's listener runs until the store closes, after the gateway's stop
            return
        if self._syncing is not None:
            self._sync_again = True
            return
        self._syncing = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _sync_loop(self) -> None:
        try:
            self._sync_again = True
            while self._sync_again:
                self._sync_again = False
                await self.sync_workers()
        except Exception:  # the next heartbeat's version check tries again
            log.exception("could not apply the store's worker set")
        finally:
            self._syncing = None

    async def sync_workers(self) -> None:
        """The same workers under the same ids as the store has them (a store that lost its worker set, as a
        Redis restarted empty, gets this process's back first)."""
        version, specs = await self.store.worker_set()
        if version == 0:
            await self.store.seed_workers([spec_of(w) for w in self.gw.pool.by_id.values()])
            version, specs = await self.store.worker_set()
        want = {str(s["id"]): s for s in specs}
        pool = self.gw.pool
        for w in list(pool.by_id.values()):
            s = want.get(w.id)
            if s is None or s.get("url") != w.url or s.get("role") != w.role:
                self.drop(w.id)
        for wid, s in sorted(want.items()):
            if wid in pool.by_id:
                continue
            try:
                w = pool.add(WorkerSpec(url=s["url"], role=Role(s["role"]), bootstrap_port=s.get("bootstrap_port"),
                                        engine=s.get("engine", "sglang")), wid)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("could not route to the store's worker %s (%s): %s", wid, s.get("url"), exc)
                continue
            if self.health_tasks or self.tasks:  # started: watched from now on
                self.start_health(w.id)

    # ---- heartbeats ----------------------------------------------------------------------------------
    def beat(self) -> Beat:
        gw = self.gw
        rids: dict[str, tuple[str, ...]] = {}
        tenants: dict[str, int] = {}
        for ctx in gw.live.values():
            a = ctx.rec.attempt
            if a is not None:
                rids[a.rid] = (a.prefill, a.decode)
            if ctx.holds and ctx.tenant is not None:
                tenants[ctx.tenant.name] = tenants.get(ctx.tenant.name, 0) + 1
        now = gw.now()
        limits = {w.id: v for w in gw.pool.by_id.values() if (v := w.slots.measured(now)) is not None}  # others take it
        info = {**self.reachable, "state": "draining" if self.draining else "live", "pid": os.getpid(),
                "host": socket.gethostname(), "limits": limits}
        return Beat(info, rids, {w.id: len(w.bound) for w in gw.pool.by_id.values()}, tenants)

    async def beats(self) -> None:
        """This instance's heartbeat: its registry entry and what it holds, whole; what the others hold on each
        worker back. Faster while requests wait on slots the others hold."""
        gw = self.gw
        while True:
            try:
                others = await self.store.heartbeat(self.beat())
                peers = [i.get("limits") or {} for name, i in getattr(self.store, "registry", {}).items()
                         if name != gw.instance and i.get("state") == "live"]
                for w in gw.pool.by_id.values():
                    if others is None:  # the store unreachable: each limit is divided among the instances last seen
                        w.slots.others, w.slots.share = 0, getattr(self.store, "instances_seen", 1)
                    else:
                        w.slots.others, w.slots.share = others.get(w.id, 0), 1
                    theirs = [v for p in peers if isinstance(v := p.get(w.id), int) and v > 0]
                    w.slots.peers = min(theirs) if theirs and others is not None else None
                gw.gate.pump()
            except Exception:  # a heartbeat must survive anything
                log.exception("heartbeat failed")
            waiting = gw.gate.queue.n and any(w.slots.others for w in gw.pool.by_id.values())
            await asyncio.sleep(QUEUED_BEAT_S if waiting else self.cfg.store.heartbeat_s)

    async def stop(self) -> None:
        # its loops end before the gateway's transport closes: a health check or a listing sent after would open
        # a connection no close reaches
        self.stopping = True
        await cancelled([*self.tasks, *self.health_tasks.values(), *filter(None, [self._syncing])])
        await self.gw.stop()
        self.lineage.close()  # stopped cleanly: nothing of this process is left for a successor
        if self.gw.metrics.shared is not None:
            self.gw.metrics.shared.flush()  # what it counted to the end stays in the group's sums
            self.gw.metrics.shared.close()
        await self.store.close()


def reachable_url(host: str, port: int) -> str:
    """How another instance reaches a listener bound to ``host:port`` (a wildcard: by this host's name)."""
    name = host.strip("[]")
    if name in ("", "0.0.0.0", "::"):
        name = socket.gethostname()
    return f"http://{'[' + name + ']' if ':' in name else name}:{port}"

