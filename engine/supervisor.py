"""Supervisor for co-located engine workers: start, wait ready, restart on exit, stop all.

Reads a cluster file (``config/cluster.sim.toml``). Each worker is a child process whose
output goes to ``<log_dir>/<name>.log``. A worker that exits is restarted after a backoff.
Children get SIGTERM if the supervisor dies (PR_SET_PDEATHSIG), and ``stop()`` ends them
all (SIGTERM, then SIGKILL), so no orphan is left, also on Ctrl-C or SIGTERM.

``python -m engine.supervisor --cluster FILE`` runs it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import difflib
import logging
import os
import signal
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("engine.supervisor")
ENGINES = ("sim", "sglang", "vllm")
KINDS = ("sglang", "vllm")  # the protocols: what the gateway talks to each worker as


@dataclass(frozen=True)
class WorkerDef:
    name: str
    engine: str
    role: str
    port: int
    bootstrap_port: int | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kind: str = "sglang"  # the protocol it speaks, the gateway's adapter for it: sglang or vllm (a sim: --protocol)
    options: Any = field(default=None, compare=False)  # engine "sglang": the whole cluster entry, for the planner

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.engine == "sim":
            cmd = [sys.executable, "-m", "engine.sim", "--role", self.role, "--host", "127.0.0.1", "--port", str(self.port)]
            if self.bootstrap_port is not None:
                cmd += ["--bootstrap-port", str(self.bootstrap_port)]
            if self.kind != "sglang":
                cmd += ["--protocol", self.kind]
            return cmd + list(self.args)
        if self.engine == "sglang":
            from engine.sglang.plan import command

            return command(self.options)
        if self.engine == "vllm":
            from engine.vllm import plan

            return plan.command(self.options)
        raise ValueError(f"worker {self.name}: engine {self.engine!r} is not supported here (supported: {', '.join(ENGINES)})")


@dataclass(frozen=True)
class Cluster:
    workers: tuple[WorkerDef, ...]
    log_dir: Path = Path("logs")
    ready_timeout_s: float = 30.0
    restart_backoff_s: tuple[float, ...] = (0.5, 1, 2, 5, 10)


PORT_KEYS = ("port", "bootstrap_port", "side_channel_port")


def _port(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535


def _check_worker(w: Any, where: str, allow_unsafe_kernel_profile: bool) -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """One ``[[worker]]`` entry's errors (all of them), the entry as the engine's planner reads it, its env."""
    errs: list[str] = []
    if not isinstance(w, dict):
        return [f"{where}: must be a table"], {}, {}
    allowed = {"name", "engine", "kind", "role", "port", "bootstrap_port", "args", "env"}
    env: dict[str, str] = {}
    engine = w.get("engine", "sim")
    try:
        if engine == "sglang":
            from engine.sglang.plan import KEYS, environment

            allowed = KEYS
            env, _ = environment(w, allow_unsafe_kernel_profile)  # profile + GPUs + env; refuses known-bad knobs
        elif engine == "vllm":
            from engine.vllm import plan

            allowed = plan.KEYS
            env = plan.environment(w)
            w = {**w, "kind": w.get("kind", "vllm")}
        elif isinstance(w.get("env", {}), dict):
            env = {str(k): str(v) for k, v in w.get("env", {}).items()}
        else:
            errs.append(f"{where}: env must be a table of strings")
    except (ValueError, KeyError, TypeError) as exc:
        from engine.sglang.plan import UnsafeProfile

        if isinstance(exc, UnsafeProfile):  # a refusal of its own: it names the flag that allows it
            raise
        errs.append(f"{where}: {exc}")
    for key in sorted(set(w) - allowed):
        close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
        errs.append(f"{where}: unknown key {key!r}; " + (f"did you mean {close[0]!r}?" if close else
                                                         f"known: {', '.join(sorted(allowed))}"))
    if engine not in ENGINES:
        errs.append(f"{where}: engine {engine!r} not supported here (supported: {', '.join(ENGINES)})")
    kind = w.get("kind", "sglang")
    if kind not in KINDS or (engine in ("sglang", "vllm") and kind != engine):
        errs.append(f"{where}: kind must be one of {', '.join(KINDS)} (a real engine speaks its own), got {kind!r}")
    if w.get("role") not in ("prefill", "decode"):
        errs.append(f"{where}: role must be prefill or decode, got {w.get('role')!r}")
    if "port" not in w:
        errs.append(f"{where}: port is required")
    for key in PORT_KEYS:
        if key in w and not _port(w[key]):
            errs.append(f"{where}: {key} must be an integer port (1-65535), got {w[key]!r}")
    if not isinstance(w.get("args", []), list) or not all(isinstance(a, (str, int, float)) for a in w.get("args", [])):
        errs.append(f"{where}: args must be a list of strings")
    return errs, w, env


def load_cluster(path: str | Path, allow_unsafe_kernel_profile: bool = False, base_port: int | None = None) -> Cluster:
    """A cluster file, every error at once (each naming its worker, "did you mean" for a misspelt key, types
    checked); ``base_port``: every worker moved to ports from ``base_port + 10`` (``pdgate up --base-port``)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    top = data.get("cluster", {})
    errs: list[str] = []
    for key in sorted(set(data) - {"cluster", "worker"}):
        errs.append(f"{path}: unknown section [{key}] (a cluster file has [cluster] and [[worker]] entries)")
    for key in sorted(set(top) - {"log_dir", "ready_timeout_s", "restart_backoff_s"}):
        close = difflib.get_close_matches(key, ["log_dir", "ready_timeout_s", "restart_backoff_s"], n=1, cutoff=0.6)
        errs.append(f"{path}: [cluster] unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    workers = []
    names: set[str] = set()
    ports: dict[int, str] = {}
    for i, w in enumerate(data.get("worker", [])):
        name = w.get("name") if isinstance(w, dict) else None
        where = f"{path}: worker {name!r}" if isinstance(name, str) and name else f"{path}: worker[{i}]"
        if not isinstance(name, str) or not name:
            errs.append(f"{where}: name is required")
        elif name in names:
            errs.append(f"{where}: name repeated")
        else:
            names.add(name)
        bad, w, env = _check_worker(w, where, allow_unsafe_kernel_profile)
        errs += bad
        if bad:
            continue
        if base_port is not None:
            w = {**w, "port": base_port + 10 + 2 * i, **({"bootstrap_port": base_port + 11 + 2 * i}
                                                          if "bootstrap_port" in w or w["role"] == "prefill" else {}),
                 **({"side_channel_port": base_port + 500 + i} if w.get("engine") == "vllm" else {})}
        for key in PORT_KEYS:
            if _port(w.get(key)):
                if w[key] in ports:
                    errs.append(f"{where}: {key} {w[key]} is also {ports[w[key]]}")
                ports[w[key]] = f"worker {w['name']}'s {key}"
        workers.append(WorkerDef(name=w["name"], engine=w.get("engine", "sim"), role=w["role"], port=int(w["port"]),
                                 bootstrap_port=w.get("bootstrap_port", 8998 if w["role"] == "prefill"
                                                      and w.get("engine") != "vllm" else None),
                                 args=tuple(str(a) for a in w.get("args", [])),
                                 env=tuple(env.items()), kind=str(w.get("kind", "sglang")), options=w))
    if not data.get("worker"):
        errs.append(f"{path}: no [[worker]] entries")
    if errs:
        raise ValueError("\n".join(errs))
    return Cluster(tuple(workers), Path(top.get("log_dir", "logs")), float(top.get("ready_timeout_s", 30)),
                   tuple(float(x) for x in top.get("restart_backoff_s", (0.5, 1, 2, 5, 10))))


def _in_the_child() -> None:
    """In the child, before its command: a process group of its own (uvloop's subprocess takes no
    ``process_group``), and SIGTERM when the supervisor process dies (Linux)."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    spec: WorkerDef
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0
    restarts: int = 0
    started_at: float = 0.0
    wanted: bool = True
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task[None] | None = None

    def view(self) -> dict[str, Any]:
        return {"name": self.spec.name, "role": self.spec.role, "engine": self.spec.engine, "url": self.spec.url,
                "pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
                "running": self.proc is not None and self.proc.returncode is None, "ready": self.ready.is_set()}


ENGINE_API_KEY_ENV = "SIM_API_KEY"  # the sim reads its --api-key from here too (kept out of the process list)


class Supervisor:
    def __init__(self, cluster: Cluster, api_key: str | None = None) -> None:
        """``api_key``: the engines' API key (SGLang's ``--api-key``), given to every worker started here."""
        self.cluster = cluster
        self.api_key = api_key
        self.children = {w.name: Child(w) for w in cluster.workers}
        self._lock = asyncio.Lock()

    def log_path(self, name: str) -> Path:
        return self.cluster.log_dir / f"{name}.log"

    async def start(self) -> None:
        self.cluster.log_dir.mkdir(parents=True, exist_ok=True)
        for c in self.children.values():
            await self._spawn(c)
            c.watcher = asyncio.create_task(self._watch(c))
        await asyncio.gather(*(self.wait_ready(c) for c in self.children.values()))

    def command(self, c: Child) -> tuple[list[str], dict[str, str]]:
        """The worker's command line and environment, with the engines' API key: the sim reads it from its
        environment, SGLang from ``--api-key`` (the only way it takes one)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(c.spec.env)}
        cmd = c.spec.command()
        if self.api_key:
            if c.spec.engine == "sglang":
                cmd += ["--api-key", self.api_key]
            else:
                env[ENGINE_API_KEY_ENV] = self.api_key
        return cmd, env

    async def _spawn(self, c: Child) -> None:
        cmd, env = self.command(c)
        shown = " ".join("<api key>" if self.api_key and a == self.api_key else a for a in cmd)
        with open(self.log_path(c.spec.name), "ab") as out:  # noqa: ASYNC230 - a local log file
            out.write(f"--- start {time.strftime('%Y-%m-%d %H:%M:%S')}: {shown}\n".encode())
            out.flush()
            # a process group of its own: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches
            # the supervisor's process alone, which stops the workers itself, after the gateway drained. Not a
            # session of its own: with the kernel's autogroup scheduling (on by default) every session is a
            # scheduling group of its own, and a real engine's (its NIXL progress thread never sleeps) took the
            # cores from the gateway's for up to 30 s at a time (scripts/sched_sessions.py); in ours, the
            # gateway and the engines share the cores as threads do
            c.proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                                                          stderr=asyncio.subprocess.STDOUT, env=env,
                                                          preexec_fn=_in_the_child)
        c.starts += 1
        c.started_at = time.monotonic()
        c.ready.clear()
        log.info("started %s (pid %d) on %s", c.spec.name, c.proc.pid, c.spec.url)

    async def wait_ready(self, c: Child) -> None:
        end = time.monotonic() + self.cluster.ready_timeout_s
        while time.monotonic() < end:
            if c.proc is None or c.proc.returncode is not None:
                raise RuntimeError(f"{c.spec.name} exited during start; see {self.log_path(c.spec.name)}")
            if await asyncio.to_thread(_health, c.spec.url):
                c.ready.set()
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{c.spec.name} not ready after {self.cluster.ready_timeout_s}s; see {self.log_path(c.spec.name)}")

    async def _watch(self, c: Child) -> None:
        """Restart the child whenever it exits while wanted, with backoff."""
        fails = 0
        while True:
            assert c.proc is not None
            code = await c.proc.wait()
            if not c.wanted:
                return
            async with self._lock:
                if c.proc.returncode is None:  # restarted on request meanwhile
                    continue
                if time.monotonic() - c.started_at > 30:
                    fails = 0
                delay = self.cluster.restart_backoff_s[min(fails, len(self.cluster.restart_backoff_s) - 1)]
                fails += 1
                log.warning("%s exited with %s; restarting in %.1fs", c.spec.name, code, delay)
                await asyncio.sleep(delay)
                if not c.wanted:
                    return
                await self._spawn(c)
                c.restarts += 1
            try:
                await self.wait_ready(c)
            except (RuntimeError, TimeoutError) as exc:
                log.error("%s", exc)

    async def restart(self, name: str) -> Child:
        """Stop one worker and start it again (a new process, so a new engine identity)."""
        c = self.children[name]
        async with self._lock:
            if c.proc is not None and c.proc.returncode is None:
                await _terminate(c.proc)
            await self._spawn(c)
            c.restarts += 1
        await self.wait_ready(c)
        return c

    async def stop(self) -> None:
        for c in self.children.values():
            c.wanted = False
        await asyncio.gather(*(_terminate(c.proc) for c in self.children.values() if c.proc is not None))
        for c in self.children.values():
            if c.watcher is not None:
                c.watcher.cancel()


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def _terminate(proc: asyncio.subprocess.Process, timeout: float = 5.0) -> None:
    if proc.returncode is not None:
        return
    try:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
    except ProcessLookupError:
        pass


async def _main(cluster: Cluster) -> None:
    sup = Supervisor(cluster)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await sup.start()
        log.info("all %d workers ready", len(sup.children))
        await stop.wait()
    finally:
        await sup.stop()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m engine.supervisor")
    p.add_argument("--cluster", default="config/cluster.sim.toml")
    a = p.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(load_cluster(a.cluster)))


if __name__ == "__main__":
    main()
