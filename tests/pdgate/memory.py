"""The whole request path without a socket: an in-memory transport (``pdgate.adapters.upstream.Transport``, as httpx's
``MockTransport``) in front of an SGLang-speaking PD pool the test steps leg by leg, and a client request made in
memory (h1lite's ``Request`` on a protocol that collects what is written).

The pool is strict where a polite one would hide a leak: a request it was sent stays held until it answered it
whole or an abort named its rid (a connection the gateway closed on it frees nothing: an SGLang prefill without
fix A does not notice), and every answer the gateway did not release is counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from h1lite.server import Request
from pdgate.core import protocol as wire
from pdgate.core.config import GatewayConfig, WorkerSpec, validate
from pdgate.path.gateway import Gateway


class Answer:
    """An engine's answer in memory: its head at once, its body whole (``body``) or fed by the test (``stream``)."""

    def __init__(self, status: int, body: bytes = b"", stream: bool = False) -> None:
        self.status = status
        self.chunks = [body] if body else []
        self.complete = False
        self.released = False
        self.paused = False
        self.exc: BaseException | None = None
        self.sink: Callable[[bytes], None] | None = None
        self.ended = asyncio.Event()
        self.on_end: list[Callable[[Answer], None]] = []
        if not stream:
            self.end()

    def feed(self, data: bytes) -> None:
        if self.complete:
            return
        if self.sink is None:
            self.chunks.append(data)
            return
        try:
            self.sink(data)
        except Exception as exc:  # as h1lite's client: the sink's error ends the exchange
            self.end(exc)

    def end(self, exc: BaseException | None = None) -> None:
        if not self.complete:
            self.complete, self.exc = True, exc
            self.ended.set()
            for f in self.on_end:
                f(self)

    async def read(self) -> bytes:
        await self.ended.wait()
        if self.exc is not None:
            raise self.exc
        return b"".join(self.chunks)

    async def pipe(self, sink: Callable[[bytes], None]) -> None:
        self.sink = sink
        if self.chunks:
            data = b"".join(self.chunks)
            self.chunks.clear()
            self.feed(data)
        await self.ended.wait()
        if self.exc is not None:
            raise self.exc

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def release(self) -> None:
        self.released = True
        self.end(ConnectionResetError("released before its end"))


@dataclass
class Call:
    base: str
    method: str
    target: str
    body: bytes
    headers: bytes


Handler = Callable[[Call], Awaitable[Answer]]


class MemoryTransport:
    """``pdgate.adapters.upstream.Transport`` in memory: every call goes to ``handler``; what it answered is kept to check
    that each answer was read whole or released."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.stale_retries = 0
        self.answers: list[Answer] = []

    async def request(self, base: str, method: str, target: str, body: bytes = b"",
                      content_type: bytes = b"application/json",
                      headers: dict[str, str] | bytes | None = None) -> Answer:
        ans = await self.handler(Call(base, method, target, body, headers if isinstance(headers, bytes) else b""))
        self.answers.append(ans)
        return ans

    async def fetch(self, base: str, method: str, target: str, body: bytes = b"",
                    content_type: bytes = b"application/json", headers: dict[str, str] | bytes | None = None,
                    limit: int | None = None) -> tuple[int, bytes]:
        ans = await self.request(base, method, target, body, content_type, headers)
        try:
            data = await ans.read()
            return ans.status, data
        finally:
            ans.released = True

    def unreleased(self) -> list[Answer]:
        return [a for a in self.answers if not a.released]

    def limit(self, base: str, max_open: int) -> None:
        pass

    def drop(self, base: str) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Leg:
    """One leg as the engine got it; the test answers it."""

    role: str
    rid: str
    body: dict[str, Any]
    answer: Answer
    aborted: bool = False

    def reply(self, status: int = 200, body: bytes = b'{"ok": true}') -> None:
        """A prefill's answer (whole)."""
        self.answer.chunks.append(body)
        self.answer.status = status
        self.answer.end()

    def token(self, text: str = "x") -> None:
        self.answer.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "%b"}}]}\n\n' % text.encode())

    def done(self) -> None:
        self.answer.feed(b"data: [DONE]\n\n")
        self.answer.end()


@dataclass
class Pool:
    """SGLang-speaking prefills and decodes at ``http://<role><n>.mem``: health and server info answered at once,
    legs held until the test answers them (``next``), aborts by rid prefix."""

    capacity: int = 8
    fixes: tuple[str, ...] = ("A", "B", "C")
    held: dict[str, Leg] = field(default_factory=dict)  # "<url> <rid>" -> the leg the engine holds
    arrived: asyncio.Queue[Leg] = field(default_factory=asyncio.Queue)
    aborts: list[tuple[str, str]] = field(default_factory=list)  # (url, rid)

    async def __call__(self, call: Call) -> Answer:
        role = "prefill" if call.base.startswith("http://prefill") else "decode"
        if call.method == "GET":
            if call.target == wire.HEALTH_PATH:
                return Answer(200)
            if call.target == wire.SERVER_INFO_PATH:
                return Answer(200, orjson.dumps({
                    "served_model_name": "mem-model", "max_running_requests": self.capacity,
                    "disaggregation_mode": role, wire.IDENTITY_FIELD: call.base, wire.FIXES_FIELD: list(self.fixes)}))
            if call.target.startswith(wire.LOADS_PATH):
                n = sum(1 for k in self.held if k.startswith(call.base + " "))
                return Answer(200, orjson.dumps({"loads": [{"num_running_reqs": n, "num_waiting_reqs": 0}]}))
            return Answer(404)
        if call.target == wire.ABORT_PATH:
            rid = orjson.loads(call.body)["rid"]
            self.aborts.append((call.base, rid))
            for k in [k for k in self.held if k.startswith(f"{call.base} {rid}")]:
                leg = self.held.pop(k)
                leg.aborted = True
                if leg.role == "prefill":
                    leg.reply(500, b'{"error": {"message": "aborted"}}')
                else:
                    leg.answer.end()  # SGLang ends an aborted stream without [DONE]
            return Answer(200)
        body = orjson.loads(call.body)
        leg = Leg(role, body[wire.RID], body, Answer(200, stream=True))  # answered when the test says
        key = f"{call.base} {leg.rid}"
        self.held[key] = leg

        def answered(a: Answer) -> None:  # answered whole: the engine holds it no more
            if a.exc is None:
                self.held.pop(key, None)

        leg.answer.on_end.append(answered)
        await self.arrived.put(leg)
        if role == "decode" and not body.get("stream"):
            await leg.answer.ended.wait()  # a whole answer: its head comes with its body
        return leg.answer

    async def next(self, role: str, timeout_s: float = 5.0) -> Leg:
        """The next leg the engines got, of ``role`` (others of the other role are put back)."""
        async with asyncio.timeout(timeout_s):
            while True:
                leg = await self.arrived.get()
                if leg.role == role:
                    return leg
                self.arrived.put_nowait(leg)
                await asyncio.sleep(0)


class Proto:
    """What h1lite's ``Request`` and ``Stream`` use of their connection, in memory."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task[Any] | None = None
        self.closed = False
        self.paused = False
        self.out: list[bytes] = []
        self.transport = self
        self.on_writable: Callable[[], None] | None = None

    def write(self, data: bytes) -> None:
        self.out.append(data)


def request(body: dict[str, Any], path: str = "/v1/chat/completions", **headers: str) -> tuple[Request, Proto]:
    proto = Proto()
    req = Request(proto, "POST", path, "", {k.replace("_", "-"): v for k, v in headers.items()}, "1.1")  # type: ignore[arg-type]
    req.body = orjson.dumps(body)
    return req, proto


def config(prefills: int = 1, decodes: int = 1, **kw: Any) -> GatewayConfig:
    kw.setdefault("state_dir", "")
    return validate(GatewayConfig(
        prefill=tuple(WorkerSpec(url=f"http://prefill{i}.mem:1", role="prefill", bootstrap_port=8998)
                      for i in range(prefills)),
        decode=tuple(WorkerSpec(url=f"http://decode{i}.mem:1", role="decode") for i in range(decodes)), **kw))


async def gateway(pool: Pool, cfg: GatewayConfig) -> tuple[Gateway, MemoryTransport]:
    """A gateway over ``pool`` in memory, its workers checked once (up); no listener, no background work."""
    transport = MemoryTransport(pool)
    gw = Gateway(cfg, transport=transport)
    await asyncio.gather(*(gw.health.check(w) for w in gw.pool.by_id.values()))
    return gw, transport
