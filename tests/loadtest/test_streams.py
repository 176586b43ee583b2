"""bench --streams-workload: paced fake engines, the stream client's framing and delays, a small real run."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from h1lite.server import Server
from loadtest import bench, fakeworker, streams
from loadtest.streamclient import Hist, run_streams


def test_capacity_interpolates_where_the_added_p99_passes_the_limit() -> None:
    pts: list[tuple[float, float | None]] = [(10000, 14.0), (2500, 1.0), (5000, 6.0), (20000, 30.0)]
    assert streams.capacity(pts, 10.0) == {"events_per_s": 7500.0, "label": "7500"}  # 5000 + (10-6)/(14-6) * 5000
    assert streams.capacity([(2500, 0.5), (5000, 10.0), (10000, 12.0)], 10.0)["events_per_s"] == 5000.0  # reached, not passed
    assert streams.capacity([(2500, 0.5), (5000, 9.0), (10000, 12.0)], 10.0)["events_per_s"] == round(
        5000 + (10 - 9) / (12 - 9) * 5000, 1)
    assert streams.capacity([(2500, 0.5), (5000, 2.0)], 10.0) == {"events_per_s": None, "label": "> 5000"}
    assert streams.capacity([(2500, 11.0), (5000, 20.0)], 10.0) == {"events_per_s": None, "label": "< 2500"}
    assert streams.capacity([(2500, None), (5000, 2.0), (10000, 22.0)], 10.0)["events_per_s"] == 7000.0
    assert streams.capacity([], 10.0)["events_per_s"] is None
    behind = streams.capacity([(10000, 1.0), (20000, 3.0), (30000, math.inf)], 10.0)
    assert behind == {"events_per_s": 20000.0, "label": ">= 20000 (behind at 30000)"}


def test_a_target_that_fell_behind_is_past_its_capacity_and_repeats_give_medians() -> None:
    ok = {"streams": 100, "errors": 0, "live_at_window_start": 100, "live_at_window_end": 100,
          "window_events_per_s": 999.0, "events_per_s_offered": 1000.0, "delay_p99_ms": 1.0}
    assert streams.kept_up(ok)
    assert not streams.kept_up({**ok, "live_at_window_start": 80}), "streams that started late"
    assert not streams.kept_up({**ok, "window_events_per_s": 900.0}), "fewer events than offered"
    assert not streams.kept_up({**ok, "errors": 1})
    runs = {"pdgate": {"100": [ok, {**ok, "delay_p99_ms": 5.0}, {**ok, "delay_p99_ms": 3.0, "errors": 2}]}}
    m = streams.medians(runs)["pdgate"]["100"]
    assert m["delay_p99_ms"] == 3.0 and m["errors"] == 0 and m["kept_up"], "medians over the repeats"


def test_histogram_percentiles() -> None:
    h = Hist()
    for us in range(1, 1001):  # 1 µs .. 1 ms
        h.add(us * 1000)
    h.add(-5)  # a clock cannot go back, but it is counted, not lost
    h.add(3 * 10**9)  # past the fine buckets: 3 s
    s = h.summary()
    assert s["delays"] == 1002 and s["negative_delays"] == 1
    assert abs(s["delay_p50_ms"] - 0.5) <= 0.011 and abs(s["delay_p99_ms"] - 0.99) <= 0.011
    assert s["delay_max_ms"] == 3000.0
    assert abs(h.quantile_ns(1.0) - 3.0005e9) < 1e6  # type: ignore[operator]
    assert Hist().quantile_ns(0.5) is None


async def fake_sse_server(events: int, modes: list[str]) -> tuple[asyncio.Server, str]:
    """A server whose n-th connection answers as ``modes[n]``: ``ok`` writes ``events`` stamped events cut and
    merged every way (an event's bytes in two writes at a random offset, HTTP framing included; two events in
    one write; an event across two HTTP chunks), ``cut`` closes after 3 events, ``500`` refuses."""
    rng = random.Random(7)
    conns = iter(modes)

    def ev() -> bytes:
        return b'data: {"object":"chat.completion.chunk","choices":[{"delta":{"content":"x"}}],"t":%d}\n\n' % (
            time.monotonic_ns())

    def chunk(b: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(b), b)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode = next(conns)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = await reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"Content-Length: (\d+)", head)
        assert m is not None
        body = orjson.loads(await reader.readexactly(int(m.group(1))))
        assert body["stream"] is True and body["max_tokens"] == events
        if mode == "500":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        sent, i = 0, 0
        while sent < (3 if mode == "cut" else events):
            how = i % 3
            i += 1
            if how == 0:  # one event, its bytes (framing included) in two writes at a random offset
                raw = chunk(ev())
                cut = rng.randrange(1, len(raw))
                writer.write(raw[:cut])
                await writer.drain()
                await asyncio.sleep(0.004)
                writer.write(raw[cut:])
                sent += 1
            elif how == 1 and sent + 2 <= events:  # two events in one write (one HTTP chunk)
                writer.write(chunk(ev() + ev()))
                sent += 2
            else:  # one event across two HTTP chunks, two writes
                e = ev()
                cut = rng.randrange(1, len(e))
                writer.write(chunk(e[:cut]))
                await writer.drain()
                await asyncio.sleep(0.004)
                writer.write(chunk(e[cut:]))
                sent += 1
            await writer.drain()
            await asyncio.sleep(0.008)
        if mode == "ok":
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_client_frames_split_and_merged_events() -> None:
    n, events = 3, 30
    server, url = await fake_sse_server(events, ["ok"] * n)
    phases: list[str] = []
    try:
        res = await run_streams([url], n, 0.05, events, 0.25, 50.0, lambda e, _: phases.append(e), slack_s=5)
    finally:
        server.close()
        await server.wait_closed()
    assert phases == ["window_start", "mid", "window_end"]
    assert res["errors"] == 0 and res["error_kinds"] == {}, res
    assert res["events_total"] == res["events_expected"] == n * events
    assert res["window_events"] > 10 and res["delays"] == res["window_events"] and res["negative_delays"] == 0
    # the stamps were read right: a merged event came at once, a split one 4 ms after its stamp (half of them)
    assert 0 < res["delay_p50_ms"] < 10 and 3.5 <= res["delay_max_ms"] < 500, res


async def test_client_counts_a_cut_stream_and_a_refused_one() -> None:
    server, url = await fake_sse_server(10, ["ok", "cut", "500"])
    try:
        res = await run_streams([url], 3, 0.1, 10, 0.1, 50.0, slack_s=5)
    finally:
        server.close()
        await server.wait_closed()
    assert res["errors"] == 2, res
    assert res["error_kinds"] == {"cut": 1, "no_done": 1, "short": 1, "status_500": 1}, res
    assert res["events_total"] == 13


async def test_paced_fake_decode_stamps_its_events_and_stops_when_the_client_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = [0]
    tick = fakeworker.Paced.tick

    def counted(self: fakeworker.Paced) -> None:
        ticks[0] += 1
        tick(self)

    monkeypatch.setattr(fakeworker.Paced, "tick", counted)
    server = Server(fakeworker.build("decode", 100.0).dispatch, 1 << 20)
    await server.start("127.0.0.1", 0)
    try:
        body = b'{"max_tokens":100000,"stream":true}'
        req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        # a short stream: max_tokens paced events, about 1/R apart, each stamped, then [DONE]
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        short = b'{"max_tokens":5,"stream":true}'
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(short), short))
        t0 = time.monotonic()
        got = b""
        while b"0\r\n\r\n" not in got:
            got += await asyncio.wait_for(r.read(65536), 5)
        assert 0.035 <= time.monotonic() - t0 < 2.0
        events = [orjson.loads(x[6:]) for x in re.findall(rb"data: \{[^\n]*\}", got)]
        assert len(events) == 5 and got.count(b"data: [DONE]") == 1
        stamps = [e["t"] for e in events]
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert stamps == sorted(stamps) and 0.03e9 <= stamps[-1] - stamps[0] <= 1.5e9  # 4 periods of 10 ms
        w.close()
        # a long one whose client leaves after three events: the engine stops ticking for it
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        w.write(req)
        got = b""
        while got.count(b'"t":') < 3:
            got += await asyncio.wait_for(r.read(65536), 5)
        w.close()
        await w.wait_closed()
        await asyncio.sleep(0.1)
        before = ticks[0]
        await asyncio.sleep(0.3)  # 30 ticks at 100/s, were it still going
        assert ticks[0] == before
    finally:
        await server.close()


def streams_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_parser(p.add_subparsers())
    return p.parse_args(["bench", "--streams-workload", "--out", str(tmp_path / "streams.json"), *extra])


@pytest.mark.timeout(150)
def test_a_small_streams_run_through_direct_and_pdgate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 streams for a 1.5 s window, direct, pdgate and the floor (a bare relay on h1lite); a pdgate-w2 that exits at
    start is skipped, saying why."""
    real = streams.gateway_args

    def args(name: str, eng: dict[str, Any], port: int, cfg: Path) -> list[str]:
        if name == "pdgate-w2":  # as a pdgate without --workers would
            return [sys.executable, "-c", "import sys; print('pdgate serve: no such option --workers'); sys.exit(2)"]
        return real(name, eng, port, cfg)

    monkeypatch.setattr(streams, "gateway_args", args)
    a = streams_args(tmp_path, "--streams", "40", "--duration", "1.5", "--ramp-s", "0.5", "--margin-s", "1", "--streams-targets", "pdgate",
                     "h1lite-floor", "--pdgate-workers", "1", "2")
    out = streams.run(a)
    assert (tmp_path / "streams.png").stat().st_size > 5000
    saved = json.loads((tmp_path / "streams.json").read_text())
    assert saved["targets"] == ["direct", "pdgate", "h1lite-floor"]
    assert set(saved["results"]) == {"direct", "pdgate", "h1lite-floor"}
    assert "no such option --workers" in saved["skipped"]["pdgate-w2"]
    assert out["capacity"]["pdgate"]["label"] == "> 400"  # 40 x 10 events/s, far below any limit
    for name in ("direct", "pdgate", "h1lite-floor"):
        m = saved["results"][name]["40"]
        assert m["errors"] == 0 and m["error_kinds"] == {}, (name, m)
        assert m["events_total"] == m["events_expected"] == 40 * m["max_tokens"], (name, m)
        assert m["max_tokens"] == 30  # 10/s x (0.5 ramp + 1.5 window + 1 margin)
        assert 0.7 * 600 <= m["window_events"] <= 1.3 * 600, m  # 400 events/s for 1.5 s
        assert m["live_at_window_start"] == m["live_at_mid"] == m["live_at_window_end"] == 40, m
        assert 0 < m["delay_p50_ms"] <= m["delay_p99_ms"] <= m["delay_p999_ms"] < 250 and m["negative_delays"] == 0, m
        assert m["engines_cpu_us_per_event"] > 0 and m["client_cpu_us_per_event"] > 0, m
        parts = m.get("target_cpu_us_per_event", 0.0) + m["engines_cpu_us_per_event"] + m["client_cpu_us_per_event"]
        assert abs(parts - m["machine_cpu_us_per_event"]) < 0.1, m
    d, g = saved["results"]["direct"]["40"], saved["results"]["pdgate"]["40"]
    assert d["added_p99_ms"] == 0 and g["added_p99_ms"] == round(g["delay_p99_ms"] - d["delay_p99_ms"], 3)
    assert g["target_cpu_us_per_event"] > 0 and g["target_cpu_share"] > 0
    assert g["idle_rss_kb"] > 10_000 and g["live_rss_kb"] > g["idle_rss_kb"] and g["kb_per_stream"] > 0, g
    assert "target_cpu_us_per_event" not in d and "kb_per_stream" not in d
