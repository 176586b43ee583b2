"""pdgate.pool.lineage: what makes a recorded process a predecessor, and what never does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pdgate.pool.lineage import Lineage, running, start_ticks


def entry(d: Path, inst: str, **kw: object) -> None:
    (d / "instances").mkdir(parents=True, exist_ok=True)
    e = {"instance": inst, "pid": os.getpid(), "ticks": start_ticks(os.getpid()), "host": os.uname().nodename,
         "workers": {"p0": "http://127.0.0.1:1"}, "rids": {f"pdg-{inst}-1.1": ["p0"]}, **kw}
    (d / "instances" / f"{inst}.json").write_text(json.dumps(e))


def test_a_live_process_a_reused_pid_a_dead_one_and_another_host(tmp_path: Path) -> None:
    me = Lineage(str(tmp_path), "aaaa")
    me.start()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    entry(tmp_path, "b0b0")  # this very process: alive
    entry(tmp_path, "c0c0", ticks=(start_ticks(os.getpid()) or 0) + 1)  # our pid, another start time: reused
    entry(tmp_path, "d0d0", pid=dead.pid, ticks=None)  # exited
    entry(tmp_path, "e0e0", pid=dead.pid, host="elsewhere")  # another host's: never judged
    assert me.predecessors() == ["c0c0", "d0d0"]
    assert running(os.getpid(), start_ticks(os.getpid())) and not running(dead.pid, None)


def test_a_zombie_is_dead(tmp_path: Path) -> None:
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    import time

    while Path(f"/proc/{z.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    assert start_ticks(z.pid) is None and not running(z.pid, None)
    z.wait()


def test_one_claimant_and_its_rids_by_url_and_a_clean_stop(tmp_path: Path) -> None:
    a, b = Lineage(str(tmp_path), "aaaa"), Lineage(str(tmp_path), "bbbb")
    entry(tmp_path, "d0d0", pid=2**22 + 7, ticks=None)
    got = a.claim("d0d0")
    assert got == {"pdg-d0d0-1.1": ("http://127.0.0.1:1",)} and b.claim("d0d0") is None
    assert a.found == {"d0d0": 1}
    a.start()
    a.record({"pdg-aaaa-2.1": ("p0", "d0")}, {"p0": "u", "d0": "v"})
    assert json.loads((tmp_path / "instances" / "aaaa.json").read_text())["rids"] == {"pdg-aaaa-2.1": ["p0", "d0"]}
    a.close()
    assert not list((tmp_path / "instances").iterdir())


def test_no_state_directory_records_nothing(tmp_path: Path) -> None:
    x = Lineage("", "aaaa")
    x.start()
    x.record({"r": ("p0",)}, {"p0": "u"})
    assert not x.enabled and x.predecessors() == [] and x.claim("d0d0") is None
