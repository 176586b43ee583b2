"""The load generator of ``bench --streams-workload``, run as its own process: N long-lived SSE streams.

``python -m loadtest.streamclient --url URL [--url URL ...] --streams N --ramp-s S --max-tokens M
--duration D --tokens-per-s R``. Stream ``i`` starts at ``i * S / N`` s and goes to the ``i % len(urls)``-th
URL (``direct``: the decodes, round robin; a gateway: its one URL). Every stream asks ``M`` tokens of a
paced fake decode (``loadtest.fakeworker --tokens-per-s R``), whose events carry their emission time
(``"t":<time.monotonic_ns()>``). The steady window opens once every stream has started and has its first
event (or has failed) and lasts ``D`` s; in it, every event's relay delay (receive time - emission time:
CLOCK_MONOTONIC is one clock for the whole machine) goes into a histogram (10 µs buckets up to 1 s, then
1 ms up to 60 s). Prints one JSON line per phase (``{"event": "window_start"}``, ``"mid"`` with the live
streams, ``"window_end"``) as it happens, so that the driver samples CPU and RSS then, and a last line,
``{"event": "result", ...}``, once every stream ended.

Cheap by design (it shares the machine's cores with what it measures): one uvloop process, raw
``asyncio.Protocol`` connections, httptools for the status line and the chunked framing, one
``time.monotonic_ns()`` per read for every event in it, the stamp found with ``bytes.find`` (no JSON decode).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson
import uvloop

FINE_NS = 10_000  # 10 µs buckets ...
FINE_N = 100_000  # ... up to 1 s
COARSE_NS = 1_000_000  # then 1 ms buckets ...
COARSE_N = 60_000  # ... up to 60 s (anything later lands in the last one)
STAMP = b'"t":'
DONE = b"data: [DONE]"
ERROR = b'data: {"error"'


class Hist:
    """Delays in ns, bucketed: percentiles without a list of millions of floats."""

    __slots__ = ("coarse", "count", "fine", "max_ns", "negative")

    def __init__(self) -> None:
        self.fine = [0] * FINE_N
        self.coarse = [0] * COARSE_N
        self.count = 0
        self.max_ns = 0
        self.negative = 0

    def add(self, ns: int) -> None:
        self.count += 1
        if ns > self.max_ns:
            self.max_ns = ns
        b = ns // FINE_NS
        if b < FINE_N:
            if b < 0:
                self.negative += 1
                b = 0
            self.fine[b] += 1
        else:
            self.coarse[min(ns // COARSE_NS, COARSE_N - 1)] += 1

    def quantile_ns(self, q: float) -> float | None:
        """The ``q`` quantile, as its bucket's midpoint (5 µs off at most below 1 s)."""
        if not self.count:
            return None
        rank = max(1, int(q * self.count + 0.999999))  # the rank-th smallest (1-based, rounded up)
        seen = 0
        for b, c in enumerate(self.fine):
            seen += c
            if seen >= rank:
                return (b + 0.5) * FINE_NS
        for b, c in enumerate(self.coarse):
            seen += c
            if seen >= rank:
                return (b + 0.5) * COARSE_NS
        return float(self.max_ns)

    def summary(self) -> dict[str, Any]:
        def ms(q: float) -> float | None:
            v = self.quantile_ns(q)
            return None if v is None else round(v / 1e6, 3)

        return {"delay_p50_ms": ms(0.5), "delay_p99_ms": ms(0.99), "delay_p999_ms": ms(0.999),
                "delay_max_ms": round(self.max_ns / 1e6, 3), "delays": self.count, "negative_delays": self.negative}


class Run:
    """What all streams share: the window, the histogram, the counters."""

    def __init__(self, n: int, max_tokens: int, duration: float, on_phase: Callable[[str, dict[str, Any]], None]) -> None:
        self.n, self.max_tokens, self.duration = n, max_tokens, duration
        self.on_phase = on_phase
        self.hist = Hist()
        self.in_window = False
        self.window_events = 0  # events received within the window (with a stamp)
        self.window_start_ns = 0
        self.window_end_ns = 0
        self.waiting_first = n  # streams with neither a first event nor a failure yet
        self.all_started = False
        self.live = 0  # streams with their answer's head in and not ended
        self.ended = 0
        self.t0_ns = time.monotonic_ns()
        self.finished = asyncio.get_running_loop().create_future()
        self.errors: dict[str, int] = {}
        self.events_total = 0
        self.timers: list[asyncio.TimerHandle] = []  # cancelled once every stream ended

    def first(self) -> None:
        self.waiting_first -= 1
        self.maybe_open()

    def maybe_open(self) -> None:
        if self.all_started and self.waiting_first <= 0 and not self.window_start_ns:
            self.open_window()

    def open_window(self) -> None:
        if self.window_start_ns:
            return
        loop = asyncio.get_running_loop()
        self.in_window = True
        self.window_start_ns = time.monotonic_ns()
        self.on_phase("window_start", {"since_first_start_s": round((self.window_start_ns - self.t0_ns) / 1e9, 3),
                                       "live": self.live})
        self.timers.append(loop.call_later(self.duration / 2, lambda: self.on_phase("mid", {"live": self.live})))
        self.timers.append(loop.call_later(self.duration, self.close_window))

    def close_window(self) -> None:
        if self.window_end_ns:
            return
        self.in_window = False
        self.window_end_ns = time.monotonic_ns()
        self.on_phase("window_end", {"live": self.live})

    def end(self, errors: list[str]) -> None:
        self.ended += 1
        for e in errors:
            self.errors[e] = self.errors.get(e, 0) + 1
        if self.ended >= self.n and not self.finished.done():
            self.finished.set_result(None)


class StreamProto(asyncio.Protocol):
    """One streamed request on its own connection; events are framed by their blank line across reads."""

    __slots__ = ("done_seen", "error_event", "events", "got_first", "message_done", "now", "parser", "request", "run",
                 "status", "tail", "transport")

    def __init__(self, run: Run, request: bytes) -> None:
        self.run, self.request = run, request
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.events = 0
        self.tail = b""
        self.now = 0
        self.got_first = False
        self.done_seen = False
        self.error_event = False
        self.message_done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.now = time.monotonic_ns()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.run.live += 1

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            return
        data = self.tail + body if self.tail else body
        start = 0
        run = self.run
        while True:
            end = data.find(b"\n\n", start)
            if end < 0:
                break
            i = data.find(STAMP, start, end)
            if i >= 0:
                j = data.find(b"}", i, end)
                self.events += 1
                if run.in_window:
                    run.hist.add(self.now - int(data[i + 4:j if j > 0 else end]))
                    run.window_events += 1
                if not self.got_first:
                    self.got_first = True
                    run.first()
            elif data.startswith(DONE, start):
                self.done_seen = True
            elif data.startswith(ERROR, start):
                self.error_event = True
            start = end + 2
        self.tail = data[start:] if start < len(data) else b""

    def on_message_complete(self) -> None:
        self.message_done = True
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        errors: list[str] = []
        if self.status == 0:
            errors.append("no_answer")
        elif self.status != 200:
            errors.append(f"status_{self.status}")
        else:
            if not self.message_done:
                errors.append("cut")
            if not self.done_seen:
                errors.append("no_done")
            if self.events < self.run.max_tokens:
                errors.append("short")
            if self.error_event:
                errors.append("error_event")
        if self.status:
            self.run.live -= 1
        self.run.events_total += self.events
        if not self.got_first:  # failed before its first event: the window does not wait for it
            self.got_first = True
            self.run.first()
        self.run.end(errors)


def request_bytes(url: str, max_tokens: int, i: int = 0) -> tuple[str, int, bytes]:
    """Stream ``i``'s request; its prompt begins with its own number (a cache-aware router spreads them)."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    body = orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": f"{i * 2654435761 % 2**32:08x} stream"}],
                         "max_tokens": max_tokens, "stream": True})
    head = (f"POST {u.path.rstrip('/') or ''}/v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
    return host, port, head.encode() + body


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_streams(urls: list[str], n: int, ramp_s: float, max_tokens: int, duration: float, rate: float,
                      on_phase: Callable[[str, dict[str, Any]], None] | None = None,
                      slack_s: float = 10.0) -> dict[str, Any]:
    """Run the streams; the result once every stream ended (or gave up ``slack_s`` past its expected end)."""
    loop = asyncio.get_running_loop()
    run = Run(n, max_tokens, duration, on_phase or (lambda _e, _d: None))
    protos: list[StreamProto] = []
    connects: set[asyncio.Task[Any]] = set()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)

    async def connect(i: int) -> None:
        host, port, req = request_bytes(urls[i % len(urls)], max_tokens, i)
        proto = StreamProto(run, req)
        protos.append(proto)
        try:
            await loop.create_connection(lambda: proto, host, port)
        except OSError:
            proto.connection_lost(None)

    start = loop.time()
    for i in range(n):
        due = start + i * ramp_s / n
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        task = loop.create_task(connect(i))
        connects.add(task)
        task.add_done_callback(connects.discard)
    run.all_started = True
    run.maybe_open()
    # a stream's first event comes within 1/R of its start: the window opens on time, or after this at the latest
    first_by = 2.0 / max(rate, 1e-3) + slack_s
    run.timers.append(loop.call_later(first_by, run.open_window))
    expected = max_tokens / max(rate, 1e-3) + 2.0 / max(rate, 1e-3)
    timed_out = 0
    try:
        await asyncio.wait_for(asyncio.shield(run.finished), expected + slack_s + first_by)
    except TimeoutError:  # streams still open this long past their expected end: closed, and counted
        timed_out = run.n - run.ended
        run.errors["timeout"] = timed_out
        for t in list(connects):
            t.cancel()
        for p in protos:
            p.close()
        await asyncio.sleep(0.2)
    for h in run.timers:
        h.cancel()
    run.close_window()  # if every stream ended before the window did
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    window_s = (run.window_end_ns - run.window_start_ns) / 1e9 if run.window_start_ns else 0.0
    failed = sum(1 for p in protos if p.status != 200 or not p.message_done or not p.done_seen
                 or p.events < max_tokens or p.error_event)
    return {"streams": n, "max_tokens": max_tokens, "ramp_s": ramp_s, "duration_s": duration, "tokens_per_s": rate,
            "window_s": round(window_s, 4), "window_events": run.window_events,
            "window_events_per_s": round(run.window_events / window_s, 1) if window_s else 0.0,
            "window_start_s": round((run.window_start_ns - run.t0_ns) / 1e9, 3) if run.window_start_ns else None,
            "events_total": run.events_total, "events_expected": n * max_tokens,
            "errors": failed, "error_kinds": run.errors, "timed_out": timed_out,
            "client_cpu_s": round(cpu, 3), **run.hist.summary()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.streamclient", description=__doc__.split("\n", 1)[0])
    p.add_argument("--url", action="append", required=True, help="where streams go, round robin (repeatable)")
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--ramp-s", type=float, default=1.0, help="the streams start evenly over this long")
    p.add_argument("--max-tokens", type=int, required=True, help="events each stream asks for")
    p.add_argument("--duration", type=float, default=10.0, help="the steady window, s")
    p.add_argument("--tokens-per-s", type=float, default=10.0, help="the engines' pace (for the time-outs)")
    a = p.parse_args(argv)
    raise_nofile()

    def phase(event: str, data: dict[str, Any]) -> None:
        sys.stdout.write(orjson.dumps({"event": event, "t_ns": time.monotonic_ns(), **data}).decode() + "\n")
        sys.stdout.flush()

    out = uvloop.run(run_streams(a.url, a.streams, a.ramp_s, a.max_tokens, a.duration, a.tokens_per_s, phase))
    phase("result", out)


if __name__ == "__main__":
    main()
