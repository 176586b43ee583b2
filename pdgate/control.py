"""The operator's side of a running gateway: its workers' health checks, registrations and removals, the
reconciler, and (under ``pdgate up``) the supervisor that runs the workers. The admin plane's handlers act
through it (``pdgate.admin``); ``server.App`` owns it next to its listeners.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

from pdgate import multi
from pdgate.config import GatewayConfig, WorkerSpec, worker_hosts_allowed
from pdgate.gateway import Gateway
from pdgate.reconcile import Reconciler
from pdgate.workers import Worker

log = logging.getLogger("pdgate.server")


class WorkerSupervisor(Protocol):
    """What runs the workers, when this gateway runs them (``pdgate up``)."""

    async def restart_url(self, url: str) -> dict[str, Any]: ...

    async def view(self) -> list[dict[str, Any]]: ...


class Control:
    def __init__(self, gw: Gateway, group: multi.Group | None, supervisor: WorkerSupervisor | None) -> None:
        self.gw = gw
        self.cfg: GatewayConfig = gw.cfg
        self.group = group  # one of several processes on one port (``pdgate serve --workers N``)
        self.supervisor = supervisor
        self.health_tasks: dict[str, asyncio.Task[None]] = {}
        self.reconciler = Reconciler(gw.cfg, gw.instance, gw.pool, gw.traces, gw.metrics, gw.recent, gw.upstream,
                                     gw.clock)
        if group is not None:
            self.reconciler.siblings = lambda: [str(m["instance"]) for m in group.members()]
        self.rec_task: asyncio.Task[None] | None = None
        self.worker_hosts = worker_hosts_allowed(gw.cfg)
        self.registering: set[tuple[str, str]] = set()  # (role, url) of registrations being probed
        self.draining = False
        # this gateway's own listeners, as worker URLs would spell them (never registered as a worker): set by App
        self.own_urls: Callable[[], set[str]] = set
        self.private: dict[str, int] = {}  # a process of a group: the port of each plane's private listener

    async def start(self) -> None:
        gw = self.gw
        self.adopt_workers()
        await asyncio.gather(*(gw.health.check(w) for w in gw.pool.by_id.values()))
        for wid in list(gw.pool.by_id):
            self.start_health(wid)
        if gw.cfg.reconcile.enabled:
            self.rec_task = asyncio.get_running_loop().create_task(self.reconciler.run())

    def start_health(self, wid: str) -> None:
        self.health_tasks[wid] = asyncio.get_running_loop().create_task(self.gw.health.run(self.gw.pool.by_id[wid]))

    async def register(self, spec: WorkerSpec, wid: str | None) -> Worker:
        """Add ``spec`` (under ``wid``, a sibling's id for it), check it once, watch it from now on."""
        gw = self.gw
        w = gw.pool.add(spec, wid)
        self.start_health(w.id)
        self.announce()
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

    def remove(self, wid: str) -> Worker:
        gw = self.gw
        w = gw.pool.remove(wid, gw.now())
        task = self.health_tasks.pop(wid, None)
        if task is not None:
            task.cancel()
        w.engine.forget(w.url)
        if not any(o.url == w.url for o in gw.pool.by_id.values()):
            gw.upstream.client.drop(w.url)  # its connections go with it
        self.announce()
        return w

    def announce(self) -> None:
        """A process of a group: its record file (``pdgate.multi``), with the workers it routes to, so that a
        sibling started later (or restarted) routes to the same ones."""
        if self.group is None:
            return
        self.group.announce({"instance": self.gw.instance, "changed": time.time(), "draining": self.draining,
                             "workers": [{"id": w.id, "role": w.role, "url": w.url, "engine": w.spec.engine,
                                          "bootstrap_port": w.spec.bootstrap_port}
                                         for w in self.gw.pool.by_id.values()],
                             "next_ids": self.gw.pool.next_ids,
                             **{plane: f"http://127.0.0.1:{port}" for plane, port in self.private.items()}})

    def adopt_workers(self) -> None:
        """Before it listens, a process of a group routes to the workers its siblings route to: those registered
        or removed on the admin plane since the config was written (the sibling that changed last knows)."""
        if self.group is None:
            return
        latest = max(self.group.siblings(), key=lambda m: float(m.get("changed") or 0), default=None)
        if latest is None or not isinstance(latest.get("workers"), list):
            return
        theirs = {(w.get("role"), w.get("url"), w.get("id")): w for w in latest["workers"] if isinstance(w, dict)}
        pool = self.gw.pool
        for w in list(pool.by_id.values()):  # the same workers under the same ids: an id means one worker in all
            if (w.role, w.url, w.id) not in theirs:
                pool.remove(w.id, self.gw.now())
        ours = {(w.role, w.url, w.id) for w in pool.by_id.values()}
        for key, rec in theirs.items():
            if key not in ours:
                try:
                    pool.add(WorkerSpec(url=rec["url"], role=rec["role"], bootstrap_port=rec.get("bootstrap_port"),
                                        engine=rec.get("engine", "sglang")), rec["id"])
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("could not adopt the worker %s of a sibling: %s", rec.get("url"), exc)
        if isinstance(latest.get("next_ids"), dict):
            pool.continue_ids(latest["next_ids"])

    async def stop(self) -> None:
        if self.rec_task is not None:
            self.rec_task.cancel()
        for t in self.health_tasks.values():
            t.cancel()
        await self.gw.stop()
