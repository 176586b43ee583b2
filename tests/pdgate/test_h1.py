"""The lean HTTP/1.1 layer on real loopback sockets: the front server and the engine-leg client."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from h1lite.client import Client, ConnectFailed, UpstreamClosed
from h1lite.server import Request, Response, Router, Server, Stream
from tests.pdgate.harness import make_config, start_gateway
from tests.procs import Procs, free_port, wait_http

MAX_BODY = 1000


class Front:
    """A front server with a few test routes; records what its handlers saw."""

    def __init__(self) -> None:
        self.router = Router()
        self.cancelled = asyncio.Event()
        self.written = 0
        self.router.add("GET", "/fast", self.fast)
        self.router.add("GET", "/slow", self.slow)
        self.router.add("POST", "/echo", self.echo)
        self.router.add("GET", "/hang", self.hang)
        self.router.add("GET", "/sse", self.sse)
        self.router.add("GET", "/flood", self.flood)
        self.router.add("GET", "/items/{id}", self.item)
        self.router.add("GET", "/boom", self.boom)
        self.router.add("GET", "/boom-stream", self.boom_stream)
        self.router.add("GET", "/boom-octets", self.boom_octets)
        self.server = Server(self.router.dispatch, MAX_BODY)
        self.port = free_port()

    async def fast(self, req: Request) -> Response:
        return Response(b"fast", content_type="text/plain")

    async def slow(self, req: Request) -> Response:
        await asyncio.sleep(0.2)
        return Response(b"slow", content_type="text/plain")

    async def echo(self, req: Request) -> Response:
        return Response(req.body, content_type="application/octet-stream")

    async def item(self, req: Request) -> Response:
        return Response(orjson.dumps({"id": req.match["id"], "q": req.query}))

    async def boom(self, req: Request) -> Response:
        raise RuntimeError("a bug")

    async def boom_stream(self, req: Request) -> Stream:
        s = req.open_stream(200, {"Content-Type": "text/event-stream"})
        await s.write(b"data: 0\n\n")
        raise RuntimeError("a bug mid-stream")

    async def boom_octets(self, req: Request) -> Stream:
        s = req.open_stream(200, {"Content-Type": "application/octet-stream"})
        await s.write(b"abcd")
        raise RuntimeError("a bug mid-stream")

    async def hang(self, req: Request) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response()

    async def sse(self, req: Request) -> Stream:
        s = req.open_stream(200, {"Content-Type": "text/event-stream"})
        for i in range(3):
            await s.write(b"data: %d\n\n" % i)
        return s

    async def flood(self, req: Request) -> Stream:
        """32 MiB to a client that reads nothing; with ``?wait=0`` the writer ignores back-pressure."""
        s = req.open_stream(200, {"Content-Type": "application/octet-stream"})
        chunk = b"x" * (1 << 20)
        for _ in range(32):
            if req.query.get("wait") == "0":
                s.send(chunk)
            else:
                await s.write(chunk)
            self.written += len(chunk)
            await asyncio.sleep(0)
        return s


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    f = Front()
    await f.server.start("127.0.0.1", f.port)
    try:
        yield f
    finally:
        await f.server.close()


async def exchange(port: int, raw: bytes, read_for: float = 1.0) -> bytes:
    """Send raw bytes, read until the server closes or ``read_for`` seconds pass."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(raw)
    out = b""
    try:
        async with asyncio.timeout(read_for):
            while chunk := await r.read(65536):
                out += chunk
    except TimeoutError:
        pass
    w.close()
    return out


def error_code(resp: bytes) -> tuple[int, str]:
    head, _, body = resp.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(body)["error"]["code"]


async def test_pipelined_requests_are_answered_in_order(front: Front) -> None:
    out = await exchange(front.port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /fast HTTP/1.1\r\nHost: x\r\n\r\n", 1.0)
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.index(b"slow") < out.index(b"fast")


async def test_a_pipelining_flood_is_read_no_faster_than_answered(front: Front) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", front.port)
    n = 20000  # 700 KB of requests; the gateway reads at most one socket read (256 KB) past the limit
    w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n" * n)
    await asyncio.sleep(0.1)
    (conn,) = front.server.conns
    assert conn.reading_paused and len(conn.queue) < n // 2, "the rest waits in the socket, not in the gateway's memory"
    seen, tail = 0, b""
    try:
        async with asyncio.timeout(20):
            while seen < n + 1:
                data = tail + await r.read(1 << 16)
                seen += data.count(b"HTTP/1.1 200 OK")
                tail = data[-14:]  # shorter than the marker: never counted twice
    finally:
        w.close()


@pytest.mark.parametrize(("raw", "status", "code"), [
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "bad_request"),
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"a" * 5000, 413, "payload_too_large"),
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n" + b"a" * 2000 + b"\r\n0\r\n\r\n",
     413, "payload_too_large"),
    (b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 70000 + b"\r\n\r\n", 431, "headers_too_large"),
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
    (b"DELETE /fast HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
])
async def test_bad_requests_get_openai_errors(front: Front, raw: bytes, status: int, code: str) -> None:
    assert error_code(await exchange(front.port, raw)) == (status, code)


async def test_a_handler_bug_is_a_500_or_a_cut_stream(front: Front, caplog: pytest.LogCaptureFixture) -> None:
    out = await exchange(front.port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /fast HTTP/1.1\r\nHost: x\r\n\r\n", 0.5)
    assert error_code(out.split(b"HTTP/1.1 200")[0]) == (500, "internal_error") and out.endswith(b"fast")
    out = await exchange(front.port, b"GET /boom-stream HTTP/1.1\r\nHost: x\r\n\r\n", 2.0)
    assert out.count(b"HTTP/1.1 ") == 1, "never a second status line inside the stream"
    assert b"data: 0\n\n\r\n" in out and b'data: {"error":{"message":"internal error"' in out
    assert out.endswith(b"\n\n\r\n0\r\n\r\n"), "an SSE stream says why it ends, then ends"
    out = await exchange(front.port, b"GET /boom-octets HTTP/1.1\r\nHost: x\r\n\r\n", 2.0)
    assert out.count(b"HTTP/1.1 ") == 1 and out.endswith(b"4\r\nabcd\r\n"), "any other stream is cut: no terminator"
    assert "a bug mid-stream" in caplog.text


async def test_upgrade_is_answered_as_plain_http_then_closed(front: Front) -> None:
    out = await exchange(front.port, b"GET /fast HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"
                                     b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out.count(b"HTTP/1.1 200 OK") == 1 and b"Connection: close" in out and out.endswith(b"fast")


async def test_expect_continue_and_chunked_body(front: Front) -> None:
    out = await exchange(front.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n"
                                     b"Connection: close\r\n\r\nhello")
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") and out.endswith(b"hello")
    out = await exchange(front.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                     b"Connection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert out.endswith(b"\r\n\r\nabcde")


async def test_head_is_get_without_the_body(front: Front) -> None:
    out = await exchange(front.port, b"HEAD /fast HTTP/1.1\r\nHost: x\r\n\r\nGET /fast HTTP/1.1\r\nHost: x\r\n\r\n", 0.5)
    first, _, second = out.partition(b"\r\n\r\n")
    assert b"Content-Length: 4" in first and second.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"\r\n\r\nfast")


async def test_path_params_and_query(front: Front) -> None:
    out = await exchange(front.port, b"GET /items/r-1?phase=decode&x= HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert orjson.loads(out.partition(b"\r\n\r\n")[2]) == {"id": "r-1", "q": {"phase": "decode", "x": ""}}
    out = await exchange(front.port, b"GET /items/a%2Fb%20c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert orjson.loads(out.partition(b"\r\n\r\n")[2])["id"] == "a/b c"


async def test_streams_are_chunked_and_unchunked_for_http10(front: Front) -> None:
    out = await exchange(front.port, b"GET /sse HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in out and out.endswith(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
    out = await exchange(front.port, b"GET /sse HTTP/1.0\r\n\r\n")
    assert b"Transfer-Encoding" not in out and b"Connection: close" in out
    assert out.endswith(b"\r\n\r\ndata: 0\n\ndata: 1\n\ndata: 2\n\n")


async def test_client_leaving_cancels_its_handler(front: Front) -> None:
    _, w = await asyncio.open_connection("127.0.0.1", front.port)
    w.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.2)
    assert not front.cancelled.is_set()
    w.close()
    await asyncio.wait_for(front.cancelled.wait(), 2)
    await asyncio.sleep(0.05)
    assert not front.server.conns


@pytest.mark.parametrize("wait", [True, False])
async def test_stream_writes_wait_for_a_slow_client(front: Front, wait: bool) -> None:
    """Back-pressure: to a client that reads nothing, ``await write()`` stops after the socket buffers fill;
    without waiting (``send()`` ignoring ``blocked``) all 32 MiB pile up in the gateway's memory."""
    _, w = await asyncio.open_connection("127.0.0.1", front.port)
    w.write(b"GET /flood?wait=%d HTTP/1.1\r\nHost: x\r\n\r\n" % int(wait))
    await asyncio.sleep(1.0)
    buffered = max(c.transport.get_write_buffer_size() for c in front.server.conns if c.transport is not None)
    if wait:
        assert front.written <= 16 << 20 and buffered <= 4 << 20
    else:
        assert front.written == 32 << 20 and buffered >= 16 << 20
    w.close()


# ---- client ---------------------------------------------------------------------------------------
class Engine:
    """A raw HTTP responder: counts connections, answers each request with ``script``'s bytes."""

    def __init__(self, script: bytes) -> None:
        self.script = script
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.port = free_port()

    async def __aenter__(self) -> Engine:
        self.srv = await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.writers:
            w.close()
        self.srv.close()
        await self.srv.wait_closed()
        await asyncio.sleep(0)

    async def start(self) -> asyncio.Server:
        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            self.writers.append(w)
            try:
                while await r.readuntil(b"\r\n\r\n"):
                    w.write(self.script)
                    if not self.script.endswith(b"\r\n0\r\n\r\n") and b"Content-Length" not in self.script:
                        w.close()  # a truncated answer: close mid-body
                        return
            except (asyncio.IncompleteReadError, ConnectionError):
                pass

        return await asyncio.start_server(on_conn, "127.0.0.1", self.port)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("keepalive_s", [0.4, 60.0])
async def test_idle_and_half_sent_connections_are_reaped(keepalive_s: float) -> None:
    """A connection that sends nothing is closed after ``keepalive_s``, one that sent half a request and
    then nothing after the head timeout (here the same); with long limits both are still open when we look."""
    f = Front()
    f.server.keepalive_s = keepalive_s
    f.server.head_s = keepalive_s
    await f.server.start("127.0.0.1", f.port)
    try:
        idle = await asyncio.open_connection("127.0.0.1", f.port)
        half = await asyncio.open_connection("127.0.0.1", f.port)
        half[1].write(b"GET /fast HTTP/1.1\r\nHost: x\r\n")  # no blank line: the request never completes
        await asyncio.sleep(1.2)
        assert len(f.server.conns) == (0 if keepalive_s < 1 else 2)
        closed, answers = [], []
        for r, w in (idle, half):
            try:
                async with asyncio.timeout(0.2):
                    data = await r.read()
                    closed.append(True)
                    answers.append(data)
            except TimeoutError:
                closed.append(False)
            w.close()
        assert closed == ([True, True] if keepalive_s < 1 else [False, False])
        if keepalive_s < 1:  # the idle one just closes; the half-sent one is told why (408), then closed
            assert answers[0] == b"" and error_code(answers[1]) == (408, "request_timeout")
    finally:
        await f.server.close()


async def test_client_reuses_connections_and_replaces_closed_ones() -> None:
    client = Client(connect_timeout_s=1.0)
    async with Engine(OK) as eng:
        base = f"http://127.0.0.1:{eng.port}"
        try:
            for _ in range(3):
                async with client.send(base, "POST", "/x", b"{}") as r:
                    assert r.status == 200 and await r.read() == b"ok"
            assert eng.connections == 1
            for w in eng.writers:  # the engine drops its idle keep-alive connection
                w.close()
            await asyncio.sleep(0.1)
            async with client.send(base, "GET", "/y") as r:
                assert await r.read() == b"ok"
            assert eng.connections == 2
        finally:
            client.close()


async def test_client_reads_a_large_body_whole() -> None:
    """A 3 MiB non-streamed answer (long outputs with logprobs get there) is read to its end."""
    body = b"y" * (3 << 20)
    client = Client(connect_timeout_s=1.0)
    async with Engine(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)) as eng:
        try:
            status, got = await asyncio.wait_for(client.fetch(f"http://127.0.0.1:{eng.port}", "POST", "/x", b"{}"), 10)
            assert status == 200 and got == body
        finally:
            client.close()


async def test_client_pipes_a_chunked_stream() -> None:
    client = Client(connect_timeout_s=1.0)
    got: list[bytes] = []
    async with Engine(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n") as eng:
        try:
            async with client.send(f"http://127.0.0.1:{eng.port}", "POST", "/s", b"{}") as r:
                await r.pipe(got.append)
            assert b"".join(got) == b"abcdef"
        finally:
            client.close()


async def test_a_piped_body_wakes_its_reader_once_not_per_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """pipe() hands every piece over from the protocol itself; the task waiting in pipe() (and read()) is woken
    by the end of the message alone, not once per piece (a task switch per token: the streaming profile in
    BENCHMARKS.md). 100 pieces, each in a read of its own, must not mean 100 wake-ups."""
    from h1lite import client as h1client

    waits = [0]
    real_wait = h1client.ClientResponse._wait

    async def counted(self: h1client.ClientResponse) -> None:
        waits[0] += 1
        await real_wait(self)

    monkeypatch.setattr(h1client.ClientResponse, "_wait", counted)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(100):
            writer.write(b"4\r\n%04d\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.002)  # each piece in a read of its own
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes its end
        writer.close()
        await writer.wait_closed()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    client = Client(connect_timeout_s=1.0)
    got: list[bytes] = []
    try:
        async with client.send(f"http://127.0.0.1:{port}", "POST", "/s", b"{}") as r:
            await r.pipe(got.append)
        assert b"".join(got) == b"".join(b"%04d" % i for i in range(100))
        assert len(got) > 50, "the pieces came in reads of their own"
        assert waits[0] <= 2, f"pipe() was woken {waits[0]} times for one message"
    finally:
        client.close()
        await asyncio.sleep(0.05)
        srv.close()
        await srv.wait_closed()


@pytest.mark.parametrize("script", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",  # closed mid-stream
    b"garbage that is not HTTP\r\n\r\n",
])
async def test_client_reports_broken_answers(script: bytes) -> None:
    client = Client(connect_timeout_s=1.0)
    async with Engine(script) as eng:
        try:
            with pytest.raises(UpstreamClosed):
                async with client.send(f"http://127.0.0.1:{eng.port}", "POST", "/s", b"{}") as r:
                    await r.read()
            assert not client.pools[f"http://127.0.0.1:{eng.port}"][0].idle, "a broken connection is never reused"
        finally:
            client.close()


async def test_client_connect_failure() -> None:
    client = Client(connect_timeout_s=1.0)
    with pytest.raises(ConnectFailed):
        await client.request(f"http://127.0.0.1:{free_port()}", "GET", "/")
    client.close()


# ---- the relay's back-pressure, through the real gateway -------------------------------------------
@pytest.mark.parametrize("backpressure", [True, False])
async def test_relay_stops_reading_the_decode_for_a_client_that_does_not_read(
        procs: Procs, gateways: list[Any], monkeypatch: pytest.MonkeyPatch, backpressure: bool) -> None:
    """A 20 MB stream to a client that reads nothing: the gateway stops reading the decode, so the bytes
    wait in the engine's socket, not in the gateway; with the mechanism off they pile up in the gateway."""
    if not backpressure:
        monkeypatch.setattr(Stream, "blocked", property(lambda self: False))
    workers = []
    for role in ("prefill", "decode"):
        port = free_port()
        w = procs.spawn([sys.executable, "-m", "loadtest.fakeworker", "--role", role, "--port", str(port)], name=role)
        wait_http(f"http://127.0.0.1:{port}/health", proc=w.popen)
        workers.append(SimpleNamespace(url=f"http://127.0.0.1:{port}", bootstrap_port=free_port()))
    g = await start_gateway(make_config([workers[0]], [workers[1]]))  # type: ignore[list-item]
    gateways.append(g)
    body = orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200_000,
                         "stream": True})
    _, w = await asyncio.open_connection("127.0.0.1", int(g.url.rsplit(":", 1)[1]))
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    try:
        await asyncio.sleep(3)
        buffered = sum(c.transport.get_write_buffer_size() for c in g.runner.server.conns if c.transport is not None)
        (rec,) = [*g.gw.traces.live.values(), *g.gw.traces.finished.values()]
        if backpressure:  # still live: the decode is paused until the client reads
            assert rec.live and buffered < 4 << 20, (rec.chunks, buffered)
        else:  # the whole stream was taken from the decode and sits in the gateway's memory
            assert rec.chunks == 200_000 and buffered > 10 << 20, (rec.chunks, buffered)
    finally:
        w.close()


@pytest.mark.parametrize("use_uvloop", [True, False])
def test_tcp_nodelay_is_on_for_both_sides_without_asking(use_uvloop: bool) -> None:
    """h1lite does not set TCP_NODELAY itself (asking uvloop for the socket costs syscalls and an object per
    connection): the loop does, on every TCP transport. A token written alone must not wait for Nagle."""
    import socket

    import uvloop

    async def main() -> tuple[int, int]:
        server = Server(Router().dispatch, 1 << 16)
        await server.start("127.0.0.1", 0)
        client = Client(connect_timeout_s=1.0)
        try:
            status, _ = await client.fetch(f"http://127.0.0.1:{server.port}", "GET", "/nothing")
            assert status == 404
            pool = next(iter(client.pools.values()))[0]
            conn = next(iter(pool.all))
            assert conn.transport is not None
            ours = conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            proto = next(iter(server.conns))
            assert proto.transport is not None
            theirs = proto.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            return ours, theirs
        finally:
            client.close()
            await server.close()

    if use_uvloop:
        got = uvloop.run(main())
    else:
        got = asyncio.run(main())
    assert got[0] and got[1], f"TCP_NODELAY (client, server): {got}"
