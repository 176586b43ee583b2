"""Admission: parse and validate the body, resolve the deadlines once, open the request's record and make its key's
claim (``docs/architecture.md``, "One request's way"). What comes next, a pair with room or a place in the queue,
is the gate's (``pdgate.path.gate``).
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from h1lite.server import Request
from pdgate.core import deadlines, validation
from pdgate.core.config import PRIORITIES, GatewayConfig
from pdgate.core.errors import InvalidField, ModelNotFound
from pdgate.core.queueing import RANKS
from pdgate.core.record import Record
from pdgate.core.rid import Ids
from pdgate.path.auth import Tenant

if TYPE_CHECKING:
    from pdgate.pool.workers import Pool
    from pdgate.store.base import TenantAsk

PRIORITY_HEADER = "x-pdgate-priority"


class Admission:
    """A request read into its record: the body parsed and checked, the model the key may use, the deadlines
    resolved once, and the key's claim on its limits (taken with its first pair: ``gate.Gate.pair_for``)."""

    def __init__(self, cfg: GatewayConfig, pool: Pool, ids: Ids, clock: Callable[[], float]) -> None:
        self.cfg, self.pool, self.ids, self.clock = cfg, pool, ids, clock

    def admit(self, request: Request, route: str, tenant: Tenant | None, body: dict[str, Any] | None = None,
              shown: str | None = None) -> tuple[Record, dict[str, Any], TenantAsk | None]:
        """The request's record (live from here on), the body to send to the engines and its key's claim.
        ``body``: made by the route from the client's (``/v1/responses``), whose path is ``shown`` on the record."""
        raw = request.body
        if body is None:
            body = validation.parse_body(raw)
        model, stream = validation.validate(route, body)
        asked = model
        model = self.model_for(model, tenant)
        if model != asked:
            body["model"] = model
        now = self.clock()
        cfg = self.cfg
        dl = deadlines.resolve(now, request.headers, body.pop("timeout", None), cfg.models.get(model or ""),
                               tenant.deadlines if tenant is not None else cfg.deadlines)
        rec = Record(id=self.ids.new(), route=shown or route, model=model, stream=stream, created=now, created_wall=time.time(),
                     deadlines=dl, client_request_id=request.headers.get("x-request-id"), body_bytes=len(raw))
        rec.priority = priority(request, tenant)
        if model != asked:
            rec.note(f"model {asked!r} is an alias of {model!r}")
        ask = None
        if tenant is not None:
            rec.tenant = tenant.name
            if tenant.limited:
                ask = self.claim(tenant, rec, route, body, len(raw) // 4)
        return rec, body, ask

    def model_for(self, model: str | None, tenant: Tenant | None) -> str | None:
        """The served model a request names: itself, or what its alias is served by (``[models."claude-*"]
        served_by``: the first pattern that matches, in the config's order, when the name is not served itself);
        a name not served, or one the key may not use, is a 404 naming those it may."""
        known = self.pool.models()
        if model is not None and known and model not in known:
            for pattern, b in self.cfg.models.items():
                if b.served_by is not None and fnmatch.fnmatchcase(model, pattern):
                    model = b.served_by
                    break
        if tenant is not None and not tenant.allows(model, known):
            # as OpenAI answers: a model this key may not use looks like one that does not exist
            allowed = ", ".join(sorted(tenant.models & known)) or "none"
            raise ModelNotFound(f"model '{model}' does not exist or this key has no access to it" if model is not None
                                else f"this key may use only some models: name one in 'model' ({allowed})")
        if model is not None and known and model not in known:
            offered = sorted(known if tenant is None or not tenant.models else tenant.models & known)
            raise ModelNotFound(f"model '{model}' is not served here; available: {', '.join(offered)}")
        return model

    def claim(self, tenant: Tenant, rec: Record, route: str, body: dict[str, Any], prompt: int) -> TenantAsk:
        """What the request may use, charged in full when it is dispatched against what the key has left (a burst
        cannot pass on one minute's allowance; settled at the end): about four bytes of JSON per prompt token, and
        the most tokens the engines serving here will generate for it, read as they read the body (a field they
        do not read for this route counts for nothing). A request they would let run to its context gets what is
        left (its output capped to it then: ``Gate.pair_for``)."""
        asked = [e.output_tokens(route, body) for e in self.pool.adapters]
        rec.prompt_estimate = prompt
        if not asked or None in asked:
            rec.estimate = prompt
            return tenant.ask(prompt, unbounded=True)
        rec.estimate = prompt + max(n for n in asked if n is not None)
        return tenant.ask(rec.estimate)


def priority(request: Request, tenant: Tenant | None) -> str:
    """The request's class: ``x-pdgate-priority`` if given, never above its key's class (without a key: normal)."""
    top = tenant.priority if tenant is not None else "normal"
    asked = request.headers.get(PRIORITY_HEADER)
    if asked is None:
        return top
    asked = asked.strip().lower()
    if asked not in PRIORITIES:
        raise InvalidField(f"header {PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}, got {asked!r}",
                           param=PRIORITY_HEADER)
    return asked if RANKS[asked] >= RANKS[top] else top
