"""``pdgate serve --workers N``: N gateway processes on one port, one supervisor, one store.

One Python process relays on one core. With ``--workers N`` the command becomes a **supervisor** that starts N
gateway processes (``python -m pdgate serve ...`` with the same flags). Each one:

- listens on the front door's and the admin plane's ports with ``SO_REUSEPORT``: the kernel spreads new
  connections over them (uvicorn's and nginx's way, without a shared accept queue);
- has an instance id of its own (``<gateway.instance_id or random>`` + its own random part), so rids stay
  unique and reconciliation tells the processes apart;
- shares what they must agree on through the store (``pdgate.store``): limits, what each holds on each worker,
  the registry and the worker set. With no ``[store] url``, the supervisor runs a ``redis-server`` of its own
  on a Unix socket in its private directory (mode 0700; Debian's ``redis-server`` package), restarted if it
  dies (the processes' heartbeats fill it again);
- answers private listeners on ``127.0.0.1`` (an ephemeral port per plane, with the plane's own keys and
  middleware), named in its registry entry: any admin plane answers for all (``pdgate.planes.peers``).

The supervisor restarts a process that dies (backoff 0.5 s doubling to 10 s, reset after 30 s of life) or stops
answering (``/health`` on its private listener missed three times in a row: killed, then restarted), and on
SIGTERM/SIGINT stops them all (each drains as a single gateway does, then SIGKILL after ``drain_s`` + 10 s). A
process whose supervisor is gone stops itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from h1lite.client import Client
from h1lite.errors import HTTPError
from h1lite.server import Request, Response, Router, Server, json_response
from pdgate.core.config import ConfigError, GatewayConfig, StoreConfig
from pdgate.core.errors import BadRequest
from pdgate.core.validation import parse_body
from pdgate.observe.metrics import process_gone
from pdgate.planes.redis_server import RedisServer, registered

log = logging.getLogger("pdgate.multi")
ENV_DIR, ENV_INDEX, ENV_SUPERVISOR = "PDGATE_PROCESS_DIR", "PDGATE_PROCESS_INDEX", "PDGATE_SUPERVISOR_PID"
METRICS_DIR = "metrics"  # under the group's directory: the processes' prometheus-client multiprocess files
ENV_STORE = "PDGATE_STORE_URL"  # the store's URL (in the environment: a password in it stays out of ps)
BACKOFF_S = (0.5, 10.0)  # first wait before a restart, and the most
STABLE_S = 30.0  # a process that lived this long restarts at the first backoff again
LIVE_S, LIVE_MISSES = 3.0, 3  # a process that does not answer /health within LIVE_S this many times is killed


def default_workers() -> int:
    """1: one process is the default everywhere (small machines, and one process holds the whole state)."""
    return 1


@dataclass
class Group:
    """In a gateway process started by the supervisor: its place, and the supervisor's private directory."""

    dir: Path
    index: int
    supervisor: int = 0  # its pid (0: not known)

    @classmethod
    def from_env(cls) -> Group | None:
        d, i, sup = os.environ.get(ENV_DIR), os.environ.get(ENV_INDEX), os.environ.get(ENV_SUPERVISOR, "")
        if not d or i is None or not i.isdigit():
            return None
        return cls(Path(d), int(i), int(sup) if sup.isdigit() else 0)


SUPERVISOR_FILE = "supervisor.json"
RESTART_S = 300.0  # the most a worker's restart asked of the supervisor may take


def error(status: int, message: str, code: str) -> Response:
    """An answer in OpenAI's error format."""
    return json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                    "code": code}}, status)


class SupervisorServer:
    """In ``pdgate up --workers N``: lets the gateway processes restart the workers this process supervises
    (``POST /v1/workers/{id}/restart``, ``GET /v1/cluster``), on loopback, behind a token kept in the group's
    private directory."""

    def __init__(self, supervised: Any, directory: Path) -> None:
        self.supervised, self.dir = supervised, directory
        self.token = secrets.token_urlsafe(24)
        r = Router()
        r.add("POST", "/restart", self.restart)
        r.add("GET", "/view", self.view)
        self.server = Server(self.checked(r), 1 << 16)

    def checked(self, r: Router) -> Any:
        want = f"Bearer {self.token}".encode()

        async def run(req: Request) -> Any:
            got = req.headers.get("authorization", "").encode("latin-1", "replace")
            if not secrets.compare_digest(got, want):
                return error(403, "not the supervisor's token", "forbidden")
            return await r.dispatch(req)

        return run

    async def restart(self, req: Request) -> Response:
        try:
            body = parse_body(req.body or b"{}")
        except BadRequest:
            body = {}
        if not isinstance(body.get("url"), str):
            return error(400, 'the body must be {"url": "<worker url>"}', "bad_request")
        try:
            return json_response(await self.supervised.restart_url(body["url"]))
        except KeyError as exc:
            return error(404, str(exc), "not_found")

    async def view(self, req: Request) -> Response:
        return json_response(await self.supervised.view())

    async def start(self) -> None:
        await self.server.start("127.0.0.1", 0)
        path = self.dir / SUPERVISOR_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": f"http://127.0.0.1:{self.server.port}", "token": self.token}, f)

    async def close(self) -> None:
        await self.server.close()


class RemoteSupervisor:
    """In a gateway process of ``pdgate up --workers N``: the supervisor of the workers, asked over loopback."""

    def __init__(self, group: Group) -> None:
        info = json.loads((group.dir / SUPERVISOR_FILE).read_text())
        self.url, self.auth = str(info["url"]), {"authorization": f"Bearer {info['token']}"}
        self.client = Client(connect_timeout_s=2.0, max_open=4, max_idle=2)

    async def restart_url(self, url: str) -> dict[str, Any]:
        async with asyncio.timeout(RESTART_S):  # an engine's restart takes a while; the supervisor bounds it too
            status, body = await self.client.fetch(self.url, "POST", "/restart", orjson.dumps({"url": url}),
                                                   headers=self.auth)
        if status == 404:
            raise KeyError(orjson.loads(body).get("error", url))
        if status != 200:
            raise OSError(f"the supervisor answered {status}")
        return dict(orjson.loads(body))

    async def view(self) -> list[dict[str, Any]]:
        """The supervised workers, asked now ([] if the supervisor does not answer within 5 s)."""
        with contextlib.suppress(OSError, ValueError):  # TimeoutError is an OSError
            async with asyncio.timeout(5.0):
                status, body = await self.client.fetch(self.url, "GET", "/view", headers=self.auth)
            if status == 200:
                return list(orjson.loads(body))
        return []

    def close(self) -> None:
        self.client.close()

    @classmethod
    def of(cls, group: Group | None) -> RemoteSupervisor | None:
        if group is None or not (group.dir / SUPERVISOR_FILE).exists():
            return None
        return cls(group)


class GatewayProcess:
    __slots__ = ("backoff", "index", "proc", "restarts", "started")

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.restarts = 0
        self.backoff = BACKOFF_S[0]


class ProcessGroup:
    """Starts ``n`` gateway processes with ``argv`` (``pdgate serve`` flags), restarts the ones that die; runs the
    store they share unless one is configured (``store.url``)."""

    def __init__(self, argv: list[str], n: int, drain_s: float, supervised: Any = None,
                 store: StoreConfig | None = None) -> None:
        self.argv, self.n, self.drain_s = argv, n, drain_s
        self.dir = Path(tempfile.mkdtemp(prefix="pdgate-procs-"))  # 0700: only this user reads what is in it
        self.children = [GatewayProcess(i) for i in range(n)]
        self.stopping = False
        self.up = asyncio.Event()  # every process is up (set by run)
        self.server = SupervisorServer(supervised, self.dir) if supervised is not None else None
        self.store = store or StoreConfig()
        self.redis: RedisServer | None = None  # the store this supervisor runs, if any
        self.client = Client(connect_timeout_s=LIVE_S, max_open=64, max_idle=0)  # the processes' /health

    async def spawn(self, c: GatewayProcess) -> None:
        env = {**os.environ, ENV_DIR: str(self.dir), ENV_INDEX: str(c.index), ENV_SUPERVISOR: str(os.getpid()),
               ENV_STORE: self.store.url}
        c.proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdgate", *self.argv, env=env)
        c.started = time.monotonic()
        log.info("gateway process %d started (pid %d)", c.index, c.proc.pid)

    async def watch(self, c: GatewayProcess) -> None:
        while not self.stopping:
            assert c.proc is not None
            rc = await c.proc.wait()
            process_gone(self.dir / METRICS_DIR, c.proc.pid)
            if self.stopping:
                return
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

    async def alive(self, url: str) -> bool:
        """Whether a gateway process answers ``GET /health`` on its private front listener within LIVE_S."""
        try:
            async with asyncio.timeout(LIVE_S):
                status, _ = await self.client.fetch(url, "GET", "/health")
            return status == 200
        except (OSError, ValueError, HTTPError):  # TimeoutError is an OSError
            return False

    async def members(self) -> list[dict[str, Any]]:
        """The registry entries of this group's live processes."""
        pids = {c.proc.pid for c in self.children if c.proc is not None and c.proc.returncode is None}
        return [m for m in (await registered(self.store) or {}).values() if m.get("pid") in pids]

    async def liveness(self, every_s: float = 2.0) -> None:
        """A process that stops answering (frozen, wedged, its loop stuck) is killed, and so restarted: a process
        that merely exists would keep taking its share of the connections and answer none. Where a process is
        reached is remembered from its registry entry (a frozen one's entry expires)."""
        misses: dict[int, int] = {}
        fronts: dict[int, str] = {}
        while not self.stopping:
            await asyncio.sleep(every_s)
            draining = set()
            for m in await self.members():
                if m.get("front"):
                    fronts[int(m["pid"])] = str(m["front"])
                if m.get("state") == "draining":
                    draining.add(int(m["pid"]))
            for c in self.children:
                pid = c.proc.pid if c.proc is not None and c.proc.returncode is None else None
                if pid is None or pid not in fronts or pid in draining:
                    continue
                misses[pid] = 0 if await self.alive(fronts[pid]) else misses.get(pid, 0) + 1
                if misses[pid] >= LIVE_MISSES and not self.stopping:
                    log.warning("gateway process %d (pid %d) did not answer /health %d times in a row: killed",
                                c.index, pid, LIVE_MISSES)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    misses.pop(pid, None)
                    fronts.pop(pid, None)

    async def ready(self, timeout_s: float = 60.0) -> bool:
        """Whether every process came up (its registry entry in the store) within ``timeout_s``. One that dies
        before it came up fails the start; one that came up and died since (its entry outlives it until its lease
        ends) does not: it is restarted as any other (a kill right after both were up, before this look saw them,
        once stopped the whole group)."""
        end = time.monotonic() + timeout_s
        seen: set[int] = set()  # the processes (by index) seen up, alive or not since
        while time.monotonic() < end:
            pids = {m.get("pid") for m in (await registered(self.store) or {}).values()}
            seen |= {c.index for c in self.children if c.proc is not None and c.proc.pid in pids}
            if len(seen) >= self.n:
                return True
            if any(c.proc is not None and c.proc.returncode is not None and c.index not in seen
                   for c in self.children):
                return False  # one died before it came up: its start fails (its own log says why)
            await asyncio.sleep(0.1)
        return False

    async def stop(self) -> None:
        self.stopping = True
        if self.redis is not None:  # its watcher starts it no more: it goes last, after the processes drained
            self.redis.stopping = True
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
        if self.redis is not None:
            await self.redis.stop()
        self.client.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def run(self, stop: asyncio.Event | None = None, check_ready: bool = False) -> int:
        """Until SIGINT/SIGTERM (or ``stop``, when given: the caller handles the signals). With ``check_ready``,
        a process that dies before all are up ends the group at once: 1 (its log line says why), else 0."""
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        watchers: list[asyncio.Task[None]] = []
        try:
            if self.server is not None:
                await self.server.start()
            if not self.store.url:
                self.redis = RedisServer(self.dir, self.store, self.n)
                await self.redis.start()
                self.store = self.redis.store
                watchers.append(asyncio.create_task(self.redis.watch()))
            for c in self.children:
                await self.spawn(c)
            if check_ready and not await self.ready():
                log.error("a gateway process exited before all %d were up: stopping", self.n)
                return 1
            self.up.set()
            watchers += [asyncio.create_task(self.watch(c)) for c in self.children]
            watchers.append(asyncio.create_task(self.liveness()))
            await stop.wait()
            return 0
        finally:
            await self.stop()
            if self.server is not None:
                await self.server.close()
            for t in watchers:
                t.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` could be listened on now (without SO_REUSEPORT: a port held by another group's
    processes, which listen with it, is taken too)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a listener binds: TIME_WAIT is not "in use"
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def check(cfg: GatewayConfig, n: int, ports: bool = False) -> None:
    """What a group of ``n`` processes needs of the config, refused before any starts (one process needs
    nothing of it); with ``ports``, also that its ports are free (SO_REUSEPORT would let a second group share
    them without a word)."""
    if not 1 <= n <= 64:
        raise ConfigError("--workers", n, "must be 1..64")
    if n == 1:
        return
    if ports:
        for flag, host, port in (("--port", cfg.host, cfg.port), ("--admin-port", cfg.admin_host, cfg.admin_port)):
            if port and not port_free(host, port):
                raise ConfigError(flag, port, f"cannot listen there: in use (choose another with {flag})")
    if cfg.admin_socket:
        raise ConfigError("--workers", n, "needs the admin plane on a TCP port (admin_port) that its processes "
                          "share; admin_socket serves one process")
    for flag, port in (("--port", cfg.port), ("--admin-port", cfg.admin_port)):
        if port == 0:
            raise ConfigError(flag, 0, f"must be a fixed port with --workers {n} (the processes share it)")


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


def run(argv: list[str], n: int, cfg: GatewayConfig) -> int:
    group = ProcessGroup(without_workers_flag(argv), n, cfg.drain_s, store=cfg.store)
    try:
        return asyncio.run(group.run(check_ready=True))
    except ConfigError as exc:
        log.error("%s", exc)
        return 1


async def orphaned(group: Group, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """In a gateway process: set ``stop`` once its supervisor is gone (its parent is no longer the pid the
    supervisor gave: also right when it died before this process got this far). The first process to see it
    removes the group's directory (the store's socket, the supervisor's token)."""
    parent = group.supervisor or os.getppid()
    while not stop.is_set():
        if os.getppid() != parent:
            log.warning("the supervisor (pid %d) is gone: stopping", parent)
            shutil.rmtree(group.dir, ignore_errors=True)
            stop.set()
            return
        await asyncio.sleep(every_s)
