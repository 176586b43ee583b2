"""What watches the requests: metrics, traces, OpenTelemetry and the access log, behind one object the stages
tell what happened (``docs/architecture.md``, "Observers"). It decides nothing; nothing it does ends a request
(an OpenTelemetry call that raises is logged and the request goes on).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pdgate.core.record import Attempt, Observer, Phase, Record, transition
from pdgate.observe import access_log
from pdgate.observe.metrics import Metrics
from pdgate.observe.traces import Traces

if TYPE_CHECKING:
    from pdgate.observe.otel import Otel
    from pdgate.path.context import Ctx
    from pdgate.pool.lineage import Lineage

log = logging.getLogger("pdgate")
T = TypeVar("T")


class Observers:
    def __init__(self, metrics: Metrics, traces: Traces, otel: Otel | None, access: bool, log_format: str,
                 recent: deque[tuple[str, str, float]]) -> None:
        self.metrics, self.traces, self.otel = metrics, traces, otel
        self.access = access
        self.log_format = log_format
        self.recent = recent  # (worker id, rid, when it ended): count-mode reconciliation aborts these again
        self.lineage: Lineage | None = None  # told what begins and ends once the lineage started (``Control.start``)
        self.transitions: tuple[Observer, ...] = (metrics.on_transition,)

    def watch(self, observer: Observer) -> None:
        """One more observer of every record transition."""
        self.transitions = (*self.transitions, observer)

    def move(self, rec: Record, to: Phase, now: float, reason: str | None = None) -> None:
        transition(rec, to, now, self.transitions, reason)

    def _otel(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except Exception:
            log.exception("OpenTelemetry failed (the request goes on without its span)")
            return None

    # ---- a request's life --------------------------------------------------------------
    def admitted(self, ctx: Ctx) -> None:
        self.traces.add(ctx.rec)
        if self.otel is not None:
            ctx.span = self._otel(self.otel.request, ctx.rec, ctx.request.headers)

    def attempt_started(self, ctx: Ctx, att: Attempt, now: float) -> Any:
        """The attempt's span (None without otel)."""
        if self.lineage is not None:
            self.lineage.began(att.rid, (att.prefill, att.decode))
        if self.otel is None or ctx.span is None:
            return None
        return self._otel(self.otel.attempt, ctx.span, ctx.rec, att, now)

    def traceparent(self, span: Any) -> dict[str, str]:
        return (self._otel(self.otel.traceparent, span) if self.otel is not None else None) or {}

    def attempt_ended(self, rec: Record, att: Attempt, span: Any, now: float) -> None:
        if span is not None and self.otel is not None:
            self._otel(self.otel.end_attempt, span, rec, att, now)

    def retried(self, reason: str) -> None:
        self.metrics.retries.labels(reason).inc()

    def aborted(self, role: str, result: str) -> None:
        self.metrics.aborts.labels(role, result).inc()

    def finished(self, ctx: Ctx, now: float) -> None:
        """The record is terminal: its rids are recently ended (first: whatever an observer below raises), traces
        keep it, OpenTelemetry ends its span, the access log has its line."""
        rec = ctx.rec
        lineage = self.lineage
        for a in rec.attempts:
            self.recent.append((a.prefill, a.rid, now))
            self.recent.append((a.decode, a.rid, now))
            if lineage is not None:
                lineage.ended(a.rid, now)
        self.traces.finish(rec)
        if ctx.span is not None and self.otel is not None:
            self._otel(self.otel.finish, ctx.span, rec)
        if self.access and access_log.enabled():
            access_log.emit(access_log.record_fields(rec), self.log_format)
        if rec.tenant is not None:
            self.metrics.tenant_tokens(rec.tenant, rec.prompt_tokens or 0,
                                       rec.completion_tokens if rec.completion_tokens is not None else rec.chunks)
