"""Front-door validation of client bodies: fail fast with a 400 that names the field.

Engines validate again; this catches what would otherwise cost two engine requests, and
what the gateway itself cannot serve (n > 1, batches).
"""

from __future__ import annotations

from typing import Any

import orjson

from pdgate.core.errors import InvalidField, InvalidJSON

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
HEADROOM = 16  # levels the gateway may wrap a client's values in (a stored response, an echo): orjson writes 254


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request's JSON object, checked for depth (``check_depth``); else a 400 naming why."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidJSON("request body must be a JSON object")
    check_depth(body)
    return body


def check_depth(body: Any) -> None:
    """A body whose values nest so deep that the gateway could not write them back (into the legs, an answer, the
    store) is a 400 now, not a 500 later. One serialization at C speed: the nesting orjson writes, less headroom."""
    wrapped = body
    for _ in range(HEADROOM):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        raise InvalidField(f"the request's values nest deeper than {254 - HEADROOM} levels") from None


def _positive_int(body: dict[str, Any], key: str) -> None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise InvalidField(f"'{key}' must be a positive integer, got {v!r}", param=key)


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi):
        raise InvalidField(f"'{key}' must be a number within [{lo}, {hi}], got {v!r}", param=key)


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if not isinstance(v, bool):
        raise InvalidField(f"'{key}' must be true or false, got {v!r}", param=key)
    return v


def validate(route: str, body: dict[str, Any]) -> tuple[str | None, bool]:
    """Check ``body`` for ``route``; returns (model, stream)."""
    stream = _bool(body, "stream")
    if route == GENERATE:
        if "text" in body:
            if not isinstance(body["text"], str):
                raise InvalidField("'text' must be a string (batches are not supported)", param="text")
        elif "input_ids" in body:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise InvalidField("'input_ids' must be a non-empty list of integers (batches are not supported)",
                                   param="input_ids")
        else:
            raise InvalidField("one of 'text' or 'input_ids' is required", param="text")
        sp = body.get("sampling_params", {})
        if not isinstance(sp, dict):
            raise InvalidField("'sampling_params' must be an object", param="sampling_params")
        _positive_int(sp, "max_new_tokens")
        _number(sp, "temperature", 0, 2)
        if sp.get("n", 1) != 1:
            raise InvalidField("sampling_params.n > 1 is not supported", param="sampling_params.n")
        model = body.get("model")
        return (model if isinstance(model, str) else None), stream
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("'model' is required and must be a string", param="model")
    if route == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise InvalidField("'messages' must be a non-empty list", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidField(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise InvalidField(f"messages[{i}].content must be a string or a list of parts", param=f"messages[{i}].content")
            if not isinstance(m.get("tool_calls"), (list, type(None))):
                raise InvalidField(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
        _positive_int(body, "max_completion_tokens")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))):
            raise InvalidField("'prompt' must be a string (batches are not supported)", param="prompt")
    _positive_int(body, "max_tokens")
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    if body.get("n", 1) != 1:
        raise InvalidField("n > 1 is not supported", param="n")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidField("'stream_options' must be an object", param="stream_options")
    return model, stream
