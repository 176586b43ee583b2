"""Worker state: a state machine over health, restarts, gray failure and the circuit breaker; identity,
live load and progress. No I/O.

Like the request record: declared states (``State``), a table of allowed moves (``ALLOWED``), one
``transition()`` that checks the move, stamps it with its cause and hands it to the observers (metrics,
logs, the traces of the requests bound to the worker). The health checker (``health.py``) and the request
path feed it; pair selection reads ``available``.

    unknown ──► up ◄──► degraded            (holding our requests with no progress for degraded_after_s)
                │ ▲
                ▼ │ success
         breaker_open ──cooldown──► half_open (one probe)
    any live state ──► down ──► restarted ──► up    (restarted also from up: a new engine identity)
    any state ──► removed
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdgate.adapters.base import Probe
from pdgate.core.config import ROLES, BreakerConfig, Role, WorkerSpec
from pdgate.core.limits import Lag, Limiter, LimitRules
from pdgate.pool.capacity import Slots

if TYPE_CHECKING:
    from pdgate.adapters.base import Engine



class Breaker(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    cfg: BreakerConfig
    state: Breaker = Breaker.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False

    def allow(self, now: float) -> bool:
        if self.state is Breaker.OPEN and now - self.opened_at >= self.cfg.cooldown_s:
            self.state = Breaker.HALF_OPEN
            self.probing = False
        if self.state is Breaker.HALF_OPEN:
            return not self.probing
        return self.state is Breaker.CLOSED

    def on_dispatch(self) -> None:
        if self.state is Breaker.HALF_OPEN:
            self.probing = True

    def success(self) -> None:
        self.state, self.failures, self.probing = Breaker.CLOSED, 0, False

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.state is Breaker.HALF_OPEN or self.failures >= self.cfg.failures:
            self.state, self.opened_at, self.probing = Breaker.OPEN, now, False


class State(enum.Enum):
    UNKNOWN = "unknown"  # not checked yet
    UP = "up"
    DEGRADED = "degraded"
    BREAKER_OPEN = "breaker_open"
    HALF_OPEN = "half_open"
    DOWN = "down"
    RESTARTED = "restarted"  # passed through on the way back up: its live requests were failed over
    REMOVED = "removed"

    __hash__ = object.__hash__


SERVING = frozenset({State.UP, State.DEGRADED, State.BREAKER_OPEN, State.HALF_OPEN})
ALLOWED: dict[State, frozenset[State]] = {
    State.UNKNOWN: frozenset({State.UP, State.DOWN, State.REMOVED}),
    State.UP: frozenset({State.DEGRADED, State.BREAKER_OPEN, State.DOWN, State.RESTARTED, State.REMOVED}),
    State.DEGRADED: frozenset({State.UP, State.BREAKER_OPEN, State.DOWN, State.RESTARTED, State.REMOVED}),
    State.BREAKER_OPEN: frozenset({State.HALF_OPEN, State.UP, State.DOWN, State.RESTARTED, State.REMOVED}),
    State.HALF_OPEN: frozenset({State.UP, State.BREAKER_OPEN, State.DEGRADED, State.DOWN, State.RESTARTED,
                                State.REMOVED}),
    State.DOWN: frozenset({State.UP, State.RESTARTED, State.REMOVED}),
    State.RESTARTED: frozenset({State.UP, State.DOWN, State.REMOVED}),
    State.REMOVED: frozenset(),
}


class IllegalWorkerTransition(Exception):
    def __init__(self, wid: str, frm: State, to: State) -> None:
        super().__init__(f"worker {wid}: {frm.value} -> {to.value} is not allowed")


WorkerObserver = Callable[["Worker", State, State, str], None]


class Bound(Protocol):
    """A live attempt bound to a worker; told at once when the worker is lost."""

    def lose(self, worker: str, role: str, cause: str) -> None: ...

    def note(self, name: str, info: Any = None) -> None: ...


@dataclass(slots=True)
class Checks:
    """What the health checker keeps of a worker between checks."""

    checked: bool = False  # checked at least once
    failures: int = 0  # failed checks in a row
    uncounted: int = 0  # timed-out checks in a row not counted against it (health.late_not_lost)
    last_error: str | None = None


@dataclass(eq=False)
class Worker:
    id: str
    spec: WorkerSpec
    breaker: CircuitBreaker
    adapter: Engine  # its engine kind's adapter (pdgate.adapters)
    observers: tuple[WorkerObserver, ...] = ()
    state: State = State.UNKNOWN
    history: deque[tuple[float, str, str]] = field(default_factory=lambda: deque(maxlen=32))  # (t, state, cause)
    identity: str | None = None  # the engine process's identity as last seen (a new one: it restarted)
    restarts: int = 0
    bound: set[Bound] = field(default_factory=set)
    last_progress: float = 0.0
    busy_since: float | None = None
    checks: Checks = field(default_factory=Checks)
    info: Probe = field(default_factory=lambda: Probe(False))  # the last passed health check's findings
    slots: Slots = field(default_factory=Slots)
    orphans: int = 0  # engine-held rids found orphaned in the last reconcile pass (exact mode)
    drift: int = 0  # engine count above our live count (count mode)
    probe_seq: int = 0  # passed health checks that read its counts so far (count mode judges each count once)
    probe_load: int = 0  # the most live requests we held on it while the last of those was out
    probe_held: int | None = None  # ... and what the engine said it held then (None: it says nothing)
    reaped: dict[str, int] = field(default_factory=dict)  # gone gateway instance -> its rids aborted here (bounded)

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> int:
        """Live requests on it: ours, those reserved for our queue's next ones, and other processes'."""
        s = self.slots
        return len(self.bound) + s.reserved + s.others

    def limit(self, now: float) -> int | None:
        """How many of our requests it may hold now (``Slots.limit``)."""
        return self.slots.limit(now, self.load)

    def has_room(self, now: float) -> bool:
        load = self.load
        lim = self.slots.limit(now, load)
        return lim is None or load < lim

    @property
    def healthy(self) -> bool:
        return self.state in SERVING

    @property
    def degraded(self) -> bool:
        return self.state is State.DEGRADED

    def transition(self, to: State, now: float, cause: str) -> None:
        """Move to ``to``, for ``cause``; the one place a worker's state changes."""
        frm = self.state
        if to is frm:
            return
        if to not in ALLOWED[frm]:
            raise IllegalWorkerTransition(self.id, frm, to)
        self.state = to
        self.history.append((now, to.value, cause))
        for obs in self.observers:
            obs(self, frm, to, cause)

    def available(self, now: float) -> bool:
        st = self.state
        if st is State.UP:
            return True
        if st is State.BREAKER_OPEN or st is State.HALF_OPEN:
            allowed = self.breaker.allow(now)  # cools down OPEN -> HALF_OPEN; one probe at a time
            if self.breaker.state is Breaker.HALF_OPEN and st is State.BREAKER_OPEN:
                self.transition(State.HALF_OPEN, now, f"breaker cooled down after {self.breaker.cfg.cooldown_s:g}s")
            return allowed
        return False

    # -- what the request path reports
    def failure(self, now: float, cause: str) -> None:
        """A leg failed on this worker (connect error, 5xx/429): counts towards its breaker."""
        self.breaker.failure(now)
        if self.breaker.state is Breaker.OPEN and self.state in SERVING and self.state is not State.BREAKER_OPEN:
            self.transition(State.BREAKER_OPEN, now, f"breaker opened after {self.breaker.failures} failures: {cause}")

    def success(self, now: float) -> None:
        self.breaker.success()
        if self.state is State.BREAKER_OPEN or self.state is State.HALF_OPEN:
            self.transition(State.UP, now, "breaker closed: a request succeeded")

    def bind(self, b: Bound, now: float) -> None:
        if not self.bound:
            self.busy_since = now
        self.bound.add(b)
        self.breaker.on_dispatch()

    def unbind(self, b: Bound) -> None:
        self.bound.discard(b)
        if not self.bound:
            self.busy_since = None

    def progress(self, now: float) -> None:
        self.last_progress = now
        if self.state is State.DEGRADED:
            self.transition(State.UP, now, "made progress again")

    def stalled_for(self, now: float) -> float:
        """Seconds this worker has held our requests without progress on any (0 when idle)."""
        if self.busy_since is None:
            return 0.0
        return now - max(self.last_progress, self.busy_since)

    def lose_all(self, cause: str) -> int:
        lost = list(self.bound)
        for b in lost:
            b.lose(self.id, self.role, cause)
        return len(lost)

    def view(self, now: float) -> dict[str, Any]:
        info = self.info
        return {
            "id": self.id, "role": self.role, "kind": self.spec.engine, "url": self.url,
            "bootstrap_port": self.spec.bootstrap_port, "state": self.state.value, "healthy": self.healthy,
            "available": self.available(now), "degraded": self.degraded, "breaker": self.breaker.state.value,
            "identity": self.identity, "restarts": self.restarts, "load": self.load,
            "stalled_s": round(self.stalled_for(now), 3), "fixes": info.fixes, "models": list(info.models),
            "last_error": self.checks.last_error, "queues": info.queues,
            "counts_unknown": info.partial is not None, "orphans": self.orphans, "drift": self.drift,
            "reaped": dict(self.reaped),
            **self.slots.view(now, self.load),
        }


class Pool:
    """All workers by id, with per-role lists kept for the hot path."""

    def __init__(self, breaker: BreakerConfig, engines: Callable[[str], Engine],
                 configured_models: frozenset[str] = frozenset(), observers: tuple[WorkerObserver, ...] = (),
                 capacity: int | None = None, rules: dict[str, LimitRules] | None = None) -> None:
        self._breaker = breaker
        self._rules = rules  # by role: each worker learns its limit (None: it does not)
        self.lag = Lag()  # the gateway's loop lag, fed by ``pdgate.planes.control``: what the learned limits discount
        self._adapters = engines  # engine kind -> its adapter
        self._capacity = capacity or None
        self.observers = observers
        self._configured = configured_models
        self._models = configured_models  # served models, kept current: read on every admission
        self.by_id: dict[str, Worker] = {}
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._seq = dict.fromkeys(ROLES, 0)  # the next id's number, by role
        self.mixed = False  # workers of more than one engine kind (a pair is always of one kind)
        self.adapters: tuple[Engine, ...] = ()  # the adapters of the kinds registered

    def add(self, spec: WorkerSpec, wid: str | None = None) -> Worker:
        """Register ``spec`` under the next id of its role, or under ``wid`` (the id the shared store gave it:
        ``pdgate.planes.control``), after which the role's ids go on from there."""
        for w in self.by_id.values():
            if w.url == spec.url and w.role == spec.role:
                raise ValueError(f"{spec.role} worker {spec.url} is already registered as {w.id}")
        if wid is None:
            wid = f"{spec.role[0]}{self._seq[spec.role]}"
        elif wid in self.by_id or not (wid[:1] == spec.role[0] and wid[1:].isdigit()):
            raise ValueError(f"worker id {wid!r} is taken or not a {spec.role} id")
        engine = self._adapters(spec.engine)  # an unknown kind raises here, before anything is registered
        self._seq[spec.role] = max(self._seq[spec.role], int(wid[1:]) + 1)
        rules = None if self._capacity or self._rules is None else self._rules.get(spec.role)
        w = Worker(wid, spec, CircuitBreaker(self._breaker), engine, self.observers,
                   slots=Slots(wid, configured=self._capacity, learned=Limiter(rules, self.lag) if rules else None))
        self.by_id[wid] = w
        getattr(self, spec.role).append(w)
        self._kinds()
        return w

    def remove(self, wid: str, now: float) -> Worker:
        w = self.by_id.pop(wid)
        w.transition(State.REMOVED, now, "removed by an operator")
        getattr(self, w.role).remove(w)
        self._refresh_models()
        self._kinds()
        return w

    def set_info(self, w: Worker, info: Probe) -> None:
        """What a passed health check found on ``w`` (its models are among those served from now on)."""
        old, w.info = w.info.models, info
        if info.models != old:
            self._refresh_models()

    def _kinds(self) -> None:
        self.adapters = tuple({id(w.adapter): w.adapter for w in self.by_id.values()}.values())
        self.mixed = len(self.adapters) > 1

    def _refresh_models(self) -> None:
        self._models = self._configured | {m for w in self.by_id.values() for m in w.info.models}

    def available(self, role: Role, now: float) -> list[Worker]:
        return [w for w in getattr(self, role) if w.available(now)]

    def with_room(self, role: Role, now: float) -> list[Worker]:
        """Available workers that may take one more of our requests (admission control)."""
        return [w for w in getattr(self, role) if w.available(now) and w.has_room(now)]

    def ready(self, now: float) -> bool:
        return bool(self.available(Role.PREFILL, now)) and bool(self.available(Role.DECODE, now))

    def models(self) -> frozenset[str]:
        """Models served by the workers or named in the config."""
        return self._models
