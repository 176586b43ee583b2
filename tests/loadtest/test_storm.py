"""The storm's verdict is honest: FAIL where pins stay, PASS where the fixes clear them."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from pdgate.core.config import ReconcileConfig
from tests.pdgate.harness import make_config, start_gateway
from tests.procs import ROOT, Procs

ENV = {"SGLANG_REQUEST_STATE_WAIT_TIMEOUT": "0.3", "SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT": "2"}


@pytest.mark.parametrize("fixes", ["none", "A,B,C"])
async def test_storm_verdict(procs: Procs, gateways: list[Any], tmp_path: Path, fixes: str) -> None:
    # every prefill waits for an acknowledgement the decode drops, and the first abort of each is lost:
    # only the engine's fixes (or the gateway's aborts and reconciler, switched off here) end those pins
    p = procs.sim("prefill", "--fixes", fixes, "--fault", "abort_race=1", env=ENV)
    d = procs.sim("decode", "--fixes", fixes, "--fault", "ack_loss=1", "--speed", "5", env=ENV)
    cfg = dataclasses.replace(make_config([p], [d]), abort_legs=False, reconcile=ReconcileConfig(enabled=False))
    g = await start_gateway(cfg)
    gateways.append(g)
    out = tmp_path / "storm.json"
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest", "storm", "--gateway", g.url, "--admin", g.admin, "--iterations", "4", "--instances", "3",
        "--watchdog", "2", "--grace", "2", "--window", "6", "--request-timeout", "20", "--out", str(out), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    report = json.loads(out.read_text())
    checks = {c["check"]: c["ok"] for c in report["checks"]}
    assert checks["baseline probe"] and checks["every client request terminal"], stdout.decode()[-3000:]
    assert out.with_suffix(".png").exists()
    if fixes == "none":
        assert proc.returncode == 1 and report["verdict"] == "FAIL" and not checks["pins cleared by watchdog + grace"]
        assert report["force_fails"] == 0
    else:
        assert proc.returncode == 0 and report["verdict"] == "PASS", stdout.decode()[-3000:]
        assert report["force_fails"] >= 1


async def test_a_prefills_pins_are_read_from_the_schedulers_count_not_a_lagging_gauge() -> None:
    """Real SGLang's /metrics queue gauges are set only when its scheduler logs stats (a real decode's read 0 while
    /v1/loads counted 4): the storm reads /v1/loads where the engine has it, /metrics where it has not (vLLM)."""
    import aiohttp
    from aiohttp import web

    from loadtest import storm

    gauge = 'sglang:num_prefill_inflight_queue_reqs{engine_type="prefill",tp_rank="0"} 0.0\n'
    loads = {"loads": [{"dp_rank": 0, "disaggregation": {"mode": "prefill", "prefill_inflight_queue_reqs": 4}}]}
    async def sglang_metrics(_: web.Request) -> web.Response:
        return web.Response(text=gauge)

    async def sglang_loads(_: web.Request) -> web.Response:
        return web.json_response(loads)

    async def vllm_metrics(_: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{a="b"} 2.0\n')

    app = web.Application()
    app.router.add_get("/sglang/metrics", sglang_metrics)
    app.router.add_get("/sglang/v1/loads", sglang_loads)
    app.router.add_get("/vllm/metrics", vllm_metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as http:
            assert await storm.held(http, f"http://127.0.0.1:{port}/sglang/metrics") == 4
            assert await storm.held(http, f"http://127.0.0.1:{port}/vllm/metrics") == 2  # no /v1/loads: its gauges
    finally:
        await runner.cleanup()


def test_a_verdicts_model_defaults_to_what_the_pdgate_up_here_serves(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`loadtest storm --iterations 4 --instances 3` from a `pdgate up --cluster config/cluster.sglang-cpu.toml`
    directory asks for "tiny-llama", which that cluster serves: with the sims' "sim-model" every probe was a 404. A
    test driving another gateway from there keeps "sim-model"."""
    from loadtest.output import up_model
    from pdgate.planes.up import write_up_file

    monkeypatch.delenv("PDGATE_ADMIN_KEY_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert up_model(None) == "sim-model"  # no pdgate up here
    write_up_file(tmp_path / ".pdgate", "http://127.0.0.1:1", "http://127.0.0.1:2", "tiny-llama")
    assert up_model("http://127.0.0.1:1") == "tiny-llama"
    assert up_model("http://127.0.0.1:9") == "sim-model"  # another gateway than the up's


@pytest.mark.timeout(240)  # three storms of ~20 s, each on fresh sims and a fresh gateway
async def test_the_storm_compared_pdgate_clears_the_pins_the_routers_leave(tmp_path: Path) -> None:
    """``loadtest storm --compare``: fresh pinning sims for each run (no engine fixes, every KV ack dropped, the first
    abort of each request lost), the same storm through pdgate, sglang-router and SMG 1.13 on their defaults. pdgate's
    aborts and reconciliation clear the pins within watchdog + grace; the routers abort nothing and the pins stay.
    Each run carries the machine's load; the verdict (exit status) is pdgate's."""
    import asyncio

    out = tmp_path / "compare.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest", "storm", "--compare", "--iterations", "2", "--instances", "3", "--watchdog", "2",
        "--grace", "3", "--window", "7", "--request-timeout", "6", "--probe-timeout", "4", "--out", str(out),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, process_group=0)
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), 220)
    finally:  # timed out or failed: its sims and gateways go with it (its own process group)
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    text = stdout.decode(errors="replace")[-4000:]
    report = json.loads(out.read_text())
    runs = {r["target"]: r for r in report["runs"]}
    assert [r["target"] for r in report["runs"]] == ["pdgate", "sglang-router", "smg"], text  # one storm each
    assert runs["pdgate"]["verdict"] == "PASS" and runs["pdgate"]["pins_left"] == 0, (runs["pdgate"]["checks"], text)
    for peer in ("sglang-router", "smg"):
        assert runs[peer]["pins_cleared"] is False and runs[peer]["pins_left"] > 0, (peer, runs[peer]["checks"])
    for r in report["runs"]:
        assert r["pins_peak"] > 0, "every target's storm pinned requests on its prefill at first"
        assert len(r["load_before"]) == 3 and 0 <= r["others_cpu_share"] and isinstance(r["busy"], bool)
    assert proc.returncode == 0 and report["verdict"] == "PASS", text
    assert out.with_suffix(".png").exists()
