"""The real tier: one real vLLM PD pair on this CPU (engine/vllm, the tiny model), started once for the tier, shared
by its tests, restarted by the tests that kill a part of it, stopped when the tier ends. Judged from outside: the
client's clock and the engines' own ``/metrics`` (``vllm:num_requests_running``/``waiting``, NIXL counters).

Not installed: in CI (``CI`` set) a failure naming the install command, never a skip; elsewhere a skip with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.vllm import plan
from tests.procs import Proc, free_port

START_S = 300.0  # two engines starting at once on two cores: 40-90 s measured, sized for a loaded CI


@dataclass
class Engine:
    role: str
    port: int
    entry: dict[str, Any]
    log: Path
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**plan.environment(self.entry)}
        self.proc = Proc(plan.command(self.entry), env, self.log, new_session=True).start()

    def wait(self, timeout: float = START_S) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc is not None and self.proc.popen is not None
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"vLLM {self.role} exited ({self.proc.popen.returncode}); its log's end:\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM {self.role} not up within {timeout:.0f}s; see {self.log}")

    def signal(self, sig: int) -> None:
        """To the server's whole process group (its engine core and worker are its children): ours, started here."""
        assert self.proc is not None and self.proc.popen is not None
        os.killpg(self.proc.popen.pid, sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.popen is None or self.proc.popen.poll() is not None:
            return
        pgid = self.proc.popen.pid
        try:
            os.killpg(pgid, signal.SIGCONT)
            os.killpg(pgid, signal.SIGTERM)
            self.proc.popen.wait(20)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        self.proc.popen.wait(10)

    def restart(self) -> float:
        self.stop()
        self.start()
        return self.wait()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=20) as r:  # seconds on a busy box
            text = r.read().decode()
        out: dict[str, float] = {}
        for name, value in re.findall(r"^(vllm:[a-z_]+)\{[^}]*\} ([0-9.e+-]+)$", text, re.M):
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def held(self) -> int:
        m = self.metrics()
        return int(m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0))


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    started_s: float = 0.0
    model: str = "tiny-llama"
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return self.prefill, self.decode

    def held(self) -> int:
        return self.prefill.held() + self.decode.held()

    def wait_clean(self, within: float) -> float:
        """Both engines hold no request (by their own counts) on two answered looks 0.3 s apart, none holding any
        between them; the seconds it took. (A full CI run failed "still hold 0 request(s) after 30s": under the pair's
        load its /metrics answered every other look, and each unanswered one restarted the count.)"""
        t0 = time.monotonic()
        clean_since = None
        while True:
            try:
                held = self.held()
            except OSError:  # /metrics not answered in time (a busy engine): look again, within the bound
                held = -1
            now = time.monotonic()
            if held == 0:
                clean_since = clean_since or now
                if now - clean_since >= 0.3:
                    return now - t0
            elif held > 0:  # an unanswered look (-1) says nothing of what is held: it neither clears nor breaks a run
                clean_since = None
            if now - t0 > within:
                raise AssertionError(f"the engines still hold {held} request(s) after {within:.0f}s (-1: no answer)")
            time.sleep(0.1)


def warm_up(p: Pair) -> float:
    """One request through the pair as vLLM's toy proxy sends it, before any test: the first KV transfer makes NIXL's
    handshake between the two, which took up to ~30 s here (measured: 0.3-35 s); a test's budget is not for that."""
    import json

    def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": "pdgate-warm-up"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return dict(json.loads(r.read()))

    body = {"model": p.model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}
    t0 = time.monotonic()
    first = post(p.prefill.url, {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}})
    post(p.decode.url, {**body, "kv_transfer_params": first["kv_transfer_params"]})
    return time.monotonic() - t0


def require_installed() -> None:
    """Real vLLM must be there: in CI a failure naming the install command, elsewhere a skip naming it."""
    try:
        plan.python()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc} (the README's test command installs it)")
        pytest.skip(str(exc))


@pytest.fixture(scope="package")
def pair() -> Iterator[Pair]:
    require_installed()
    logs = Path(tempfile.mkdtemp(prefix="pdgate-real-"))
    pp, dp = free_port(), free_port()
    engines = [Engine(role, port, {"name": f"vllm-{role}", "engine": "vllm", "role": role, "port": port,
                                   "cpu": cpu, "side_channel_port": free_port()}, logs / f"vllm-{role}.log")
               for role, port, cpu in (("prefill", pp, 0), ("decode", dp, 1))]
    try:
        t0 = time.monotonic()
        for e in engines:
            e.start()
        for e in engines:
            e.wait()
        p = Pair(*engines, started_s=time.monotonic() - t0)
        p.notes["first_transfer_s"] = warm_up(p)
        yield p
    finally:
        for e in engines:
            e.stop()
