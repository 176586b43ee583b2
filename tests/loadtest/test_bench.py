"""bench against given targets: closed and open loop, streaming TPOT; the generator is its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.pdgate.harness import make_config, start_gateway
from tests.procs import ROOT, Procs


async def test_bench_targets_closed_and_open_loop(procs: Procs, gateways: list[Any], tmp_path: Path) -> None:
    p, d = procs.pair("--speed", "0")
    g = await start_gateway(make_config([p], [d]))
    gateways.append(g)
    import asyncio

    for extra, key in ((["--concurrency", "4", "--stream"], "s4"), (["--rate", "40"], "ns40rps")):
        out = tmp_path / f"{key}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest", "bench", "--target", g.url, *extra, "--duration", "2", "--out", str(out),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, stdout.decode()[-2000:]
        m = json.loads(out.read_text())["results"][key][g.url]
        assert m["ok"] > 0 and m["errors"] == 0
        if key == "s4":
            assert m["tpot_p50_ms"] is not None and m["ttft_p50_ms"] > 0
        else:  # open loop: about the asked rate, not what the server could do
            assert 25 <= m["rps"] <= 55, m


def test_bench_needs_a_target() -> None:
    r = subprocess.run([sys.executable, "-m", "loadtest", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "--target" in r.stderr
