"""A learned concurrency limit per worker: how many of our requests an engine can hold before it queues them
itself. Pure core (time from the caller); ``pool.capacity.Slots.learned`` holds one, ``Slots.limit`` reads it
(docs/architecture.md, "Admission").

An engine's reported ``max_running_requests`` is what its KV memory allows; what its compute serves in time is
usually far less (prefill above all: batches are cut by tokens, so a prefill's latency grows with every request
queued before it). The limiter learns the smaller figure from what the gateway measures, in the spirit of TCP
Vegas and Netflix's gradient limiters:

- **samples**: each request's latency on the prefill, as the engine answers it (dispatch to the prefill leg's
  own answer: never the decode's step or pace), and the engine's own compute queue where its adapter reads one
  (``Probe.waiting``). A decode's limit is not learned: its gaps between events stretch with the gateway's and the
  host's load as much as with the engine's, and a stream's gaps are its reader's pace (2,000 paced streams on
  defaults once ended with 64 complete); a decode holds what it reports it can run;
- **baseline**: the least latency seen in the last ``window_s`` (its no-load figure; it follows a slower or a
  faster engine within that window);
- **target**: ``tolerance`` times the baseline, and never more than ``budget_share`` of the sampled requests'
  least TTFT budget (the gateway's queue needs the rest of it to hold and shed);
- **the host's share**: the gateway's own event loop is watched (``Lag``: how late a timer fires, the gateway's
  and the host's CPU contention in one figure); latency above the target by no more than ``lag_factor`` times the
  loop's recent lag (or ``slack_s``, the larger: a sub-millisecond baseline is noise) is not the engine's and cuts
  nothing (``held`` says so where it was the lag);
- **every ``update_s``**: latency above the target beyond that allowance, or the engine's queue above
  ``queue_allowance`` on ``queue_probes`` probes in a row (a burst's queue that the next check finds drained is
  not overload), cuts the limit at once by the gradient (target / latency, at least halved, at most by 10%); with
  neither, new samples and the limit binding (a request waited for this worker since the last update), it grows
  by a tenth (at least ``probe_step``); an engine that answered nothing within ``window_s`` grows so on each probe
  that finds its queue clear while the limit binds; otherwise it holds;
- **slow start**, from ``initial`` until the first cut: every answer that shows no queueing (within
  ``start_tolerance`` of the baseline, plus the allowance) while the limit binds adds one at once, TCP's slow
  start (a doubling a round trip): a fast engine is not held back for long, and a serialised one is not sent
  more than its answers vouch for (doubling blind, 16 became 32 at the first queued request, and a prefill
  serving 5 a second missed 1.5 s TTFT budgets). Before the first answer it doubles only once requests have
  waited ``2 * update_s`` with none (an engine that answers late).
Always within [``floor``, the engine's reported maximum or the operator's cap].
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LimitRules:
    initial: int = 4  # the limit before anything was answered (TCP's initial window, in spirit)
    floor: int = 1  # it never goes below
    cap: int | None = None  # the operator's cap (None: the engine's reported maximum only)
    tolerance: float = 2.0  # latency above this many times the baseline is queueing in the engine
    budget_share: float = 0.25  # ... and so is latency above this share of the requests' TTFT budget,
    min_tolerance: float = 1.5  # ... unless that is below this many times the baseline (a slow engine may queue a little)
    probe_step: float = 0.25  # the least it grows by past slow start: a limit of 2 takes 4 healthy updates to reach 3
    # (at +1 a small limit jumps by half, queues in the engine, is cut, and the queue's estimates swing with it)
    queue_allowance: int = 2  # the engine's own compute queue may hold this many before the limit is cut ...
    queue_probes: int = 2  # ... on this many probes in a row (a burst's queue, drained by the next check, is no
    # overload: a prefill that serialises showed 3 waiting right after a doubling sent it 4, and the cut, on an
    # engine that answered nothing, was never grown back: 30 streams did not all start within 20 s in CI)
    window_s: float = 10.0  # the baseline is the least latency within this window
    update_s: float = 0.5  # the limit moves at most this often
    lag_factor: float = 4.0  # a latency sample spans a few turns of the gateway's loop: this many times its lag
    slack_s: float = 0.005  # latency within this of the target is in time, whatever the lag
    start_tolerance: float = 1.25  # slow start grows on answers within this many times the baseline (no queueing)


@dataclass(slots=True)
class Lag:
    """How late the gateway's event loop runs its timers lately: the largest overshoot of the last ``span_s``
    (``pdgate.planes.control`` feeds it from a ticker). Pure: time from the caller."""

    span_s: float = 2.0
    _seen: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=512))  # (time, overshoot s)

    def note(self, overshoot: float, now: float) -> None:
        self._seen.append((now, max(0.0, overshoot)))

    def recent(self, now: float) -> float:
        seen = self._seen
        while seen and seen[0][0] < now - self.span_s:
            seen.popleft()
        return max((o for _, o in seen), default=0.0)


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
    host: Lag | None = None  # the gateway's loop lag (None: not watched, nothing discounted)
    limit: float = 0.0
    baseline: float | None = None  # seconds: the least latency in the window
    latency: float | None = None  # seconds: the median of the last update's samples
    waiting: int | None = None  # the engine's compute queue, as last probed
    over: int = 0  # probes in a row that found it above ``queue_allowance``
    slow_start: bool = True
    binding: bool = False  # since the last update, the limit held a request back
    bound_at: float = -math.inf  # when it last did
    first_bound_at: float | None = None  # when it first did
    next_at: float = 0.0
    budget: float = math.inf  # the least TTFT budget among this update's samples
    sampled_at: float = -math.inf  # its last sample (another gateway process takes its figure while it is recent)
    lag: float | None = None  # the loop's lag at the last update (None: not watched)
    held: str | None = None  # the last update's latency above target that the loop's lag explained (no cut)
    _fresh: bool = False  # ``waiting`` came with a probe since the last cut
    _grown: int = 0  # slow start's growth since the last update
    _told: int = 0  # the value at the last update
    _low: float = math.inf  # the least sample since the last update
    _samples: list[float] = field(default_factory=list)
    _mins: deque[tuple[float, float]] = field(default_factory=deque)  # (time, least sample of an update)
    history: deque[tuple[float, int, str]] = field(default_factory=lambda: deque(maxlen=64))  # (t, limit, why)

    def __post_init__(self) -> None:
        if not self.limit:
            self.limit = float(max(self.rules.floor, self.rules.initial))

    def top(self, engine_max: int | None) -> int:
        """The most it may reach: the engine's reported maximum and the operator's cap."""
        top, cap = 1 << 30, self.rules.cap  # twice a request: no generator
        if engine_max is not None and engine_max < top:
            top = engine_max
        if cap is not None and cap < top:
            top = cap
        return max(self.rules.floor, top)

    def value(self, engine_max: int | None) -> int:
        """The limit now, within the floor, the operator's cap and the engine's reported maximum."""
        return max(self.rules.floor, min(int(self.limit), self.top(engine_max)))

    def sample(self, latency: float, budget: float, now: float, engine_max: int | None) -> Move | None:
        """A request's latency on the worker (``budget``: its TTFT budget). What moved, if the limit did."""
        if len(self._samples) < 512:  # bounded between updates: the median of the first 512 is enough
            self._samples.append(latency)
        if latency < self._low:
            self._low = latency
        self.sampled_at = now
        if budget < self.budget:
            self.budget = budget
        if self.slow_start and now - self.bound_at <= self.rules.update_s:
            base = self._low if self.baseline is None else min(self.baseline, self._low)
            if latency <= self.rules.start_tolerance * base + self.allowance():  # no queueing, requests waited: +1
                top = float(self.top(engine_max))
                if self.limit < top:
                    self.limit = min(top, self.limit + 1)
                    self._grown += 1
        return self.update(now, engine_max)

    def allowance(self) -> float:
        """Latency above the target that is not the engine's: the slack, or the loop's lag as last read."""
        return max(self.rules.slack_s, self.rules.lag_factor * (self.lag or 0.0))

    def queue(self, waiting: int | None, now: float, engine_max: int | None) -> Move | None:
        """The engine's compute queue for the worker's role, as probed (None: it says none)."""
        self.waiting, self._fresh = waiting, True
        self.over = self.over + 1 if waiting is not None and waiting > self.rules.queue_allowance else 0
        return self.update(now, engine_max)

    def held_back(self, now: float, engine_max: int | None) -> Move | None:
        """A request found the worker at its limit."""
        self.binding, self.bound_at = True, now
        if self.first_bound_at is None:
            self.first_bound_at = now
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
            self._low = math.inf
        mins = self._mins
        while mins and mins[0][0] < now - r.window_s:
            mins.popleft()
        if mins:
            self.baseline = min(m for _, m in mins)
        before = self._told or self.value(engine_max)  # slow start may have grown it since the last update
        why = self._move(engine_max, fresh, now)
        self.binding, self.budget = False, math.inf
        after = self._told = self.value(engine_max)
        if why is None or after == before:
            return None
        self.history.append((now, after, why))
        return Move(before, after, why)

    def target(self) -> float | None:
        return None if self.baseline is None else self._target(self.baseline)

    def _target(self, baseline: float) -> float:
        r = self.rules
        return min(r.tolerance * baseline, max(r.budget_share * self.budget, r.min_tolerance * baseline))

    def _move(self, engine_max: int | None, fresh: bool, now: float) -> str | None:
        r = self.rules
        top = float(self.top(engine_max))
        if self.limit > top:  # the engine or the operator lowered its maximum
            self.limit = top
        target, lat = self.target(), self.latency if fresh else None
        queued = self._fresh and self.over >= r.queue_probes
        clear = self._fresh and self.waiting is not None and not self.over
        slow = target is not None and lat is not None and lat > target
        if self.host is not None:
            self.lag = self.host.recent(now)
        if fresh:
            self.held = None
        grown, self._grown = self._grown, 0
        if slow and not queued and lat is not None and target is not None and lat - target <= self.allowance():
            if self.rules.lag_factor * (self.lag or 0.0) > r.slack_s:  # the gateway's or the host's load
                self.held = (f"latency {lat * 1000:.1f}ms above its target {target * 1000:.1f}ms by no more than "
                             f"{r.lag_factor:g}x the gateway's loop lag {self.lag * 1000:.1f}ms: not cut"
                             if self.lag is not None else None)
            return self._grew(grown)  # nor grown further: it holds until the engine's own figures say which way
        if slow or queued:
            grad = max(0.5, min(0.9, target / lat)) if slow and target and lat else 0.75
            self.limit = max(float(r.floor), self.limit * grad)
            self.slow_start = False
            self._fresh = False  # judged once: the next cut needs new samples or a new probe
            return (f"engine latency {lat:.3f}s above its target {target:.3f}s" if slow and lat is not None and target
                    else f"engine queue: it queues {self.waiting} requests itself")
        if not self.slow_start and self.binding and fresh:  # it grows on evidence
            self.limit = min(top, self.limit + max(self.rules.probe_step, self.limit / 10))
            return "engine keeps up and requests waited for it"
        if not self.slow_start and self.binding and clear and not self.measured(now):
            # it answers nothing lately (a prefill held until its decode is done): its own queue is the evidence
            self.limit = min(top, self.limit + max(self.rules.probe_step, self.limit / 10))
            self._fresh = False  # one probe, one step
            return "engine queue clear, nothing answered lately, and requests waited for it"
        if (self.slow_start and self.binding and self.baseline is None and self.first_bound_at is not None
                and now - self.first_bound_at >= 2 * r.update_s):  # no answer yet, requests wait: it answers late
            self.limit = min(top, 2 * self.limit)
            return f"no answer yet {now - self.first_bound_at:.1f}s after requests began to wait: doubled"
        return self._grew(grown)

    @staticmethod
    def _grew(grown: int) -> str | None:
        return f"engine keeps up: slow start, +{grown} answered in time while requests waited" if grown else None

    def measured(self, now: float) -> bool:
        """Whether it rests on samples of the last window (a figure other gateway processes may take)."""
        return now - self.sampled_at <= self.rules.window_s

    def view(self, engine_max: int | None) -> dict[str, object]:
        return {"limit": self.value(engine_max), "baseline_ms": _ms(self.baseline), "latency_ms": _ms(self.latency),
                "target_ms": _ms(self.target()), "engine_waiting": self.waiting, "slow_start": self.slow_start,
                "loop_lag_ms": _ms(self.lag),
                "held": self.held,
                "history": [{"t": round(t0, 3), "limit": n, "why": why} for t0, n, why in self.history]}


def _ms(s: float | None) -> float | None:
    return None if s is None or math.isinf(s) else round(s * 1000, 2)
