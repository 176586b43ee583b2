"""The admission queue's order and its estimates, without I/O (``admission.Gate`` runs it on the loop).

Order: the priority class first (a retry of an admitted request before everything, then high, normal,
low); within a class, tenants share by weighted fair queuing (start-time fair queuing: each tenant has a
virtual time that advances by 1/weight per request served; the backlogged tenant with the lowest one goes
next, and a tenant that comes back is moved up to the current virtual time, so an idle tenant banks no
credit); within a tenant, the earliest deadline first.

Estimates: how fast the queue drains (slots freed per second, over a window) and how long a dispatched
request takes to its first token (an EWMA), so a request that cannot reach its first token within its
TTFT budget can be answered at once instead of waiting its budget out.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

RANKS = {"retry": -1, "high": 0, "normal": 1, "low": 2}


@dataclass(eq=False, slots=True)
class Entry:
    """One waiting request. ``item`` is the caller's (the gate keeps its future there)."""

    rank: int
    tenant: str
    deadline: float  # its first-token deadline (absolute, the caller's clock)
    weight: float = 1.0
    item: Any = None
    seq: int = 0
    gone: bool = False  # left the queue (its deadline, its client, a drain): skipped, dropped lazily

    def key(self) -> tuple[int, float, int]:
        return (self.rank, self.deadline, self.seq)


@dataclass(slots=True)
class _Tenant:
    vtime: float
    weight: float
    heap: list[tuple[tuple[int, float, int], Entry]] = field(default_factory=list)
    live: int = 0  # entries not gone

    def head(self) -> Entry | None:
        while self.heap and self.heap[0][1].gone:
            heapq.heappop(self.heap)
        return self.heap[0][1] if self.heap else None


class FairQueue:
    """Fair queuing within each class (a tenant's place in one class says nothing of its place in another:
    a request parked in ``low`` banks no credit for ``normal``)."""

    def __init__(self) -> None:
        self._tenants: dict[tuple[int, str], _Tenant] = {}  # (rank, tenant) -> its backlog in that class
        self._vtimes: dict[tuple[int, str], float] = {}  # a tenant's virtual time in a class it is not backlogged in
        self._clock: dict[int, float] = {}  # per class: the virtual time of the last request served
        self._seq = itertools.count()
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def _start(self, rank: int, tenant: str) -> float:
        """The virtual time a tenant (re)joins a class at: where it was, but never behind the class's clock."""
        return max(self._vtimes.get((rank, tenant), 0.0), self._clock.get(rank, 0.0))

    def push(self, e: Entry) -> None:
        e.seq = next(self._seq)
        key = (e.rank, e.tenant)
        t = self._tenants.get(key)
        if t is None:
            t = self._tenants[key] = _Tenant(self._start(e.rank, e.tenant), e.weight)
            self._vtimes.pop(key, None)
        heapq.heappush(t.heap, (e.key(), e))
        t.live += 1
        self.n += 1

    def _drop(self, e: Entry, served: bool) -> None:
        e.gone = True
        key = (e.rank, e.tenant)
        t = self._tenants.get(key)
        if t is None:
            return
        t.live -= 1
        self.n -= 1
        if served:
            self._clock[e.rank] = max(self._clock.get(e.rank, 0.0), t.vtime)
            t.vtime += 1.0 / t.weight
        if t.live == 0:
            del self._tenants[key]
            self._vtimes[key] = t.vtime

    def remove(self, e: Entry) -> None:
        """``e`` leaves without being served (its deadline, its client...)."""
        if not e.gone:
            self._drop(e, served=False)

    def take(self, e: Entry) -> None:
        """``e`` leaves served: its tenant's virtual time in its class moves on."""
        if not e.gone:
            self._drop(e, served=True)

    def peek(self) -> Entry | None:
        best: tuple[int, float, float] | None = None
        pick: Entry | None = None
        for (rank, _), t in self._tenants.items():
            h = t.head()
            if h is None:
                continue
            k = (rank, t.vtime, h.deadline)
            if best is None or k < best:
                best, pick = k, h
        return pick

    def pop(self) -> Entry | None:
        e = self.peek()
        if e is not None:
            self.take(e)
        return e

    def ahead_of(self, rank: int, tenant: str, deadline: float, weight: float = 1.0) -> int:
        """About how many waiting requests go before a new one with these fields: every one of a better class;
        of its class, its tenant's own with an earlier deadline, and of each other tenant those whose virtual
        start comes before the new one's (fair queuing's order, without serving anything)."""
        better = 0
        mine = 0
        others: list[tuple[float, float, int]] = []  # (vtime, weight, waiting) of the other tenants in this class
        for (r, name), t in self._tenants.items():
            if r < rank:
                better += t.live
            elif r == rank:
                if name == tenant:
                    mine = sum(1 for _, e in t.heap if not e.gone and e.deadline <= deadline)
                else:
                    others.append((t.vtime, t.weight, t.live))
        own = self._tenants.get((rank, tenant))
        start = (own.vtime if own is not None else self._start(rank, tenant)) + mine / weight
        # another tenant's j-th waiting request starts at v + j/w: ahead if that is not after ours (a tie goes by
        # deadline, which is not known here, so it counts as ahead)
        turns = sum(min(n, math.floor((start - v) * w + 1e-9) + 1) for v, w, n in others if start >= v)
        return better + mine + turns

    def over_share(self, tenant: str, weight: float) -> bool:
        """Whether ``tenant`` already holds more than its weighted share of the queue while others wait too."""
        names = {name for _, name in self._tenants}
        if not names - {tenant}:
            return False
        weights = {name: t.weight for (_, name), t in self._tenants.items()}
        weights[tenant] = weight
        mine = sum(t.live for (_, name), t in self._tenants.items() if name == tenant)
        return mine + 1 > (self.n + 1) * weight / sum(weights.values())


class Rates:
    """How fast the queue drains and how long a dispatched request takes to its first token.

    The drain rate is measured only while requests wait (the pair saturated): an EWMA of the intervals
    between slots freed with the queue non-empty at both ends. Slots freed with nobody waiting say how fast
    requests came, not how fast the engines serve, and would make the estimate pessimistic (more shedding,
    an emptier queue, idle engines)."""

    MIN_SAMPLES = 5

    def __init__(self, window_s: float, alpha: float = 0.1) -> None:
        self.window_s = window_s  # an estimate older than this (no saturated interval since) is not used
        self.alpha = alpha
        self.interval: float | None = None  # EWMA of seconds between slots freed while saturated
        self.samples = 0
        self.last: float | None = None  # the last slot freed while requests waited
        self.busy_since: float | None = None  # since when requests wait (None: nobody waits)
        self.ttft: float | None = None
        self.last_ttft: float | None = None  # the latest sample (a cold start's queue grows faster than the EWMA)

    def waiting(self, now: float, anyone: bool) -> None:
        """Whether requests wait, told as the queue fills and empties."""
        if anyone and self.busy_since is None:
            self.busy_since = now
        elif not anyone:
            self.busy_since = None

    def free(self, now: float) -> None:
        """A slot freed while requests wait."""
        if self.last is not None and self.busy_since is not None and self.last >= self.busy_since:
            gap = now - self.last
            self.interval = gap if self.interval is None else self.interval + self.alpha * (gap - self.interval)
            self.samples += 1
        self.last = now

    def drain_rate(self, now: float) -> float | None:
        """Slots freed per second while saturated (None: not measured enough, or not lately)."""
        if self.interval is None or self.samples < self.MIN_SAMPLES or self.last is None:
            return None
        if now - self.last > self.window_s:
            return None
        return 1.0 / max(self.interval, 1e-4)

    def first_token(self, seconds: float) -> None:
        self.ttft = seconds if self.ttft is None else self.ttft + 0.2 * (seconds - self.ttft)
        self.last_ttft = seconds

    def expected_ttft(self) -> float | None:
        """What a request dispatched now takes to its first token: the average, or the latest answer where that is
        longer (an engine's queue growing answer by answer, as at a cold start: the average lags it and a request
        sent on it missed its budget)."""
        return None if self.ttft is None else max(self.ttft, self.last_ttft or 0.0)

    def little(self, running: int) -> float | None:
        """A cold start's drain rate, before one is measured: ``running`` requests at a time (the prefills' limits,
        all held: requests wait), each as long as the latest answer or the average, the longer (Little's law: at a
        cold start the engine's queue grows answer by answer, and the average lags it). None: nothing answered yet."""
        ttft = self.expected_ttft()
        return running / ttft if ttft and running > 0 else None
