"""What the sim model answers to an agent's OpenAI requests: tool calls and JSON, by deterministic rules.

Tool calls (``tools`` on /v1/chat/completions):
- ``tool_choice`` ``"none"``: text, as without tools.
- ``{"type": "function", "function": {"name": X}}``: a call of X.
- ``"required"``: a call of the tool named in the last user message, else of the first tool.
- ``"auto"`` (the default): a call when the last message is the user's (of the tool it names, else the first
  tool; system messages after it do not count); after a ``tool`` message (the result came back, whatever user
  text follows it in the same turn) or anything else, a text answer. So an agent loop goes: user asks -> tool
  call -> tool result -> answer -> user asks again ...
- The arguments are a JSON object made from the function's ``parameters`` schema (``value_for``): every
  property (only the ``required`` ones where it names some), a string's ``enum[0]`` or a word, whole numbers
  within ``minimum``/``maximum``, booleans false (an agent's optional switches stay off: no background run, no
  sandbox bypass), one item per array. A string
  property named as a command or a path (``FILLED``) takes the first `backticked` text of the user's last
  message, if it has one: "run `ls` with Bash" calls Bash with ``{"command": "ls", ...}``, so an agent's tool
  round trip does something real. Streamed as OpenAI does: the first delta names the call, later ones carry
  argument pieces, ``finish_reason`` is ``tool_calls`` (``length`` if ``max_tokens`` cut the arguments short).

JSON (``response_format``): ``json_object`` gives ``{"answer": "<words>"}``, always valid (the words shrink to
fit ``max_tokens``); ``json_schema`` gives a value of its schema (valid unless ``max_tokens`` cuts it).

The answer is a fixed list of tokens (``Script``) that both legs compute from the same body: the prefill
emits the first, the decode the rest, as for any output.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from engine.sim.text import WORDS

PIECE = 8  # characters of JSON per output token
MAX_TOOLS = 128  # OpenAI's limit
MAX_JSON_WORDS = 4096  # json_object: a larger max_tokens ends the object sooner (finish_reason stop)
NAME_SCAN_CHARS = 4096  # the part of the user's message searched for a tool's name
MAX_DEPTH = 4  # nested schemas deeper than this are answered with null (a hostile schema cannot recurse forever)


class BadRequest(ValueError):
    """A tools or response_format field OpenAI would refuse (400)."""


@dataclass(frozen=True)
class Script:
    tokens: tuple[str, ...]
    call: dict[str, str] | None = None  # a tool call: id and function name (the arguments are the tokens)


def _pieces(text: str) -> tuple[str, ...]:
    return tuple(text[i:i + PIECE] for i in range(0, len(text), PIECE)) or ("",)


FILLED = frozenset(("cmd", "command", "file_path", "path", "input"))  # string properties a `snippet` fills
TICKED = re.compile(r"`([^`\n]{1,400})`")


def value_for(schema: Any, rng: random.Random, depth: int = 0, fill: str | None = None) -> Any:
    """A value that fits a JSON schema (the common keywords; anything else is answered with a word); ``fill``:
    the value of a string property named in ``FILLED``."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return value_for(schema[key][0], rng, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required")
        if isinstance(required, list) and required:  # a model leaves optional properties out
            props = {k: v for k, v in props.items() if k in required}
        return {str(k): fill if fill is not None and k in FILLED and isinstance(v, dict) and v.get("type") == "string"
                else value_for(v, rng, depth + 1) for k, v in list(props.items())[:32]}
    if kind == "array":
        return [value_for(schema.get("items"), rng, depth + 1)]
    if kind == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 100)
        lo, hi = (int(lo), int(hi)) if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else (0, 100)
        return rng.randint(lo, max(lo, hi))
    if kind == "number":  # a whole number, as models mostly write one (and a client may read it as an integer)
        return rng.randint(0, 100)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return " ".join(rng.choice(WORDS) for _ in range(2))


def _named(tools: list[dict[str, Any]], text: str) -> dict[str, Any]:
    text = text[:NAME_SCAN_CHARS]
    for t in tools:
        if t["function"]["name"] in text:
            return t
    return tools[0]


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise BadRequest("'tools' must be a non-empty list")
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
    return tools


def script_for(body: dict[str, Any], prompt: str, max_tokens: int) -> Script | None:
    """The scripted answer to a chat request, or None for free text (module docstring)."""
    rng = random.Random(zlib.crc32(prompt.encode()))
    tools = body.get("tools")
    if tools not in (None, []):
        tools = _check_tools(tools)
        choice = body.get("tool_choice") or "auto"
        msgs = [m for m in body.get("messages") or () if not (isinstance(m, dict) and m.get("role") == "system")]
        last = msgs[-1] if msgs and isinstance(msgs[-1], dict) else {}
        turn = []  # what came after the assistant's last message
        for m in reversed(msgs):
            if not isinstance(m, dict) or m.get("role") == "assistant":
                break
            turn.append(m.get("role"))
        answered = "tool" in turn  # a tool's result came back (a client may add text after it in the same turn)
        last_user = next((str(m.get("content") or "") for m in reversed(msgs) if isinstance(m, dict)
                          and m.get("role") == "user"), "")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
            tool = next((t for t in tools if t["function"]["name"] == name), None)
            if tool is None:
                raise BadRequest(f"tool_choice names function {name!r}, which is not in 'tools'")
        elif choice == "required" or (choice == "auto" and last.get("role") == "user" and not answered):
            tool = _named(tools, last_user)
        elif choice in ("auto", "none"):
            tool = None
        else:
            raise BadRequest(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
        if tool is not None:
            fn = tool["function"]
            ticked = TICKED.search(last_user[:NAME_SCAN_CHARS]) if choice != "none" else None
            args = value_for(fn.get("parameters") or {"type": "object", "properties": {}}, rng, 0,
                             ticked.group(1) if ticked else None)
            call_id = f"call_{zlib.crc32((prompt + fn['name']).encode()):08x}{rng.getrandbits(64):016x}"
            return Script(_pieces(orjson.dumps(args).decode()), {"id": call_id, "name": fn["name"]})
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        if max_tokens < 3:
            return Script(("{}",))
        ws = [rng.choice(WORDS) for _ in range(min(max_tokens, MAX_JSON_WORDS) - 2)]
        return Script(('{"answer": "', ws[0], *(" " + w for w in ws[1:]), '"}'))
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("response_format.json_schema must be {'name': ..., 'schema': {...}}")
        return Script(_pieces(orjson.dumps(value_for(spec.get("schema") or {"type": "object"}, rng)).decode()))
    raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
