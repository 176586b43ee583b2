"""The request path: admission -> attempts (both legs) -> relay -> outcome, for one client request
(``docs/architecture.md``, "One request's way").

One ``Ctx`` per request goes through the stages, each a module of its own with the collaborators it needs
(nothing reaches back up): ``admission`` (validate, resolve deadlines, open the record; the gate: a pair now
or a place in the queue), ``attempt`` (pair, both legs, retries), ``relay`` (decode's stream, framed per
event), ``outcome`` (what ended it -> outcome, status, answer). The whole life runs in the request's cancel
scope (``pdgate.path.scope``): the deadline watchdog, an operator's abort, the client leaving and a drain all end it
through ``scope.cancel(reason)``, first reason wins, and ``outcome`` turns that reason into the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from h1lite.server import ClientGone, Request, Response, Stream
from pdgate.core.errors import GatewayError
from pdgate.path.admission import Admission
from pdgate.path.attempt import Attempts
from pdgate.path.auth import Tenant
from pdgate.path.context import Ctx, Front
from pdgate.path.observers import Observers
from pdgate.path.outcome import Outcomes
from pdgate.path.scope import Cancelled, Cause, Reason
from pdgate.pool.policies import RequestView, client_session, session_key

CLIENT_GONE = Reason(Cause.CLIENT_GONE)
STOPPING = Reason(Cause.DRAIN, detail="the gateway stopped")
log = logging.getLogger("pdgate")


class Pipeline:
    def __init__(self, admission: Admission, attempts: Attempts, outcomes: Outcomes, obs: Observers,
                 session_header: str, clock: Callable[[], float]) -> None:
        self.admission, self.attempts, self.outcomes, self.obs = admission, attempts, outcomes, obs
        self.session_header = session_header.lower()  # h1lite's header names are lower case
        self.clock = clock
        self.live: dict[str, Ctx] = {}  # live request id -> its context (and cancel scope)

    def handle(self, request: Request, route: str, body: dict[str, Any] | None = None, shown: str | None = None,
               front: Front | None = None, session: str | None = None,
               asked: dict[str, Any] | None = None) -> Awaitable[Response | Stream]:
        """Admit the request (a refusal raises here) and return its life to be awaited (no frame of its own). A
        route that speaks another protocol to the client (``/v1/responses``, ``/v1/messages``) gives the engines'
        ``body``, its own path (``shown``), its ``front``, the session it continues and the client's own body
        (``asked``: where the client names its session)."""
        tenant = request.state if isinstance(request.state, Tenant) else None
        rec, body, ask = self.admission.admit(request, route, tenant, body, shown)
        if front is not None:
            front.start(rec)
        client = asked if asked is not None else body
        named = client_session(request.headers, client, self.session_header)
        key = (session_key(rec.tenant, named, {}) or session or session_key(rec.tenant, None, client)
               or (front.session_for(rec) if front is not None else None))
        rec.session = key
        view = RequestView(route, rec.model, body, key)
        ctx = Ctx(request, rec, route, body, view, tenant, self.clock)
        ctx.ask = ask
        ctx.front = front
        self.obs.admitted(ctx)
        return self.serve(ctx)

    async def serve(self, ctx: Ctx) -> Response | Stream:
        """The whole life of one admitted request, in its cancel scope, under its deadlines' watchdog."""
        rid = ctx.rec.id
        self.live[rid] = ctx
        ctx.request.on_gone = lambda: ctx.cancel(CLIENT_GONE)
        body = b""
        exc: GatewayError | None = None
        stopping = False
        try:
            with ctx.watchdog, ctx.scope:
                body = await self.attempts.dispatch(ctx)
        except ClientGone:  # the client's socket closed under a write: as if it had left (unless something came first)
            ctx.cancel(CLIENT_GONE)
        except GatewayError as e:
            exc = e
        except Cancelled:
            pass
        except asyncio.CancelledError:  # cancelled from outside the scope (the loop shutting down): answered, then on
            ctx.cancel(STOPPING)
            stopping = True
        except Exception:  # a bug: the request still ends, with a 500, and nothing stays live
            log.exception("request %s failed inside the gateway", rid)
            exc = GatewayError("internal error")
        finally:
            ctx.request.on_gone = None
            del self.live[rid]
        resp = self.outcomes.conclude(ctx, ctx.scope.reason, exc, body)
        if stopping:
            raise asyncio.CancelledError
        return resp

    def drain(self, detail: str | None = None) -> int:
        """End every live request now with a terminal answer (outcome aborted, cause drain); their legs are
        aborted on the engines. Returns how many were live."""
        live = list(self.live.values())
        for ctx in live:
            ctx.cancel(Reason(Cause.DRAIN, detail=detail))
        return len(live)
