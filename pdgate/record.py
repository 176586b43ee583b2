"""The request record: one per client request, pure data plus one transition function.

Every phase change goes through ``transition()``, which checks the move against
``ALLOWED``, stamps the time and hands the change to the observers (metrics, traces).
No I/O here; time comes from the caller's clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"
    DEADLINE_EXCEEDED = "deadline_exceeded"

    # Members are singletons compared by identity: hash them by identity too (C speed) instead of
    # Enum's Python-level hash of the name; phases are dict and set keys on every transition.
    __hash__ = object.__hash__

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({Phase.COMPLETED, Phase.FAILED, Phase.ABORTED, Phase.DEADLINE_EXCEEDED})
LIVE = (Phase.QUEUED, Phase.DISPATCHED, Phase.PREFILL, Phase.TRANSFER, Phase.DECODE)

ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.DISPATCHED, *TERMINAL} - {Phase.COMPLETED}),
    # a retry goes back to DISPATCHED with a new attempt
    Phase.DISPATCHED: frozenset({Phase.DISPATCHED, Phase.PREFILL, *TERMINAL} - {Phase.COMPLETED}),
    Phase.PREFILL: frozenset({Phase.DISPATCHED, Phase.TRANSFER, Phase.DECODE, *TERMINAL}),
    Phase.TRANSFER: frozenset({Phase.DISPATCHED, Phase.DECODE, *TERMINAL}),
    Phase.DECODE: frozenset({Phase.DISPATCHED, *TERMINAL}),
    **{t: frozenset() for t in TERMINAL},
}


class IllegalTransition(Exception):
    def __init__(self, rec_id: str, frm: Phase, to: Phase) -> None:
        super().__init__(f"request {rec_id}: {frm.value} -> {to.value} is not allowed")


@dataclass(slots=True)
class Attempt:
    n: int
    rid: str
    prefill: str
    decode: str
    room: int
    # (time, name, info) — kept as tuples: cheap on the hot path, shaped for traces on demand
    events: list[tuple[float, str, Any]] = field(default_factory=list)
    error: str | None = None
    first_token: bool = False  # this attempt produced a token (its decode has the KV)

    def event(self, t: float, name: str, info: Any = None) -> None:
        self.events.append((t, name, info))


@dataclass(slots=True)
class Deadlines:
    """Absolute times (the record's clock) and the idle gap in seconds."""

    total_s: float
    ttft_s: float
    idle_s: float
    total_at: float
    ttft_at: float

    def due(self, first_token_at: float | None, last_token_at: float | None, idle: bool = True) -> tuple[str, float]:
        """The budget that runs out next and when, given the token times so far.

        Before the first token: TTFT or total. After it: idle (counted from the last token) or
        total; ``idle=False`` for non-streaming requests, whose answer comes whole (no gaps to bound)."""
        if first_token_at is None:
            if self.ttft_at < self.total_at:
                return "ttft", self.ttft_at
            return "total", self.total_at
        if idle:
            idle_at = (last_token_at or first_token_at) + self.idle_s
            if idle_at < self.total_at:
                return "idle", idle_at
        return "total", self.total_at


@dataclass(slots=True)
class Record:
    id: str
    route: str
    model: str | None
    stream: bool
    created: float
    created_wall: float
    deadlines: Deadlines
    client_request_id: str | None = None
    body_bytes: int = 0
    phase: Phase = Phase.QUEUED
    phase_since: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    history: list[tuple[float, str]] = field(default_factory=list)
    outcome: Phase | None = None
    ended_phase: Phase | None = None
    reason: str | None = None
    status: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    bytes_sent: bool = False  # the client has received bytes: no more retries
    cause: str | None = None  # why it ended early (scope.Cause value: deadline, drain, client_gone, ...)
    tenant: str | None = None  # the client key's name (None: an open front door)
    priority: str = "normal"  # the key's priority class
    dispatched_at: float | None = None  # its latest attempt's start (admission's first-token estimate)
    estimate: int = 0  # prompt tokens charged to the key's tokens_per_min at admission (settled at the end)

    def __post_init__(self) -> None:
        self.phase_since = self.created
        self.history.append((self.created, self.phase.value))

    @property
    def attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def live(self) -> bool:
        return not self.phase.terminal

    def due(self) -> tuple[str, float]:
        """The budget that runs out next for this request, and when."""
        return self.deadlines.due(self.first_token_at, self.last_token_at, self.stream)


Observer = Callable[[Record, Phase, Phase, float], None]


def transition(rec: Record, to: Phase, now: float, observers: tuple[Observer, ...] = (), reason: str | None = None) -> None:
    """Move ``rec`` to ``to`` at ``now``; terminal moves record the outcome and the phase it ended in."""
    frm = rec.phase
    if to not in ALLOWED[frm]:
        raise IllegalTransition(rec.id, frm, to)
    rec.phase = to
    rec.history.append((now, to.value))
    if to.terminal:
        rec.outcome = to
        rec.ended_phase = frm
        rec.finished_at = now
        rec.reason = reason if reason is not None else rec.reason
    for obs in observers:
        obs(rec, frm, to, now - rec.phase_since)
    rec.phase_since = now


def phase_label(phase: Phase) -> str:
    """How a phase is named to users: the gateway sees prefill and KV transfer as one span."""
    return "prefill+transfer" if phase is Phase.PREFILL else phase.value
