"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) in terms of the engines' chat
completions, as ``pdgate.apis.responses`` does for the Responses API (``docs/messages.md``).

Pure data: no I/O, no clock. ``to_chat`` makes the chat body from a Messages request; ``answer`` turns a chat
completion into a Message; ``Events`` turns a chat stream into Anthropic's event sequence (``message_start``,
``ping``, ``content_block_start`` / ``_delta`` / ``_stop`` for text and tool input JSON, ``message_delta``,
``message_stop``) and a gateway-ended stream into one ``event: error`` naming why. ``Error`` renders any
gateway error in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).

What the engines cannot act on is accepted and left out, never refused: ``thinking``, ``context_management``,
``output_config``, ``cache_control``, thinking blocks given back, ``anthropic-beta`` features. Server tools (a
``type`` other than ``custom``: ``web_search_...``, ``bash_...``) are left out of what the engine sees and named
in the answer's ``x-pdgate-tools-dropped`` header; a deferred tool (``defer_loading``) is declared in full.
"""

from __future__ import annotations

from typing import Any

import orjson

from pdgate.apis.responses import ChatReader
from pdgate.core.errors import GatewayError, InvalidField

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
MAX_STOP = 16
MAX_CALLS = 128
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               499: "api_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
# Claude Code's first system block: "x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=<nonce>;"
# its cch value changes every request, so no two rounds of a session share a cached prefix (normalise_billing)
BILLING = "x-anthropic-billing-header:"
STOPS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
         "content_filter": "refusal"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


class Error(GatewayError):
    """A gateway error as Anthropic's clients read it (same status, code and headers; Anthropic's body)."""

    def __init__(self, err: GatewayError) -> None:
        super().__init__(err.message, param=err.param)
        self.inner = err
        self.status, self.code, self.headers = err.status, err.code, err.headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def from_openai(status: int, body: bytes) -> bytes:
    """An error answer the request path made in OpenAI's shape, in Anthropic's."""
    try:
        err = orjson.loads(body).get("error") or {}
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (orjson.JSONDecodeError, AttributeError):
        message = body[:200].decode(errors="replace")
    return orjson.dumps(error_body(status, str(message)))


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined (what a system prompt or a tool result holds)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"'{where}' must be a string or a list of content blocks", param=where)
    out = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            out.append(b["text"])
        elif kind == "tool_reference" and isinstance(b.get("tool_name"), str):
            out.append(f"(tool {b['tool_name']} is available)")
        elif kind in ("image", "document"):
            out.append(f"[{kind} omitted]")
        else:
            raise InvalidField(f"'{where}[{j}]' of type {kind!r} is not supported here (text)", param=where)
    return "\n".join(out)


def _image(b: dict[str, Any], where: str) -> dict[str, Any]:
    src = _obj(b.get("source"))
    if src.get("type") == "base64" and isinstance(src.get("data"), str) and isinstance(src.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{src['media_type']};base64,{src['data']}"}}
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise InvalidField(f"'{where}.source' must be a base64 or url image source", param=where)


def _message(i: int, m: Any, out: list[dict[str, Any]]) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidField(f"'{where}' must be an object", param="messages")
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant", "system"):
        raise InvalidField(f"'{where}.role' must be user or assistant, got {role!r}", param="messages")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise InvalidField(f"'{where}.content' must be a string or a list of content blocks", param="messages")
    if role == "system":
        out.append({"role": "system", "content": _text_of(content, f"{where}.content")})
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(b, w))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise InvalidField(f"'{w}' (tool_use) needs id and name strings", param="messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": orjson.dumps(b.get("input") or {}).decode()}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise InvalidField(f"'{w}' (tool_result) needs a tool_use_id string", param="messages")
            text = _text_of(b.get("content") or "", f"{w}.content")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": ("Error: " + text) if b.get("is_error") is True else text})
        elif kind in ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result"):
            continue  # the model's own reasoning or a server tool's turn: nothing an engine here is given back
        else:
            raise InvalidField(f"'{w}' of type {kind!r} is not supported here (text, image, tool_use, tool_result)",
                               param="messages")
    if calls:
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif parts:
        if all(p["type"] == "text" for p in parts):
            out.append({"role": role, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({"role": role, "content": parts})
    elif role == "assistant":
        out.append({"role": "assistant", "content": ""})


def _tools(tools: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The client's tools as chat functions, and the server tools left out."""
    if not isinstance(tools, list):
        raise InvalidField("'tools' must be a list", param="tools")
    out, dropped = [], []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise InvalidField(f"'tools[{i}]' must be an object with a name", param="tools")
        kind = t.get("type")
        if kind not in (None, "custom"):
            dropped.append(f"{t['name']}:{kind}")
            continue
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise InvalidField(f"'tools[{i}].input_schema' must be a JSON schema object", param="tools")
        fn = {"name": t["name"], "parameters": schema,
              **({"description": t["description"]} if isinstance(t.get("description"), str) else {})}
        out.append({"type": "function", "function": fn})
    return out, dropped


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """``tool_choice`` as chat's, and whether parallel calls are allowed."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidField(f"'tool_choice' must be {{\"type\": auto | any | none | tool}}, got {choice!r}",
                       param="tool_choice")


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi):
        raise InvalidField(f"'{key}' must be a number within [{lo}, {hi}], got {v!r}", param=key)


def system_text(system: Any, normalise_billing: bool) -> str:
    text = _text_of(system, "system")
    return without_nonce(text) if normalise_billing else text


def without_nonce(text: str) -> str:
    """The system prompt with the ``cch=<nonce>`` field of its first line dropped, if that line is Claude Code's
    billing line (string operations: linear in the line, whatever it holds)."""
    if not text.startswith(BILLING):
        return text
    line, nl, rest = text.partition("\n")
    fields = line[len(BILLING):].split(";")
    kept = [f for f in fields if not f.strip().startswith("cch=")]
    if len(kept) == len(fields):
        return text
    return BILLING + ";".join(kept).rstrip() + nl + rest


def to_chat(body: dict[str, Any], normalise_billing: bool = True,
            counting: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The chat body for a Messages request, and the server tools left out of it. ``counting``: for
    count_tokens (no ``max_tokens`` needed)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("'model' is required and must be a string", param="model")
    max_tokens = body.get("max_tokens")
    if not counting and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidField(f"'max_tokens' is required and must be a positive integer, got {max_tokens!r}",
                           param="max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidField("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    if body.get("system") not in (None, "", []):
        out.append({"role": "system", "content": system_text(body["system"], normalise_billing)})
    for i, m in enumerate(msgs):
        _message(i, m, out)
    chat: dict[str, Any] = {"model": model, "messages": out}
    last = out[-1] if out else {}
    if last.get("role") == "assistant" and isinstance(last.get("content"), str) and last["content"] \
            and not last.get("tool_calls"):  # a prefill: the answer continues it (vLLM's and SGLang's chat fields)
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if not counting:
        chat["max_tokens"] = max_tokens
    _number(body, "temperature", 0, 1)
    _number(body, "top_p", 0, 1)
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InvalidField(f"'top_k' must be a non-negative integer, got {top_k!r}", param="top_k")
        chat["top_k"] = top_k
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise InvalidField(f"'stop_sequences' must be a list of at most {MAX_STOP} non-empty strings",
                               param="stop_sequences")
        if stop:
            chat["stop"] = stop
    dropped: list[str] = []
    if body.get("tools"):
        chat["tools"], dropped = _tools(body["tools"])
        if not chat["tools"]:
            del chat["tools"]
    if body.get("tool_choice") is not None and "tools" in chat:
        chat["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if not parallel:
            chat["parallel_tool_calls"] = False
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise InvalidField("'metadata' must be an object", param="metadata")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidField(f"'stream' must be true or false, got {stream!r}", param="stream")
    if stream and not counting:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    for key in ("timeout",):  # pdgate's own: a total budget in the body
        if key in body:
            chat[key] = body[key]
    return chat, dropped


def usage_of(u: Any) -> dict[str, int]:
    """A chat ``usage`` as Anthropic's: ``input_tokens`` are those not read from the cache."""
    u = u if isinstance(u, dict) else {}
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = u.get("prompt_tokens") if isinstance(u.get("prompt_tokens"), int) else 0
    cached = cached if isinstance(cached, int) and 0 <= cached <= prompt else 0
    out = u.get("completion_tokens") if isinstance(u.get("completion_tokens"), int) else 0
    return {"input_tokens": prompt - cached, "output_tokens": out, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def _obj(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _input(args: str) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``input`` is (what does not parse is kept as text)."""
    try:
        v = orjson.loads(args or "{}")
    except orjson.JSONDecodeError:
        return {"_arguments": args}
    return v if isinstance(v, dict) else {"_arguments": v}


def stop_of(choice: dict[str, Any], stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` from a chat choice (vLLM names the matched stop in
    ``stop_reason``, SGLang in ``matched_stop``)."""
    finish = choice.get("finish_reason")
    reason = STOPS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn"
    matched = choice.get("stop_reason", choice.get("matched_stop"))
    if reason == "end_turn" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return reason, None


def message(msg_id: str, model: str) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage_of(None)}


def answer(body: dict[str, Any], chat: bytes, msg_id: str) -> dict[str, Any]:
    """A chat completion as an Anthropic Message."""
    obj = orjson.loads(chat)
    choices = obj.get("choices") if isinstance(obj, dict) else None
    choice = _obj(choices[0]) if isinstance(choices, list) and choices else {}
    msg = _obj(choice.get("message"))
    out = message(msg_id, body.get("model") or "")
    if isinstance(msg.get("content"), str) and msg["content"]:
        out["content"].append({"type": "text", "text": msg["content"]})
    calls = msg.get("tool_calls")
    for i, tc in enumerate(c for c in (calls if isinstance(calls, list) else ())[:MAX_CALLS] if isinstance(c, dict)):
        fn = _obj(tc.get("function"))
        out["content"].append({"type": "tool_use", "id": _str(tc.get("id")) or f"toolu_{msg_id}_{i}",
                               "name": _str(fn.get("name")), "input": _input(_str(fn.get("arguments")))})
    out["stop_reason"], out["stop_sequence"] = stop_of(choice, body.get("stop_sequences") or [])
    if out["stop_reason"] == "end_turn" and any(b["type"] == "tool_use" for b in out["content"]):
        out["stop_reason"] = "tool_use"
    out["usage"] = usage_of(obj.get("usage") if isinstance(obj, dict) else None)
    return out


def event(kind: str, fields: dict[str, Any]) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (kind.encode(), orjson.dumps({"type": kind, **fields}))


def error_event(status: int, message: str) -> bytes:
    return b"event: error\ndata: %b\n\n" % orjson.dumps(error_body(status, message))


class Events(ChatReader):
    """One Messages stream made from the engine's chat stream (``feed``: whole SSE events, as the relay's framer
    cut them) and the gateway's own end of it (``failed``)."""

    __slots__ = ("block", "body", "calls", "ended", "msg", "opened", "stop", "stops", "usage")

    def __init__(self, body: dict[str, Any], msg_id: str) -> None:
        self.body = body
        self.msg = message(msg_id, body.get("model") or "")
        self.stops: list[str] = body.get("stop_sequences") or []
        self.opened = False
        self.ended = False
        self.block = -1  # the open content block's index (-1: none)
        # chat tool call index -> [id, name, argument pieces]: its tool_use block goes out whole at the end (a chat
        # stream may interleave calls' arguments, or text, where Anthropic's blocks cannot be reopened)
        self.calls: dict[int, list[Any]] = {}
        self.stop: tuple[str, str | None] | None = None
        self.usage: dict[str, int] | None = None

    def open(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        return event("message_start", {"message": self.msg}) + event("ping", {})

    def _close(self) -> bytes:
        if self.block < 0:
            return b""
        i, self.block = self.block, -1
        return event("content_block_stop", {"index": i})

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.block = len(self.msg["content"])
        self.msg["content"].append(block)
        return out + event("content_block_start", {"index": self.block, "content_block": block})

    def engine_failed(self, message: str) -> bytes:
        self.ended = True
        return self._close() + error_event(502, message)

    def took(self, usage: Any) -> None:
        self.usage = usage_of(usage)

    def choice(self, choice: dict[str, Any]) -> bytes:
        if choice.get("finish_reason") is not None:
            self.stop = stop_of(choice, self.stops)
        delta = _obj(choice.get("delta"))
        out = []
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.block < 0 or self.msg["content"][self.block]["type"] != "text":
                out.append(self._start({"type": "text", "text": ""}))
            out.append(event("content_block_delta", {"index": self.block,
                                                     "delta": {"type": "text_delta", "text": text}}))
        calls = delta.get("tool_calls")
        for tc in calls if isinstance(calls, list) else ():
            if not isinstance(tc, dict):
                continue
            i = tc.get("index", 0)
            if not isinstance(i, int) or (i not in self.calls and len(self.calls) >= MAX_CALLS):
                continue
            fn = _obj(tc.get("function"))
            call = self.calls.get(i)
            if call is None:
                call = self.calls[i] = [_str(tc.get("id")) or f"toolu_{self.msg['id']}_{i}", _str(fn.get("name")), []]
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                call[2].append(args)
        return b"".join(out)

    def _tool_blocks(self) -> bytes:
        out = []
        for tid, name, pieces in (self.calls[i] for i in sorted(self.calls)):
            out.append(self._start({"type": "tool_use", "id": tid, "name": name, "input": {}}))
            args = "".join(pieces)
            if args:
                out.append(event("content_block_delta", {"index": self.block,
                                                         "delta": {"type": "input_json_delta", "partial_json": args}}))
        return b"".join(out)

    def done(self) -> bytes:
        """The engine's [DONE]: the open block closed, then ``message_delta`` and ``message_stop``."""
        if self.ended:
            return b""
        self.ended = True
        reason, seq = self.stop or ("end_turn", None)
        if reason == "end_turn" and self.calls:
            reason = "tool_use"
        usage = self.usage or usage_of(None)
        self.msg["usage"] = usage
        return (self._tool_blocks() + self._close() + event("message_delta", {"delta": {
            "stop_reason": reason, "stop_sequence": seq}, "usage": usage}) + event("message_stop", {}))

    def failed(self, err: GatewayError) -> bytes:
        """What the gateway ended (deadline, drain, abort, a failed leg): the open block closed, one error event."""
        if self.ended:
            return b""
        self.ended = True
        return self._close() + error_event(err.status, err.message)
