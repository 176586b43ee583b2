"""The five ways the promise broke on cea4624, each as a regression test (issue 12), plus the framer's units.

Real gateway, real sim processes; streams read by a client that timestamps every event.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.engine.simclient import set_faults
from tests.pdgate.harness import assert_clean, make_config, start_gateway
from tests.pdgate.sse import call
from tests.pdgate.test_outcomes import CHAT, gateway, trace
from tests.procs import ROOT, Procs, free_port, wait_http
from tests.test_up import cluster_file

STREAM = {**CHAT, "stream": True}


# ---- 1. the idle budget applies from the first token, even when the prefill took longer than it ----
async def test_idle_deadline_after_a_long_prefill(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    """idle 0.5 s, a prefill of 1 s, then the decode stalls after a few tokens: an idle error within
    ~0.5 s of the last token. On cea4624 the watchdog, having fired early at admission + idle, slept
    until the TTFT deadline (10 s here) and only then said 'idle'."""
    p = procs.sim("prefill", "--fault", "slow_prefill=1")
    d = procs.sim("decode", "--speed", "20")  # ~80 ms a token
    g = await gateway(gateways, [p], [d])
    body = {**STREAM, "max_tokens": 64}
    task = asyncio.create_task(call(http, g.url + "/v1/chat/completions", body,
                                    {"x-pdgate-idle-timeout": "0.5", "x-pdgate-ttft-timeout": "10"}))
    while not g.gw.traces.live or next(iter(g.gw.traces.live.values())).chunks < 3:
        await asyncio.sleep(0.02)
    await set_faults(http, d, decode_stall=True)  # no more tokens, while /health still answers (a gray failure)
    try:
        seen = await asyncio.wait_for(task, 15)
    finally:
        await set_faults(http, d, decode_stall=False)
    assert seen.status == 200 and seen.done_count == 1
    [err] = seen.error_events
    assert err["code"] == "deadline_exceeded" and err["message"].startswith("idle deadline of 0.5s"), err
    assert seen.ended_at is not None
    assert seen.ended_at - seen.tokens[-1] < 0.5 + 0.4, "the idle answer came late"
    t = await trace(http, g, seen.rid or "")
    assert t["outcome"] == "deadline_exceeded" and t["cause"] == "deadline"
    await assert_clean(http, g.gw, [p, d], within=5)


# ---- 2. a stream's TTFT is its first decode token, not the prefill's answer ----
async def test_streaming_ttft_is_the_first_decode_token(procs: Procs, http: aiohttp.ClientSession,
                                                       gateways: list[Any]) -> None:
    """The prefill answers at once, the decode's first token comes 0.5 s later. With a 0.2 s TTFT budget the
    stream must get a TTFT 504 (cea4624: completed, TTFT recorded 0.05 s); with a generous budget the
    recorded TTFT is what the client saw."""
    p, d = procs.sim("prefill"), procs.sim("decode", "--fault", "slow_first_token=0.5")
    g = await gateway(gateways, [p], [d])
    url = g.url + "/v1/chat/completions"
    tight = await call(http, url, {**STREAM, "max_tokens": 2}, {"x-pdgate-ttft-timeout": "0.2"})
    assert tight.status == 504, (tight.status, tight.events)
    assert tight.json["error"]["message"].startswith("ttft deadline of 0.2s"), tight.json
    assert tight.ended_at is not None and tight.ended_at - tight.sent_at < 0.2 + 0.25
    ok = await call(http, url, {**STREAM, "max_tokens": 2}, {"x-pdgate-ttft-timeout": "5"})
    assert ok.status == 200 and ok.done_count == 1
    client_ttft = ok.tokens[0] - ok.sent_at
    t = await trace(http, g, ok.rid or "")
    assert client_ttft > 0.45
    assert abs(t["timings_s"]["ttft"] - client_ttft) < 0.05, (t["timings_s"], client_ttft)
    await assert_clean(http, g.gw, [p, d])


# ---- 3. [DONE] (and any event) split across reads ----
SAMPLE = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}\n\n'
          b"data: [DONE]\n\n")


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
def test_framer_decides_per_event_at_every_split(sep: bytes) -> None:
    from pdgate.path.relay import Framer  # here, not at the top: the end-to-end tests above also run on cea4624

    stream = SAMPLE.replace(b"\n\n", sep)
    for cut in range(1, len(stream)):
        for cut2 in (cut, min(len(stream) - 1, cut + 7)):
            fr = Framer()
            out, tokens = b"", 0
            for piece in (stream[:cut], stream[cut:cut2], stream[cut2:]):
                out += fr.push(piece)
                tokens += fr.tokens
                assert not fr.error
            assert out == stream and fr.done and tokens == 2, (cut, cut2)
            assert fr.push(b"data: late\n\n") == b"", "nothing after [DONE]"


def test_framer_error_events() -> None:
    from pdgate.path.relay import Framer

    fr = Framer()
    assert fr.push(b'data: {"err') == b""
    assert fr.push(b'or": {"message": "x"}}\n\n') and fr.first_error and fr.error and fr.tokens == 0
    fr = Framer()
    fr.push(b'data: {"a": 1}\n\ndata: {"er')
    assert fr.tokens == 1 and not fr.error
    fr.push(b'ror": 1}\n\ndata: [DONE]\n\n')
    assert fr.error and not fr.first_error and fr.done and fr.tokens == 0


async def test_streams_with_events_split_and_merged_complete(procs: Procs, http: aiohttp.ClientSession,
                                                             gateways: list[Any]) -> None:
    """The decode cuts every write at random offsets (its last write is the bare [DONE]: always split) or
    merges writes. Every stream completes with all its tokens and exactly one [DONE]; on cea4624 a split
    [DONE] failed the stream and the client got two."""
    p = procs.sim("prefill")
    d = procs.sim("decode", "--fault", "segment=1", "--fault", "segment_seed=12")
    g = await gateway(gateways, [p], [d])
    seen = await asyncio.gather(*(call(http, g.url + "/v1/chat/completions", {**STREAM, "max_tokens": 12})
                                  for _ in range(24)))
    doubled = [s.rid for s in seen if s.done_count != 1 or s.error_events]
    assert not doubled, f"{len(doubled)} of 24 streams got an error event or two [DONE]s"
    for s in seen:
        assert s.status == 200 and s.error is None, s
        assert len(s.tokens) == 12
        t = await trace(http, g, s.rid or "")
        assert t["outcome"] == "completed" and t["tokens"]["chunks"] == 12, t
    await assert_clean(http, g.gw, [p, d])


# ---- 4. drain answers every live request ----
async def test_drain_answers_live_requests(procs: Procs, http: aiohttp.ClientSession) -> None:
    """Past drain_s a live stream gets an error event (gateway_draining) and one [DONE], a live
    non-streaming request a 503 JSON, and both legs are aborted; cea4624 closed the sockets with no answer."""
    p, d = procs.sim("prefill"), procs.sim("decode", "--speed", "30")
    g = await start_gateway(make_config([p], [d], drain_s=0.3))
    url = g.url + "/v1/chat/completions"
    try:
        stream = asyncio.create_task(call(http, url, {**STREAM, "max_tokens": 64}))
        plain = asyncio.create_task(call(http, url, {**CHAT, "max_tokens": 64}))
        while len(g.gw.traces.live) < 2 or not any(r.chunks for r in g.gw.traces.live.values()):
            await asyncio.sleep(0.02)
        await g.close()
    finally:
        if g.gw.upstream is not None and g.runner.server.server is not None and g.runner.server.server.is_serving():
            await g.close()
    s, n = await stream, await plain
    assert s.status == 200 and s.error is None and s.done_count == 1, s
    [err] = s.error_events
    assert err["code"] == "gateway_draining" and err["message"].startswith("drain:")
    assert n.status == 503 and n.json["error"]["code"] == "gateway_draining", (n.status, n.body)
    for rid in (s.rid, n.rid):
        rec = g.gw.traces.get(rid or "")
        assert rec is not None and rec.outcome is not None and rec.outcome.value == "aborted" and rec.cause == "drain"
    await assert_clean(http, g.gw, [p, d], within=5)


def test_ctrl_c_on_pdgate_up_drains_before_the_workers_stop(procs: Procs, tmp_path: Path) -> None:
    """A terminal's Ctrl-C is SIGINT to the whole foreground process group. The workers live in process
    groups of their own, so only `pdgate up` gets it: its gateway drains (the live stream finishes), then the
    supervisor stops the workers. On cea4624 the workers died at once and the stream ended in 0.7 s."""
    port = free_port()
    cluster = cluster_file(tmp_path, 1, 1)
    text = cluster.read_text().replace('role = "decode"', 'role = "decode"\nargs = ["--speed", "10"]')
    cluster.write_text(text)
    up = procs.spawn([sys.executable, "-m", "pdgate", "up", "--cluster", str(cluster), "--port", str(port),
                      "--admin-port", str(free_port()), "--admin-key-file", str(tmp_path / "admin.key")],
                     name="pdgate-up", own_group=True)
    gw = f"http://127.0.0.1:{port}"
    wait_http(gw + "/readiness", timeout=60, proc=up.popen)
    client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0)
    try:
        stream = client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=40, stream=True)
        it = iter(stream)
        parts = [next(it).choices[0].delta.content or ""]
        t0 = time.monotonic()
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C: the foreground group, i.e. `pdgate up` and anything it shares it with
        parts.extend(c.choices[0].delta.content or "" for c in it if c.choices)
    finally:
        client.close()
    assert len("".join(parts).split()) == 40, "the live stream was cut"
    assert time.monotonic() - t0 > 0.5
    assert up.popen is not None and up.popen.wait(20) == 0


# ---- 5. every id a client holds finds its request ----
async def test_trace_by_response_id_and_client_request_id(procs: Procs, http: aiohttp.ClientSession,
                                                          gateways: list[Any]) -> None:
    """``pdgate trace <response.id>`` (an attempt's rid, what the OpenAI SDK shows) and the client's own
    x-request-id find the request; cea4624 answered 404 to both."""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0,
                                default_headers={"x-request-id": "client-abc-1"})
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": "say hi"}], max_tokens=3)
        resp = raw.parse()
    finally:
        await client.close()
    ours = raw.headers["x-request-id"]
    assert resp.id == ours + ".1"
    for ident in (ours, resp.id, "client-abc-1"):
        t = await trace(http, g, ident)
        assert t["id"] == ours and t["client_request_id"] == "client-abc-1", ident
    for missing in (ours + ".2", ours + ".x", "client-abc-2"):
        async with http.get(f"{g.admin}/v1/requests/{missing}") as r:
            assert r.status == 404, missing
    out = await asyncio.to_thread(_cli_trace, g.admin, resp.id)
    assert ours in out and "completed" in out


def _cli_trace(url: str, ident: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pdgate", "trace", ident, "--admin", url], cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout
