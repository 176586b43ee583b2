"""Start real processes on free loopback ports for tests, and always stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


@dataclass
class Proc:
    args: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.kill(self.popen.pid, signal.SIGCONT)
            self.popen.send_signal(sig)
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Sim:
    role: str
    port: int
    bootstrap_port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Procs:
    """Owns every process a test starts; ``close()`` stops them all."""

    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdgate-test-")))
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, args: Sequence[str], env: dict[str, str] | None = None, name: str = "proc") -> Proc:
        p = Proc(list(args), env or {}, self.tmp / f"{name}-{len(self.procs)}.log").start()
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

    def pair(self, *extra: str, env: dict[str, str] | None = None) -> tuple[Sim, Sim]:
        return self.sim("prefill", *extra, env=env), self.sim("decode", *extra, env=env)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
