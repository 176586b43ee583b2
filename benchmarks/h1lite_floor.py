"""The floor of a PD relay on h1lite (issue 37; it replaces ``aiohttp_floor.py``, the floor of the aiohttp days).

h1lite's server, both legs through h1lite's pooled client, the prefill in a task of its own and the decode awaited,
as pdgate runs them; a streamed answer relayed as it comes (``ClientResponse.pipe`` into the client's chunked stream,
as ``pdgate.path.relay`` does, less its framing per event; a client that is behind pauses the engine's reads); the
decodes taken in turn. No validation, admission, record, deadlines, health checks, metrics or logs. What pdgate's own
features cost is its CPU less this one's, measured alike: ``loadtest bench --compare --floor``, ``--streams-targets ...
h1lite-floor``, ``scripts/ab_hotpath.sh`` with ``FLOOR=1``.

python benchmarks/h1lite_floor.py --port P --prefill URL --bootstrap-port B --decode URL [URL ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random

import orjson
import uvloop

from h1lite.client import Client
from h1lite.server import Request, Response, Router, Server, Stream

SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def main(a: argparse.Namespace) -> None:
    client = Client(connect_timeout_s=5.0, max_open=1 << 16)  # no cap of its own: a stream holds its connection
    loop = asyncio.get_running_loop()
    decodes = itertools.cycle(a.decode)

    async def handle(request: Request) -> Response | Stream:
        body = orjson.loads(request.body)
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=a.bootstrap_port, bootstrap_room=random.getrandbits(63))
        data = orjson.dumps(body)
        decode = next(decodes)
        prefill = loop.create_task(client.fetch(a.prefill, "POST", request.path, data))
        try:
            if not body.get("stream"):
                status, out = await client.fetch(decode, "POST", request.path, data)
                return Response(out, status)
            resp = await client.request(decode, "POST", request.path, data)
            try:
                if resp.status != 200:
                    return Response(await resp.read(), resp.status)
                stream = request.open_stream(200, SSE)

                def sink(event: bytes) -> None:  # as pdgate's relay: a client that is behind stops the engine's reads
                    stream.send(event)
                    if stream.blocked:
                        resp.pause()
                        stream.on_writable(resp.resume)

                await resp.pipe(sink)
            finally:
                resp.release()
            return stream
        finally:
            await prefill  # on every path: its failure is this request's

    router = Router()
    router.add("POST", "/v1/chat/completions", handle)
    router.add("POST", "/generate", handle)
    server = Server(router.dispatch, 1 << 22)
    await server.start("127.0.0.1", a.port)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--decode", required=True, nargs="+")
    uvloop.run(main(p.parse_args()))
