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
from collections import deque
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
    """Slots freed per second over ``window_s``, and an EWMA of dispatch -> first token."""

    def __init__(self, window_s: float, alpha: float = 0.2) -> None:
        self.window_s = window_s
        self.freed: deque[float] = deque(maxlen=4096)
        self.alpha = alpha
        self.ttft: float | None = None

    def free(self, now: float) -> None:
        self.freed.append(now)

    def drain_rate(self, now: float) -> float | None:
        """Slots freed per second in the last window (None: fewer than 5 seen, nothing to go by yet)."""
        f = self.freed
        while f and now - f[0] > self.window_s:
            f.popleft()
        if len(f) < 5:
            return None
        span = max(now - f[0], 1e-3)
        return len(f) / span

    def first_token(self, seconds: float) -> None:
        self.ttft = seconds if self.ttft is None else self.ttft + self.alpha * (seconds - self.ttft)

    def wait_s(self, ahead: int, now: float) -> float | None:
        """Expected seconds from now to a first token for a request with ``ahead`` before it (None: unknown)."""
        rate = self.drain_rate(now)
        if rate is None:
            return None
        return (ahead + 1) / rate + (self.ttft or 0.0)
