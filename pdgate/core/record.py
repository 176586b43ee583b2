"""The request record: one per client request, pure data plus its transition functions
(``docs/architecture.md``, "The request record").

Every phase change goes through ``transition()``, which checks the move against ``ALLOWED``, stamps the time
and hands the change to the observers (metrics, traces, admission's rates). ``first_token()`` is the one
other change the request path makes: it says whether the watchdog must re-arm. No I/O here; time comes from
the caller's clock.

The gateway sees a prefill and its KV transfer as one span (the prefill answers once the transfer is over),
so there is no transfer phase: ``prefill`` is shown as ``prefill+transfer``.
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
    DECODE = "decode"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"
    DEADLINE_EXCEEDED = "deadline_exceeded"

    # Members are singletons compared by identity: hash them by identity too (C speed) instead of
    # Enum's Python-level hash of the name; phases are dict and set keys on every transition.
    __hash__ = object.__hash__

    # whether it ends a request: a plain attribute of each member (set below), read several times a request where a
    # property would be a call each time. (Where every request reads a phase's name, it reads ``_value_``: what Enum's
    # ``value`` property returns, without the property's two calls.)
    terminal: bool


TERMINAL = frozenset({Phase.COMPLETED, Phase.FAILED, Phase.ABORTED, Phase.DEADLINE_EXCEEDED})
for _phase in Phase:
    _phase.terminal = _phase in TERMINAL
del _phase
LIVE = (Phase.QUEUED, Phase.DISPATCHED, Phase.PREFILL, Phase.DECODE)

ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.DISPATCHED, *TERMINAL} - {Phase.COMPLETED}),
    # a retry goes back to DISPATCHED with a new attempt
    Phase.DISPATCHED: frozenset({Phase.DISPATCHED, Phase.PREFILL, *TERMINAL} - {Phase.COMPLETED}),
    Phase.PREFILL: frozenset({Phase.DISPATCHED, Phase.DECODE, *TERMINAL}),
    Phase.DECODE: frozenset({Phase.DISPATCHED, *TERMINAL}),
    **{t: frozenset() for t in TERMINAL},
}


class IllegalTransition(Exception):
    def __init__(self, rec_id: str, frm: Phase, to: Phase) -> None:
        super().__init__(f"request {rec_id}: {frm.value} -> {to.value} is not allowed")


@dataclass(slots=True)
class Attempt:
    """One try on a (prefill, decode) pair. What its legs did is in fields (the request path decides by them);
    ``events`` is what happened when, for traces only."""

    n: int
    rid: str
    prefill: str
    decode: str
    drawn: dict[str, Any] = field(default_factory=dict)  # what its engine adapter drew for it (SGLang's room), shown
    # (time, name, info) — kept as tuples: cheap on the hot path, shaped for traces on demand
    events: list[tuple[float, str, Any]] = field(default_factory=list)
    error: str | None = None
    first_token: bool = False  # this attempt produced a token (its decode has the KV)
    prefill_answered: bool = False  # the prefill leg's answer came (any status)
    transferred: bool = False  # the prefill answered 200: the KV transfer reached Success
    decode_answered: bool = False  # the decode leg's status line came
    # "sent", then the engine's answer ("ok", "http_<status>", "error"); None: never aborted
    prefill_abort: str | None = None
    decode_abort: str | None = None

    def event(self, t: float, name: str, info: Any = None) -> None:
        self.events.append((t, name, info))

    def answered(self, role: str) -> bool:
        return self.prefill_answered if role == "prefill" else self.decode_answered

    def aborting(self, role: str, state: str) -> None:
        if role == "prefill":
            self.prefill_abort = state
        else:
            self.decode_abort = state


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
    budget: str | None = None  # the budget that ended it, when a deadline did (total, ttft, idle)
    tenant: str | None = None  # the client key's name (None: an open front door)
    priority: str = "normal"  # the key's priority class
    dispatched_at: float | None = None  # its latest attempt's start (admission's first-token estimate)
    estimate: int = 0  # tokens charged to the key's tokens_per_min at admission (settled at the end)
    prompt_estimate: int = 0  # of it, for the prompt (settled with what the engine reports it read)
    cached_tokens: int | None = None  # of the prompt, found in the prefill's cache (as the engine reports it)
    session: str | None = None  # its session key (per tenant), as the routing policies saw it
    notes: list[str] | None = None  # what the gateway changed of the client's request (a model alias, tools left out)

    def __post_init__(self) -> None:
        self.phase_since = self.created
        self.history.append((self.created, self.phase._value_))

    def note(self, text: str) -> None:
        """Say in its trace what the gateway changed of the client's request."""
        if self.notes is None:
            self.notes = []
        if len(self.notes) < 8:
            self.notes.append(text)

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
    rec.history.append((now, to._value_))
    if to.terminal:
        rec.outcome = to
        rec.ended_phase = frm
        rec.finished_at = now
        rec.reason = reason if reason is not None else rec.reason
    for obs in observers:
        obs(rec, frm, to, now - rec.phase_since)
    rec.phase_since = now


def first_token(rec: Record, now: float, observers: tuple[Observer, ...] = ()) -> bool:
    """A token reached the client (a stream's first event, a non-streaming request's prefill answer): the
    attempt is marked, the request moves to decode. True the first time for the request: the budget due next
    moved earlier (TTFT to idle, or to total), and the watchdog must re-arm."""
    rec.attempts[-1].first_token = True
    first = rec.first_token_at is None
    if first:
        rec.first_token_at = now
    if rec.phase is Phase.PREFILL:
        transition(rec, Phase.DECODE, now, observers)
    return first


def phase_label(phase: Phase) -> str:
    """How a phase is named to users: the gateway sees prefill and KV transfer as one span."""
    return "prefill+transfer" if phase is Phase.PREFILL else phase.value
