"""``pdgate serve --workers N``: N gateway processes on one port, one supervisor, one admin plane.

One Python process relays on one core. With ``--workers N`` the command becomes a **supervisor**
that starts N gateway processes (``python -m pdgate serve ...`` with the same flags). Each one:

- listens on the front door's and the admin plane's ports with ``SO_REUSEPORT``: the kernel
  spreads new connections over them (uvicorn's and nginx's way, without a shared accept queue);
- has an instance id of its own (``<gateway.instance_id or random>`` + its own random part), so
  rids stay unique and reconciliation tells the processes apart (``pdgate.reconcile``): a
  sibling's rids are never orphans while the sibling's record file is there, and a dead
  process's rids lapse after ``lease_s`` and are aborted by the others;
- answers private listeners on ``127.0.0.1`` (an ephemeral port per plane, with the plane's own
  keys and middleware) and writes them to its **record file** ``<dir>/<index>.json`` in the
  supervisor's private directory (mode 0700);
- and, for an admin-plane call (or a client's own requests on the front door), asks its siblings
  through their private listeners, forwarding the caller's key, and merges the answers
  (``pdgate.siblings``): live requests, traces, workers, the dashboard and ``/metrics`` answer
  for all processes whichever one the kernel picked; a change (``POST``/``DELETE /v1/workers``)
  is applied by every process.

The supervisor restarts a process that dies (backoff 0.5 s doubling to 10 s, reset after 30 s of
life), and on SIGTERM/SIGINT stops them all (each drains as a single gateway does, then SIGKILL
after ``drain_s`` + 10 s). A process whose supervisor is gone stops itself.

Limits and admission (``max_concurrent``, rate limits, per-worker capacity) are per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pdgate.multi")
ENV_DIR, ENV_INDEX = "PDGATE_PROCESS_DIR", "PDGATE_PROCESS_INDEX"
BACKOFF_S = (0.5, 10.0)  # first wait before a restart, and the most
STABLE_S = 30.0  # a process that lived this long restarts at the first backoff again


def default_workers() -> int:
    """1: one process is the default everywhere (small machines, and one process holds the whole state)."""
    return 1


@dataclass
class Group:
    """In a gateway process started by the supervisor: where its record file and its siblings' are."""

    dir: Path
    index: int

    @classmethod
    def from_env(cls) -> Group | None:
        d, i = os.environ.get(ENV_DIR), os.environ.get(ENV_INDEX)
        if not d or i is None or not i.isdigit():
            return None
        return cls(Path(d), int(i))

    @property
    def path(self) -> Path:
        return self.dir / f"{self.index}.json"

    def announce(self, info: dict[str, Any]) -> None:
        """Write this process's record file (atomically: a reader never sees half of it)."""
        tmp = self.dir / f".{self.index}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**info, "index": self.index, "pid": os.getpid()}))
        os.replace(tmp, self.path)

    def withdraw(self) -> None:
        with contextlib.suppress(OSError):
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()

    def members(self) -> list[dict[str, Any]]:
        """Every process's record whose process is alive (this one's included)."""
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                info = json.loads(p.read_text())
                os.kill(int(info["pid"]), 0)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            out.append(info)
        return out

    def siblings(self) -> list[dict[str, Any]]:
        return [m for m in self.members() if m.get("pid") != os.getpid()]


class Child:
    __slots__ = ("backoff", "index", "proc", "restarts", "started")

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.restarts = 0
        self.backoff = BACKOFF_S[0]


class Supervisor:
    """Starts ``n`` gateway processes with ``argv`` (``pdgate serve`` flags), restarts the ones that die."""

    def __init__(self, argv: list[str], n: int, drain_s: float) -> None:
        self.argv, self.n, self.drain_s = argv, n, drain_s
        self.dir = Path(tempfile.mkdtemp(prefix="pdgate-procs-"))  # 0700: only this user reads the records
        self.children = [Child(i) for i in range(n)]
        self.stopping = False

    async def spawn(self, c: Child) -> None:
        env = {**os.environ, ENV_DIR: str(self.dir), ENV_INDEX: str(c.index)}
        c.proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdgate", *self.argv, env=env)
        c.started = time.monotonic()
        log.info("gateway process %d started (pid %d)", c.index, c.proc.pid)

    async def watch(self, c: Child) -> None:
        while not self.stopping:
            assert c.proc is not None
            rc = await c.proc.wait()
            if self.stopping:
                return
            with contextlib.suppress(OSError):
                (self.dir / f"{c.index}.json").unlink()
            lived = time.monotonic() - c.started
            if lived >= STABLE_S:
                c.backoff = BACKOFF_S[0]
            log.warning("gateway process %d (pid %d) exited with %s after %.1fs; restarting in %.1fs", c.index,
                        c.proc.pid, rc, lived, c.backoff)
            await asyncio.sleep(c.backoff)
            c.backoff = min(c.backoff * 2, BACKOFF_S[1])
            if self.stopping:
                return
            c.restarts += 1
            await self.spawn(c)

    async def stop(self) -> None:
        self.stopping = True
        live = [c.proc for c in self.children if c.proc is not None and c.proc.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        if live:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=self.drain_s + 10)
            for p in live:
                if p.returncode is None:
                    log.warning("gateway process pid %d did not stop within %.0fs: killed", p.pid, self.drain_s + 10)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            for t in pending:
                await t
        shutil.rmtree(self.dir, ignore_errors=True)

    async def run(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        watchers: list[asyncio.Task[None]] = []
        try:
            for c in self.children:
                await self.spawn(c)
                watchers.append(asyncio.create_task(self.watch(c)))
            await stop.wait()
        finally:
            await self.stop()
            for t in watchers:
                t.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)


def without_workers_flag(argv: list[str]) -> list[str]:
    """``argv`` with ``--workers N`` (or ``--workers=N``) taken out: what each gateway process runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--workers":
            skip = True
        elif not a.startswith("--workers="):
            out.append(a)
    return out


def run(argv: list[str], n: int, drain_s: float) -> None:
    asyncio.run(Supervisor(without_workers_flag(argv), n, drain_s).run())


async def orphaned(parent: int, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """In a gateway process: set ``stop`` once its supervisor is gone (its parent changed)."""
    while not stop.is_set():
        if os.getppid() != parent:
            log.warning("the supervisor (pid %d) is gone: stopping", parent)
            stop.set()
            return
        await asyncio.sleep(every_s)
