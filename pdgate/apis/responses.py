"""The Responses API (``/v1/responses``) in terms of the engines' chat completions: the request translated to a
chat body, the chat answer (whole, or its SSE events) translated back (``docs/responses.md``: why translate
rather than pass through, and what is supported).

Pure data: no I/O, no clock of its own. ``to_chat`` makes the chat body and the round's messages (what a
continuation by ``previous_response_id`` resends); ``answer`` turns a chat completion into a Response object;
``Events`` turns a chat stream into the Responses event sequence (``response.created``, output items and content
parts, ``response.output_text.delta``, ``response.function_call_arguments.delta``, the ``.done`` events, and one
terminal event: ``response.completed``, ``response.incomplete`` or ``response.failed``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

from pdgate.core.errors import GatewayError, InvalidField

RESPONSES = "/v1/responses"
DROPPED_HEADER = "x-pdgate-tools-dropped"
NS_SEP = "__"  # a namespace's function as the engine knows it: <namespace>__<name>
LOCAL_SHELL = "local_shell"
CALLS = {"function_call": "call_id, name and arguments as strings", "custom_tool_call": "call_id, name and input "
         "as strings", "local_shell_call": "a call_id and an action object"}
OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
# items a client replays that the engines here are not given back (Codex sends them each turn)
REPLAYED = ("reasoning", "web_search_call", "tool_search_call", "tool_search_output", "compaction",
            "compaction_summary", "image_generation_call", "file_search_call", "code_interpreter_call", "item_reference",
            "additional_tools")
ID = re.compile(r"resp_[A-Za-z0-9_.-]{1,160}")  # what a stored response's id may be (never a ':': see store/redis)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# accepted and not acted on (OpenAI's own fields that change nothing an engine does here)
IGNORED = frozenset(("include", "truncation", "reasoning", "prompt_cache_key", "prompt_cache_retention",
                     "safety_identifier", "service_tier", "top_logprobs", "max_tool_calls", "context_management",
                     "prompt_cache_options", "stream_options", "client_metadata"))
PASSED = ("temperature", "top_p", "parallel_tool_calls", "user", "timeout", "seed", "stop", "frequency_penalty",
          "presence_penalty")
MAX_ITEMS = 10_000
MAX_CALLS = 128  # tool calls in one answer (OpenAI's tool limit): an engine that numbers more is not followed


def response_id(request_id: str) -> str:
    """A response's id: its request's (the trace of a request is found by either)."""
    return "resp_" + request_id


def request_id(resp_id: str) -> str | None:
    return resp_id[5:] if resp_id.startswith("resp_") else None


def _text_parts(content: Any, where: str, images: bool) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"'{where}.content' must be a string or a list of content parts", param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal") and isinstance(part.get("text", part.get("refusal")), str):
            parts.append({"type": "text", "text": part.get("text", part.get("refusal"))})
        elif kind == "input_image" and images and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise InvalidField(f"'{where}.content[{j}]' of type {kind!r} is not supported here (text parts"
                               f"{', input_image with image_url' if images else ''})", param=f"{where}.content")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def messages_of(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidField("'input' must be a string or a non-empty list of items", param="input")
    if len(items) > MAX_ITEMS:
        raise InvalidField(f"'input' holds {len(items)} items; at most {MAX_ITEMS}", param="input")
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise InvalidField(f"'{where}' must be an object", param="input")
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = ROLES.get(it.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise InvalidField(f"'{where}.role' must be one of {', '.join(ROLES)}, got {it.get('role')!r}",
                                   param="input")
            out.append({"role": role, "content": _text_parts(it.get("content"), where, role == "user")})
        elif kind in CALLS:
            call = chat_call(it)
            if call is None:
                raise InvalidField(f"'{where}' ({kind}) needs {CALLS[kind]}", param="input")
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant message, as chat has them
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in OUTPUTS:
            call_id, output = it.get("call_id", it.get("id")), it.get("output")
            if not isinstance(call_id, str):
                raise InvalidField(f"'{where}' ({kind}) needs a call_id string", param="input")
            text = output if isinstance(output, str) else _text_parts(output, where, False)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text if isinstance(text, str) else ""})
        elif kind in REPLAYED:
            continue  # a model's reasoning, a built-in tool's turn: nothing the engines here are given back
        else:
            raise InvalidField(f"'{where}' of type {kind!r} is not supported here (message, "
                               f"{', '.join((*CALLS, *OUTPUTS, *REPLAYED))})", param="input")
    return out


def chat_call(it: dict[str, Any]) -> dict[str, Any] | None:
    """A call item (function, a namespace's function, custom, local shell) as a chat tool call, named as the
    engine knows its tool (``engine_tools``); None if it lacks a field."""
    kind, call_id = it.get("type"), it.get("call_id", it.get("id"))
    if not isinstance(call_id, str):
        return None
    if kind == "function_call":
        name, args, ns = it.get("name"), it.get("arguments", ""), it.get("namespace")
        if not (isinstance(name, str) and isinstance(args, str)) or not isinstance(ns, (str, type(None))):
            return None
        flat = f"{ns}{NS_SEP}{name}" if ns else name
    elif kind == "custom_tool_call":
        name, text = it.get("name"), it.get("input", "")
        if not (isinstance(name, str) and isinstance(text, str)):
            return None
        flat, args = name, orjson.dumps({"input": text}).decode()
    else:  # local_shell_call
        action = it.get("action")
        if not isinstance(action, dict):
            return None
        flat, args = LOCAL_SHELL, orjson.dumps({k: v for k, v in action.items() if k != "type"}).decode()
    return {"id": call_id, "type": "function", "function": {"name": flat, "arguments": args}}


def _function(t: dict[str, Any], name: str) -> dict[str, Any]:
    fn = {"name": name, **{k: t[k] for k in ("description", "parameters", "strict") if t.get(k) is not None}}
    return {"type": "function", "function": fn}


def engine_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str, str | None]], list[str]]:
    """The tools as the engine's chat functions; what each function's name stands for (kind, name, namespace);
    and the built-in tools left out (the engines cannot act on them: ``web_search``, ``tool_search``, ...).

    ``function``: itself. ``namespace``: each of its functions, named ``<namespace>__<name>`` for the engine and
    answered as a ``function_call`` with its ``namespace``. ``custom`` (freeform, e.g. Codex's ``apply_patch``):
    a function taking one string, ``input`` (its grammar in the description), answered as a ``custom_tool_call``.
    ``local_shell``: a function taking the exec action's fields, answered as a ``local_shell_call``."""
    if not isinstance(tools, list):
        raise InvalidField("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    names: dict[str, tuple[str, str, str | None]] = {}
    dropped: list[str] = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(t, dict) or not isinstance(kind, str):
            raise InvalidField(f"'tools[{i}]' must be an object with a type", param="tools")
        name = t.get("name")
        if (isinstance(name, str) and kind in ("function", "custom") and name in names) \
                or (kind == "local_shell" and LOCAL_SHELL in names):
            raise InvalidField(f"'tools[{i}]': the name {name or LOCAL_SHELL!r} is given twice (a namespace's "
                               f"functions are named <namespace>{NS_SEP}<name> here)", param="tools")
        if kind == "function" and isinstance(name, str):
            out.append(_function(t, name))
            names[name] = ("function", name, None)
        elif kind == "namespace" and isinstance(name, str) and isinstance(t.get("tools"), list):
            for j, inner in enumerate(t["tools"]):
                if not isinstance(inner, dict) or inner.get("type", "function") != "function" \
                        or not isinstance(inner.get("name"), str):
                    raise InvalidField(f"'tools[{i}].tools[{j}]' must be a function tool", param="tools")
                flat = f"{name}{NS_SEP}{inner['name']}"
                if flat in names:
                    raise InvalidField(f"'tools[{i}].tools[{j}]': the name {flat!r} is given twice (a namespace's "
                                       f"functions are named <namespace>{NS_SEP}<name> here)", param="tools")
                out.append(_function(inner, flat))
                names[flat] = ("function", inner["name"], name)
        elif kind == "custom" and isinstance(name, str):
            fmt = _obj(t.get("format"))
            grammar = fmt.get("definition") if isinstance(fmt.get("definition"), str) else None
            about = _str(t.get("description")) + ("\nThe input is free text" + (
                f" in this {_str(fmt.get('syntax'))} grammar:\n{grammar}" if grammar else "") + ".")
            out.append({"type": "function", "function": {"name": name, "description": about, "parameters": {
                "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}})
            names[name] = ("custom", name, None)
        elif kind == "local_shell":
            out.append({"type": "function", "function": {
                "name": LOCAL_SHELL, "description": "Run a command on the user's machine.", "parameters": {
                    "type": "object", "required": ["command"], "properties": {
                        "command": {"type": "array", "items": {"type": "string"}},
                        "working_directory": {"type": "string"}, "timeout_ms": {"type": "integer"}}}}})
            names[LOCAL_SHELL] = ("local_shell", LOCAL_SHELL, None)
        elif kind in ("function", "namespace", "custom"):
            raise InvalidField(f"'tools[{i}]' of type {kind!r} needs a name" + (" and tools" if kind == "namespace"
                                                                                else ""), param="tools")
        else:
            dropped.append(kind if not isinstance(name, str) else f"{name}:{kind}")
    return out, names, dropped


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return "required" if choice.get("mode") == "required" else "auto"
    raise InvalidField(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, got "
                       f"{choice!r}", param="tool_choice")


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        js = {"name": fmt.get("name") or "response", "schema": fmt["schema"],
              **({"strict": fmt["strict"]} if isinstance(fmt.get("strict"), bool) else {})}
        return {"type": "json_schema", "json_schema": js}
    raise InvalidField("'text.format' must be text, json_object, or json_schema with a schema", param="text.format")


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat body for a Responses request, and this round's input as chat messages (``history``: the stored
    conversation ``previous_response_id`` continues, instructions never carried over, as OpenAI has it)."""
    for key in ("background", "conversation", "prompt"):
        if body.get(key):
            raise InvalidField(f"'{key}' is not supported by this gateway", param=key)
    if "input" not in body:
        raise InvalidField("'input' is required", param="input")
    turn = messages_of(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidField("'instructions' must be a string", param="instructions")
    chat: dict[str, Any] = {"model": body.get("model"),
                            "messages": ([{"role": "system", "content": instructions}] if instructions else [])
                            + history + turn}
    for key in PASSED:
        if key in body and body[key] is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        tools, _, _ = engine_tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        choice = _tool_choice(body["tool_choice"])
        if "tools" in chat:  # every tool left out: no choice to make (an engine refuses one without tools)
            chat["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        if body["stream"] is True:
            chat["stream_options"] = {"include_usage": True}
    store, meta = body.get("store", True), body.get("metadata")
    if not isinstance(store, bool):
        raise InvalidField(f"'store' must be true or false, got {store!r}", param="store")
    if meta is not None and not (isinstance(meta, dict) and len(meta) <= 16
                                 and all(isinstance(v, str) and len(v) <= 512 for v in meta.values())):
        raise InvalidField("'metadata' must be an object of at most 16 string values", param="metadata")
    return chat, turn


def usage_of(u: Any) -> dict[str, Any] | None:
    """A chat ``usage`` as the Responses API's."""
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    inp, out = u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + out}


def shell(body: dict[str, Any], rid: str, created: int, status: str) -> dict[str, Any]:
    """A Response object with what the request asked for, its output still empty."""
    tools = body.get("tools") or []
    return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "model": body.get("model"), "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": body.get("store", True), "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": tools, "top_p": body.get("top_p"), "truncation": body.get("truncation") or "disabled",
            "usage": None, "user": body.get("user")}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


Kinds = dict[str, tuple[str, str, "str | None"]]


def dropped_header(dropped: list[str]) -> dict[str, str]:
    """The tools left out of what the engine sees, named in the answer's head (and in the trace); a client's names,
    so only their printable ASCII goes into a header (``?`` for the rest)."""
    text = ",".join(dropped)[:1000]
    return {DROPPED_HEADER: "".join(c if " " <= c <= "~" else "?" for c in text)} if dropped else {}


def dropped_tools(body: dict[str, Any]) -> list[str]:
    """The built-in tools of the request that the engines are not given (``engine_tools``)."""
    tools = body.get("tools")
    return engine_tools(tools)[2] if isinstance(tools, list) and tools else []


def kinds_of(body: dict[str, Any]) -> Kinds:
    """What each engine function's name stands for, from the request's tools (``engine_tools``)."""
    tools = body.get("tools")
    return engine_tools(tools)[1] if isinstance(tools, list) and tools else {}


def _call(kinds: Kinds, item_id: str, call_id: str, flat: str, args: str, status: str) -> dict[str, Any]:
    """The output item of an engine's call of function ``flat``: a ``function_call`` (with its ``namespace`` when
    the function is one of a namespace's), a ``custom_tool_call`` or a ``local_shell_call``."""
    kind, name, ns = kinds.get(flat, ("function", flat, None))
    if kind == "custom":
        got = _parsed(args)
        text = got.get("input") if isinstance(got.get("input"), str) else args if status == "completed" else ""
        return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name, "input": text,
                "status": status}
    if kind == "local_shell":
        got = _parsed(args)
        cmd = got.get("command")
        action = {"type": "exec", "command": [str(c) for c in cmd] if isinstance(cmd, list) else
                  ([cmd] if isinstance(cmd, str) else []), "working_directory": got.get("working_directory"),
                  "timeout_ms": got.get("timeout_ms"), "env": None, "user": None}
        return {"type": "local_shell_call", "id": item_id, "call_id": call_id, "action": action, "status": status}
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": args,
            "status": status}
    if ns is not None:
        item["namespace"] = ns
    return item


def item_id_kind(kinds: Kinds, flat: str) -> str:
    return kinds.get(flat, ("function", flat, None))[0]


def _parsed(args: str) -> dict[str, Any]:
    try:
        v = orjson.loads(args or "{}")
    except orjson.JSONDecodeError:
        return {}
    return v if isinstance(v, dict) else {}


def finish(resp: dict[str, Any], finish_reason: Any) -> None:
    """Its status from the chat's finish reason: ``length`` is incomplete (max_output_tokens)."""
    if finish_reason == "length":
        resp["status"] = "incomplete"
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"


def answer(body: dict[str, Any], chat: bytes, rid: str, created: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A chat completion as a Response object, and its output as chat messages (for a continuation)."""
    obj = orjson.loads(chat)
    resp = shell(body, rid, created, "completed")
    choices = obj.get("choices") if isinstance(obj, dict) else None
    choice = _obj(choices[0]) if isinstance(choices, list) and choices else {}
    msg = _obj(choice.get("message"))
    base = rid.removeprefix("resp_")
    content, calls = msg.get("content"), msg.get("tool_calls")
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    if isinstance(content, str) and content:
        resp["output"].append(_message("msg_" + base, content, status))
    kinds = kinds_of(body)
    for i, tc in enumerate(c for c in (calls if isinstance(calls, list) else ()) if isinstance(c, dict)):
        fn = _obj(tc.get("function"))
        resp["output"].append(_call(kinds, f"fc_{base}_{i}", _str(tc.get("id")) or f"call_{base}_{i}",
                                    _str(fn.get("name")), _str(fn.get("arguments")), "completed"))
    finish(resp, choice.get("finish_reason"))
    resp["usage"] = usage_of(obj.get("usage") if isinstance(obj, dict) else None)
    return resp, said(resp)


def _obj(v: Any) -> dict[str, Any]:
    """An engine's field as an object (what is not one counts as empty: an engine's garbage loses nothing else)."""
    return v if isinstance(v, dict) else {}


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def said(resp: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a continuation sends back."""
    text = "".join(c["text"] for it in resp["output"] if it["type"] == "message" for c in it["content"])
    calls = [c for it in resp["output"] if it["type"] in CALLS and (c := chat_call(it)) is not None]
    if not text and not calls:
        return [{"role": "assistant", "content": ""}]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def chat_chunks(events: bytes, sep: bytes) -> Iterator[dict[str, Any] | None]:
    """A chat stream's whole SSE events (as the relay's framer cut them) as its chunks, and None for ``[DONE]``; an
    event that is not a JSON object carries nothing to show (the framer judged it)."""
    for ev in events.split(sep):
        data = b"".join(line[5:].lstrip() for line in ev.splitlines() if line.startswith(b"data:"))
        if not data:
            continue
        if data == b"[DONE]":
            yield None
            continue
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(chunk, dict):
            yield chunk


def engine_error(chunk: dict[str, Any]) -> str:
    """What an engine's error event says."""
    e = chunk["error"]
    return str(e.get("message") if isinstance(e, dict) else e)


def first_choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    choices = chunk.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None


class ChatReader:
    """A client protocol's stream made from the engine's chat stream (``Ctx.front``): ``feed`` reads whole SSE
    events and hands each chunk on (``chunk``), the engine's ``[DONE]`` (``done``), its error event
    (``engine_failed``); nothing after the end."""

    ended: bool

    def open(self) -> bytes:
        return b""

    def feed(self, events: bytes, sep: bytes) -> bytes:
        out = [self.open()]
        for chunk in chat_chunks(events, sep):
            if self.ended:
                break
            if chunk is None:
                out.append(self.done())
            elif chunk.get("error") is not None:
                out.append(self.engine_failed(f"the engine reported: {engine_error(chunk)}"))
            else:
                out.append(self.chunk(chunk))
        return b"".join(out)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if chunk.get("usage"):
            self.took(chunk["usage"])
        choice = first_choice(chunk)
        return b"" if choice is None else self.choice(choice)

    def took(self, usage: Any) -> None:
        """The engine's usage (its last chunk, with ``stream_options.include_usage``)."""
        raise NotImplementedError

    def choice(self, choice: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def done(self) -> bytes:
        raise NotImplementedError

    def engine_failed(self, message: str) -> bytes:
        raise NotImplementedError


def event(kind: str, seq: int, fields: dict[str, Any]) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (kind.encode(), orjson.dumps({"type": kind, "sequence_number": seq, **fields}))


def error_of(err: GatewayError) -> dict[str, Any]:
    return {"code": err.code, "message": err.message}


class Events(ChatReader):
    """One Responses stream, made from the engine's chat stream (``feed``: whole SSE events, as the relay's framer
    cut them) and the gateway's own ends (``failed``). The terminal event of a success is held in ``final`` until
    the route has stored the response (a client that continues at once finds it)."""

    __slots__ = ("base", "body", "calls", "ended", "final", "finish_reason", "kinds", "msg_index", "next_index",
                 "opened", "pieces", "resp", "seq", "usage")

    def __init__(self, body: dict[str, Any], rid: str, created: int) -> None:
        self.body = body
        self.kinds = kinds_of(body)
        self.resp = shell(body, rid, created, "in_progress")
        self.base = rid.removeprefix("resp_")
        self.seq = 0
        self.opened = False  # response.created went out
        self.pieces: list[str] = []  # the message's text so far
        self.msg_index = -1  # its output index (-1: no message item yet)
        self.next_index = 0
        self.calls: dict[int, list[Any]] = {}  # chat tool call index -> [output index, item id, call id, name, args]
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.final = b""  # response.completed / response.incomplete, sent by the route once stored
        self.ended = False  # a terminal event went out (or is held in final)

    def _ev(self, kind: str, **fields: Any) -> bytes:
        out = event(kind, self.seq, fields)
        self.seq += 1
        return out

    def open(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        return self._ev("response.created", response=self.resp) + self._ev("response.in_progress", response=self.resp)

    def engine_failed(self, message: str) -> bytes:
        return self._failed({"code": "engine_error", "message": message})

    def took(self, usage: Any) -> None:
        self.usage = usage_of(usage)

    def choice(self, choice: dict[str, Any]) -> bytes:
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        delta = _obj(choice.get("delta"))
        out = []
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.msg_index < 0:
                self.msg_index = self.next_index
                self.next_index += 1
                item = _message("msg_" + self.base, "", "in_progress")
                item["content"] = []
                out.append(self._ev("response.output_item.added", output_index=self.msg_index, item=item))
                out.append(self._ev("response.content_part.added", item_id="msg_" + self.base,
                                    output_index=self.msg_index, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            self.pieces.append(text)
            out.append(self._ev("response.output_text.delta", item_id="msg_" + self.base, output_index=self.msg_index,
                                content_index=0, delta=text, logprobs=[]))
        calls = delta.get("tool_calls")
        for tc in calls if isinstance(calls, list) else ():
            if not isinstance(tc, dict):
                continue
            i = tc.get("index", 0)
            if not isinstance(i, int) or (len(self.calls) >= MAX_CALLS and i not in self.calls):
                continue
            fn = _obj(tc.get("function"))
            call = self.calls.get(i)
            if call is None:
                item_id = f"fc_{self.base}_{i}"
                call = self.calls[i] = [self.next_index, item_id, _str(tc.get("id")) or f"call_{self.base}_{i}",
                                        _str(fn.get("name")), []]
                self.next_index += 1
                out.append(self._ev("response.output_item.added", output_index=call[0],
                                    item=_call(self.kinds, item_id, call[2], call[3], "", "in_progress")))
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                call[4].append(args)
                if item_id_kind(self.kinds, call[3]) == "function":  # a custom or shell call's input comes whole
                    out.append(self._ev("response.function_call_arguments.delta", item_id=call[1],
                                        output_index=call[0], delta=args))
        return b"".join(out)

    def done(self) -> bytes:
        """The engine's [DONE]: every item closed; the terminal event held in ``final``."""
        if self.ended:
            return b""
        self.ended = True
        out = []
        items: list[tuple[int, dict[str, Any]]] = []
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if self.msg_index >= 0:
            text = "".join(self.pieces)
            mid = "msg_" + self.base
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._ev("response.output_text.done", item_id=mid, output_index=self.msg_index, content_index=0,
                                text=text, logprobs=[]))
            out.append(self._ev("response.content_part.done", item_id=mid, output_index=self.msg_index,
                                content_index=0, part=part))
            item = _message(mid, text, status)
            out.append(self._ev("response.output_item.done", output_index=self.msg_index, item=item))
            items.append((self.msg_index, item))
        for index, item_id, call_id, name, pieces in self.calls.values():
            args = "".join(pieces)
            item = _call(self.kinds, item_id, call_id, name, args, "completed")
            if item["type"] == "function_call":
                out.append(self._ev("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                    name=item["name"], arguments=args))
            elif item["type"] == "custom_tool_call":
                out.append(self._ev("response.custom_tool_call_input.done", item_id=item_id, output_index=index,
                                    input=item["input"]))
            out.append(self._ev("response.output_item.done", output_index=index, item=item))
            items.append((index, item))
        resp = self.resp
        resp["output"] = [it for _, it in sorted(items, key=lambda x: x[0])]
        resp["usage"] = self.usage
        finish(resp, self.finish_reason)
        self.final = self._ev("response." + resp["status"], response=resp)
        return b"".join(out)

    def _failed(self, error: dict[str, Any]) -> bytes:
        self.ended = True
        resp = self.resp
        resp["status"], resp["error"], resp["usage"] = "failed", error, self.usage
        return self._ev("response.failed", response=resp)

    def failed(self, err: GatewayError) -> bytes:
        """What the gateway ended (deadline, drain, abort, a leg that failed): ``response.failed`` naming why."""
        if self.ended and not self.final:
            return b""
        self.final = b""
        return self.open() + self._failed(error_of(err))
