"""The engine seam is real: a second, minimal adapter (sequential legs, its own abort and probe) drives requests
through the unchanged request path, and one gateway fronts pools of two kinds, pairing only within a kind.

The "mini" engine (an aiohttp app in the test): its prefill answers a handoff token, and its decode refuses any
request that does not carry that prefill's handoff, so a path that ran the legs at once, or that did not make
the decode's body from the prefill's answer (``Engine.decode_after``), fails here. It splits its SSE writes. Its
legs are sent where only its adapter knows (``/mini`` before the route: ``Engine.call`` and ``Engine.open``), so
a path that sent them itself fails here too.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from pdgate.adapters import Held, Probe, Usage
from pdgate.adapters.upstream import Answer, Upstream
from pdgate.core.config import GatewayConfig, HealthConfig, WorkerSpec, validate
from pdgate.core.record import Attempt
from pdgate.path.gateway import Gateway
from pdgate.planes.server import build_app, serve
from tests.pdgate.harness import Running, assert_clean
from tests.procs import Procs, free_port


class Mini:
    kind = "mini"
    sequential = True
    prefill_answer_is_first_token = True
    done_event = b"data: [DONE]"
    error_event = b'data: {"error"'

    def __init__(self, up: Upstream) -> None:
        self.up = up

    def legs(self, body: dict[str, Any], att: Attempt, prefill: WorkerSpec) -> tuple[bytes, bytes]:
        return (orjson.dumps({**body, "mini_role": "prefill", "id": att.rid, "stream": False}),
                orjson.dumps({**body, "mini_role": "decode", "id": att.rid}))

    def decode_after(self, decode: bytes, prefill_answer: bytes) -> bytes:
        return orjson.dumps({**orjson.loads(decode), "handoff": orjson.loads(prefill_answer)["handoff"]})

    async def call(self, url: str, route: str, body: bytes, headers: bytes) -> tuple[int, bytes]:
        return await self.up.post_read(url, "/mini" + route, body, headers)

    async def open(self, url: str, route: str, body: bytes, headers: bytes) -> Answer:
        return await self.up.open(url, "/mini" + route, body, headers)

    def needs_prefill_answer(self, route: str, body: dict[str, Any]) -> bool:
        return False

    def merge(self, prefill_answer: bytes, decode_answer: bytes) -> bytes:
        return decode_answer

    def usage(self, answer: bytes) -> Usage:
        u = orjson.loads(answer).get("usage") or {}
        return Usage(u.get("prompt_tokens"), u.get("completion_tokens"))

    def defers_decode_abort(self, decode_fixes: list[str] | None) -> bool:
        return False

    async def abort(self, url: str, rid: str) -> int:
        return await self.up.post_small(url, "/cancel", orjson.dumps({"id": rid}))

    async def probe(self, url: str, role: str, timeout_s: float) -> Probe:
        try:
            status, info = await self.up.get_json(url + "/ping", timeout_s)
        except OSError as exc:
            return Probe(False, repr(exc))
        if status != 200 or not isinstance(info, dict) or info.get("role") != role:
            return Probe(False, f"/ping answered {status}")
        return Probe(True, identity=info["started"], models=("mini-model",))

    async def identify(self, spec: WorkerSpec, timeout_s: float) -> bool:
        return (await self.probe(spec.url, spec.role, timeout_s)).ok

    async def held(self, url: str, timeout_s: float) -> list[Held] | None:
        return None

    def forget(self, url: str) -> None:
        pass

    def output_tokens(self, route: str, body: dict[str, Any]) -> int | None:
        return body.get("max_tokens", 4)  # type: ignore[no-any-return]

    def limit_output(self, route: str, body: dict[str, Any], n: int) -> None:
        body["max_tokens"] = min(n, body.get("max_tokens", n))

    async def count_tokens(self, url: str, chat: dict[str, Any], timeout_s: float) -> int | None:
        return None


class MiniEngine:
    """One worker of the mini engine, prefill or decode; remembers what it was sent and what it was told to cancel."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.port = free_port()
        self.seen: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.live: dict[str, asyncio.Event] = {}
        app = web.Application()
        app.router.add_get("/ping", self.ping)
        app.router.add_post("/mini/v1/chat/completions", self.chat)  # its legs, as its adapter sends them
        app.router.add_post("/cancel", self.cancel)
        self.runner = web.AppRunner(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def ping(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "started": "mini-1"})

    async def cancel(self, request: web.Request) -> web.Response:
        rid = (await request.json())["id"]
        self.cancelled.append(rid)
        if rid in self.live:
            self.live[rid].set()
        return web.json_response({})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        rid = body["id"]
        if body.get("mini_role") != self.role:
            return web.json_response({"error": {"message": "wrong role"}}, status=400)
        if self.role == "prefill":
            return web.json_response({"handoff": f"kv-{rid}"})
        if body.get("handoff") != f"kv-{rid}":
            return web.json_response({"error": {"message": "no handoff from the prefill"}}, status=400)
        n = body.get("max_tokens", 4)
        words = [f"w{i} " for i in range(n)]
        usage = {"prompt_tokens": 3, "completion_tokens": n}
        if not body.get("stream"):
            return web.json_response({"id": rid, "object": "chat.completion", "model": "mini-model", "usage": usage,
                                      "choices": [{"index": 0, "finish_reason": "length",
                                                   "message": {"role": "assistant", "content": "".join(words)}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        gone = self.live[rid] = asyncio.Event()
        try:
            for w in words:
                ev = b"data: " + orjson.dumps({"id": rid, "object": "chat.completion.chunk", "model": "mini-model",
                                              "choices": [{"index": 0, "delta": {"content": w}}]}) + b"\n\n"
                await resp.write(ev[:7])  # an event cut in two writes
                await asyncio.sleep(0.01)
                await resp.write(ev[7:])
                if await _gone_within(gone, body.get("pace", 0.0)):
                    return resp
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.live.pop(rid, None)
        return resp

    async def close(self) -> None:
        await self.runner.cleanup()


async def _gone_within(gone: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(gone.wait(), seconds)
        return True
    except TimeoutError:
        return False


@pytest.fixture
async def mini() -> AsyncIterator[tuple[MiniEngine, MiniEngine]]:
    p, d = MiniEngine("prefill"), MiniEngine("decode")
    await p.start()
    await d.start()
    try:
        yield p, d
    finally:
        await p.close()
        await d.close()


async def start(cfg: GatewayConfig, gateways: list[Any]) -> Running:
    gw = Gateway(cfg, engines={"mini": Mini})
    app = await serve(build_app(cfg, gw), cfg.host, cfg.port)
    g = Running(f"http://127.0.0.1:{cfg.port}", gw, app, app.admin_url)
    gateways.append(g)
    return g


def config(prefills: list[WorkerSpec], decodes: list[WorkerSpec]) -> GatewayConfig:
    port = free_port()
    return validate(GatewayConfig(port=port, admin_port=next(p for p in iter(free_port, 0) if p != port),
                                  prefill=tuple(prefills), decode=tuple(decodes), drain_s=0.5,
                                  health=HealthConfig(interval_s=0.5, timeout_s=0.5)))


async def test_a_second_adapter_drives_sequential_legs_through_the_same_path(
        mini: tuple[MiniEngine, MiniEngine], gateways: list[Any]) -> None:
    p, d = mini
    g = await start(config([WorkerSpec(p.url, "prefill", engine="mini")], [WorkerSpec(d.url, "decode", engine="mini")]),
                    gateways)
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0)
    try:
        r = await client.chat.completions.create(model="mini-model", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3)
        assert r.choices[0].message.content == "w0 w1 w2 " and r.usage is not None and r.usage.completion_tokens == 3
        parts = [c.choices[0].delta.content async for c in await client.chat.completions.create(
            model="mini-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
            if c.choices and c.choices[0].delta.content]
        assert parts == [f"w{i} " for i in range(5)]
    finally:
        await client.close()
    # the prefill went first, alone; the decode came with what the prefill answered
    assert [b["mini_role"] for b in p.seen] == ["prefill", "prefill"] and all(not b["stream"] for b in p.seen)
    assert [b["handoff"] for b in d.seen] == [f"kv-{b['id']}" for b in p.seen]
    rec = g.gw.traces.get(d.seen[-1]["id"])
    assert rec is not None and rec.chunks == 5 and rec.outcome is not None and rec.outcome.value == "completed"


async def test_a_client_that_leaves_gets_both_legs_cancelled_by_the_adapter(
        mini: tuple[MiniEngine, MiniEngine], gateways: list[Any]) -> None:
    p, d = mini
    g = await start(config([WorkerSpec(p.url, "prefill", engine="mini")], [WorkerSpec(d.url, "decode", engine="mini")]),
                    gateways)
    async with aiohttp.ClientSession() as http:
        async with http.post(g.url + "/v1/chat/completions",
                             json={"model": "mini-model", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 50, "stream": True, "pace": 0.2}) as r:
            assert r.status == 200
            await r.content.readline()
    for _ in range(100):
        if d.cancelled and p.cancelled:
            break
        await asyncio.sleep(0.05)
    rid = d.seen[-1]["id"]
    assert d.cancelled[:1] == [rid] and p.cancelled[:1] == [rid], (p.cancelled, d.cancelled)
    assert not d.live and not g.gw.live and not g.gw.traces.live


async def test_one_gateway_fronts_two_kinds_and_pairs_within_a_kind(procs: Procs, mini: tuple[MiniEngine, MiniEngine],
                                                                    http: aiohttp.ClientSession,
                                                                    gateways: list[Any]) -> None:
    p, d = mini
    sp, sd = procs.pair()
    sd2 = procs.sim("decode")  # three decodes, two prefills: round robin alone would pair across kinds
    cfg = config([WorkerSpec(p.url, "prefill", engine="mini"), WorkerSpec(sp.url, "prefill", sp.bootstrap_port)],
                 [WorkerSpec(d.url, "decode", engine="mini"), WorkerSpec(sd.url, "decode"), WorkerSpec(sd2.url, "decode")])
    g = await start(dataclasses.replace(cfg, policy="round_robin"), gateways)
    kinds = {w.id: w.spec.engine for w in g.gw.pool.by_id.values()}
    for model in ("mini-model", "sim-model") * 3:
        async with http.post(g.url + "/v1/chat/completions",
                             json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()
    recs = list(g.gw.traces.finished.values())
    assert len(recs) == 6 and all(kinds[r.attempts[-1].prefill] == kinds[r.attempts[-1].decode] for r in recs)
    assert {kinds[r.attempts[-1].prefill] for r in recs} == {"mini", "sglang"}
    async with http.get(g.admin + "/v1/workers") as r:
        assert {w["id"]: w["kind"] for w in (await r.json())["workers"]} == kinds
    await assert_clean(http, g.gw, [sp, sd, sd2])


def test_an_adapter_that_lacks_part_of_the_seam_is_refused_when_its_workers_are_made() -> None:
    """An adapter without ``call`` and ``open`` (how its legs are sent) is named when the gateway is made, not found
    leg by leg as failures counted against its workers."""

    Lacking = type("Lacking", (), {k: v for k, v in vars(Mini).items() if k not in ("call", "open")})
    cfg = config([WorkerSpec("http://127.0.0.1:1", "prefill", engine="mini")],
                 [WorkerSpec("http://127.0.0.1:2", "decode", engine="mini")])
    with pytest.raises(TypeError, match=r"engine kind 'mini': its adapter lacks call, open"):
        Gateway(cfg, engines={"mini": Lacking})
