"""A request's context: what one client request carries through the stages (``docs/architecture.md``,
"One request's way"). Plain data: the stages act on it, it calls nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from h1lite.server import Request, Stream
from pdgate.core.record import Record
from pdgate.path.scope import Reason, Scope, Watchdog
from pdgate.pool.policies import RequestView

if TYPE_CHECKING:
    from pdgate.core.errors import GatewayError
    from pdgate.path.auth import Tenant
    from pdgate.store.base import TenantAsk


class Front(Protocol):
    """What the client is answered in, when that is not what the engines speak (``pdgate.apis.responses.Events``): the
    engine's whole SSE events translated (``feed``), and the gateway's own end of a started stream (``failed``)."""

    headers: dict[str, str]  # sent with the answer's head (what the gateway left out of the request)

    def start(self, rec: Record) -> None: ...

    def session_for(self, rec: Record) -> str | None:
        """The session of a request that names none."""

    def feed(self, events: bytes, sep: bytes) -> bytes: ...

    def failed(self, err: GatewayError) -> bytes: ...


class Ctx:
    __slots__ = ("ask", "body", "done", "front", "holds", "loop", "rec", "request", "resp", "route", "scope", "span", "stream_error", "tenant",
                 "view", "watchdog")

    def __init__(self, request: Request, rec: Record, route: str, body: dict[str, Any], view: RequestView,
                 tenant: Tenant | None, clock: Callable[[], float]) -> None:
        self.request = request
        self.rec = rec
        self.route = route
        self.body = body  # what the engines are sent (the client's JSON, less what the gateway took from it)
        self.view = view  # what the routing policies see of it
        self.tenant = tenant  # its client key (None: an open front door)
        self.span: Any = None  # its OpenTelemetry span (None without otel)
        self.resp: Stream | None = None  # the client's stream, once its head went out
        self.stream_error: str | None = None  # the engine's own error event went out on it
        self.done = False  # its stream's [DONE] went out: the client has its whole answer, nothing follows it
        self.front: Front | None = None  # the client's protocol where it is not the engines' (/v1/responses)
        self.ask: TenantAsk | None = None  # its key's claim on its limits (taken with its first pair)
        self.holds = False  # it holds one of its key's live requests (given back when it ends)
        self.loop = request.loop
        self.scope = Scope(request.task)
        self.watchdog = Watchdog(self.scope, rec.due, clock, self.loop)

    def cancel(self, reason: Reason) -> bool:
        return self.scope.cancel(reason)
