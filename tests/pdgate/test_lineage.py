"""pdgate.pool.lineage: what makes a recorded process a predecessor, and what never does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pdgate.pool.lineage import COMPACT_MIN, Lineage, running, start_ticks


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
    a.began("pdg-aaaa-2.1", ("p0", "d0"))
    a.record(1.0, {"p0": "u", "d0": "v"})
    assert Lineage._read(tmp_path / "instances" / "aaaa.json")["rids"] == {"pdg-aaaa-2.1": ["p0", "d0"]}
    a.close()
    assert not list((tmp_path / "instances").iterdir())


def test_what_a_record_writes_follows_what_changed_not_what_is_live(tmp_path: Path) -> None:
    """2,000 live streams are written once; then a tick with nothing new writes nothing, and one that saw one rid
    begin and one drop out of reach appends one short line (a rewrite of every rid each tenth of a second held the
    gateway's loop 2 ms in every 100: the streams' p99). The successor replays the lines to the same rids."""
    a = Lineage(str(tmp_path), "aaaa", window_s=10.0)
    a.start()
    path = tmp_path / "instances" / "aaaa.json"
    urls = {"p0": "http://127.0.0.1:1", "d0": "http://127.0.0.1:2"}
    for i in range(2000):
        a.began(f"pdg-aaaa-{i}.1", ("p0", "d0"))
    a.record(1.0, urls)
    size, inode = path.stat().st_size, path.stat().st_ino
    a.record(1.1, urls)
    assert path.stat().st_size == size, "nothing changed: nothing written"
    a.ended("pdg-aaaa-0.1", 1.2)
    a.began("pdg-aaaa-new.1", ("p0", "d0"))
    a.record(1.3, urls)  # the ended one is still within reach: recorded yet
    a.record(11.5, urls)  # now it is not
    assert path.stat().st_ino == inode, "appended to, not written whole"
    assert path.stat().st_size - size < 200, f"{path.stat().st_size - size} bytes for two changes"
    want = {f"pdg-aaaa-{i}.1" for i in range(1, 2000)} | {"pdg-aaaa-new.1"}
    with path.open("ab") as f:  # a kill in the middle of a line
        f.write(b'{"add": {"pdg-aaaa-cut')
    e = Lineage._read(path)
    assert e is not None and set(e["rids"]) == want and e["workers"] == urls


def test_the_journal_is_written_whole_again_once_it_outgrows_its_rids(tmp_path: Path) -> None:
    """Short requests churn: the lines appended are bounded by twice the rids (plus COMPACT_MIN), then the file is
    written whole again; ended rids past ``keep`` are dropped, the oldest first."""
    a = Lineage(str(tmp_path), "aaaa", window_s=1e9, keep=100)
    a.start()
    path = tmp_path / "instances" / "aaaa.json"
    t = 0.0
    for i in range(6 * COMPACT_MIN):
        t += 0.001
        a.began(f"pdg-aaaa-{i}.1", ("p0", "d0"))
        a.ended(f"pdg-aaaa-{i}.1", t)
        if i % 10 == 0:
            a.record(t, {})
            assert path.stat().st_size < 2 * 200 * 70 + COMPACT_MIN * 70, "the journal outgrew its rids"
    a.record(t, {})
    e = Lineage._read(path)
    assert e is not None and set(e["rids"]) == {f"pdg-aaaa-{i}.1" for i in range(6 * COMPACT_MIN - 100,
                                                                                                  6 * COMPACT_MIN)}


def test_no_state_directory_records_nothing(tmp_path: Path) -> None:
    x = Lineage("", "aaaa")
    x.start()
    x.record(1.0, {"p0": "u"})
    assert not x.enabled and x.predecessors() == [] and x.claim("d0d0") is None


def test_a_record_found_missing_is_written_whole_again(tmp_path: Path) -> None:
    """Removed by hand, or claimed by a sibling that took this process for gone: an append would make a file whose
    first line names no process (never a predecessor for anyone); the whole record is written again instead."""
    a = Lineage(str(tmp_path), "aaaa", window_s=10.0)
    a.start()
    a.began("pdg-aaaa-1.1", ("p0", "d0"))
    a.record(1.0, {"p0": "u", "d0": "v"})
    path = tmp_path / "instances" / "aaaa.json"
    path.unlink()
    a.began("pdg-aaaa-2.1", ("p0", "d0"))
    a.record(1.1, {"p0": "u", "d0": "v"})
    e = Lineage._read(path)
    assert e is not None and e["pid"] == os.getpid() and e["instance"] == "aaaa"
    assert set(e["rids"]) == {"pdg-aaaa-1.1", "pdg-aaaa-2.1"} and e["workers"] == {"p0": "u", "d0": "v"}


def test_worker_changes_count_toward_writing_it_whole(tmp_path: Path) -> None:
    """A pool whose URLs change on every tick (workers coming and going) appends the whole URL map each time: those
    count like rids, so the file stays bounded with no request at all."""
    a = Lineage(str(tmp_path), "aaaa")
    a.start()
    path = tmp_path / "instances" / "aaaa.json"
    urls = {f"w{i}": f"http://127.0.0.1:{10000 + i}" for i in range(64)}
    for t in range(1000):
        a.record(float(t), {**urls, "flip": str(t)})
        assert path.stat().st_size < 4 * (COMPACT_MIN + 65) * 40, "the journal outgrew what it says"
    assert Lineage._read(path)["workers"] == {**urls, "flip": "999"}
