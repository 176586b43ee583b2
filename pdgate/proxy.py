"""The request path: admission -> attempts (both legs) -> relay -> outcome, for one client request.

One ``Ctx`` per request goes through the steps, each in a module of its own:
``admission`` (validate, resolve deadlines, open the record), ``attempt`` (pair, both legs,
retries), ``relay`` (decode's stream, framed per event), ``outcome`` (what ended it -> outcome,
status, answer). The whole life runs in the request's cancel scope (``pdgate.scope``): the
deadline watchdog, an operator's abort, the client leaving and a drain all end it through
``scope.cancel(reason)``, first reason wins, and ``outcome`` turns that reason into the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from h1lite.server import ClientGone, Request, Response, Stream
from pdgate import admission, attempt, outcome, policies
from pdgate.errors import GatewayError
from pdgate.gateway import Gateway
from pdgate.record import Phase, Record
from pdgate.scope import Cancelled, Cause, Reason, Scope

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = Reason(Cause.CLIENT_GONE)


class Ctx:
    __slots__ = ("body", "gw", "merge_logprobs", "rec", "request", "resp", "route", "scope", "span", "stream_error",
                 "view", "watchdog")

    def __init__(self, gw: Gateway, request: Request, rec: Record, route: str, body: dict[str, Any]) -> None:
        self.gw = gw
        self.request = request
        self.rec = rec
        self.route = route
        self.body = body
        session = policies.session_key(rec.tenant, request.headers.get(gw.session_header), body)
        self.view = policies.RequestView(route, rec.model, body, session)  # what the policies see of it
        self.span = gw.otel_safely(gw.otel.request, rec, request.headers) if gw.otel is not None else None
        self.resp: Stream | None = None
        self.stream_error: str | None = None
        self.merge_logprobs = attempt.wants_logprobs(route, body)
        self.scope = Scope()
        self.watchdog = Watchdog(self)

    def start_stream(self) -> Stream:
        self.rec.bytes_sent = True
        self.resp = self.request.open_stream(200, {**SSE_HEADERS, "x-request-id": self.rec.id})
        return self.resp

    def first_token(self, now: float) -> None:
        rec = self.rec
        if rec.attempts:
            rec.attempts[-1].first_token = True
        if rec.first_token_at is None:
            rec.first_token_at = now
            if rec.dispatched_at is not None:
                self.gw.gate.rates.first_token(now - rec.dispatched_at)
            self.watchdog.rearm()  # the budget due next is now idle (streams) or total, not TTFT
        if rec.phase in (Phase.PREFILL, Phase.TRANSFER):
            self.gw.move(rec, Phase.DECODE)

    def cancel(self, reason: Reason) -> bool:
        return self.scope.cancel(reason)


class Watchdog:
    """Cancels the request's scope when the budget due next (``Record.due``) runs out.

    One timer per request, armed at the next due time. Tokens never touch it: the idle budget
    only moves later with each token, so a timer that fires early re-arms itself at the new due
    time. The one move earlier, from TTFT to idle at the first token, re-arms it (``rearm``)."""

    __slots__ = ("at", "ctx", "handle", "loop", "offset")

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()
        self.handle: asyncio.TimerHandle | None = None
        self.offset = self.loop.time() - ctx.gw.now()  # record clock -> loop clock
        self.at = 0.0  # when the timer fires (record clock)

    def arm(self) -> None:
        self.at = self.ctx.rec.due()[1]
        self.handle = self.loop.call_at(self.at + self.offset, self._fire)

    def rearm(self) -> None:
        """The due time may have moved earlier (the first token: TTFT -> idle): set the timer there."""
        if self.handle is not None and self.ctx.rec.due()[1] < self.at:
            self.handle.cancel()
            self.arm()

    def _fire(self) -> None:
        ctx = self.ctx
        kind, when = ctx.rec.due()
        if when > ctx.gw.now():
            self.at = when
            self.handle = self.loop.call_at(when + self.offset, self._fire)
            return
        self.handle = None
        ctx.cancel(Reason(Cause.DEADLINE, budget=kind))

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


def handle(gw: Gateway, request: Request, route: str) -> Awaitable[Response | Stream]:
    """Admit the request (a refusal raises here) and return its life to be awaited (no frame of its own)."""
    rec, body = admission.admit(gw, request, route)
    return serve(Ctx(gw, request, rec, route, body))


async def serve(ctx: Ctx) -> Response | Stream:
    """The whole life of one admitted request, in its cancel scope."""
    gw, rec = ctx.gw, ctx.rec
    gw.live[rec.id] = ctx
    ctx.request.on_gone = lambda: ctx.cancel(CLIENT_GONE)
    ctx.watchdog.arm()
    body = b""
    exc: GatewayError | None = None
    try:
        try:
            with ctx.scope:
                body = await attempt.dispatch(ctx)
        except ClientGone:  # the client's socket closed under a write: as if it had left (unless something came first)
            ctx.cancel(CLIENT_GONE)
        except GatewayError as e:
            exc = e
        except Cancelled:
            pass
        except asyncio.CancelledError:  # cancelled from outside the scope (the loop shutting down)
            outcome.finalize(ctx, Phase.ABORTED, "cancelled", 499)
            raise
        return outcome.finish(ctx, ctx.scope.reason, exc, body)
    finally:
        ctx.watchdog.disarm()
        ctx.request.on_gone = None
        gw.live.pop(rec.id, None)
        if rec.live:  # an unexpected exception: never leave a live record behind
            outcome.finalize(ctx, Phase.FAILED, "internal error", 500)
