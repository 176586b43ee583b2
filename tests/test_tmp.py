"""A test run leaves nothing in the machine's temp folder (``tests/conftest.py``: one folder a run, removed at its
end), also what the processes it started put there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT


def test_a_run_leaves_nothing_in_the_temp_folder(tmp_path: Path) -> None:
    """A run of one test that starts sims (their logs) and gateways (their state directories) in a temp folder of its
    own: the folder is empty afterwards. Without the run's folder it held a ``pdgate-test-*`` and a ``pdgate-state-*``
    for every such test, which accumulated by the thousand on this machine."""
    machine_tmp = tmp_path / "tmp"
    machine_tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/pdgate/test_front.py::test_inspection_api"],
                       cwd=ROOT, env={**os.environ, "TMPDIR": str(machine_tmp)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 passed" in r.stdout, r.stdout[-2000:]
    assert sorted(p.name for p in machine_tmp.iterdir()) == []
