"""A real engine of the real tiers (vLLM's ``tests/real``, SGLang's ``tests/real_sglang``), started here, in its own
virtual environment, its own process group; and a PD pair of them. Judged from outside: their own ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from engine.sglang import plan as sglang_plan
from engine.vllm import plan as vllm_plan
from pdgate.core.config import DeadlineConfig, GatewayConfig, HealthConfig, WorkerSpec, validate
from tests.pdgate.harness import Running
from tests.procs import ROOT, Proc, free_port

CLEAN_S = 30.0  # both engines hold nothing within this (the promise's "within seconds", on a loaded 2-core box)
# on time, with the slack a 2-core box leaves when the pair's NIXL threads keep both cores busy (docs/fidelity.md:
# in a full CI run a total budget's end reached the client 2.8 s late); the sims' tier judges timing to 0.3 s
SLACK_S = 4.0
MSG = [{"role": "user", "content": "Tell me about the weather in a few words."}]
START_S = 300.0  # two engines starting at once on two cores: 40-90 s measured, sized for a loaded CI


def sglang_held(url: str) -> int:
    """What an SGLang engine holds, as its scheduler last published it (``/v1/loads?include=disagg``; republished when
    idle, every 50 ms while stalled, on batch results): running, waiting and every PD queue. Not its /metrics gauges: those are set only when the scheduler logs its stats, and a decode's
    transfer queue read 0 there while 4 requests waited in it for their KV."""
    with urllib.request.urlopen(url + "/v1/loads?include=disagg", timeout=20) as r:
        loads = json.loads(r.read())["loads"]
    return sum(int(ld["num_running_reqs"]) + int(ld["num_waiting_reqs"])
               + sum(int(v) for k, v in ld["disaggregation"].items() if k.endswith("_queue_reqs")) for ld in loads)


@dataclass
class Engine:
    role: str
    port: int
    entry: dict[str, Any]
    log: Path
    proc: Proc | None = None
    kind: str = "vllm"  # or "sglang"
    env: dict[str, str] = field(default_factory=dict)  # on top of the plan's

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.kind == "sglang":
            cmd, env = sglang_plan.command(self.entry), sglang_plan.environment(self.entry)[0]
        else:
            cmd, env = vllm_plan.command(self.entry), vllm_plan.environment(self.entry)
        self.proc = Proc(cmd, {**env, **self.env}, self.log, own_group=True).start()

    def wait(self, timeout: float = START_S) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc is not None and self.proc.popen is not None
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"{self.kind} {self.role} exited ({self.proc.popen.returncode}); its log's end:\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.kind} {self.role} not up within {timeout:.0f}s; see {self.log}")

    def signal(self, sig: int) -> None:
        """To the server's whole process group (its engine core and worker are its children): ours, started here."""
        assert self.proc is not None and self.proc.popen is not None
        os.killpg(self.proc.popen.pid, sig)

    def stop(self) -> None:
        """SIGTERM to the group (SIGCONT first: a stopped one cannot exit), 20 s, then SIGKILL to whatever of the group
        is left: also when the leader is gone already and its children are not."""
        if self.proc is None or self.proc.popen is None:
            return
        pgid = self.proc.popen.pid
        try:
            if self.proc.popen.poll() is None:
                os.killpg(pgid, signal.SIGCONT)
                os.killpg(pgid, signal.SIGTERM)
                self.proc.popen.wait(20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self) -> float:
        self.stop()
        self.start()
        return self.wait()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=20) as r:  # seconds on a busy box
            text = r.read().decode()
        out: dict[str, float] = {}
        for name, value in re.findall(r"^((?:vllm|sglang):[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def held(self) -> int:
        if self.kind == "sglang":
            return sglang_held(self.url)
        m = self.metrics()
        return int(m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0))


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    started_s: float = 0.0
    model: str = "tiny-llama"
    notes: dict[str, Any] = field(default_factory=dict)
    watchdog_s: float = 5.0  # how long the storm waits for the engines to let go of what a cancellation left

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


@contextlib.contextmanager
def running(prefill: Engine, decode: Engine, **kw: Any) -> Iterator[Pair]:
    """Both engines started at once and up; both stopped afterwards, also on failure."""
    try:
        t0 = time.monotonic()
        for e in (prefill, decode):
            e.start()
        for e in (prefill, decode):
            e.wait()
        yield Pair(prefill, decode, started_s=time.monotonic() - t0, **kw)
    finally:
        try:
            prefill.stop()
        finally:
            decode.stop()  # also when the prefill's stop failed: never two pairs at once


def require_installed(kind: str) -> None:
    """The real engine must be there: in CI a failure naming the install command, elsewhere a skip naming it."""
    if kind == "sglang":
        exe = sglang_plan.home() / "sglang" / "bin" / "python"
        problem = None if exe.exists() else f"real SGLang is not installed ({exe} missing): run `{sglang_plan.INSTALL}`"
    else:
        try:
            vllm_plan.python()
            problem = None
        except FileNotFoundError as exc:
            problem = str(exc)
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{problem} (the README's test command installs it)")
    pytest.skip(problem)


def config(pair: Pair, extra_decodes: tuple[str, ...] = (), **kw: Any) -> GatewayConfig:
    return validate(GatewayConfig(
        port=free_port(), admin_port=free_port(), drain_s=0.5, state_dir=tempfile.mkdtemp(prefix="pdgate-state-"),
        prefill=(WorkerSpec(url=pair.prefill.url, role="prefill", engine=pair.prefill.kind,
                            bootstrap_port=pair.prefill.entry.get("bootstrap_port")),),
        decode=(WorkerSpec(url=pair.decode.url, role="decode", engine=pair.decode.kind),
                *(WorkerSpec(url=u, role="decode", engine=pair.decode.kind) for u in extra_decodes)),
        health=kw.pop("health", HealthConfig(interval_s=1.0, timeout_s=5.0, failures=3, degraded_after_s=60)), **kw))


async def healthy(g: Running, within: float = 30.0) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(g.admin + "/v1/workers") as r:
                ws = (await r.json())["workers"]
            if ws and all(w["healthy"] for w in ws):
                return
            assert time.monotonic() - t0 < within, ws
            await asyncio.sleep(0.2)


def sdk(g: Running, **kw: Any) -> openai.AsyncOpenAI:
    """The client waits past the gateway's TTFT budget: a stalled pair ends at the gateway's answer (a 504 naming
    the budget), never at the client's own timeout."""
    return openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0,
                              timeout=DeadlineConfig().ttft_s + SLACK_S, **kw)


async def clean(pair: Pair, within: float = CLEAN_S) -> float:
    return await asyncio.to_thread(pair.wait_clean, within)


async def run_loadtest(*args: str, timeout: float) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "loadtest", *args, cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:  # timed out or cancelled: the load test is ours to end
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(errors="replace")
