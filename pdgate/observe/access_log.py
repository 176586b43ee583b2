"""The access log: one line per request on the ``pdgate.access`` logger, at info, as ``key=value`` text or JSON.

A request that got a record (it was admitted) is logged when it ends (``outcome.finalize``): its id, the
client's own id, tenant, route, model, status, outcome, what ended it early (cause, and the budget if a
deadline fired), TTFT, e2e, tokens, its last attempt's workers and the number of attempts. A request refused
before admission (bad JSON, a missing key, a rate limit, a full queue) is logged by the front door's
middleware with its status and error code. Client-chosen values are percent-quoted in text lines (a line
cannot be forged); keys never appear.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

import orjson

from pdgate.core.record import Record

log = logging.getLogger("pdgate.access")
FORMATS = ("text", "json")


def _ms(t: float | None, base: float) -> float | None:
    return None if t is None else round((t - base) * 1000, 2)


def record_fields(rec: Record) -> dict[str, Any]:
    a = rec.attempt
    return {
        "id": rec.id, "client_id": rec.client_request_id, "tenant": rec.tenant, "route": rec.route,
        "model": rec.model, "stream": rec.stream, "status": rec.status,
        "outcome": rec.outcome.value if rec.outcome else None, "cause": rec.cause, "budget": rec.budget,
        "ttft_ms": _ms(rec.first_token_at, rec.created), "e2e_ms": _ms(rec.finished_at, rec.created),
        "prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.completion_tokens, "chunks": rec.chunks,
        "prefill": a.prefill if a else None, "decode": a.decode if a else None, "attempts": len(rec.attempts),
    }


def refused_fields(route: str, status: int, code: str, tenant: str | None, e2e_s: float) -> dict[str, Any]:
    return {"id": None, "tenant": tenant, "route": route, "status": status, "outcome": "refused", "code": code,
            "e2e_ms": round(e2e_s * 1000, 2)}


def line(fields: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return orjson.dumps(fields).decode()
    return "access " + " ".join(f"{k}={'-' if v is None else quote(str(v), safe='.:/+-_')}" for k, v in fields.items())


def emit(fields: dict[str, Any], fmt: str) -> None:
    log.info("%s", line(fields, fmt))


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)
