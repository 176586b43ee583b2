"""A test client for the gateway's streams: every SSE event with the time it arrived, framed by blank lines.

Chat, completions and ``/generate`` streams end with ``[DONE]`` and carry errors as ``{"error": ...}`` events; a
Responses stream (``/v1/responses``) ends with one terminal event (``response.completed``, ``.incomplete`` or
``.failed``, whose ``response.error`` is the error) and its tokens are ``response.output_text.delta`` events; a
Messages stream (``/v1/messages``) ends with ``message_stop`` or one ``error`` event, its tokens are ``text_delta``
events. ``Seen`` reads all three."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

RESPONSE_EVENT = b'{"type":"response.'
# Anthropic's Messages stream (/v1/messages): ends with message_stop, or an error event; text in text_delta events
MESSAGES_FIRST = (b'{"type":"message_start"', b'{"type":"error"')
MESSAGES_END = (b'{"type":"message_stop"', b'{"type":"error"')
MESSAGES_ERROR = b'{"type":"error"'
MESSAGES_DELTA = b'{"type":"content_block_delta","index":'
# Anthropic's error types back to the gateway's codes the checks name (the message says the rest)
ANTHROPIC_CODES = {"timeout_error": "deadline_exceeded", "invalid_request_error": "invalid_request",
                   "not_found_error": "not_found", "rate_limit_error": "rate_limit_exceeded"}


def anthropic_error(err: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic error object as the checks read errors: a ``code`` (from its type and words) and its message."""
    kind, msg = err.get("type"), str(err.get("message", ""))
    code = ANTHROPIC_CODES.get(kind)  # type: ignore[arg-type]
    if code is None:
        low = msg.lower()
        code = ("gateway_draining" if "drain" in low or "gateway stopped" in low else
                "request_aborted" if "abort" in low else str(kind))
    return {"code": code, "message": msg, "type": kind}
TERMINAL = tuple(b'{"type":"response.%b"' % k for k in (b"completed", b"incomplete", b"failed"))
FAILED = b'{"type":"response.failed"'
DELTA = b'{"type":"response.output_text.delta"'


@dataclass
class Seen:
    """What one client saw of one request."""

    status: int = 0
    rid: str | None = None
    sent_at: float = 0.0
    events: list[tuple[float, bytes]] = field(default_factory=list)  # (monotonic time, data of the event)
    body: bytes = b""  # a non-SSE answer
    ended_at: float | None = None
    error: str | None = None  # the connection failed (or we left)

    @property
    def responses(self) -> bool:
        """A Responses stream (its events are typed ``response.*``)."""
        return bool(self.events) and self.events[0][1].startswith(RESPONSE_EVENT)

    @property
    def messages(self) -> bool:
        """An Anthropic Messages stream (``message_start``, or the gateway's one ``error`` event)."""
        return bool(self.events) and self.events[0][1].startswith(MESSAGES_FIRST)

    @property
    def done_count(self) -> int:
        if self.responses:
            return sum(1 for _, d in self.events if d.startswith(TERMINAL))
        if self.messages:
            return sum(1 for _, d in self.events if d.startswith(MESSAGES_END))
        return sum(1 for _, d in self.events if d == b"[DONE]")

    def is_done(self, data: bytes) -> bool:
        if self.messages:
            return data.startswith(MESSAGES_END)
        return data.startswith(TERMINAL) if self.responses else data == b"[DONE]"

    @property
    def error_events(self) -> list[dict[str, Any]]:
        if self.responses:
            return [orjson.loads(d)["response"]["error"] for _, d in self.events if d.startswith(FAILED)]
        if self.messages:
            return [anthropic_error(orjson.loads(d)["error"]) for _, d in self.events if d.startswith(MESSAGES_ERROR)]
        out = []
        for _, d in self.events:
            if d.startswith(b'{"error"'):
                out.append(orjson.loads(d)["error"])
        return out

    @property
    def tokens(self) -> list[float]:
        """Arrival times of the data events that are tokens (not an error, not [DONE]; a Responses stream's text
        deltas)."""
        if self.responses:
            return [t for t, d in self.events if d.startswith(DELTA)]
        if self.messages:
            return [t for t, d in self.events if d.startswith(MESSAGES_DELTA) and b'"text_delta"' in d]
        return [t for t, d in self.events if d != b"[DONE]" and not d.startswith(b'{"error"')]

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


def parse_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Whole events' data fields, and what is left (an incomplete event)."""
    out = []
    while True:
        i = buf.find(b"\n\n")
        if i < 0:
            return out, buf
        ev, buf = buf[:i], buf[i + 2:]
        for line in ev.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:])


async def call(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
               leave_after: int | None = None, read_delay: float = 0.0) -> Seen:
    """POST and read the answer; for a stream, every event as it arrives. ``leave_after``: close the
    connection after that many events (0: right after the headers); ``read_delay``: sleep between reads."""
    seen = Seen(sent_at=time.monotonic())
    try:
        async with http.post(url, json=body, headers=headers or {}) as r:
            seen.status = r.status
            seen.rid = r.headers.get("x-request-id")
            if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                if leave_after == 0:
                    seen.error = "left"
                    return seen
                buf = b""
                async for chunk in r.content.iter_any():
                    now = time.monotonic()
                    evs, buf = parse_events(buf + chunk)
                    seen.events.extend((now, e) for e in evs)
                    if leave_after is not None and len(seen.events) >= leave_after:
                        seen.error = "left"
                        return seen
                    if read_delay:
                        await asyncio.sleep(read_delay)
                if buf:
                    seen.error = f"stream ended inside an event: {buf[:80]!r}"
            else:
                seen.body = await r.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        seen.error = f"{exc.__class__.__name__}: {exc}"
    finally:
        seen.ended_at = time.monotonic()
    return seen
