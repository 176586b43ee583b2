"""A gateway's predecessors: what each process of this deployment owns, kept in its state directory so that a
successor finds what a killed one left on the engines (``docs/architecture.md``, "Workers, health and
reconciliation").

Each process writes one file, ``<state_dir>/instances/<instance>.json``: its instance id, pid, the pid's start time
(so a reused pid is not taken for it), its host, its workers' URLs, and the rids of its attempts, live and ended
lately (an abort an engine without fix A lost may have left them pinned), each with the workers it was on. A clean
stop removes the file.

The file is a journal, so that what a record costs follows what changed, not what is live: its first line is the
whole record (one JSON object), each line after it what changed since (``add``: rids begun, ``drop``: rids out of
reach now, ``workers``: the URLs, whole), appended at most every ``RECORD_S``. When the changes appended since
(a rid begun or dropped, a URL) outnumber twice the rids plus ``COMPACT_MIN``, the file is written whole again
(write and rename); so is a file found missing (removed by hand, or claimed by a sibling that took this process
for gone). Thousands of live streams are
recorded once, not every tenth of a second (a full rewrite of 2,000 rids held the loop 2 ms in every 100: the
streams' p99 delay). A reader replays the lines; a last line a kill cut short is skipped.

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
from collections import deque
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("pdgate.reconcile")
RECORD_S = 0.1  # at most this often: what a kill may lose in count mode is what began in its last tenth of a second
COMPACT_MIN = 4096  # changes appended before the file may be written whole again (and twice its rids)
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
    """This process's entry in the state directory, and the predecessors it finds there. The request path tells it
    what begins (``began``) and ends (``ended``); ``record`` writes what changed."""

    def __init__(self, state_dir: str | None, instance: str, window_s: float = 0.0, keep: int = 2000) -> None:
        self.dir = Path(state_dir) / "instances" if state_dir else None
        self.instance = instance
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.ticks = start_ticks(self.pid)
        self.window_s, self.keep = window_s, keep  # an ended rid is kept this long, and at most this many of them
        self.rids: dict[str, tuple[str, ...]] = {}  # what the file says once the changes below are written
        self.ended_at: deque[tuple[float, str]] = deque()  # (when, rid), oldest first
        self.added: list[str] = []  # rids begun since the last write
        self.dropped: list[str] = []  # rids out of reach since the last write
        self.urls: dict[str, str] = {}  # as the file says
        self.appended = 0  # changes appended since the file was last written whole
        self.whole = False  # the file holds the whole record (it has been written since start)
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
        self.record(0.0, {})

    # ---- what the request path tells it (nothing is written here)
    def began(self, rid: str, workers: tuple[str, ...]) -> None:
        """An attempt's rid is on these workers now."""
        self.rids[rid] = workers
        self.added.append(rid)

    def ended(self, rid: str, now: float) -> None:
        """Its attempt ended: it stays recorded for ``window_s`` (the newest ``keep`` of them)."""
        self.ended_at.append((now, rid))

    def record(self, now: float, urls: dict[str, str]) -> None:
        """Write what changed: the rids begun, those ended more than ``window_s`` ago (or past ``keep``) dropped, and
        ``urls`` (worker id -> URL) if they differ. A write that fails is logged; the whole record is written at the
        next change."""
        if self.dir is None:
            return
        ended, rids, dropped = self.ended_at, self.rids, self.dropped
        since = now - self.window_s
        while ended and (ended[0][0] < since or len(ended) > self.keep):
            rid = ended.popleft()[1]
            if rids.pop(rid, None) is not None:
                dropped.append(rid)
        changed = urls != self.urls
        if self.whole and not changed and not self.added and not dropped:
            return
        n = len(self.added) + len(dropped)
        if not self.whole or self.appended + n > 2 * len(rids) + COMPACT_MIN:
            self._write_whole(urls)
            return
        delta: dict[str, object] = {}
        if self.added:
            delta["add"] = {r: rids[r] for r in self.added if r in rids}
        if dropped:
            delta["drop"] = dropped
        if changed:
            delta["workers"] = urls
        path = self._path(self.instance)
        line = orjson.dumps(delta) + b"\n"
        try:  # one write: a kill leaves whole lines and at most one cut short
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # never created here: a file without its first line
        except FileNotFoundError:  # would name no process (removed, or claimed by a sibling that took this one
            self._write_whole(urls)  # for gone): written whole again, at once
            return
        except OSError as exc:
            log.warning("could not record this process's requests in %s: %s", path, exc)
            self.whole, self.added, self.dropped = False, [], []  # the next change writes it whole
            return
        try:
            os.write(fd, line)
        except OSError as exc:
            log.warning("could not record this process's requests in %s: %s", path, exc)
            self.whole, self.added, self.dropped = False, [], []  # the next change writes it whole
            return
        finally:
            os.close(fd)
        self.appended += n + (len(urls) if changed else 0)
        self.urls = dict(urls)
        self.added, self.dropped = [], []

    def _write_whole(self, urls: dict[str, str]) -> None:
        path = self._path(self.instance)
        tmp = path.with_suffix(".tmp")
        body = orjson.dumps({"instance": self.instance, "pid": self.pid, "ticks": self.ticks, "host": self.host,
                             "workers": urls, "rids": self.rids}) + b"\n"
        try:
            tmp.write_bytes(body)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not record this process's requests in %s: %s", path, exc)
            self.whole, self.added, self.dropped = False, [], []  # tried again at the next change
            return
        self.whole, self.appended, self.urls = True, 0, dict(urls)
        self.added, self.dropped = [], []

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
        """The record a file holds: its first line, with every whole line after it applied (a last line a kill cut
        short, or any line that does not parse, is skipped)."""
        try:
            lines = p.read_bytes().split(b"\n")
        except OSError:
            return None
        try:
            e = orjson.loads(lines[0])
        except orjson.JSONDecodeError:
            return None
        if not isinstance(e, dict):
            return None
        rids, urls = e.get("rids"), e.get("workers")
        rids = e["rids"] = dict(rids) if isinstance(rids, dict) else {}
        e["workers"] = dict(urls) if isinstance(urls, dict) else {}
        for line in lines[1:]:
            try:
                d = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(d, dict):
                continue
            add, drop, urls = d.get("add"), d.get("drop"), d.get("workers")
            if isinstance(add, dict):
                rids.update(add)
            if isinstance(drop, list):
                for r in drop:
                    if isinstance(r, str):
                        rids.pop(r, None)
            if isinstance(urls, dict):
                e["workers"] = urls
        return e
