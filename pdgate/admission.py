"""Admission: parse and validate the body, resolve the deadlines once, open the request's record."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from h1lite.server import Request
from pdgate import deadlines, protocol, validation
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
    if model is not None and known and model not in known:
        raise ModelNotFound(f"model '{model}' is not served here; available: {', '.join(sorted(known))}")
    now = gw.now()
    dl = deadlines.resolve(now, request.headers, body.pop("timeout", None), gw.cfg.models.get(model or ""),
                           gw.cfg.deadlines)
    body.pop(protocol.RID, None)
    rec = Record(id=gw.new_id(), route=route, model=model, stream=stream, created=now, created_wall=time.time(),
                 deadlines=dl, client_request_id=request.headers.get("x-request-id"), body_bytes=len(raw))
    gw.traces.add(rec)
    return rec, body
