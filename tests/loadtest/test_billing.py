"""``python -m loadtest billing`` (BENCHMARKS.md run V), small: a session with a billing nonce in every request
keeps its prefix in the engines' cache only with ``normalise_billing`` on (the mechanism switched off loses it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT


def test_the_nonce_defeats_the_prefix_cache_unless_normalised(tmp_path: Path) -> None:
    png = tmp_path / "billing.png"
    run = subprocess.run([sys.executable, "-m", "loadtest", "billing", "--rounds", "0", "--replay-rounds", "3",
                          "--system-words", "600", "--json", "--plot", str(png)],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)["settings"]
    on, off = got["on"]["replay"], got["off"]["replay"]
    assert on["after_first"] > 0.7, on
    assert off["after_first"] < 0.05, off
    assert "normalise_billing" in run.stderr and png.stat().st_size > 10_000
