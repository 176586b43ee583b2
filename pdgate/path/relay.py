"""The relay: decode's SSE stream to the client, decided per event, never per read.

``Framer`` keeps state across TCP reads: an event is recognised only when its blank line
(``\\n\\n``, or ``\\r\\n\\r\\n`` for a CRLF stream) has arrived, so a ``[DONE]``, an error event or a
token split across reads is judged once, whole (SMG's ``chunk_contains_done_event`` exists for
the same reason: "a sentinel split across chunks is never treated as terminal").

What arrives is relayed as it arrives, unchanged: every whole event in a read goes to the client
in that read's one write. Only an event still incomplete at the end of a read is held until its
end comes (usually the next read): forwarding half an event would let a terminal event that the
gateway writes itself (deadline, drain, a decode that died) land in the middle of the engine's,
and the client would get neither.

The relay runs inside the upstream connection's ``data_received`` (``resp.pipe``): one client
write per engine read and no task switch per token. It opens the client's stream itself, at the first event.
How an engine's terminal events look is its adapter's (``Engine.done_event``, ``error_event``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdgate.adapters.upstream import Answer
from pdgate.core.config import Role
from pdgate.core.errors import UpstreamError, UpstreamStatus, detail_of
from pdgate.core.record import Observer, first_token
from pdgate.pool.workers import State

DEGRADED = State.DEGRADED

if TYPE_CHECKING:
    from pdgate.core.record import Attempt
    from pdgate.path.context import Ctx
    from pdgate.pool.workers import Worker

ERROR = b'data: {"error"'
DONE = b"data: [DONE]"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Framer:
    """Splits an SSE byte stream into whole events. ``push`` returns the whole events that a read
    completed (bytes as received) and sets, for them: ``tokens`` (data events that are neither
    an error nor ``[DONE]``), ``error`` / ``first_error`` (an error event among them / as the very
    first event of the stream), ``done`` (the ``[DONE]`` event came; nothing after it is passed on)."""

    __slots__ = ("done", "done_ev", "done_mark", "error", "error_ev", "error_mark", "first_error", "sep", "sep_done",
                 "tail", "tokens")

    def __init__(self, done: bytes = DONE, error: bytes = ERROR) -> None:
        self.done_mark, self.error_mark = done, error
        self.tail = b""
        self.sep = b""  # b"\n\n" or b"\r\n\r\n", fixed by the first event
        # made once with the separator (every read is looked at for them): an error event after another event,
        # the [DONE] event, and [DONE] after another event
        self.error_ev = self.done_ev = self.sep_done = b""
        self.tokens = 0
        self.error = False
        self.first_error = False
        self.done = False

    def push(self, chunk: bytes) -> bytes:
        self.tokens = 0
        self.error = self.first_error = False
        if self.done:
            return b""
        first = not self.sep
        if self.tail:
            chunk = self.tail + chunk
            self.tail = b""
        sep = self.sep or self._sep(chunk)
        if not sep:  # no event has ended yet
            self.tail = chunk
            return b""
        if not chunk.endswith(sep):  # the common case (one whole event per read) skips the search for the end
            end = chunk.rfind(sep)
            if end < 0:
                self.tail = chunk
                return b""
            end += len(sep)
            chunk, self.tail = chunk[:end], chunk[end:]
        if self.done_mark in chunk:  # a cheap look first: is there anything like [DONE] at all
            done_at = self._done_at(chunk)
            if done_at >= 0:
                self.done = True
                self.tail = b""
                chunk = chunk[:done_at]
                errors = self._errors(chunk)
                self.first_error = first and chunk.startswith(self.error_mark)
                self.error = errors > 0
                self.tokens = chunk.count(sep) - errors - 1
                return chunk
        errors = self._errors(chunk)
        if errors:
            self.first_error = first and chunk.startswith(self.error_mark)
            self.error = True
        self.tokens = chunk.count(sep) - errors
        return chunk

    def _errors(self, chunk: bytes) -> int:
        if self.error_mark not in chunk:  # a cheap look first (a scan in C), as for [DONE]
            return 0
        return chunk.count(self.error_ev) + chunk.startswith(self.error_mark)

    def _sep(self, data: bytes) -> bytes:
        lf, crlf = data.find(b"\n\n"), data.find(b"\r\n\r\n")
        if crlf >= 0 and (lf < 0 or crlf < lf):
            self.sep = b"\r\n\r\n"
        elif lf >= 0:
            self.sep = b"\n\n"
        if self.sep:
            self.error_ev, self.done_ev = self.sep + self.error_mark, self.done_mark + self.sep
            self.sep_done = self.sep + self.done_ev
        return self.sep

    def _done_at(self, chunk: bytes) -> int:
        """The end of the ``[DONE]`` event in ``chunk`` (an event of its own), or -1."""
        if chunk.startswith(self.done_ev):
            return len(self.done_ev)
        i = chunk.find(self.sep_done)
        return -1 if i < 0 else i + len(self.sep_done)


class Relay:
    __slots__ = ("att", "clock", "ctx", "framer", "transitions", "upstream", "w")

    def __init__(self, ctx: Ctx, att: Attempt, w: Worker, upstream: Answer, clock: Callable[[], float],
                 transitions: tuple[Observer, ...]) -> None:
        self.ctx, self.att, self.w, self.upstream = ctx, att, w, upstream
        self.framer = Framer(w.adapter.done_event, w.adapter.error_event)
        self.clock = clock  # one call per read
        self.transitions = transitions  # the record's observers (the first token moves it to decode)

    def feed(self, chunk: bytes) -> None:
        fr = self.framer
        events = fr.push(chunk)
        if not events:
            return
        ctx, w = self.ctx, self.w
        now = self.clock()
        out = ctx.resp
        if out is None:
            if fr.first_error:  # failed before anything reached the client: retryable
                detail = detail_of(events[6:].split(fr.sep, 1)[0])
                raise UpstreamStatus(f"decode worker {w.id} failed: {detail}", role=Role.DECODE, worker=w.id,
                                     upstream_status=500)
            rec = ctx.rec
            self.att.event(now, "first_token")
            if first_token(rec, now, self.transitions):
                ctx.watchdog.rearm()  # the budget due next is now idle, not TTFT
            rec.bytes_sent = True
            out = ctx.resp = ctx.request.open_stream(200, {**SSE_HEADERS, "x-request-id": rec.id, **(
                ctx.front.headers if ctx.front is not None else {})})
        if fr.error:
            ctx.stream_error = "decode reported an error mid-stream"
        if fr.done:
            ctx.done = True
        if fr.tokens:
            rec = ctx.rec
            rec.chunks += fr.tokens
            rec.last_token_at = now
        w.last_progress = now  # Worker.progress, inlined for the one case of every read
        if w.state is DEGRADED:
            w.progress(now)
        if ctx.front is not None:  # the client speaks another protocol (/v1/responses)
            events = ctx.front.feed(events, fr.sep)
        out.send(events)
        if out.blocked:  # back-pressure: stop reading the decode until the client takes more
            self.upstream.pause()
            out.on_writable(self.upstream.resume)


async def relay_stream(ctx: Ctx, att: Attempt, w: Worker, resp: Answer, clock: Callable[[], float],
                       transitions: tuple[Observer, ...]) -> None:
    """Relay decode's SSE events as they come; when the client's socket is full, reading from the
    decode pauses until it drains. A stream that ends before ``[DONE]`` is a failed leg."""
    relay = Relay(ctx, att, w, resp, clock, transitions)
    await resp.pipe(relay.feed)
    att.event(clock(), "decode_done", ctx.rec.chunks)
    if not relay.framer.done:
        raise UpstreamError(f"decode worker {w.id} closed the stream before [DONE]", role=Role.DECODE, worker=w.id)
