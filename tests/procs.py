"""Start real processes on free loopback ports for tests, and always stop them."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.procs import ROOT, Proc, free_port, wait_http, worker_tables

__all__ = ["ROOT", "Proc", "Procs", "Sim", "free_port", "wait_http", "workers_toml"]


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
class Procs:
    """Owns every process a test starts; ``close()`` stops them all."""

    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdgate-test-")))
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, args: Sequence[str], env: dict[str, str] | None = None, name: str = "proc",
              new_session: bool = False, cwd: Path | None = None) -> Proc:
        p = Proc(list(args), env or {}, self.tmp / f"{name}-{len(self.procs)}.log", new_session=new_session,
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

    def pair(self, *extra: str, env: dict[str, str] | None = None) -> tuple[Sim, Sim]:
        return self.sim("prefill", *extra, env=env), self.sim("decode", *extra, env=env)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
