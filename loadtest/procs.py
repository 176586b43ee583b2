"""Child processes for load tests and test fixtures: start on loopback, wait, measure CPU, stop by PID."""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_TICK = os.sysconf("SC_CLK_TCK")


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_GIVEN: collections.deque[int] = collections.deque(maxlen=512)  # the ports this process handed out last


def free_port() -> int:
    """A free port for a server we are about to start, chosen below the kernel's ephemeral range.

    A port from ``bind(0)`` is an ephemeral one: between this check and the child's own bind,
    any outgoing connection (a worker's KV or bootstrap link, a load generator) may take it,
    and the child dies with "address already in use" (seen in CI-like runs). Ports below the
    range are never handed out to outgoing connections."""
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in _GIVEN:  # handed out a moment ago, maybe not bound yet: two servers would share it
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.append(port)
            return port
    with socket.socket() as s:  # the range below is crowded: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None,
              data: bytes | None = None) -> None:
    """Poll ``url`` until it answers 200 (POSTing ``data`` if given)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered")
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and all its descendants (from /proc)."""
    total = 0.0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


KILL_WAIT_S = 60.0  # how long a SIGKILLed process is waited for before its stop fails


def stop_all(procs: list[Proc]) -> None:
    """Stop every one of ``procs``, newest first; one that fails to stop does not leave the others running: the
    first failure is raised once all were tried."""
    failed: BaseException | None = None
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as e:  # raised below, after the rest are stopped
            failed = failed or e
    if failed is not None:
        raise failed


@dataclass
class Proc:
    args: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    # a process group of its own (as a shell's job), in this session: killpg reaches it alone, and the kernel's autogroup
    # scheduler counts it with us (a session of its own was a group of its own there: real engines in theirs starved
    # this session's processes for up to 30 s, engine/supervisor.py)
    own_group: bool = False
    cwd: Path | None = None  # where it runs (default: the repository)

    def start(self) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.args, cwd=self.cwd or ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, process_group=0 if self.own_group else None)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        """``sig``, then SIGKILL after ``timeout``; returns once the process is reaped. A killed process is waited
        for up to ``KILL_WAIT_S``: on a loaded machine the kernel's teardown of a big process can take seconds, and a
        process left unreaped is a leak (and a ResourceWarning in whichever test runs next)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.kill(self.popen.pid, signal.SIGCONT)
            self.popen.send_signal(sig)
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(KILL_WAIT_S)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


class Stack:
    """The processes of one benchmark run; all stopped at the end, by PID (also on failure)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(args, env or {}, self.tmp / f"{name}.log").start()
        self.procs.append(p)
        return p

    def stop(self, p: Proc) -> None:
        """Stop one of them now (the rest at ``close``)."""
        p.stop()
        if p in self.procs:
            self.procs.remove(p)

    def close(self) -> None:
        try:
            stop_all(self.procs)
        finally:
            self.procs.clear()


ROUTER_MISSING = ("sglang-router is not installed here, and this comparison runs it: "
                  "pip install sglang-router==0.3.2 (it is in the test extra: pip install -e '.[test]')")


def require_router() -> None:
    """Before a comparison starts anything: sglang-router must be importable, or one line says how to get it."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit(f"loadtest: {ROUTER_MISSING}")
    if not SMG.exists():
        raise SystemExit(f"loadtest: {SMG_MISSING}")


SMG = Path(os.environ.get("PDGATE_PEERS_DIR") or Path.home() / ".cache" / "pdgate" / "peers") / "smg" / "bin" / "smg"
SMG_MISSING = "SMG 1.13 is not installed here, and this comparison runs it: bash loadtest/install_smg.sh"
PEERS = ("sglang-router", "smg")  # the PD routers a comparison runs beside pdgate: sglang-router 0.3.2 and SMG 1.13
KNOCKED = "pdgate-knocked"  # pdgate with named features knocked out (scripts/knockout_serve.py): measurement only
FLOOR = "h1lite-floor"  # the least a Python PD relay on h1lite does: what pdgate's own features cost is measured over it


def knockout_module() -> types.ModuleType:
    """``scripts/knockout_serve.py`` as a module (its ``KNOCKS`` and ``apply``), run by ``KNOCKED``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("knockout_serve", ROOT / "scripts" / "knockout_serve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def knockout_names() -> list[str]:
    """The features ``KNOCKED`` can knock out."""
    return list(knockout_module().KNOCKS)


def floor_cmd(port: int, prefill: str, bootstrap_port: int, decodes: list[str]) -> list[str]:
    """The command line of ``benchmarks/h1lite_floor.py`` (``FLOOR``) on loopback."""
    return [sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / "h1lite_floor.py"),
            "--port", str(port), "--prefill", prefill, "--bootstrap-port", str(bootstrap_port), "--decode", *decodes]


def peer_cmd(kind: str, port: int, prefills: list[tuple[str, int | None]], decodes: list[str],
             extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of a peer PD router on its defaults (``kind``: ``sglang-router``, ``mini_lb``, the same with
    ``--mini-lb``, or ``smg``: SMG's ``smg launch``, the Rust gateway that replaced sglang-router), on loopback,
    its metrics on a port of their own."""
    pre = [x for u, b in prefills for x in ("--prefill", u, *([str(b)] if b is not None else []))]
    dec = [x for d in decodes for x in ("--decode", d)]
    head = ([str(SMG), "launch"] if kind == "smg"
            else [sys.executable, "-m", "sglang_router.launch_router"])
    return [*head, "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port), *pre, *dec,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
            *(["--mini-lb"] if kind == "mini_lb" else []), *extra]


def worker_tables(prefills: list[tuple[str, int]], decodes: list[str]) -> str:
    """The ``[[prefill]]`` and ``[[decode]]`` tables of a gateway config for these workers."""
    return ("".join(f'[[prefill]]\nurl = "{u}"\nbootstrap_port = {b}\n' for u, b in prefills)
            + "".join(f'[[decode]]\nurl = "{u}"\n' for u in decodes))
