"""A lean HTTP/1.1 server: pdgate's front door and the sims' HTTP surface; asyncio protocols, httptools parsing.

aiohttp's server costs ~200 µs of CPU per request on this kind of machine, more than the
whole budget pdgate has for a PD request. This one keeps what a gateway needs: keep-alive
and pipelining (requests on a connection are answered in order), ``Expect: 100-continue``,
a body-size limit checked on ``Content-Length`` before the body is read, a header-size
limit, chunked streaming with back-pressure (``await stream.write()`` waits while the
client's socket buffer is full; ``send()`` + ``on_writable`` for callers that cannot wait),
TCP_NODELAY, idle-connection reaping, and the handler
task cancelled when the client goes away, as aiohttp does with ``handler_cancellation``.
Routing is a dict of exact paths plus ``/prefix/{id}[/suffix]`` patterns; HEAD is answered by
the GET handler, without the body.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import httptools
import orjson

from h1lite.errors import HTTPError, NotFound, PayloadTooLarge, ProtocolError, error_json

log = logging.getLogger("h1lite.server")

MAX_HEADER_BYTES = 64 * 1024
MAX_PIPELINED = 32  # requests queued behind the one being answered; beyond this the connection is not read
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
REASONS[499] = b"Client Closed Request"


def error_response(exc: HTTPError) -> Response:
    return Response(error_json(exc), exc.status)


class Request:
    __slots__ = ("_query", "body", "headers", "keep_alive", "match", "method", "on_gone", "path", "proto",
                 "query_string", "streaming", "too_large", "version")

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
        self.streaming = False
        self._query: dict[str, str] | None = None
        # called instead of cancelling the handler task when the client goes away (a handler that ends
        # its work through its own cancel scope sets it)
        self.on_gone: Callable[[], object] | None = None

    @property
    def query(self) -> dict[str, str]:
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    def open_stream(self, status: int, headers: dict[str, str]) -> Stream:
        """Send the status line and headers now; the body follows in ``write()`` or ``send()`` calls."""
        self.streaming = True
        return Stream(self, status, headers)


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

    __slots__ = ("chunked", "ended", "proto", "req")

    def __init__(self, req: Request, status: int, headers: dict[str, str]) -> None:
        self.req, self.proto = req, req.proto
        self.chunked = req.version != "1.0"
        if not self.chunked:
            req.keep_alive = False
        self.ended = False
        extra = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
        self.proto.write(head(status, headers, extra, req.keep_alive))

    def send(self, data: bytes) -> None:
        """Write without waiting; the caller checks ``blocked`` (and ``on_writable``) for back-pressure."""
        if self.proto.closed:
            raise ClientGone("client closed the connection")
        if data:
            self.proto.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

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
            if self.chunked and not self.proto.closed:
                self.proto.write(b"0\r\n\r\n")


def head(status: int, headers: dict[str, str], extra: bytes, keep_alive: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, REASONS.get(status, b"Unknown"))]
    lines.extend(f"{k}: {v}\r\n".encode() for k, v in headers.items())
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
            raise NotFound(f"{req.method} {req.path}: Not Found")
        handler = methods.get(req.method) or (methods.get("GET") if req.method == "HEAD" else None)
        if handler is None:
            raise ProtocolError(405, f"{req.method} {req.path}: Method Not Allowed (allowed: {', '.join(sorted(methods))})",
                            "method_not_allowed")
        return handler

    async def dispatch(self, req: Request) -> Response | Stream:
        """Run the handler for ``req``: what a ``Server`` calls when routing is all it needs."""
        return await self.resolve(req)(req)


class Server:
    """Owns the listening socket, the connections and their reaper."""

    def __init__(self, dispatch: Callable[[Request], Awaitable[Response | Stream]], max_body: int,
                 keepalive_s: float = 75.0) -> None:
        self.dispatch = dispatch
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.conns: set[HttpProtocol] = set()
        self.server: asyncio.AbstractServer | None = None
        self.reaper: asyncio.Task[None] | None = None
        self.draining = False

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: HttpProtocol(self), host, port, reuse_address=True,
                                               backlog=backlog)
        self.reaper = loop.create_task(self._reap())

    async def _reap(self) -> None:
        """Close connections that sat idle (or half-sent a request) longer than the keep-alive time."""
        while True:
            await asyncio.sleep(min(5.0, self.keepalive_s / 2))
            cutoff = time.monotonic() - self.keepalive_s
            for c in [c for c in self.conns if c.task is None and c.last_active < cutoff]:
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
        self.queue: deque[Request] = deque()
        self.last_active = time.monotonic()
        self.close_after = False
        self.reading_paused = False
        # the request being parsed
        self.url = b""
        self.hdrs: dict[str, str] = {}
        self.hdr_bytes = 0
        self.body: list[bytes] = []
        self.body_size = 0
        self.req: Request | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.conns.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.close_after:
            return
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
        self.body = []
        self.body_size = 0
        self.req = None

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.hdr_bytes += len(url)
        if self.hdr_bytes > MAX_HEADER_BYTES:
            raise ProtocolError(414, "request line too long", "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.hdr_bytes += len(name) + len(value)
        if self.hdr_bytes > MAX_HEADER_BYTES:
            raise ProtocolError(431, f"request headers larger than {MAX_HEADER_BYTES} bytes", "headers_too_large")
        self.hdrs[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        p = self.parser
        u = httptools.parse_url(self.url)
        path = u.path.decode("latin-1")
        req = self.req = Request(self, p.get_method().decode(), path, (u.query or b"").decode("latin-1"), self.hdrs,
                                 p.get_http_version())
        req.keep_alive = p.should_keep_alive()
        cl = self.hdrs.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.server.max_body:
            req.too_large = True  # answered 413 without reading the body, and the connection closed
            req.keep_alive = False
        elif self.hdrs.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        req = self.req
        if req is None or req.too_large:
            return
        self.body_size += len(body)
        if self.body_size > self.server.max_body:
            req.too_large = True
            req.keep_alive = False
            self.body = []
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        req = self.req
        if req is None:
            return
        self.req = None
        req.body = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body = []
        if self.task is None:
            self.task = self.loop.create_task(self.handle(req))
        else:
            self.queue.append(req)  # pipelined: answered in order
            if len(self.queue) >= MAX_PIPELINED and self.transport is not None and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()
        if req.too_large:
            self.close_after = True  # the rest of this body is still on the wire: nothing after it can be parsed

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
        if self.task is None:
            body = error_json(exc)
            self.write(head(exc.status, {"Content-Type": "application/json"}, b"Content-Length: %d\r\n" % len(body),
                            False) + body)
            self.close()

    async def handle(self, req: Request) -> None:
        while True:
            self.current = req
            try:
                if req.too_large:
                    raise PayloadTooLarge(f"request body is larger than {self.server.max_body} bytes")
                resp = await self.server.dispatch(req)
            except HTTPError as exc:  # every error leaves in OpenAI's shape
                resp = error_response(exc)
            except (asyncio.CancelledError, ClientGone):
                self.task = self.current = None
                self.close()
                return
            except Exception:  # a bug: the client still gets an answer (or, mid-stream, a closed connection)
                log.exception("unhandled error in %s %s", req.method, req.path)
                if req.streaming:
                    self.task = self.current = None
                    self.close()
                    return
                resp = error_response(HTTPError("internal error"))
            keep = req.keep_alive and not self.close_after and not self.server.draining
            if isinstance(resp, Stream):
                resp.end()
                keep = keep and req.keep_alive
            else:
                self.write(head(resp.status, resp.headers, b"Content-Length: %d\r\n" % len(resp.body), keep)
                           + (resp.body if req.method != "HEAD" else b""))
            self.last_active = time.monotonic()
            self.current = None
            if not keep or self.closed:
                self.task = None
                self.close()
                return
            if not self.queue:
                self.task = None
                return
            req = self.queue.popleft()
            if self.reading_paused and self.transport is not None:
                self.reading_paused = False
                self.transport.resume_reading()
