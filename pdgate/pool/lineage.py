"""A gateway's predecessors: what each process of this deployment owns, kept in its state directory so that a
successor finds what a killed one left on the engines (``docs/architecture.md``, "Workers, health and
reconciliation").

Each process writes one file, ``<state_dir>/instances/<instance>.json``: its instance id, pid, the pid's start time
(so a reused pid is not taken for it), its host, and — rewritten while anything changed, at most every
``RECORD_S`` — the rids of its live attempts and of those that ended lately (an abort an engine without fix A
lost may have left them pinned), each with the URLs of the workers it was on. A clean stop removes the file.

A file whose process is not running any more on this host is a **predecessor**: gone for certain, whatever a
store's lease says. Its successor (the next process on this state directory: a restarted ``pdgate serve``, a
``--workers`` process its supervisor started again, or a live sibling) claims it by renaming it (one claimant),
and the reconciler aborts its rids by name. Nothing else is judged: a file of a running process (another replica
on the same directory) or of another host is never a predecessor, and a replica with another state directory
is never seen at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("pdgate.reconcile")
RECORD_S = 0.1  # at most this often: what a kill may lose in count mode is what began in its last tenth of a second
MAX_RIDS = 20_000  # bound on the rids one record names (live ones first)
NAME = re.compile(r"[0-9a-f]{1,32}")


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux; None: not running, a zombie, or not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: the fields start after its last ')'
        fields = stat.rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])  # a zombie is dead, only not reaped yet
    except (IndexError, ValueError):
        return None


def running(pid: int, ticks: int | None) -> bool:
    """Whether the process that wrote an entry runs still (a pid reused by another process does not count)."""
    if pid <= 0:
        return False
    if Path("/proc/self/stat").exists():
        now = start_ticks(pid)
        return now is not None and (ticks is None or now == ticks)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lineage:
    """This process's entry in the state directory, and the predecessors it finds there."""

    def __init__(self, state_dir: str | None, instance: str) -> None:
        self.dir = Path(state_dir) / "instances" if state_dir else None
        self.instance = instance
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.ticks = start_ticks(self.pid)
        self.last: bytes | None = None
        self.found: dict[str, int] = {}  # predecessor instance -> rids claimed of it (shown)

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def _path(self, instance: str) -> Path:
        assert self.dir is not None
        return self.dir / f"{instance}.json"

    def start(self) -> None:
        if self.dir is None:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("state directory %s cannot be written (%s): a successor will not find this process's "
                        "requests", self.dir.parent, exc)
            self.dir = None
            return
        self.record({}, {})

    def record(self, rids: dict[str, tuple[str, ...]], urls: dict[str, str]) -> None:
        """Write what this process owns now: ``rids`` (rid -> worker ids) and ``urls`` (worker id -> URL), when it
        changed. A write that fails is logged and tried again at the next change."""
        if self.dir is None:
            return
        if len(rids) > MAX_RIDS:
            rids = dict(list(rids.items())[:MAX_RIDS])
        body = orjson.dumps({"instance": self.instance, "pid": self.pid, "ticks": self.ticks, "host": self.host,
                             "workers": urls, "rids": {r: list(ws) for r, ws in rids.items()}})
        if body == self.last:
            return
        path = self._path(self.instance)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(body)
            os.replace(tmp, path)
            self.last = body
        except OSError as exc:
            log.warning("could not record this process's requests in %s: %s", path, exc)

    def close(self) -> None:
        """A clean stop: nothing of this process is left for a successor."""
        if self.dir is None:
            return
        for p in (self._path(self.instance), self._path(self.instance).with_suffix(".tmp")):
            with contextlib.suppress(OSError):
                p.unlink()

    def predecessors(self) -> list[str]:
        """Instances recorded here whose process is not running any more on this host."""
        if self.dir is None:
            return []
        out = []
        try:
            entries = list(self.dir.glob("*.json"))
        except OSError:
            return []
        for p in entries:
            inst = p.stem
            if inst == self.instance or not NAME.fullmatch(inst):
                continue
            e = self._read(p)
            if e is None or e.get("host") != self.host:
                continue  # unreadable now, or another host's: nothing here can say it is gone
            pid, ticks = e.get("pid"), e.get("ticks")
            if isinstance(pid, int) and not running(pid, ticks if isinstance(ticks, int) else None):
                out.append(inst)
        return sorted(out)

    def claim(self, instance: str) -> dict[str, tuple[str, ...]] | None:
        """A predecessor's rids -> the URLs of the workers each was on, taken by this process alone (None: another
        successor took it first)."""
        if self.dir is None:
            return None
        mine = self.dir / f"{instance}.claimed-{self.instance}"
        try:
            os.replace(self._path(instance), mine)  # atomic: of two claimants one finds the file gone
        except OSError:
            return None
        e = self._read(mine) or {}
        with contextlib.suppress(OSError):
            mine.unlink()
        urls, rids = e.get("workers"), e.get("rids")
        urls = urls if isinstance(urls, dict) else {}
        rids = rids if isinstance(rids, dict) else {}
        out = {str(r): tuple(str(urls[w]) for w in ws if isinstance(w, str) and isinstance(urls.get(w), str))
               for r, ws in rids.items() if isinstance(ws, list)}
        self.found[instance] = len(out)
        while len(self.found) > 64:
            del self.found[next(iter(self.found))]
        return out

    @staticmethod
    def _read(p: Path) -> dict[str, Any] | None:
        try:
            e = orjson.loads(p.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        return e if isinstance(e, dict) else None
