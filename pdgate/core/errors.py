"""Errors the gateway answers with, each mapped to an OpenAI error object in one place.

    GatewayError (h1lite.errors.HTTPError) 500 internal_error
    ├── BadRequest                     400 invalid_request_error
    │   ├── InvalidJSON                400 invalid_json
    │   ├── InvalidField               400 invalid_value (param names the field)
    │   └── InvalidDeadline            400 invalid_deadline
    ├── Unauthorized                   401 invalid_api_key (no key, or not a key of this plane's kind)
    ├── Forbidden                      403 permission_denied (a valid key that may not do this)
    ├── NotFound                       404 not_found
    │   └── ModelNotFound              404 model_not_found
    ├── Conflict                       409 conflict (a worker registered twice, the worker limit)
    ├── RateLimited                    429 rate_limit_exceeded (Retry-After; type names the limit)
    ├── Shed                           503 | 429 deadline_unmeetable | queue_full (Retry-After; admission control)
    ├── PayloadTooLarge                413 payload_too_large
    ├── NoHealthyPair                  503 no_healthy_pair
    ├── WorkerUnreachable              502 worker_unreachable (a registration whose /health did not answer 200)
    ├── UpstreamError                  502 upstream_error (retryable before the first byte)
    │   ├── UpstreamConnectError       502 upstream_connect_error
    │   ├── UpstreamStatus             502 upstream_5xx | upstream_unauthorized (401/403) | the engine's 4xx passed through
    │   └── WorkerLost                 502 worker_restarted (worker, role and cause as fields)
    ├── StoreUnavailable               503 store_unavailable (stored responses: the shared store did not answer)
    ├── Draining                       503 gateway_draining (the gateway stopped before the answer was done)
    ├── DeadlineExceeded               504 deadline_exceeded
    └── Aborted                        499 request_aborted (client left or operator abort)
"""

from __future__ import annotations

from typing import Any

import orjson

# the root and two leaves live in the HTTP layer, which raises them itself
from h1lite.errors import HTTPError
from h1lite.errors import NotFound as NotFound
from h1lite.errors import PayloadTooLarge as PayloadTooLarge
from h1lite.errors import error_json as error_json

GatewayError = HTTPError


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(BadRequest):
    code = "invalid_json"


class InvalidField(BadRequest):
    code = "invalid_value"


class InvalidDeadline(BadRequest):
    code = "invalid_deadline"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    headers = {"WWW-Authenticate": 'Bearer realm="pdgate"'}


class Forbidden(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RateLimited(GatewayError):
    """A key's limit reached; ``limit`` is concurrency, requests or tokens (OpenAI's ``type`` is the last two)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.type = "tokens" if limit == "tokens" else "requests"
        self.headers = {"Retry-After": str(retry_after_s)}


class Shed(GatewayError):
    """Answered at once by admission control: the queue is full, or the first token cannot come within the TTFT
    budget. 503 when the gateway is saturated, 429 when the tenant holds more than its share of the queue."""

    type = "service_unavailable"

    def __init__(self, message: str, *, code: str, status: int, retry_after_s: int) -> None:
        super().__init__(message)
        self.code, self.status = code, status
        if status == 429:
            self.type = "requests"
        self.headers = {"Retry-After": str(retry_after_s)}


class WorkerUnreachable(GatewayError):
    status = 502
    type = "upstream_error"
    code = "worker_unreachable"


class NoHealthyPair(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_pair"


class UpstreamError(GatewayError):
    """A leg failed. ``retryable`` says whether another pair may succeed."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"
    retryable = True
    reason = "upstream"

    def __init__(self, message: str, *, role: str = "", worker: str = "") -> None:
        super().__init__(message)
        self.role = role
        self.worker = worker


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"
    reason = "connect"


class UpstreamStatus(UpstreamError):
    """An engine answered with an error status. 4xx (but 429) is the client's fault: passed on."""

    reason = "status"

    def __init__(self, message: str, *, role: str, worker: str, upstream_status: int, detail: Any = None) -> None:
        super().__init__(message, role=role, worker=worker)
        self.upstream_status = upstream_status
        self.detail = detail
        if upstream_status in (401, 403):  # the engine refused the gateway's credentials: not the client's fault
            self.code = "upstream_unauthorized"
            self.reason = "unauthorized"
        elif 400 <= upstream_status < 500 and upstream_status != 429:
            self.status = upstream_status
            self.type = "invalid_request_error"
            self.code = "engine_rejected"
            self.retryable = False
            self.reason = "rejected"
        else:
            self.code = "upstream_429" if upstream_status == 429 else "upstream_5xx"
            self.reason = str(upstream_status)


class WorkerLost(UpstreamError):
    """An attempt's worker was found down or restarted while the attempt ran."""

    code = "worker_restarted"
    reason = "worker_lost"

    def __init__(self, message: str, *, role: str, worker: str, cause: str) -> None:
        super().__init__(message, role=role, worker=worker)
        self.cause = cause


class StoreUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "store_unavailable"


class Draining(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "gateway_draining"


class DeadlineExceeded(GatewayError):
    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"

    def __init__(self, message: str, *, budget: str, phase: str) -> None:
        super().__init__(message)
        self.budget = budget
        self.phase = phase


class Aborted(GatewayError):
    status = 499
    type = "request_aborted"
    code = "request_aborted"


def sse_error_event(exc: GatewayError) -> bytes:
    """What a stream gets when it fails after its headers were sent: an error event, then [DONE]."""
    return b"data: " + error_json(exc) + b"\n\ndata: [DONE]\n\n"


DETAIL_CHARS = 200


def one_line(text: str, limit: int = DETAIL_CHARS) -> str:
    """``text`` as one line of printable characters, at most ``limit`` of them: what of an engine's words reaches
    a client or a log line (never a page of someone else's HTML, never a forged line)."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 4]).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def detail_of(body: bytes) -> str:
    """What an engine's error body says, for our message: its ``error.message`` or ``message``, else its text;
    bounded and on one line (``one_line``)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return one_line(body[: DETAIL_CHARS * 4].decode(errors="replace"))
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            obj = err.get("message", err)
        else:
            obj = obj.get("message", err if err is not None else obj)
    return one_line(obj if isinstance(obj, str) else orjson.dumps(obj).decode())


class LoopLate(TimeoutError):
    """A timeout that says more about this process than about the engine: it was noticed well after it was due
    (raised by ``pdgate.adapters.upstream``; here so that what judges a probe imports no I/O)."""
