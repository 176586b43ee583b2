"""Worker state: health, identity, circuit breaker, live load and progress. No I/O.

The health checker (``health.py``) and the request path feed it; pair selection reads
``available``. A worker that holds our live requests but makes no progress on any of
them for ``degraded_after_s`` is *degraded* (a gray failure ``/health`` does not see):
it gets no new requests until it makes progress again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdgate.config import BreakerConfig, WorkerSpec


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


class Bound(Protocol):
    """A live attempt bound to a worker; told at once when the worker is lost."""

    def lose(self, worker: str, role: str, cause: str) -> None: ...

    def note(self, name: str, info: Any = None) -> None: ...


@dataclass(eq=False)
class Worker:
    id: str
    spec: WorkerSpec
    breaker: CircuitBreaker
    healthy: bool = False
    checked: bool = False
    health_failures: int = 0
    identity: str | None = None
    fixes: list[str] | None = None
    models: tuple[str, ...] = ()
    restarts: int = 0
    last_error: str | None = None
    bound: set[Bound] = field(default_factory=set)
    last_progress: float = 0.0
    busy_since: float | None = None
    degraded: bool = False
    engine: dict[str, Any] = field(default_factory=dict)  # last engine-reported queue counts
    has_extension: bool | None = None
    info_path: bool | None = None  # offers /pdgate/v1/info (None: not asked yet)
    orphans: int = 0  # engine-held rids found orphaned in the last reconcile pass (exact mode)
    drift: int = 0  # engine count above our live count (count mode)

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> int:
        return len(self.bound)

    def available(self, now: float) -> bool:
        return self.healthy and not self.degraded and self.breaker.allow(now)

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
        self.degraded = False

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
        return {
            "id": self.id, "role": self.role, "url": self.url, "bootstrap_port": self.spec.bootstrap_port,
            "healthy": self.healthy, "available": self.available(now), "degraded": self.degraded,
            "breaker": self.breaker.state.value, "identity": self.identity, "restarts": self.restarts,
            "load": self.load, "stalled_s": round(self.stalled_for(now), 3), "fixes": self.fixes,
            "models": list(self.models), "last_error": self.last_error, "engine": self.engine,
            "orphans": self.orphans, "drift": self.drift,
        }


class Pool:
    """All workers by id, with per-role lists kept for the hot path."""

    def __init__(self, breaker: BreakerConfig, configured_models: frozenset[str] = frozenset()) -> None:
        self._breaker = breaker
        self._configured = configured_models
        self._models = configured_models  # served models, kept current: read on every admission
        self.by_id: dict[str, Worker] = {}
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._seq = {"prefill": 0, "decode": 0}

    def add(self, spec: WorkerSpec) -> Worker:
        for w in self.by_id.values():
            if w.url == spec.url and w.role == spec.role:
                raise ValueError(f"{spec.role} worker {spec.url} is already registered as {w.id}")
        wid = f"{spec.role[0]}{self._seq[spec.role]}"
        self._seq[spec.role] += 1
        w = Worker(wid, spec, CircuitBreaker(self._breaker))
        self.by_id[wid] = w
        getattr(self, spec.role).append(w)
        return w

    def remove(self, wid: str) -> Worker:
        w = self.by_id.pop(wid)
        getattr(self, w.role).remove(w)
        self._refresh_models()
        return w

    def set_models(self, w: Worker, models: tuple[str, ...]) -> None:
        if models != w.models:
            w.models = models
            self._refresh_models()

    def _refresh_models(self) -> None:
        self._models = self._configured | {m for w in self.by_id.values() for m in w.models}

    def available(self, role: str, now: float) -> list[Worker]:
        return [w for w in getattr(self, role) if w.available(now)]

    def ready(self, now: float) -> bool:
        return bool(self.available("prefill", now)) and bool(self.available("decode", now))

    def models(self) -> frozenset[str]:
        """Models served by the workers or named in the config."""
        return self._models
