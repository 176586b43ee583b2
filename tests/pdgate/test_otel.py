"""OpenTelemetry: spans per request, attempt and leg, with the client's trace context in and the attempt's out to
both engines; checked with the SDK's in-memory exporter, and over OTLP/HTTP with a receiver in the test that
decodes what a real `pdgate serve` sends."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdgate.core.config import OtelConfig
from pdgate.observe.otel import Otel
from tests.pdgate.harness import make_config, start_gateway
from tests.procs import Procs, free_port, wait_http, workers_toml

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


async def seen(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with http.get(url + "/pdgate/v1/seen") as r:
        return list((await r.json())["seen"])


async def test_spans_per_request_attempt_and_leg_and_the_engines_join_the_trace(procs: Procs,
                                                                                gateways: list[Any]) -> None:
    bad = procs.sim("prefill", "--fault", "http_500_rate=1")  # the first attempt fails there, the second succeeds
    good, d = procs.sim("prefill"), procs.sim("decode")
    g = await start_gateway(make_config([bad, good], [d], policy="round_robin"))
    gateways.append(g)
    exporter = InMemorySpanExporter()
    g.gw.obs.otel = Otel(OtelConfig(enabled=True), exporter)
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # round robin: one of the two requests tries the failing prefill first
            async with http.post(g.url + "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}) as r:
                assert r.status == 200
                await r.read()
        spans = exporter.get_finished_spans()
        reqs = [s for s in spans if s.name == "pdgate /v1/chat/completions"]
        assert len(reqs) == 2
        for s in reqs:
            assert f"{s.context.trace_id:032x}" == TRACE, "the client's trace"
            assert s.parent is not None and f"{s.parent.span_id:016x}" == PARENT, "the client's span is the parent"
            assert s.attributes["pdgate.outcome"] == "completed" and s.attributes["gen_ai.usage.output_tokens"] == 4
            assert {"phase dispatched", "phase prefill", "phase completed"} <= {e.name for e in s.events}
        attempts = [s for s in spans if s.name.startswith("attempt ")]
        failed = [s for s in attempts if s.status.status_code.name == "ERROR"]
        assert [s.name for s in attempts].count("attempt 1") == 2
        assert 1 <= len(failed) == [s.name for s in attempts].count("attempt 2"), "each failed attempt was retried"
        assert all("500" in (f.status.description or "") for f in failed)
        by_id = {s.context.span_id: s for s in spans}
        for a in attempts:
            assert by_id[a.parent.span_id].name == "pdgate /v1/chat/completions"
            legs = sorted(s.name for s in spans if s.parent is not None and s.parent.span_id == a.context.span_id)
            assert legs == ["decode leg", "prefill leg"], legs
        ok = [a for a in attempts if a.status.status_code.name != "ERROR"]
        assert all("first_token" in {e.name for e in a.events} for a in ok)
        # both legs of every attempt carried the attempt span's context: the engines' own spans join it
        wanted = {f"00-{TRACE}-{a.context.span_id:016x}-01" for a in attempts}
        got = {x["traceparent"] for w in (bad, good, d) for x in await seen(http, w.url)}
        assert got == wanted, (got, wanted)


async def test_otlp_http_export_from_a_real_gateway_process(procs: Procs, tmp_path: Any) -> None:
    """`pdgate serve` with [otel] enabled sends its spans to an OTLP/HTTP receiver (here, in the test), decoded
    with the OTLP protobuf; they are flushed when the gateway stops."""
    got: list[Any] = []

    async def receive(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        for rs in msg.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                got.extend((service, s) for s in ss.spans)
        return web.Response(content_type="application/x-protobuf", body=b"")

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    rport = free_port()
    await web.TCPSite(runner, "127.0.0.1", rport).start()
    try:
        p, d = procs.pair()
        port = free_port()
        cfg = tmp_path / "g.toml"
        cfg.write_text(f'[gateway]\nport = {port}\nadmin_port = {free_port()}\n[otel]\nenabled = true\n'
                       f'endpoint = "http://127.0.0.1:{rport}/v1/traces"\nservice_name = "pdgate-test"\n'
                       + workers_toml([p], [d]))
        gw = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg)], name="pdgate-otel")
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_http, url + "/readiness", 30, gw.popen)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}) as r:
                assert r.status == 200
                await r.read()
        assert gw.popen is not None
        gw.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(gw.popen.wait, 20)
        for _ in range(50):
            if len(got) >= 4:
                break
            await asyncio.sleep(0.1)
        names = sorted(s.name for _, s in got)
        assert names == ["attempt 1", "decode leg", "pdgate /v1/chat/completions", "prefill leg"], names
        assert {svc for svc, _ in got} == {"pdgate-test"}
        assert all(s.trace_id.hex() == TRACE for _, s in got)
        root = next(s for _, s in got if s.name.startswith("pdgate "))
        assert root.parent_span_id.hex() == PARENT and root.end_time_unix_nano > root.start_time_unix_nano
    finally:
        await runner.cleanup()


def test_otel_without_the_extra_is_a_named_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from pdgate.core.config import ConfigError

    real = builtins.__import__

    def no_sdk(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("opentelemetry.sdk"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    with pytest.raises(ConfigError, match=r"otel.enabled = True: needs the otel extra"):
        Otel(OtelConfig(enabled=True))


async def test_stopping_with_the_collector_down_is_bounded() -> None:
    """A collector that is down used to hold the gateway's stop for 7-30 s (the exporter's retries)."""
    import time

    from pdgate.observe import otel

    dead = free_port()  # nothing listens there
    o = Otel(OtelConfig(enabled=True, endpoint=f"http://127.0.0.1:{dead}/v1/traces"))
    for i in range(3000):
        o.tracer.start_span(f"s{i}").end()
    t0 = time.monotonic()
    await o.shutdown()
    assert time.monotonic() - t0 < otel.SHUTDOWN_S + 1.0


class Broken:
    """An OpenTelemetry whose every call raises (an SDK bug, a full queue that throws)."""

    def __getattr__(self, name: str) -> Any:
        def fail(*_: Any) -> Any:
            raise RuntimeError(f"otel {name} broke")

        return fail


async def test_an_sdk_that_raises_never_ends_a_request(procs: Procs, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await start_gateway(make_config([p], [d]))
    gateways.append(g)
    g.gw.obs.otel = Broken()  # type: ignore[assignment]
    async with aiohttp.ClientSession() as http:
        for body in (CHAT, {**CHAT, "stream": False}):
            async with http.post(g.url + "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}) as r:
                assert r.status == 200
                await r.read()
    assert not g.gw.live and not g.gw.traces.live
    assert all(w.load == 0 for w in g.gw.pool.by_id.values()) and g.gw.gate.queue.n == 0
