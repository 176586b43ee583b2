"""agents catches the unsafe kernel profile's long-context stall and passes on the safe one; agents --compare runs
the same sessions through each policy and sglang-router."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.pdgate.harness import make_config, start_gateway
from tests.procs import ROOT, Procs


@pytest.mark.parametrize("profile, api", [("unsafe", "chat"), ("safe", "chat"), ("unsafe", "responses"),
                                          ("safe", "responses")])
async def test_agents_catch_the_long_context_stall(procs: Procs, gateways: list[Any], tmp_path: Path, profile: str,
                                                   api: str) -> None:
    """Over chat (the history resent) and over Responses (previous_response_id: the gateway's stored conversation
    grows the context the same way)."""
    env = {"SIM_STALL_THRESHOLD_TOKENS": "400"}
    if profile == "unsafe":
        env["SGLANG_SM120_MMA_TARGET_CTAS"] = "512"
    p, d = procs.sim("prefill"), procs.sim("decode", env=env)
    g = await start_gateway(make_config([p], [d]))
    gateways.append(g)
    out = tmp_path / "agents.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest", "agents", "--gateway", g.url, "--sessions", "4", "--rounds", "5",
        "--growth", "120", "--deadline", "2", "--max-tokens", "8", "--no-tools", "--think-ms", "0", "--out", str(out),
        "--api", api, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    stdout, _ = await asyncio.wait_for(proc.communicate(), 90)
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    rounds_ok = [r["ok"] for r in report["per_round"]]
    if profile == "unsafe":
        assert proc.returncode == 1 and report["verdict"] == "FAIL"
        assert len(report["failures"]) == 4, stdout.decode()[-2000:]
        first_bad = min(f["round"] for f in report["failures"])
        assert first_bad >= 2 and rounds_ok[0] == 4, "short contexts still work: the stall comes with growth"
        assert all("deadline" in f["why"] for f in report["failures"]), report["failures"]
        assert report["api"] == api
    else:
        assert proc.returncode == 0 and report["verdict"] == "PASS" and rounds_ok == [4] * 5, stdout.decode()[-2000:]


async def test_agents_compare_runs_every_policy_and_the_router(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest", "agents", "--compare", "--sessions", "2", "--rounds", "4",
        "--system-tokens", "2000", "--growth", "200", "--think-ms", "20", "--max-tokens", "4", "--out", str(out),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    stdout, _ = await asyncio.wait_for(proc.communicate(), 150)
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    assert list(report["targets"]) == ["round_robin", "least_loaded", "session", "cache_aware",
                                       "sglang-router cache_aware"], stdout.decode()[-2000:]
    for name, t in report["targets"].items():
        assert not t["failures"] and sum(r["ok"] for r in t["per_round"]) == 8, name
        assert sum(r["tool_calls"] for r in t["per_round"]) == 4, "rounds 1 and 3 of each session are tool calls"
        assert t["prefill_prompt_tokens"] > 2 * 4 * 2000
    for name in ("session", "cache_aware"):  # round 1 is cold; rounds 2-4 find their history
        assert report["targets"][name]["cache_hit_rate"] > 0.6, report["targets"][name]
    assert proc.returncode == (0 if report["verdict"] == "PASS" else 1)
