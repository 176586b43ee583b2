"""Admission: parse and validate the body, resolve the deadlines once, open the request's record."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from h1lite.server import Request
from pdgate import deadlines, protocol, validation
from pdgate.auth import Tenant
from pdgate.errors import InvalidJSON, ModelNotFound
from pdgate.record import Record

if TYPE_CHECKING:
    from pdgate.gateway import Gateway


def admit(gw: Gateway, request: Request, route: str) -> tuple[Record, dict[str, Any]]:
    """The request's record (live from here on) and the body to send to the engines."""
    raw = request.body
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidJSON("request body must be a JSON object")
    model, stream = validation.validate(route, body)
    known = gw.known_models()
    tenant = request.state if isinstance(request.state, Tenant) else None
    if tenant is not None and not tenant.allows(model, known):
        # as OpenAI answers: a model this key may not use looks like one that does not exist
        allowed = ", ".join(sorted(tenant.models & known)) or "none"
        raise ModelNotFound(f"model '{model}' does not exist or this key has no access to it" if model is not None
                            else f"this key may use only some models: name one in 'model' ({allowed})")
    if model is not None and known and model not in known:
        offered = sorted(known if tenant is None or not tenant.models else tenant.models & known)
        raise ModelNotFound(f"model '{model}' is not served here; available: {', '.join(offered)}")
    now = gw.now()
    dl = deadlines.resolve(now, request.headers, body.pop("timeout", None), gw.cfg.models.get(model or ""),
                           tenant.deadlines if tenant is not None else gw.cfg.deadlines)
    body.pop(protocol.RID, None)
    rec = Record(id=gw.new_id(), route=route, model=model, stream=stream, created=now, created_wall=time.time(),
                 deadlines=dl, client_request_id=request.headers.get("x-request-id"), body_bytes=len(raw))
    if tenant is not None:
        rec.tenant, rec.priority = tenant.name, tenant.priority
        if tenant.tokens is not None:
            rec.estimate = len(raw) // 4  # about four bytes of JSON per prompt token; settled at the end
            tenant.charge(rec.estimate, now)
    gw.traces.add(rec)
    return rec, body
