"""The floor of an aiohttp PD proxy: one server, both legs through one pooled client session,
no validation, records, deadlines or metrics. Measures what pdgate's CPU per request is made of.

python benchmarks/aiohttp_floor.py --port P --prefill URL --bootstrap-port B --decode URL
"""

from __future__ import annotations

import argparse
import asyncio
import random

import aiohttp
import orjson
import uvloop
from aiohttp import web


async def main(a: argparse.Namespace) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar(),
                                    auto_decompress=False)

    async def leg(url: str, data: bytes) -> bytes:
        async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            return await r.read()

    async def handle(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=a.bootstrap_port, bootstrap_room=random.getrandbits(63))
        data = orjson.dumps(body)
        _, out = await asyncio.gather(leg(a.prefill + request.path, data), leg(a.decode + request.path, data))
        return web.Response(body=out, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", a.port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--decode", required=True)
    uvloop.run(main(p.parse_args()))
