"""The root of the error tree the server answers with, as OpenAI error objects.

A handler raises an ``HTTPError`` (or a subclass) and the client gets its ``status`` and
``{"error": {"message", "type", "code", "param"}}``. pdgate builds its own tree on
``HTTPError`` (``pdgate.core.errors``); the few errors the HTTP layer raises itself live here.
"""

from __future__ import annotations

from typing import Any

import orjson


class HTTPError(Exception):
    status = 500
    type = "internal_error"
    code = "internal_error"
    headers: dict[str, str] | None = None  # sent with the answer (WWW-Authenticate, Retry-After)

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


class ProtocolError(HTTPError):
    """Answered before any handler runs: malformed HTTP (400), an unknown method (405), a too
    long request line (414) or headers (431)."""

    type = "invalid_request_error"

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class NotFound(HTTPError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(HTTPError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


def error_json(exc: HTTPError) -> bytes:
    return orjson.dumps(exc.body())
