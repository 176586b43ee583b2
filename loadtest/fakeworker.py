"""A zero-cost PD worker for gateway-bound benchmarks: answers at once, moves no KV, keeps no state.

``python -m loadtest.fakeworker --role prefill|decode --port P [--tokens-per-s R]``. It speaks just
enough of SGLang's HTTP surface for pdgate and sglang-router to route to it (health, server/model
info, loads, abort, the three generate routes). The decode answers non-streamed requests
with one OpenAI body and streamed ones with ``max_tokens`` SSE events then ``[DONE]``,
written back to back (``--tokens-per-s 0``, the default), or paced: one
``chat.completion.chunk`` event every ``1/R`` s, each one write stamped with its emission time
(``"t":<time.monotonic_ns()>``, the event's last field: ``loadtest.streams`` measures the relay
delay from it), the first at a random offset within ``1/R`` (so that the ticks of many streams
spread out), the ticks of all streams grouped by millisecond (``Ticker``: one wake-up per millisecond,
not per event) and no JSON encoding per event; a stream stops when
its client leaves. The prefill always answers at once. This is the "zero-cost fake worker" setting of the
baselines in BENCHMARKS.md, where the gateway, not the workers, bounds throughput;
it runs on the h1lite HTTP layer (as engine.sim does) because an aiohttp worker would cost more than the
gateways under test.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import orjson
import uvloop

from h1lite.server import ClientGone, Request, Response, Router, Server, Stream, json_response

MODEL = "sim-model"
# a paced event: %d is its emission time (time.monotonic_ns()), always the last field
PACED = (b'data: {"id":"fake","object":"chat.completion.chunk","model":"sim-model","choices":[{"index":0,'
         b'"delta":{"content":"x "},"finish_reason":null}],"t":%d}\n\n')
DONE = b"data: [DONE]\n\n"


QUANTUM_S = 0.001  # ticks due within the same millisecond are sent in one wake-up of the loop


class Ticker:
    """The streams' ticks by millisecond: one timer and one wake-up per millisecond that has any, not one per
    event (thousands of streams would otherwise wake the loop for every token: the fake would cost more than
    the gateways it feeds). Each event's stamp is taken as it is written, so the grouping adds nothing to the
    measured relay delay."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.buckets: dict[int, list[Paced]] = {}

    def add(self, p: Paced, at: float) -> None:
        k = -int(-at // QUANTUM_S)  # the millisecond it is due by
        bucket = self.buckets.get(k)
        if bucket is None:
            self.buckets[k] = [p]
            self.loop.call_at(k * QUANTUM_S, self.fire, k)
        else:
            bucket.append(p)

    def fire(self, k: int) -> None:
        for p in self.buckets.pop(k, ()):
            p.tick()


_ticker: list[Ticker] = []


def ticker() -> Ticker:
    """The running loop's ticker (made on first use; a new loop, as in tests, gets a new one)."""
    if not _ticker or _ticker[0].loop is not asyncio.get_running_loop():
        _ticker[:] = [Ticker()]
    return _ticker[0]


class Paced:
    """One paced stream: ``n`` events, one per ``period`` s from a random phase, then ``[DONE]``."""

    __slots__ = ("cancelled", "done", "left", "loop", "next", "period", "stream", "ticker")

    def __init__(self, stream: Stream, n: int, rate: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.stream, self.left, self.period = stream, n, 1.0 / rate
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.cancelled = False
        self.ticker = ticker()
        self.next = self.loop.time() + random.random() * self.period
        self.ticker.add(self, self.next)

    def tick(self) -> None:
        if self.cancelled:
            return
        try:
            self.stream.send(PACED % time.monotonic_ns())
            self.left -= 1
            if self.left <= 0:
                self.stream.send(DONE)
        except ClientGone:
            self.left = 0
        if self.left <= 0:
            if not self.done.done():
                self.done.set_result(None)
            return
        self.next += self.period  # on the schedule, not after the last tick: no drift
        self.ticker.add(self, self.next)

    async def wait(self) -> None:
        try:
            await self.done
        finally:  # the client left (the handler is cancelled): no more ticks
            self.cancelled = True


def build(role: str, rate: float = 0.0) -> Router:
    r = Router()

    async def ok(_: Request) -> Response:
        return json_response({})

    async def info(_: Request) -> Response:
        return json_response({"model_path": MODEL, "served_model_name": MODEL, "disaggregation_mode": role})

    async def model_info(_: Request) -> Response:
        return json_response({"model_path": MODEL, "is_generation": True})

    async def models(_: Request) -> Response:
        return json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def loads(_: Request) -> Response:
        return json_response({"timestamp": time.time(), "loads": [{"dp_rank": 0, "num_running_reqs": 0,
                                                                    "num_waiting_reqs": 0}]})

    async def generate(req: Request) -> Response | Stream:
        body: dict[str, Any] = orjson.loads(req.body or b"{}")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
        if role == "prefill" or not body.get("stream"):
            return json_response({"id": "fake", "object": "chat.completion", "model": MODEL, "usage": usage,
                                  "choices": [{"index": 0, "finish_reason": "length",
                                               "message": {"role": "assistant", "content": "x " * n}}]})
        s = req.open_stream(200, {"Content-Type": "text/event-stream"})
        if rate > 0:
            if n > 0:
                await Paced(s, n, rate).wait()
            else:
                await s.write(DONE)
            return s
        event = b'data: {"id":"fake","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x "}}]}\n\n'
        for _ in range(n):
            s.send(event)
        await s.write(b"data: [DONE]\n\n")
        return s

    for path in ("/health", "/health_generate"):
        r.add("GET", path, ok)
    r.add("POST", "/abort_request", ok)
    for path in ("/server_info", "/get_server_info"):
        r.add("GET", path, info)
    for path in ("/model_info", "/get_model_info"):
        r.add("GET", path, model_info)
    r.add("GET", "/v1/models", models)
    r.add("GET", "/v1/loads", loads)
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        r.add("POST", path, generate)
    return r


async def main(a: argparse.Namespace) -> None:
    server = Server(build(a.role, a.tokens_per_s).dispatch, 64 << 20)
    await server.start("127.0.0.1", a.port, backlog=4096)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens-per-s", type=float, default=0.0,
                   help="a streamed decode answer's events per second, each stamped with its emission time "
                        "(0, the default: all at once, unstamped)")
    uvloop.run(main(p.parse_args()))
