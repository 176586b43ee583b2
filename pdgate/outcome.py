"""The end of a request: one place maps what ended it to an outcome, a status and an answer.

What ended it is either the request's cancel-scope reason (deadline, operator abort, client
gone, drain: ``scope.Reason``) or an error of the request path itself (no pair, a leg that
failed on the last attempt, the client's socket gone while writing). The scope's reason wins
when there is one: it came first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from h1lite.server import Response, Stream
from pdgate import access_log
from pdgate.auth import Tenant
from pdgate.errors import Aborted, DeadlineExceeded, Draining, GatewayError, error_json, sse_error_event
from pdgate.record import Phase, Record, phase_label
from pdgate.scope import Cause, Reason

if TYPE_CHECKING:
    from pdgate.proxy import Ctx


def deadline_error(rec: Record, budget: str) -> DeadlineExceeded:
    d = rec.deadlines
    seconds = {"total": d.total_s, "ttft": d.ttft_s, "idle": d.idle_s}[budget]
    a = rec.attempt
    where = f" (attempt {a.n} on prefill {a.prefill}, decode {a.decode})" if a else ""
    phase = phase_label(rec.phase)
    return DeadlineExceeded(f"{budget} deadline of {seconds:g}s exceeded in phase {phase}{where}", budget=budget, phase=phase)


def from_reason(ctx: Ctx, reason: Reason) -> tuple[Phase, GatewayError | None]:
    """The outcome and the error answered for a request ended by its scope (None: nobody to answer)."""
    rec = ctx.rec
    cause = reason.cause
    if cause is Cause.DEADLINE:
        assert reason.budget is not None
        ctx.gw.metrics.deadlines.labels(reason.budget, phase_label(rec.phase)).inc()
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


def finish(ctx: Ctx, reason: Reason | None, exc: GatewayError | None, body: bytes = b"") -> Response | Stream:
    """End the request: the outcome on the record, and what the client gets (an error event on a started
    stream). ``body`` is a non-streaming request's answer."""
    if reason is not None:
        ctx.rec.cause = reason.cause.value
        outcome, err = from_reason(ctx, reason)
    elif exc is not None:
        outcome, err = Phase.FAILED, exc
    elif ctx.stream_error is not None:  # the engine's own error event went out, then its [DONE]
        finalize(ctx, Phase.FAILED, ctx.stream_error, 502)
        assert ctx.resp is not None
        return ctx.resp
    else:
        finalize(ctx, Phase.COMPLETED, None, 200)
        return ctx.resp or Response(body, headers={"x-request-id": ctx.rec.id})
    if err is None:  # the client left: nobody reads an answer
        finalize(ctx, outcome, "client disconnected", 499)
        return ctx.resp or Response(status=499)
    finalize(ctx, outcome, err.message, err.status)
    return respond_error(ctx, err)


def finalize(ctx: Ctx, outcome: Phase, reason: str | None, status: int) -> None:
    rec = ctx.rec
    if not rec.live:
        return
    rec.status = status
    gw = ctx.gw
    gw.move(rec, outcome, reason)
    gw.traces.finish(rec)
    if ctx.span is not None and gw.otel is not None:
        gw.otel_safely(gw.otel.finish, ctx.span, rec)
    now = gw.now()
    if gw.cfg.access_log and access_log.enabled():
        access_log.emit(access_log.record_fields(rec), gw.cfg.log_format)
    tenant = ctx.request.state
    if isinstance(tenant, Tenant):
        used = (rec.prompt_tokens or rec.estimate) + (rec.completion_tokens or rec.chunks)
        tenant.charge(used - rec.estimate, now)  # the estimate charged at admission, settled
        gw.metrics.tenant_tokens(rec.tenant, rec.prompt_tokens or 0, rec.completion_tokens or rec.chunks)
    for a in rec.attempts:
        gw.recent.append((a.prefill, a.rid, now))
        gw.recent.append((a.decode, a.rid, now))


def respond_error(ctx: Ctx, exc: GatewayError) -> Response | Stream:
    if ctx.resp is not None:  # headers already sent: an error event, then [DONE] (not waited for: the stream ends next)
        if not ctx.resp.proto.closed:
            ctx.resp.send(sse_error_event(exc))
        return ctx.resp
    return Response(error_json(exc), exc.status, headers={**(exc.headers or {}), "x-request-id": ctx.rec.id})
