"""Bounded fuzzing of the front door: no input crashes the gateway, gets a 500, or leaks a live record."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import orjson

from tests.pdgate.harness import assert_clean
from tests.pdgate.test_outcomes import CHAT, gateway, post
from tests.procs import Procs

VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**70, 1.5, float("-0.0"), "", "x", "💥" * 50, [], [1], {}, {"a": 1},
                     [{"role": "user"}], [{"role": 1, "content": "x"}], [{"role": "user", "content": ["x", 1]}],
                     "9" * 400]
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature",
          "top_p", "n", "stop", "timeout", "prompt", "text", "input_ids", "sampling_params", "return_logprob", "rid",
          "bootstrap_room", "logprobs"]
HEADERS = ["x-pdgate-timeout", "x-pdgate-ttft-timeout", "x-pdgate-idle-timeout", "x-request-id"]


def mutate(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    kind = rng.random()
    if kind < 0.1:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))), {}
    body: dict[str, Any] = dict(CHAT)
    for _ in range(rng.randint(1, 4)):
        body[rng.choice(FIELDS)] = rng.choice(VALUES)
    body["max_tokens"] = body["max_tokens"] if rng.random() < 0.5 else 2  # keep the valid ones cheap
    headers = {h: rng.choice(["1", "0", "-3", "abc", "1e9", " 2 ", "nan"]) for h in HEADERS if rng.random() < 0.15}
    try:
        return orjson.dumps(body), headers
    except (TypeError, orjson.JSONEncodeError):
        return b"{}", headers


async def test_front_door_fuzz(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    rng = random.Random(20261129)
    seen: dict[int, int] = {}
    for i in range(240):
        path = ("/v1/chat/completions", "/v1/completions", "/generate")[i % 3]
        data, headers = mutate(rng)
        async with http.post(g.url + path, data=data, headers={"Content-Type": "application/json", **headers}) as r:
            raw = await r.read()
            seen[r.status] = seen.get(r.status, 0) + 1
            assert r.status < 500 or r.status == 504, (path, data[:300], headers, raw[:300])
            if r.status >= 400:
                err = orjson.loads(raw)["error"]
                assert set(err) == {"message", "type", "code", "param"} and err["message"], raw
    assert seen.get(200, 0) > 10 and seen.get(400, 0) > 50, seen
    status, _, _ = await post(http, g, CHAT)  # still serving
    assert status == 200
    await assert_clean(http, g.gw, [p, d], within=5)
    for _ in range(40):  # background work (abort repeats: at most 1.25 s) drains: no task leaks
        if not g.gw.background:
            break
        await asyncio.sleep(0.1)
    assert not g.gw.background, g.gw.background
