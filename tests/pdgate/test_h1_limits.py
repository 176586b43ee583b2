"""h1lite bounded and timed (issue 13): each limit with its mechanism on, and off to show the failure it prevents.

Raw sockets against the real server; a raw engine (asyncio streams, not h1lite) against the real client.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import h1lite.server
from h1lite.client import BodyTooLarge, Client, ConnectFailed
from h1lite.server import HttpProtocol, Request, Response, Router, Server, Stream
from tests.procs import free_port

MAX_BODY = 1000


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


class App:
    def __init__(self) -> None:
        self.router = Router()
        self.router.add("GET", "/health", self.health)
        self.router.add("GET", "/work", self.work)
        self.router.add("GET", "/big", self.big)
        self.router.add("GET", "/sse", self.sse)
        self.router.add("POST", "/echo", self.echo)
        self.router.add("GET", "/bad-header", self.bad_header)
        self.server = Server(self.router.dispatch, MAX_BODY)
        self.port = free_port()

    async def health(self, req: Request) -> Response:
        return Response(b"ok", content_type="text/plain")

    async def work(self, req: Request) -> Response:
        sum(range(20000))  # ~0.3 ms of CPU, like rendering /metrics
        return Response(b"w", content_type="text/plain")

    async def big(self, req: Request) -> Response:
        return Response(b"x" * 65536, content_type="application/octet-stream")

    async def sse(self, req: Request) -> Stream:
        s = req.open_stream(200, {"Content-Type": "text/event-stream"})
        await s.write(b"data: 1\n\n")
        return s

    async def echo(self, req: Request) -> Response:
        return Response(req.body, content_type="application/octet-stream")

    async def bad_header(self, req: Request) -> Response:
        return Response(b"", headers={"X-Evil": "a\r\nSet-Cookie: stolen=1"})


@pytest.fixture
async def app() -> AsyncIterator[App]:
    a = App()
    await a.server.start("127.0.0.1", a.port)
    try:
        yield a
    finally:
        await a.server.close()


async def read_all(r: asyncio.StreamReader, within: float) -> bytes:
    out = b""
    try:
        async with asyncio.timeout(within):
            while chunk := await r.read(65536):
                out += chunk
    except (TimeoutError, ConnectionError):
        pass
    return out


async def health_ms(port: int) -> float:
    t0 = time.monotonic()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = await read_all(r, 5)
    w.close()
    assert out.endswith(b"ok")
    return (time.monotonic() - t0) * 1000


# ---- a header that never ends ----
@pytest.mark.parametrize("bounded", [True, False])
async def test_a_header_value_that_never_ends(app: App, monkeypatch: pytest.MonkeyPatch, bounded: bool) -> None:
    """128 MB of one header value: 431 after ~64 KiB, RSS + < 10 MB, and another connection's /health answered
    within 100 ms meanwhile. Off (no bound while it arrives): no answer after 48 MB, and the gateway holds it."""
    if not bounded:
        monkeypatch.setattr(h1lite.server, "MAX_HEADER_BYTES", 1 << 40)
    before = rss_mb()
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
    reader = asyncio.create_task(read_all(r, 60))
    piece = b"v" * (64 << 10)
    sent, worst = 0, 0.0
    try:
        # off: 48 MB, so RSS shows the held value even where earlier tests left freed memory to reuse
        while sent < (128 << 20 if bounded else 48 << 20) and not reader.done() and not r.at_eof():
            w.write(piece)
            await w.drain()
            sent += len(piece)
            if sent % (4 << 20) == 0:
                worst = max(worst, await health_ms(app.port))
            if r._buffer:
                break
    except ConnectionError:
        pass
    await asyncio.sleep(0.3)
    grown = rss_mb() - before
    w.close()
    answer = await reader
    if bounded:
        assert answer.startswith(b"HTTP/1.1 431 ") and b"headers_too_large" in answer, answer[:100]
        assert sent < 8 << 20, f"the answer came only after {sent} bytes"
        assert grown < 10, f"RSS grew {grown:.1f} MB"
        assert worst < 100, f"/health took {worst:.0f} ms"
    else:
        assert answer == b"" and grown > 10, "without the bound the partial value is held, growing"


# ---- pipelining ----
@pytest.mark.parametrize("yields", [True, False])
async def test_pipelined_requests_never_block_the_loop(app: App, monkeypatch: pytest.MonkeyPatch, yields: bool) -> None:
    """5,000 pipelined requests in one write: the loop never waits more than 50 ms for its turn; without the
    turn given between answers it waits for all of them."""
    if not yields:
        async def nothing() -> None:
            pass
        monkeypatch.setattr(h1lite.server, "pass_turn", nothing)
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.002)
            lags.append(loop.time() - t - 0.002)

    tick = asyncio.create_task(ticker())
    r, w = await asyncio.open_connection("127.0.0.1", app.port, limit=1 << 24)
    n = 5000
    w.write(b"GET /work HTTP/1.1\r\nHost: x\r\n\r\n" * n)
    got, tail = 0, b""
    async with asyncio.timeout(30):
        while got < n:
            data = tail + await r.read(1 << 16)
            got += data.count(b"HTTP/1.1 200 OK")
            tail = data[-14:]
    stop.set()
    await tick
    w.close()
    if yields:
        assert max(lags) < 0.050, f"the loop waited {max(lags) * 1000:.0f} ms"
    else:
        assert max(lags) > 0.2, "without a turn between answers the loop waits for the whole batch"


@pytest.mark.parametrize("backpressure", [True, False])
async def test_a_pipeliner_that_never_reads_is_bounded(app: App, monkeypatch: pytest.MonkeyPatch,
                                                       backpressure: bool) -> None:
    """500 pipelined requests for 64 KiB answers, never read: what the server buffers stays bounded (answers
    wait for the socket); without write back-pressure for plain answers all 32 MB pile up."""
    if not backpressure:
        monkeypatch.setattr(HttpProtocol, "pause_writing", lambda self: None)
    _, w = await asyncio.open_connection("127.0.0.1", app.port)
    w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 500)
    await asyncio.sleep(1.0)
    (conn,) = app.server.conns
    assert conn.transport is not None
    buffered = conn.transport.get_write_buffer_size()
    w.close()
    if backpressure:
        assert buffered < 4 << 20 and conn.reading_paused
    else:
        assert buffered > 16 << 20


# ---- timeouts ----
@pytest.mark.parametrize("head_s", [1.0, 1000.0])
async def test_slowloris_is_closed_within_the_head_timeout(app: App, head_s: float) -> None:
    """One byte every 0.1 s: each byte is activity, so keep-alive reaping never fires; the head timeout does (408)."""
    app.server.head_s = head_s
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    t0 = time.monotonic()
    closed_at = None
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 40:
        try:
            w.write(bytes([b]))
            await w.drain()
        except ConnectionError:
            break
        await asyncio.sleep(0.1)
        if r.at_eof() or (r._buffer if hasattr(r, "_buffer") else b""):
            closed_at = time.monotonic() - t0
            break
    answer = await read_all(r, 0.3)
    w.close()
    if head_s < 10:
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer
        assert closed_at is not None and closed_at < head_s + 1.2
    else:
        assert answer == b"" and closed_at is None, "still trickling, still open"


# ---- expectations, sizes, HEAD, headers ----
async def test_expect_continue_only_when_the_body_is_wanted(app: App) -> None:
    # pipelined behind a streamed answer: no 100 Continue inside that answer's chunked body
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    w.write(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5\r\nConnection: close\r\n\r\n")
    await asyncio.sleep(0.2)
    w.write(b"hello")
    out = await read_all(r, 1.0)
    w.close()
    first_end = out.index(b"0\r\n\r\n") + 5
    assert b"100 Continue" not in out[:first_end], "no 100 Continue inside the previous answer"
    assert out.endswith(b"hello")
    # another expectation: 417, and the body is never read
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: something-else\r\nContent-Length: 5\r\n\r\n")
    out = await read_all(r, 1.0)
    w.close()
    assert out.startswith(b"HTTP/1.1 417 ") and b"expectation_failed" in out


async def test_413_comes_at_once_from_content_length(app: App) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 999999999\r\n\r\n")
    out = await read_all(r, 1.0)  # no byte of the body sent: the answer must not wait for it
    w.close()
    assert out.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in out and b"Connection: close" in out


async def test_head_of_a_stream_sends_no_body_and_answers_have_a_date(app: App) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    w.write(b"HEAD /sse HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = await read_all(r, 1.0)
    w.close()
    first, _, rest = out.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in first and rest.startswith(b"HTTP/1.1 200 OK"), rest[:40]
    assert b"\r\nDate: " in first and rest.endswith(b"ok")


async def test_response_header_values_cannot_inject_headers(app: App, caplog: pytest.LogCaptureFixture) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    w.write(b"GET /bad-header HTTP/1.1\r\nHost: x\r\n\r\n")
    out = await read_all(r, 1.0)
    w.close()
    assert b"Set-Cookie" not in out and out.startswith(b"HTTP/1.1 500 ")
    assert "invalid response header" in caplog.text


# ---- client -----------------------------------------------------------------------------------------
class RawEngine:
    """An engine on asyncio streams: ``answer(n)`` gives the bytes for the n-th request on a connection
    (None: close without answering)."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.port = free_port()
        self.connections = 0
        self.heads: list[bytes] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> RawEngine:
        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            task = asyncio.current_task()
            assert task is not None
            self.tasks.add(task)
            self.writers.append(w)
            n = 0
            try:
                while True:
                    head = await r.readuntil(b"\r\n\r\n")
                    self.heads.append(head)
                    n += 1
                    out = self.answer(n)  # type: ignore[operator]
                    if out is None:
                        break
                    if isinstance(out, bytes):
                        w.write(out)
                        await w.drain()
                    else:
                        await out(w)
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            except asyncio.CancelledError:
                w.transport.abort()  # a flood cut short: no flush of what is still buffered
            finally:
                w.close()
                self.tasks.discard(task)

        self.srv = await asyncio.start_server(on_conn, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.srv.close()
        await self.srv.wait_closed()
        for t in self.tasks:  # a handler still writing (a flood) ends here, not in the loop's teardown
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Engine: sim\r\nRetry-After: 3\r\n\r\nok"


async def flood(w: asyncio.StreamWriter) -> None:
    """An answer of 2 GiB, written as fast as the peer takes it."""
    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (2 << 30))
    zeros = b"\0" * (1 << 20)
    for _ in range(2048):
        w.write(zeros)
        await w.drain()


async def test_an_engine_that_died_with_our_request_is_not_sent_it_again() -> None:
    """A connection busy a moment ago that closes without an answer is an engine that died holding our
    request: the failure surfaces (the gateway retries on another pair, with a new room), never a silent
    resend of the same rid and room to whatever listens there now."""
    client = Client(connect_timeout_s=1.0, idle_s=30)
    async with RawEngine(lambda n: OK if n == 1 else None) as eng:
        try:
            assert await client.fetch(eng.base, "GET", "/x") == (200, b"ok")
            with pytest.raises(ConnectionError):
                await client.fetch(eng.base, "GET", "/x")
            assert client.stale_retries == 0 and eng.connections == 1
        finally:
            client.close()


@pytest.mark.parametrize("closed_first", [True, False])
async def test_a_pooled_connection_the_engine_closed_is_not_reused(closed_first: bool) -> None:
    """The engine closed an idle pooled connection (its keep-alive timeout): the close is seen before reuse
    (a peek at the socket), so the request goes out on a fresh connection and nothing fails."""
    client = Client(connect_timeout_s=1.0, idle_s=30)
    async with RawEngine(lambda n: OK) as eng:
        try:
            await client.fetch(eng.base, "GET", "/x")
            (pool, _), = client.pools.values()
            (conn,) = pool.idle
            for w in eng.writers if closed_first else []:
                w.close()
            await asyncio.sleep(0.15)  # idle past CHECK_AFTER_S: the socket is looked at before reuse
            assert conn.usable is (not closed_first)
            assert await client.fetch(eng.base, "GET", "/x") == (200, b"ok")
            assert eng.connections == (2 if closed_first else 1) and client.stale_retries == 0
        finally:
            client.close()


@pytest.mark.parametrize("retry", [True, False])
async def test_a_reused_connection_the_engine_closed_is_retried_not_failed(monkeypatch: pytest.MonkeyPatch,
                                                                           retry: bool) -> None:
    """The engine's keep-alive close races our second request on the connection (it closes without a byte of
    answer): sent once more on a fresh connection and counted; without that it is a failed request."""
    if not retry:
        monkeypatch.setattr("h1lite.client._stale", lambda *a: False)
    monkeypatch.setattr("h1lite.client.STALE_IDLE_S", 0.2)
    client = Client(connect_timeout_s=1.0, idle_s=30)
    async with RawEngine(lambda n: OK if n == 1 else None) as eng:
        try:
            assert await client.fetch(eng.base, "GET", "/x") == (200, b"ok")
            await asyncio.sleep(0.25)  # idle long enough for a keep-alive close to be plausible
            if retry:
                assert await client.fetch(eng.base, "GET", "/x") == (200, b"ok")
                assert client.stale_retries == 1 and eng.connections == 2
            else:
                with pytest.raises(ConnectionError):
                    await client.fetch(eng.base, "GET", "/x")
        finally:
            client.close()


async def test_idle_connections_expire_before_the_engines_keepalive() -> None:
    client = Client(connect_timeout_s=1.0, idle_s=0.2)
    async with RawEngine(lambda n: OK) as eng:
        try:
            await client.fetch(eng.base, "GET", "/x")
            await client.fetch(eng.base, "GET", "/x")
            assert eng.connections == 1
            await asyncio.sleep(0.3)
            await client.fetch(eng.base, "GET", "/x")
            assert eng.connections == 2 and client.stale_retries == 0
        finally:
            client.close()


async def test_pool_caps_open_connections_per_origin() -> None:
    gate = asyncio.Event()

    async def slow(w: asyncio.StreamWriter) -> None:
        await gate.wait()
        w.write(OK)
        await w.drain()

    client = Client(connect_timeout_s=0.5, max_open=2)
    async with RawEngine(lambda n: slow) as eng:
        try:
            first = [asyncio.create_task(client.fetch(eng.base, "GET", "/x")) for _ in range(2)]
            await asyncio.sleep(0.1)
            with pytest.raises(ConnectFailed, match="the pool's limit"):
                await client.fetch(eng.base, "GET", "/x")
            third = asyncio.create_task(client.fetch(eng.base, "GET", "/x"))
            await asyncio.sleep(0.1)
            assert eng.connections == 2
            gate.set()
            assert [await t for t in (*first, third)] == [(200, b"ok")] * 3
        finally:
            client.close()


@pytest.mark.parametrize("raise_it", [True, False])
async def test_a_raised_cap_lets_the_waiting_requests_go_at_once(raise_it: bool) -> None:
    """Connections follow capacity (issue 27): a request waiting at the pool's cap opens its own connection as soon
    as the cap is raised (``Client.limit`` wakes it); left as it is, it waits for the first one to end."""
    gate = asyncio.Event()

    async def slow(w: asyncio.StreamWriter) -> None:
        await gate.wait()
        w.write(OK)
        await w.drain()

    client = Client(connect_timeout_s=1.0, max_open=1)
    async with RawEngine(lambda n: slow) as eng:
        try:
            first = asyncio.create_task(client.fetch(eng.base, "GET", "/x"))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(client.fetch(eng.base, "GET", "/x"))
            await asyncio.sleep(0.05)
            if raise_it:
                client.limit(eng.base, 2)
            await asyncio.sleep(0.2)
            assert eng.connections == (2 if raise_it else 1)
            gate.set()
            assert [await first, await second] == [(200, b"ok")] * 2
        finally:
            client.close()


@pytest.mark.parametrize("limit", [1 << 20, None])
async def test_a_huge_answer_is_bounded(limit: int | None) -> None:
    """An engine (or anything registered as one) answering 2 GiB: the read stops at the limit with a clear
    error, memory + < 10 MB; with no limit it keeps reading (checked up to 256 MB, then we stop it)."""
    client = Client(connect_timeout_s=1.0)
    before = rss_mb()
    async with RawEngine(lambda n: flood) as eng:
        try:
            if limit is not None:
                with pytest.raises(BodyTooLarge, match="more than 1048576 bytes"):
                    await client.fetch(eng.base, "GET", "/health", limit=limit)
                assert rss_mb() - before < 10
            else:
                task = asyncio.create_task(client.fetch(eng.base, "GET", "/health"))
                while rss_mb() - before < 256:
                    assert not task.done()
                    await asyncio.sleep(0.05)
                task.cancel()
        finally:
            client.close()


async def test_client_keeps_response_headers_sends_ours_and_reads_to_close() -> None:
    async def until_close(w: asyncio.StreamWriter) -> None:  # no length, no chunks: the body ends with the connection
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await w.drain()

    answers = {1: OK}
    client = Client(connect_timeout_s=1.0)
    async with RawEngine(lambda n: answers.get(n, OK)) as eng:
        try:
            resp, body = await client.fetch_response(eng.base, "GET", "/x", headers={"traceparent": "00-ab-cd-01",
                                                                                     "Authorization": "Bearer k"})
            assert body == b"ok" and resp.headers["retry-after"] == "3" and resp.headers["x-engine"] == "sim"
            assert b"traceparent: 00-ab-cd-01\r\n" in eng.heads[0] and b"Authorization: Bearer k\r\n" in eng.heads[0]
            with pytest.raises(ValueError, match="invalid request header"):
                await client.fetch(eng.base, "GET", "/x", headers={"X": "a\r\nb: c"})
        finally:
            client.close()
    client = Client(connect_timeout_s=1.0)  # a closed client sends nothing more
    async with RawEngine(lambda n: until_close if n == 1 else None) as eng:
        try:
            assert await client.fetch(eng.base, "GET", "/x") == (200, b"all of it")
        finally:
            client.close()


def test_https_and_bad_ports_are_refused_at_validation() -> None:
    from pdgate.core.config import ConfigError, WorkerSpec, validate_worker

    with pytest.raises(ConfigError, match="https:// workers are not supported"):
        validate_worker(WorkerSpec(url="https://127.0.0.1:30000", role="decode"))
    with pytest.raises(ConfigError, match="not a URL"):
        validate_worker(WorkerSpec(url="http://127.0.0.1:99999", role="decode"))


async def test_a_huge_leg_answer_and_a_huge_health_answer_through_the_gateway() -> None:
    """A decode whose every answer is 2 GiB: the request gets a clear 502 and the gateway's memory stays
    bounded; its /health answer is refused as well (the worker is down, its error says why)."""
    from pdgate.core.config import GatewayConfig, HealthConfig, ReconcileConfig, WorkerSpec, validate
    from tests.pdgate.harness import start_gateway

    prefill_ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
    async with RawEngine(lambda n: prefill_ok) as pre, RawEngine(lambda n: flood) as dec:
        cfg = validate(GatewayConfig(
            port=free_port(), max_upstream_body_bytes=1 << 20, drain_s=0.2, reconcile=ReconcileConfig(enabled=False),
            prefill=(WorkerSpec(url=pre.base, role="prefill", bootstrap_port=free_port()),),
            decode=(WorkerSpec(url=dec.base, role="decode"),),
            health=HealthConfig(interval_s=60, timeout_s=2, failures=1, degraded_after_s=30)))
        g = await start_gateway(cfg)
        try:
            await huge_leg(g, cfg.port)
        finally:
            await g.close()  # before the engines go: no health check reconnects to a closing flood


async def huge_leg(g: Any, port: int) -> None:
    from pdgate.pool.workers import State

    w = g.gw.pool.by_id["d0"]
    assert not w.healthy and "more than 1048576 bytes" in (w.checks.last_error or ""), w.checks.last_error
    for _ in range(100):  # the health task's first check (the start's is the first failure) must be over too
        if w.checks.failures >= 2:
            break
        await asyncio.sleep(0.05)
    w.transition(State.UP, g.gw.now(), "test: let it serve")
    before = rss_mb()
    r, wr = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}'
    wr.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body))
    out = await read_all(r, 10)
    wr.close()
    # the leg's own error, or (when a health check got there first) the worker's: both say why
    assert out.startswith(b"HTTP/1.1 502 ") and b"answered more than 1048576 bytes" in out, out[:300]
    assert rss_mb() - before < 20


def test_the_open_files_limit_is_raised_at_start() -> None:
    """Every connection is an fd: the soft limit goes up to the hard one (in a child, so this process keeps its own)."""
    import subprocess
    import sys

    code = ("import resource; from pdgate.planes.server import raise_fd_limit; s, h = resource.getrlimit(resource.RLIMIT_NOFILE);"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, h), h)); raise_fd_limit();"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE) == (h, h))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr


async def test_a_request_split_at_every_few_bytes_is_answered(app: App) -> None:
    """uvicorn's fragmentation case: head and body arrive in 7-byte pieces, and the answer is whole."""
    r, w = await asyncio.open_connection("127.0.0.1", app.port)
    raw = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\nConnection: close\r\n\r\nhello world"
    for i in range(0, len(raw), 7):
        w.write(raw[i:i + 7])
        await w.drain()
        await asyncio.sleep(0.005)
    out = await read_all(r, 2.0)
    w.close()
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"hello world")


async def ended(eng: RawEngine, within: float = 2.0) -> bool:
    """Whether every connection the engine accepted has ended (its handler saw our close), within ``within`` s."""
    end = time.monotonic() + within
    while eng.tasks and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return not eng.tasks


async def test_a_closed_client_opens_no_connection_a_late_call_would_leave_open() -> None:
    """A call after ``close()`` (a gateway's abort task that outlived its stop) is refused: it used to open a
    connection in a new pool no close reaches, left to the garbage collector (a ResourceWarning in a later test)."""
    client = Client(connect_timeout_s=0.5)
    async with RawEngine(lambda n: OK) as eng:
        assert await client.fetch(eng.base, "GET", "/x") == (200, b"ok")
        client.close()
        assert await ended(eng), "the idle connection was not closed"
        with pytest.raises(ConnectFailed, match="the client is closed"):
            await client.fetch(eng.base, "GET", "/x")
        assert eng.connections == 1 and not client.pools


async def test_a_connection_made_while_its_pool_closes_is_closed_not_pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` lands while a connection is being made (it is in none of the pool's lists yet): that connection
    is closed on arrival and its call fails, instead of serving and idling in a pool nobody closes again."""
    made, go = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    real = loop.create_connection

    async def slow_connect(*a: Any, **kw: Any) -> Any:
        out = await real(*a, **kw)
        made.set()
        await go.wait()
        return out

    monkeypatch.setattr(loop, "create_connection", slow_connect)
    client = Client(connect_timeout_s=2.0)
    async with RawEngine(lambda n: OK) as eng:
        call = asyncio.create_task(client.fetch(eng.base, "GET", "/x"))
        await asyncio.wait_for(made.wait(), 2)
        client.close()
        go.set()
        with pytest.raises(ConnectFailed, match="its pool is closed"):
            await call
        assert await ended(eng), "the connection made during close() is still open"
        assert eng.heads == []
