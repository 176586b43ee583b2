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
    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._vtimes: dict[str, float] = {}  # a tenant's virtual time while it is not backlogged
        self._clock = 0.0  # the virtual time of the last request served
        self._seq = itertools.count()
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def push(self, e: Entry) -> None:
        e.seq = next(self._seq)
        t = self._tenants.get(e.tenant)
        if t is None:
            t = self._tenants[e.tenant] = _Tenant(max(self._vtimes.pop(e.tenant, 0.0), self._clock), e.weight)
        heapq.heappush(t.heap, (e.key(), e))
        t.live += 1
        self.n += 1

    def remove(self, e: Entry) -> None:
        if e.gone:
            return
        e.gone = True
        t = self._tenants.get(e.tenant)
        if t is not None:
            t.live -= 1
            self.n -= 1
            if t.live == 0:
                self._retire(e.tenant, t)

    def _retire(self, name: str, t: _Tenant) -> None:
        del self._tenants[name]
        self._vtimes[name] = t.vtime

    def peek(self) -> Entry | None:
        best: tuple[int, float, float] | None = None
        pick: Entry | None = None
        for t in self._tenants.values():
            h = t.head()
            if h is None:
                continue
            k = (h.rank, t.vtime, h.deadline)
            if best is None or k < best:
                best, pick = k, h
        return pick

    def pop(self) -> Entry | None:
        e = self.peek()
        if e is None:
            return None
        t = self._tenants[e.tenant]
        heapq.heappop(t.heap)
        e.gone = True
        t.live -= 1
        self.n -= 1
        self._clock = max(self._clock, t.vtime)
        t.vtime += 1.0 / t.weight
        if t.live == 0:
            self._retire(e.tenant, t)
        return e

    def ahead_of(self, rank: int, tenant: str, deadline: float, weight: float = 1.0) -> int:
        """About how many waiting requests go before a new one with these fields: every one of a better class;
        of its class, its own tenant's with an earlier deadline, and of each other tenant as many as fair
        queuing serves while this tenant's go (their share: weight for weight)."""
        better = 0
        same: dict[str, int] = {}
        weights: dict[str, float] = {}
        for name, t in self._tenants.items():
            weights[name] = t.weight
            for _, e in t.heap:
                if e.gone:
                    continue
                if e.rank < rank:
                    better += 1
                elif e.rank == rank and (name != tenant or e.deadline <= deadline):
                    same[name] = same.get(name, 0) + 1
        mine = same.pop(tenant, 0)
        turns = (mine + 1) / weight
        return better + mine + sum(min(n, math.ceil(turns * weights[u])) for u, n in same.items())

    def over_share(self, tenant: str, weight: float) -> bool:
        """Whether ``tenant`` already holds more than its weighted share of the queue while others wait too."""
        if not any(name != tenant for name in self._tenants):
            return False
        total_w = sum(t.weight for name, t in self._tenants.items() if name != tenant) + weight
        mine = self._tenants[tenant].live if tenant in self._tenants else 0
        return mine + 1 > (self.n + 1) * weight / total_w


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

    def wait_s(self, ahead: int, now: float) -> float | None:
        """Expected seconds from now to a first token for a request with ``ahead`` before it (None: unknown)."""
        rate = self.drain_rate(now)
        if rate is None:
            return None
        return (ahead + 1) / rate + (self.ttft or 0.0)
