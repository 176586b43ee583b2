"""Start real processes on free loopback ports for tests, and always stop them."""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.procs import ROOT, Proc, free_port, stop_all, wait_http, worker_tables

__all__ = ["ROOT", "Proc", "Procs", "Redis", "Sim", "free_port", "wait_http", "workers_toml"]
REDIS_MISSING = ("redis-server is not installed: the store's tests run a real one (Debian's redis-server package; "
                 "the README's test command installs it)")


@dataclass
class Sim:
    role: str
    port: int
    bootstrap_port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def workers_toml(prefills: Sequence[Sim], decodes: Sequence[Sim]) -> str:
    """The ``[[prefill]]`` and ``[[decode]]`` tables of a gateway config for these sims."""
    return worker_tables([(p.url, p.bootstrap_port) for p in prefills], [d.url for d in decodes])


@dataclass
class Redis:
    """A real redis-server on a Unix socket in the test's directory (nothing on disk, no TCP port)."""

    sock: Path
    proc: Proc

    @property
    def url(self) -> str:
        return f"unix:{self.sock}"

    def ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1.0)
                s.connect(str(self.sock))
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def wait(self, timeout: float = 10.0) -> Redis:
        end = time.monotonic() + timeout
        while not self.ping():
            assert self.proc.popen is not None and self.proc.popen.poll() is None, self.proc.logs()[-2000:]
            assert time.monotonic() < end, f"redis-server did not answer on {self.sock}"
            time.sleep(0.05)
        return self


@dataclass
class Procs:
    """Owns every process a test starts; ``close()`` stops them all."""

    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdgate-test-")))
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, args: Sequence[str], env: dict[str, str] | None = None, name: str = "proc",
              own_group: bool = False, cwd: Path | None = None) -> Proc:
        p = Proc(list(args), env or {}, self.tmp / f"{name}-{len(self.procs)}.log", own_group=own_group,
                 cwd=cwd).start()
        self.procs.append(p)
        return p

    def sim(self, role: str, *extra: str, env: dict[str, str] | None = None, port: int | None = None,
            bootstrap_port: int | None = None, wait: bool = True) -> Sim:
        port = port or free_port()
        bport = bootstrap_port or free_port()
        args = [sys.executable, "-m", "engine.sim", "--role", role, "--port", str(port),
                "--bootstrap-port", str(bport), *extra]
        s = Sim(role, port, bport, self.spawn(args, env, name=f"sim-{role}-{port}"))
        if wait:
            wait_http(f"{s.url}/health", proc=s.proc.popen)
        return s

    def redis(self, sock: Path | None = None) -> Redis:
        """Start a redis-server (on ``sock``: again on the socket of one stopped before, as a restart)."""
        exe = shutil.which("redis-server")
        if exe is None:
            import pytest

            pytest.skip(REDIS_MISSING)
        sock = sock or self.tmp / f"redis-{len(self.procs)}.sock"
        sock.unlink(missing_ok=True)
        args = [exe, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "",
                "--appendonly", "no", "--daemonize", "no"]
        return Redis(sock, self.spawn(args, name="redis")).wait()

    def pair(self, *extra: str, env: dict[str, str] | None = None) -> tuple[Sim, Sim]:
        return self.sim("prefill", *extra, env=env), self.sim("decode", *extra, env=env)

    def close(self) -> None:
        stop_all(self.procs)
