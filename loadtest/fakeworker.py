"""A zero-cost PD worker for gateway-bound benchmarks: answers at once, moves no KV, keeps no state.

``python -m loadtest.fakeworker --role prefill|decode --port P``. It speaks just enough of
SGLang's HTTP surface for pdgate and sglang-router to route to it (health, server/model
info, loads, abort, the three generate routes). The decode answers non-streamed requests
with one OpenAI body and streamed ones with ``max_tokens`` SSE events then ``[DONE]``,
written back to back. This is the "zero-cost fake worker" setting of
``../shared/reference/peers.md``, where the gateway, not the workers, bounds throughput;
it runs on the h1lite HTTP layer (as engine.sim does) because an aiohttp worker would cost more than the
gateways under test.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
import uvloop

from h1lite.server import Request, Response, Router, Server, Stream, json_response

MODEL = "sim-model"


def build(role: str) -> Router:
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
    server = Server(build(a.role).dispatch, 64 << 20)
    await server.start("127.0.0.1", a.port)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--port", type=int, required=True)
    uvloop.run(main(p.parse_args()))
