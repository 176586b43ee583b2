"""A lean HTTP/1.1 server: pdgate's front door and the sims' HTTP surface; asyncio protocols, httptools parsing.

aiohttp's server costs ~200 µs of CPU per request on this kind of machine, more than the
whole budget pdgate has for a PD request. This one keeps what a gateway needs, held to what
uvicorn's ``httptools_impl`` and aiohttp do:
- keep-alive and pipelining: requests on a connection are answered in order, reading pauses as
  soon as one waits behind the answer in progress, and the loop gets a turn between answers;
- bounds and times: the request head is bounded while it arrives (431), a head and a body must
  arrive within their timeouts (408: slowloris), idle connections close after ``keepalive_s``;
  a ``Content-Length`` over the limit is a 413 at once, without reading the body;
- ``Expect: 100-continue`` answered when the body is wanted (never inside another answer), 417
  for other expectations;
- back-pressure on every answer (``await stream.write()`` waits while the client's socket
  buffer is full; ``send()`` + ``on_writable`` for callers that cannot wait); TCP_NODELAY;
- HEAD answered by the GET handler without a body (streams too); an error after a stream's head
  ends it (an SSE error event and the terminator, or a cut), never a second status line;
  ``Date`` on every answer; response headers checked for control characters;
- the handler cancelled when the client goes away, as aiohttp does with ``handler_cancellation``
  (or told, through ``Request.on_gone``, when it ends its work through a cancel scope of its own).
Routing is a dict of exact paths plus ``/prefix/{id}[/suffix]`` patterns.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import httptools
import orjson

from h1lite.errors import HTTPError, NotFound, PayloadTooLarge, ProtocolError, error_json

log = logging.getLogger("h1lite.server")

MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100  # as aiohttp (max_headers) and h11
LINGER_S = 1.0  # after refusing a request whose bytes still arrive: read and drop them this long, then close
# Pipelining: at most this many requests wait parsed behind the one being answered; what a read brought beyond is
# kept unparsed until they are answered, and a read is parsed about this many bytes at a time, cut after a head's
# end (a read of 256 KiB of tiny requests is thousands of them: parsed at once, they would hold the loop for all)
PIPELINED = 32
PARSE_PIECE = 4096
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
REASONS[499] = b"Client Closed Request"


def error_response(exc: HTTPError) -> Response:
    return Response(error_json(exc), exc.status, headers=exc.headers)


class Request:
    __slots__ = ("_query", "body", "failed", "headers", "keep_alive", "match", "method", "on_gone", "path", "proto",
                 "query_string", "started", "state", "stream", "too_large", "version")

    def __init__(self, proto: HttpProtocol, method: str, path: str, query_string: str, headers: dict[str, str],
                 version: str) -> None:
        self.proto = proto
        self.method, self.path, self.query_string = method, path, query_string
        self.headers = headers  # lower-case names; a repeated header keeps its last value
        self.version = version
        self.body = b""
        self.match: dict[str, str] = {}
        self.keep_alive = True
        self.too_large = False
        self.failed: HTTPError | None = None  # refused before any handler runs (417)
        self.stream: Stream | None = None  # the answer, once its head went out
        self._query: dict[str, str] | None = None
        # called instead of cancelling the handler task when the client goes away (a handler that ends
        # its work through its own cancel scope sets it)
        self.on_gone: Callable[[], object] | None = None
        self.state: Any = None  # what the application's middleware learned about the request (who sent it)
        self.started = 0.0  # when its first byte was parsed (time.monotonic)

    @property
    def query(self) -> dict[str, str]:
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task that answers it (its connection's handler)."""
        return self.proto.task

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.proto.loop

    def open_stream(self, status: int, headers: dict[str, str]) -> Stream:
        """Send the status line and headers now; the body follows in ``write()`` or ``send()`` calls."""
        self.stream = Stream(self, status, headers)
        return self.stream


class Response:
    __slots__ = ("body", "headers", "status")

    def __init__(self, body: bytes = b"", status: int = 200, content_type: str = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        self.body, self.status = body, status
        self.headers = {"Content-Type": content_type, **(headers or {})}


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers=headers)


class ClientGone(ConnectionError):
    """The client closed its connection while we were writing to it."""


class Stream:
    """A streamed (chunked) answer; ``HTTP/1.0`` clients get it unchunked, then the connection closes."""

    __slots__ = ("chunked", "ended", "headless", "proto", "req", "sse")

    def __init__(self, req: Request, status: int, headers: dict[str, str]) -> None:
        self.req, self.proto = req, req.proto
        self.chunked = req.version != "1.0"
        if not self.chunked:
            req.keep_alive = False
        self.ended = False
        self.headless = req.method == "HEAD"  # the head only: a body is never sent
        self.sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers.items())
        extra = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
        self.proto.write(head(status, headers, extra, req.keep_alive))

    def send(self, data: bytes) -> None:
        """Write without waiting; the caller checks ``blocked`` (and ``on_writable``) for back-pressure."""
        proto = self.proto
        if proto.closed:
            raise ClientGone("client closed the connection")
        if data and not self.headless and proto.transport is not None:  # HttpProtocol.write, inlined: once a token
            proto.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    @property
    def blocked(self) -> bool:
        return self.proto.paused

    def on_writable(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the client's socket takes data again."""
        self.proto.on_writable = callback

    async def write(self, data: bytes) -> None:
        self.send(data)
        await self.drain()

    async def drain(self) -> None:
        proto = self.proto
        if proto.closed:
            raise ClientGone("client closed the connection")
        if proto.paused:
            await proto.wait_writable()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            if self.chunked and not self.proto.closed and not self.headless:
                self.proto.write(b"0\r\n\r\n")

    def fail(self, resp: Response | Stream) -> bool:
        """The handler failed after this stream's head went out (``resp`` is the error it would have sent):
        an SSE stream gets the error as an event and then its end; any other is cut (closed), since its
        body cannot say so. Never a second status line. Returns whether the connection can be kept."""
        if self.ended or self.proto.closed:
            return False
        if self.sse and isinstance(resp, Response) and not self.headless:
            self.send(b"data: " + resp.body + b"\n\n")
            self.end()
            return True
        self.ended = True
        return False


_date: list[Any] = [0, b""]  # (second, b"Date: ...\r\n"), made once a second


def date_line() -> bytes:
    now = int(time.time())
    if _date[0] != now:
        _date[0], _date[1] = now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return cast(bytes, _date[1])


BAD_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # uvicorn's HEADER_VALUE_RE: no CR, LF or other controls
BAD_OTHER = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # the same but CR and LF (counted apart)


def head(status: int, headers: dict[str, str], extra: bytes, keep_alive: bool) -> bytes:
    """The status line and headers. A header name or value with CR, LF or another control character is a
    ``ValueError`` (it would split the response: header injection)."""
    block = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    # every answer passes here: one look at the whole block, not two per header. It holds exactly one CR and
    # one LF per header (ours) and no other control character, or a name or value carried one.
    n = len(headers)
    if BAD_OTHER.search(block) or block.count("\r") != n or block.count("\n") != n:
        bad = next((k, v) for k, v in headers.items() if BAD_HEADER.search(k) or BAD_HEADER.search(v))
        raise ValueError(f"invalid response header {bad[0]!r}: {bad[1]!r}")
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, REASONS.get(status, b"Unknown")), date_line(), block.encode()]
    if not keep_alive:
        lines.append(b"Connection: close\r\n")
    lines.append(extra)
    lines.append(b"\r\n")
    return b"".join(lines)


Handler = Callable[[Request], Awaitable["Response | Stream"]]


class Router:
    """Exact paths, and patterns with ``{name}`` segments (no slash inside a segment)."""

    def __init__(self) -> None:
        self.exact: dict[str, dict[str, Handler]] = {}
        self.patterns: list[tuple[re.Pattern[str], dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        if "{" not in path:
            self.exact.setdefault(path, {})[method] = handler
            return
        rx = re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path)) + "$")
        for p, methods in self.patterns:
            if p.pattern == rx.pattern:
                methods[method] = handler
                return
        self.patterns.append((rx, {method: handler}))

    def paths(self) -> list[str]:
        """Every path this router serves (patterns as written, ``{name}`` for a segment), sorted."""
        shown = [re.sub(r"\(\?P<(\w+)>\[\^/\]\+\)", r"{\1}", rx.pattern[1:-1]).replace("\\", "")
                 for rx, _ in self.patterns]
        return sorted({*self.exact, *shown})

    def resolve(self, req: Request) -> Handler:
        methods = self.exact.get(req.path)
        if methods is None:
            for rx, m in self.patterns:
                hit = rx.match(req.path)
                if hit is not None:
                    req.match = {k: unquote(v) for k, v in hit.groupdict().items()}
                    methods = m
                    break
        if methods is None:
            raise NotFound(f"{req.method} {req.path}: Not Found; served here: {', '.join(self.paths())}")
        handler = methods.get(req.method) or (methods.get("GET") if req.method == "HEAD" else None)
        if handler is None:
            raise ProtocolError(405, f"{req.method} {req.path}: Method Not Allowed (allowed: {', '.join(sorted(methods))})",
                            "method_not_allowed")
        return handler

    def dispatch(self, req: Request) -> Awaitable[Response | Stream]:
        """The handler's answer for ``req`` (to be awaited): what a ``Server`` calls when routing is all it needs.
        Not a coroutine of its own: a stream that lasts minutes does not keep one more frame alive."""
        return self.resolve(req)(req)


async def pass_turn() -> None:
    """Let every other ready task and callback run once."""
    await asyncio.sleep(0)


def unix_socket_live(path: str) -> bool:
    """Whether a server accepts on the Unix socket at ``path``."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


class Server:
    """Owns the listening socket, the connections and their reaper."""

    def __init__(self, dispatch: Callable[[Request], Awaitable[Response | Stream]], max_body: int,
                 keepalive_s: float = 75.0, head_timeout_s: float = 10.0, body_timeout_s: float = 60.0,
                 on_error: Callable[[Request, HTTPError], object] | None = None,
                 shape: Callable[[Request, HTTPError], HTTPError] | None = None) -> None:
        self.dispatch = dispatch
        self.on_error = on_error  # told of every request a handler refused (an access log's line)
        self.shape = shape  # an error as the route's clients read it (OpenAI's shape unless it says otherwise)
        self.max_body = max_body
        # uvicorn's timeout_keep_alive is 5 s; nginx's client_header_timeout and client_body_timeout 60 s
        self.keepalive_s, self.head_s, self.body_s = keepalive_s, head_timeout_s, body_timeout_s
        self.conns: set[HttpProtocol] = set()
        self.server: asyncio.AbstractServer | None = None
        self.reaper: asyncio.Task[None] | None = None
        self.draining = False

    async def start(self, host: str, port: int, backlog: int = 1024, reuse_port: bool = False) -> None:
        """Listen on ``host:port`` (port 0: a free one, then read ``self.port``); ``reuse_port``: with
        ``SO_REUSEPORT``, beside other processes listening on the same port (the kernel spreads connections)."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: HttpProtocol(self), host, port, reuse_address=True,
                                               reuse_port=reuse_port or None, backlog=backlog)
        self.reaper = loop.create_task(self._reap())

    async def start_unix(self, path: str, backlog: int = 1024) -> None:
        """Listen on a Unix socket at ``path``, readable by its owner only. A stale socket file there (nobody
        accepts on it) is replaced; a live one is another server's: OSError(EADDRINUSE), it is left alone."""
        loop = asyncio.get_running_loop()
        if unix_socket_live(path):
            raise OSError(errno.EADDRINUSE, f"another server listens on {path}")
        old = os.umask(0o177)
        try:
            self.server = await loop.create_unix_server(lambda: HttpProtocol(self), path, backlog=backlog)
        finally:
            os.umask(old)
        self.reaper = loop.create_task(self._reap())

    @property
    def port(self) -> int:
        """The TCP port listened on (0 for a Unix socket)."""
        assert self.server is not None, "not started"
        sockets = cast(asyncio.Server, self.server).sockets  # uvloop's Server has them too, without subclassing
        name = sockets[0].getsockname()
        return int(name[1]) if isinstance(name, tuple) else 0

    async def _reap(self) -> None:
        """Close connections idle longer than the keep-alive time, and those whose request head (or body)
        has taken longer than its limit to arrive, however many bytes trickle in (slowloris): 408."""
        while True:
            await asyncio.sleep(min(1.0, self.keepalive_s / 2, self.head_s / 2, self.body_s / 2))
            now = time.monotonic()
            for c in list(self.conns):
                if c.task is not None:
                    continue
                if c.parsing_since is not None:
                    limit = self.head_s if c.req is None else self.body_s
                    if now - c.parsing_since > limit:
                        what = "request head" if c.req is None else "request body"
                        c.protocol_error(ProtocolError(408, f"{what} not received within {limit:g}s", "request_timeout"))
                elif now - c.last_active > self.keepalive_s:
                    c.close()

    async def close(self, drain_s: float = 0.0, on_deadline: Callable[[], object] | None = None,
                    answer_s: float = 5.0) -> None:
        """Stop listening; give requests in flight ``drain_s`` to finish (their connections then close).
        Then ``on_deadline()`` lets the application end what is still running with an answer of its
        own, written within ``answer_s``; then every connection closes, which ends the rest."""
        if self.reaper is not None:
            self.reaper.cancel()
        if self.server is not None:
            self.server.close()
        self.draining = True
        for c in [c for c in self.conns if c.task is None]:
            c.close()
        busy = [c.task for c in self.conns if c.task is not None]
        if busy and drain_s > 0:
            await asyncio.wait(busy, timeout=drain_s)
        busy = [c.task for c in self.conns if c.task is not None]
        if busy and on_deadline is not None:
            on_deadline()
            await asyncio.wait(busy, timeout=answer_s)  # their connections close after the answer (transports flush first)
        tasks = [c.task for c in self.conns if c.task is not None]
        for c in list(self.conns):
            c.close()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self.server is not None:
            await self.server.wait_closed()


class HttpProtocol(asyncio.Protocol):
    """One client connection. Requests are parsed as they arrive and answered in order; reading pauses as
    soon as one request waits behind the one being answered, every answer waits for the client's socket
    to take it (back-pressure), and the loop gets a turn between pipelined answers."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False
        self.writable: asyncio.Future[None] | None = None
        self.on_writable: Callable[[], None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.current: Request | None = None  # the request whose handler runs
        self.queue: deque[Request] | None = None  # pipelined requests, made on the first (an empty deque is 600 B)
        self.last_active = time.monotonic()
        self.close_after = False
        self.reading_paused = False
        self.parsing_since: float | None = None  # a request's first byte came at this time; None between requests
        # the request being parsed
        self.url = b""
        self.hdrs: dict[str, str] = {}
        self.hdr_bytes = 0  # of the headers parsed so far
        self.head_read = 0  # bytes read since the head began, counted from the read after the one it began in
        self.head_began = False  # a head began in the read being parsed
        self.in_head = True  # between messages or in a request head
        self.body: list[bytes] = []
        self.body_size = 0
        self.req: Request | None = None
        self.continue_due = False  # the request being parsed expects 100 Continue, not sent yet
        self.unparsed = b""  # bytes read but not parsed yet: PIPELINED requests already wait

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # TCP_NODELAY: set by the loop itself on every TCP transport (see h1lite.client's connection_made)
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.server.conns.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.close_after:
            return
        if self.unparsed:  # reading is paused; what still came waits behind what is already held
            self.unparsed += data
            return
        n = len(data)
        if n <= PARSE_PIECE:
            self.feed(data)
            return
        view = memoryview(data)
        at = 0
        while at < n and not self.close_after:
            if self.queue is not None and len(self.queue) >= PIPELINED:
                self.unparsed = bytes(view[at:])
                return
            # cut just after a head's end: pipelined requests in pieces; a head or body with no such end (one long
            # header value, a JSON body) goes whole, as it was read
            end = data.find(b"\r\n\r\n", at + PARSE_PIECE)
            end = n if end < 0 else end + 4
            self.feed(view[at:end])
            at = end

    def parse_held(self) -> None:
        """Parse what was held back, now that the pipelined requests before it were answered."""
        data, self.unparsed = self.unparsed, b""
        self.data_received(data)

    def feed(self, data: bytes | memoryview) -> None:
        self.head_began = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no upgrades here: answer a complete request, then close
            self.protocol_error(ProtocolError(400, "protocol upgrades are not supported", "bad_request"))
        except httptools.HttpParserCallbackError as exc:
            ctx = exc.__context__  # httptools keeps our callback's exception as the context
            self.protocol_error(ctx if isinstance(ctx, ProtocolError) else ProtocolError(400, "malformed HTTP request",
                                                                                 "bad_request"))
        except httptools.HttpParserError as exc:
            self.protocol_error(ProtocolError(400, f"malformed HTTP request: {exc}", "bad_request"))
        else:
            if self.in_head and self.parsing_since is not None and not self.head_began:
                # a head still incomplete after a whole read of it: httptools accumulates a header value
                # piecewise (quadratic) and reports it only once complete, so the head is bounded here, while
                # it arrives (at most one read past the limit)
                self.head_read += len(data)
                if self.head_read > MAX_HEADER_BYTES:
                    self.protocol_error(ProtocolError(431, f"request headers larger than {MAX_HEADER_BYTES} bytes",
                                                      "headers_too_large"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.conns.discard(self)
        if self.task is not None:  # the client left: its handler stops, and aborts what it started
            req = self.current
            if req is not None and req.on_gone is not None:
                req.on_gone()
            else:
                self.task.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_exception(ClientGone("client closed the connection"))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.on_writable is not None:
            cb, self.on_writable = self.on_writable, None
            cb()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.hdrs = {}
        self.hdr_bytes = 0
        self.head_read = 0
        self.head_began = True
        self.in_head = True
        self.body = []
        self.body_size = 0
        self.req = None
        self.parsing_since = time.monotonic()

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_HEADER_BYTES:
            raise ProtocolError(414, "request line too long", "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.hdr_bytes += len(name) + len(value)
        if self.hdr_bytes > MAX_HEADER_BYTES:
            raise ProtocolError(431, f"request headers larger than {MAX_HEADER_BYTES} bytes", "headers_too_large")
        if len(self.hdrs) >= MAX_HEADERS:
            raise ProtocolError(431, f"more than {MAX_HEADERS} request headers", "headers_too_large")
        self.hdrs[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.in_head = False
        p = self.parser
        u = httptools.parse_url(self.url)
        path = u.path.decode("latin-1")
        req = self.req = Request(self, p.get_method().decode(), path, (u.query or b"").decode("latin-1"), self.hdrs,
                                 p.get_http_version())
        req.keep_alive = p.should_keep_alive()
        req.started = self.parsing_since or 0.0
        expect = self.hdrs.get("expect")
        cl = self.hdrs.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.server.max_body:
            # answered 413 now, without reading the body (its bytes are never parsed: the connection closes)
            req.too_large = True
            self.stop_reading(req)
        elif expect is not None and expect.lower() != "100-continue":
            req.failed = ProtocolError(417, f"expectation {expect!r} is not supported", "expectation_failed")
            self.stop_reading(req)
        elif expect is not None:
            self.continue_due = True
            self.send_continue()

    def stop_reading(self, req: Request) -> None:
        """Answer ``req`` (in its turn) without its body, then close: nothing after it can be parsed."""
        req.keep_alive = False
        self.close_after = True
        self.parsing_since = None
        self.req = None
        if self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True
        self.enqueue(req)

    def send_continue(self) -> None:
        """``100 Continue`` for the request being parsed, once nothing else is being answered (it would land
        inside that answer): from the server's first wish to read the body, as uvicorn does."""
        if self.continue_due and self.task is None and self.req is not None and self.transport is not None:
            self.continue_due = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        req = self.req
        if req is None or req.too_large:
            return
        self.continue_due = False  # the client did not wait for it
        self.body_size += len(body)
        if self.body_size > self.server.max_body:
            req.too_large = True
            self.body = []
            self.stop_reading(req)
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        req = self.req
        self.parsing_since = None
        self.in_head = True
        self.continue_due = False
        if req is None:
            return
        self.req = None
        req.body = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body = []
        if self.task is None:  # the common case, inline: nothing being answered on this connection
            self.task = self.loop.create_task(self.handle(req))
        else:
            self.enqueue(req)

    def enqueue(self, req: Request) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self.handle(req))
            return
        # pipelined: answered in order, and nothing more is read meanwhile (what one read brought is bounded)
        if self.queue is None:
            self.queue = deque()
        self.queue.append(req)
        if self.transport is not None and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    # -- ours
    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def wait_writable(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()
        await self.writable

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def protocol_error(self, exc: ProtocolError) -> None:
        self.close_after = True
        self.parsing_since = None
        if self.task is None:
            body = error_json(exc)
            self.write(head(exc.status, {"Content-Type": "application/json"}, b"Content-Length: %d\r\n" % len(body),
                            False) + body)
            self.linger()

    def linger(self, seconds: float = LINGER_S) -> None:
        """Close a connection whose client may still be sending (a refused head or body): our side first
        (FIN after the answer), then read and drop what still comes for ``seconds`` before the close. A close
        with unread bytes sends a reset, which can make the client's kernel discard our answer unread."""
        t = self.transport
        if t is None or self.closed:
            return
        if not t.can_write_eof():
            self.close()
            return
        t.write_eof()
        if self.reading_paused:
            self.reading_paused = False
            t.resume_reading()
        self.loop.call_later(seconds, self.close)

    async def handle(self, req: Request) -> None:
        while True:
            self.current = req
            try:
                if req.too_large:
                    raise PayloadTooLarge(f"request body is larger than {self.server.max_body} bytes")
                if req.failed is not None:
                    raise req.failed
                resp = await self.server.dispatch(req)
            except HTTPError as exc:  # every error leaves in OpenAI's shape, or the one the route's clients read
                if self.server.shape is not None:
                    exc = self.server.shape(req, exc)
                if self.server.on_error is not None:
                    self.server.on_error(req, exc)
                resp = error_response(exc)
            except (asyncio.CancelledError, ClientGone):
                self.task = self.current = None
                self.close()
                return
            except Exception:  # a bug: the client still gets an answer (or, mid-stream, a cut stream)
                log.exception("unhandled error in %s %s", req.method, req.path)
                bug = HTTPError("internal error")
                resp = error_response(self.server.shape(req, bug) if self.server.shape is not None else bug)
            keep = req.keep_alive and not self.close_after and not self.server.draining
            try:
                if req.stream is not None:
                    if resp is not req.stream:  # failed after its head went out: end it, never a second status line
                        keep = req.stream.fail(resp)
                    else:
                        req.stream.end()
                    keep = keep and req.keep_alive
                else:
                    assert isinstance(resp, Response)
                    self.write(head(resp.status, resp.headers, b"Content-Length: %d\r\n" % len(resp.body), keep)
                               + (resp.body if req.method != "HEAD" else b""))
                if self.paused and not self.closed:  # back-pressure for every answer, not only streams
                    await self.wait_writable()
            except ValueError as exc:  # an invalid response header: a bug of the handler; never sent as it is
                log.error("invalid response to %s %s: %s", req.method, req.path, exc)
                if req.stream is None:
                    err = error_response(HTTPError("internal error: invalid response header"))
                    self.write(head(err.status, err.headers, b"Content-Length: %d\r\n" % len(err.body), False) + err.body)
                self.task = self.current = None
                self.close()
                return
            except ClientGone:
                self.task = self.current = None
                self.close()
                return
            self.last_active = time.monotonic()
            self.current = None
            if not keep or self.closed:
                self.task = None
                if self.close_after:  # the client may still be sending what we did not read
                    self.linger()
                else:
                    self.close()
                return
            if not self.queue:
                self.task = None
                if self.unparsed:  # requests read but held back: parsed now (they start a handler of their own)
                    self.parse_held()
                    if self.unparsed or self.task is not None:
                        return
                self.send_continue()  # a request that was waiting behind this answer may now send its body
                if self.reading_paused and self.transport is not None:
                    self.reading_paused = False
                    self.transport.resume_reading()
                return
            req = self.queue.popleft()
            if self.unparsed and len(self.queue) < PIPELINED // 2:
                self.parse_held()
            await pass_turn()  # pipelined answers do not hold the loop: others get a turn between them
