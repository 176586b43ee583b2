"""Stopping the processes a test or a benchmark started: every one, also when one of them is slow to die or fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import procs as lp
from tests.procs import Procs

SLEEPS = "import time; time.sleep(120)"


class SlowToReap:
    """A process the kernel takes ``reap_s`` seconds to tear down after SIGKILL (a big one, on a loaded machine):
    its ``wait`` times out for any shorter timeout, as ``subprocess.Popen.wait`` does."""

    def __init__(self, reap_s: float) -> None:
        self.reap_s, self.killed, self.returncode = reap_s, False, None
        self.pid = 2 ** 22 + 1  # above pid_max's default: no process has it

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        if not self.killed or (timeout is not None and timeout < self.reap_s):
            raise subprocess.TimeoutExpired("slow", timeout or 0)
        self.returncode = -signal.SIGKILL
        return self.returncode


def test_a_killed_process_that_takes_seconds_to_reap_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI's failure on a528d40: a sim's teardown raised TimeoutExpired 5 s after its SIGKILL, and the unreaped Popen
    failed the next test with a ResourceWarning."""
    monkeypatch.setattr(lp.os, "kill", lambda pid, sig: None)
    p = lp.Proc(["slow"], {}, tmp_path / "slow.log", popen=SlowToReap(8.0))  # type: ignore[arg-type]
    p.stop(timeout=0.01)
    assert p.popen is not None and p.popen.returncode == -signal.SIGKILL


def test_one_process_that_fails_to_stop_leaves_no_other_running(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = SlowToReap(lp.KILL_WAIT_S + 1)
    kill = lp.os.kill
    monkeypatch.setattr(lp.os, "kill", lambda pid, sig: None if pid == stuck.pid else kill(pid, sig))
    ps = Procs(tmp=tmp_path)
    first = ps.spawn([sys.executable, "-c", SLEEPS], name="first")
    ps.procs.append(lp.Proc(["stuck"], {}, tmp_path / "stuck.log", popen=stuck))  # type: ignore[arg-type]
    last = ps.spawn([sys.executable, "-c", SLEEPS], name="last")
    real = (first, last)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            ps.close()
        assert [p.popen.returncode for p in real if p.popen is not None] == [-signal.SIGTERM] * 2
    finally:
        for p in real:
            if p.popen is not None and p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait()


def test_a_process_of_its_own_group_is_in_this_session(tmp_path: Path) -> None:
    """``own_group``: killpg reaches it alone, and it shares this session (the kernel's autogroup scheduling counts it
    with us: engines in sessions of their own starved this session's processes for seconds)."""
    p = lp.Proc([sys.executable, "-c", "import time; time.sleep(30)"], {}, tmp_path / "p.log", own_group=True).start()
    try:
        assert (os.getpgid(p.pid), os.getsid(p.pid)) == (p.pid, os.getsid(0))
        assert os.getpgid(0) != p.pid
    finally:
        lp.stop_all([p])
