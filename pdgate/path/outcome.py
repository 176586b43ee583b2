"""The end of a request: one place maps what ended it to an outcome, a status and an answer.

What ended it is either the request's cancel-scope reason (deadline, operator abort, client gone, drain:
``scope.Reason``) or an error of the request path itself (no pair, a leg that failed on the last attempt, the
client's socket gone while writing). The scope's reason wins when there is one: it came first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from h1lite.server import Response, Stream
from pdgate.core.errors import Aborted, DeadlineExceeded, Draining, GatewayError, error_json, sse_error_event
from pdgate.core.record import Phase, Record, phase_label
from pdgate.path.scope import Cause, Reason

if TYPE_CHECKING:
    from pdgate.path.context import Ctx
    from pdgate.path.observers import Observers
    from pdgate.store.base import Store


def deadline_error(rec: Record, budget: str) -> DeadlineExceeded:
    d = rec.deadlines
    seconds = {"total": d.total_s, "ttft": d.ttft_s, "idle": d.idle_s}[budget]
    a = rec.attempt
    where = f" (attempt {a.n} on prefill {a.prefill}, decode {a.decode})" if a else ""
    phase = phase_label(rec.phase)
    return DeadlineExceeded(f"{budget} deadline of {seconds:g}s exceeded in phase {phase}{where}", budget=budget, phase=phase)


def from_reason(rec: Record, reason: Reason) -> tuple[Phase, GatewayError | None]:
    """The outcome and the error answered for a request ended by its scope (None: nobody to answer)."""
    cause = reason.cause
    if cause is Cause.DEADLINE:
        assert reason.budget is not None
        rec.budget = reason.budget
        return Phase.DEADLINE_EXCEEDED, deadline_error(rec, reason.budget)
    if cause is Cause.OPERATOR:
        return Phase.ABORTED, Aborted(f"request aborted {reason.detail or 'by an operator'}")
    if cause is Cause.DRAIN:
        return Phase.ABORTED, Draining(f"drain: the gateway is shutting down and stopped this request in phase "
                                       f"{phase_label(rec.phase)}" + (f" ({reason.detail})" if reason.detail else ""))
    if cause is Cause.CLIENT_GONE:
        return Phase.ABORTED, None
    # an attempt-level reason that reached the request: its error is the answer
    err = reason.error
    return Phase.FAILED, err if isinstance(err, GatewayError) else GatewayError("internal error")


class Outcomes:
    def __init__(self, obs: Observers, store: Store, clock: Callable[[], float]) -> None:
        self.obs, self.store, self.clock = obs, store, clock

    def conclude(self, ctx: Ctx, reason: Reason | None, exc: GatewayError | None, body: bytes = b"") -> Response | Stream:
        """End the request: the outcome on the record, and what the client gets (an error event on a started
        stream). ``body`` is a non-streaming request's answer."""
        rec = ctx.rec
        err: GatewayError | None = None
        if ctx.done:  # its stream's [DONE] went out before anything else ended it: that was its answer
            reason = exc = None
        if reason is not None:
            rec.cause = reason.cause.value
            outcome, err = from_reason(rec, reason)
            why, status = (err.message, err.status) if err is not None else ("client disconnected", 499)
        elif exc is not None:
            outcome, err, why, status = Phase.FAILED, exc, exc.message, exc.status
        elif ctx.stream_error is not None:  # the engine's own error event went out, then its [DONE]
            outcome, why, status = Phase.FAILED, ctx.stream_error, 502
        else:
            outcome, why, status = Phase.COMPLETED, None, 200
        self.finalize(ctx, outcome, why, status)
        if err is None:  # done; or the client left, and nobody reads an answer
            return ctx.resp or Response(body, status, headers={"x-request-id": rec.id})
        if ctx.resp is not None:  # headers already sent: an error event, then [DONE] (the stream ends next)
            if not ctx.resp.proto.closed:
                ctx.resp.send(ctx.front.failed(err) if ctx.front is not None else sse_error_event(err))
            return ctx.resp
        return Response(error_json(err), err.status, headers={**(err.headers or {}), "x-request-id": rec.id})

    def finalize(self, ctx: Ctx, outcome: Phase, reason: str | None, status: int) -> None:
        rec = ctx.rec
        if not rec.live:
            return
        rec.status = status
        now = self.clock()
        self.obs.move(rec, outcome, now, reason)
        tenant = ctx.tenant
        if tenant is not None and ctx.holds:  # its live request given back, its tokens settled
            self.store.release(tenant.name, (), now)
            tpm = tenant.key.tokens_per_min
            if tpm:
                used = ((rec.prompt_tokens if rec.prompt_tokens is not None else rec.prompt_estimate)
                        + (rec.completion_tokens if rec.completion_tokens is not None else rec.chunks))
                self.store.charge(tenant.name, tpm, used - rec.estimate, now)
        self.obs.finished(ctx, now)
