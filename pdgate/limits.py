"""A learned concurrency limit per worker: how many of our requests an engine can hold before it queues them
itself. Pure core (time from the caller); ``workers.Slots.learned`` holds one, ``Worker.limit`` reads it
(docs/architecture.md, "Admission").

An engine's reported ``max_running_requests`` is what its KV memory allows; what its compute serves in time is
usually far less (prefill above all: batches are cut by tokens, so a prefill's latency grows with every request
queued before it). The limiter learns the smaller figure from what the gateway measures, in the spirit of TCP
Vegas and Netflix's gradient limiters:

- **samples**: each request's latency on the worker (prefill: dispatch to first token; decode: the mean gap
  between its events), and the engine's own compute queue where its adapter reads one (``Probe.waiting``);
- **baseline**: the least latency seen in the last ``window_s`` (its no-load figure; it follows a slower or a
  faster engine within that window);
- **target**: ``tolerance`` times the baseline, and never more than ``budget_share`` of the sampled requests'
  least TTFT budget (the gateway's queue needs the rest of it to hold and shed);
- **every ``update_s``**: latency above the target, or the engine's queue above ``queue_allowance``, cuts the
  limit at once by the gradient (target / latency, at least halved, at most by 10%); with neither and the
  limit binding (a request waited for this worker, or the worker held as many as it allowed) and new samples
  (or none ever: a worker whose requests have not ended yet), it grows:
  doubling until the first cut (slow start), then by a tenth (at least one); otherwise it holds. Always within
  [``floor``, the engine's reported maximum or the operator's cap].
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LimitRules:
    initial: int = 16  # the limit before anything was measured
    floor: int = 1  # it never goes below
    cap: int | None = None  # the operator's cap (None: the engine's reported maximum only)
    tolerance: float = 2.0  # latency above this many times the baseline is queueing in the engine
    budget_share: float = 0.25  # ... and so is latency above this share of the requests' TTFT budget,
    min_tolerance: float = 1.5  # ... unless that is below this many times the baseline (a slow engine may queue a little)
    probe_step: float = 0.25  # the least it grows by past slow start: a limit of 2 takes 4 healthy updates to reach 3
    # (at +1 a small limit jumps by half, queues in the engine, is cut, and the queue's estimates swing with it)
    queue_allowance: int = 2  # the engine's own compute queue may hold this many before the limit is cut
    window_s: float = 10.0  # the baseline is the least latency within this window
    update_s: float = 0.5  # the limit moves at most this often


@dataclass(frozen=True, slots=True)
class Move:
    before: int
    after: int
    why: str

    @property
    def large(self) -> bool:
        """Halved or doubled at least: worth a log line."""
        return self.after >= 2 * self.before or 2 * self.after <= self.before


@dataclass(slots=True)
class Limiter:
    rules: LimitRules
    limit: float = 0.0
    baseline: float | None = None  # seconds: the least latency in the window
    latency: float | None = None  # seconds: the median of the last update's samples
    waiting: int | None = None  # the engine's compute queue, as last probed
    slow_start: bool = True
    binding: bool = False  # since the last update, the limit held a request back
    next_at: float = 0.0
    budget: float = math.inf  # the least TTFT budget among this update's samples
    sampled_at: float = -math.inf  # its last sample (another gateway process takes its figure while it is recent)
    _fresh: bool = False  # ``waiting`` came with a probe since the last cut
    _samples: list[float] = field(default_factory=list)
    _mins: deque[tuple[float, float]] = field(default_factory=deque)  # (time, least sample of an update)
    history: deque[tuple[float, int, str]] = field(default_factory=lambda: deque(maxlen=64))  # (t, limit, why)

    def __post_init__(self) -> None:
        if not self.limit:
            self.limit = float(max(self.rules.floor, self.rules.initial))

    def top(self, engine_max: int | None) -> int:
        """The most it may reach: the engine's reported maximum and the operator's cap."""
        return max(self.rules.floor, min(x for x in (engine_max, self.rules.cap, 1 << 30) if x is not None))

    def value(self, engine_max: int | None) -> int:
        """The limit now, within the floor, the operator's cap and the engine's reported maximum."""
        return max(self.rules.floor, min(int(self.limit), self.top(engine_max)))

    def sample(self, latency: float, budget: float, now: float, engine_max: int | None) -> Move | None:
        """A request's latency on the worker (``budget``: its TTFT budget). What moved, if the limit did."""
        if len(self._samples) < 512:  # bounded between updates: the median of the first 512 is enough
            self._samples.append(latency)
        self.sampled_at = now
        if budget < self.budget:
            self.budget = budget
        return self.update(now, engine_max)

    def queue(self, waiting: int | None, now: float, engine_max: int | None) -> Move | None:
        """The engine's compute queue for the worker's role, as probed (None: it says none)."""
        self.waiting, self._fresh = waiting, True
        return self.update(now, engine_max)

    def held_back(self, now: float, engine_max: int | None) -> Move | None:
        """A request found the worker at its limit."""
        self.binding = True
        return self.update(now, engine_max)

    def update(self, now: float, engine_max: int | None) -> Move | None:
        if now < self.next_at:
            return None
        self.next_at = now + self.rules.update_s
        r = self.rules
        s = self._samples
        fresh = bool(s)
        if s:
            s.sort()
            self.latency = s[len(s) // 2]
            self._mins.append((now, s[0]))
            s.clear()
        mins = self._mins
        while mins and mins[0][0] < now - r.window_s:
            mins.popleft()
        if mins:
            self.baseline = min(m for _, m in mins)
        before = self.value(engine_max)
        why = self._move(engine_max, fresh)
        self.binding, self.budget = False, math.inf
        after = self.value(engine_max)
        if why is None or after == before:
            return None
        self.history.append((now, after, why))
        return Move(before, after, why)

    def target(self) -> float | None:
        if self.baseline is None:
            return None
        r = self.rules
        return min(r.tolerance * self.baseline, max(r.budget_share * self.budget, r.min_tolerance * self.baseline))

    def _move(self, engine_max: int | None, fresh: bool) -> str | None:
        r = self.rules
        top = float(self.top(engine_max))
        if self.limit > top:  # the engine or the operator lowered its maximum
            self.limit = top
        target, lat = self.target(), self.latency if fresh else None
        queued = self._fresh and self.waiting is not None and self.waiting > r.queue_allowance
        slow = target is not None and lat is not None and lat > target
        if slow or queued:
            grad = max(0.5, min(0.9, target / lat)) if slow and target and lat else 0.75
            self.limit = max(float(r.floor), self.limit * grad)
            self.slow_start = False
            self._fresh = False  # judged once: the next cut needs new samples or a new probe
            return (f"latency {lat:.3f}s above its target {target:.3f}s" if slow and lat is not None and target
                    else f"the engine queues {self.waiting} requests itself")
        if self.binding and (fresh or self.baseline is None):  # it grows on evidence (or before there is any)
            step = self.limit if self.slow_start else max(self.rules.probe_step, self.limit / 10)
            self.limit = min(top, self.limit + step)
            return "it keeps up and requests waited for it"
        return None

    def measured(self, now: float) -> bool:
        """Whether it rests on samples of the last window (a figure other gateway processes may take)."""
        return now - self.sampled_at <= self.rules.window_s

    def view(self, engine_max: int | None) -> dict[str, object]:
        return {"limit": self.value(engine_max), "baseline_ms": _ms(self.baseline), "latency_ms": _ms(self.latency),
                "target_ms": _ms(self.target()), "engine_waiting": self.waiting, "slow_start": self.slow_start,
                "history": [{"t": round(t0, 3), "limit": n, "why": why} for t0, n, why in self.history]}


def _ms(s: float | None) -> float | None:
    return None if s is None or math.isinf(s) else round(s * 1000, 2)
