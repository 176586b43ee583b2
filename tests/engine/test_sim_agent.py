"""The sim's prefix cache and its agent-facing OpenAI (tool calls, JSON, logprobs, seeds), driven directly like
a router (no gateway in between); and the pure parts (cache bound, schema values, the sampler)."""

from __future__ import annotations

import random
import time

import aiohttp
import orjson
import pytest

from engine.sim import agent
from engine.sim.cache import BLOCK, PrefixCache
from engine.sim.text import Sampler
from tests.engine.simclient import gauge, pd
from tests.procs import Procs

LONG = " ".join(f"w{i}" for i in range(2000))  # 2000 prompt tokens


def chat(content: str, **kw: object) -> dict[str, object]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


async def test_prefill_computes_only_what_its_cache_lacks(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill = procs.sim("prefill", "--prefill-per-token-us", "500")  # 2000 tokens: 1 s to compute
    decode = procs.sim("decode")
    took, usage = [], []
    for content in (LONG, LONG + " and more", LONG):
        t0 = time.monotonic()
        (ps, _), (ds, db) = await pd(http, prefill, decode, "/v1/chat/completions", chat(content))
        took.append(time.monotonic() - t0)
        assert (ps, ds) == (200, 200)
        usage.append(orjson.loads(db)["usage"])
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0 and took[0] > 0.9
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] >= usage[0]["prompt_tokens"] - BLOCK
    assert took[1] < 0.3 and took[2] < 0.3, took  # only the new tokens (and the last one) are computed
    hit = await gauge(http, prefill, "cached_tokens_total")
    assert hit == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert 0.5 < await gauge(http, prefill, "cache_hit_rate") < 1
    async with http.post(prefill.url + "/flush_cache") as r:
        assert r.status == 200
    (_, _), (_, db) = await pd(http, prefill, decode, "/v1/chat/completions", chat(LONG))
    assert orjson.loads(db)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "flushed"


def test_prefix_cache_is_bounded_and_keeps_roots_longest() -> None:
    c = PrefixCache(capacity_tokens=BLOCK * 100)
    rng = random.Random(0)
    for i in range(500):
        c.insert(c.keys(f"p{i} " + " ".join(str(rng.random()) for _ in range(BLOCK * 10))))
        assert len(c.blocks) <= 100
    keys = c.keys("root " * BLOCK * 50)  # 50 blocks, into a cache of 10: the first blocks stay
    small = PrefixCache(capacity_tokens=BLOCK * 10)
    small.insert(keys)
    assert small.cached(keys) == BLOCK * 10
    assert PrefixCache(0).capacity_blocks == 0


async def test_tool_calls_streamed_and_whole(procs: Procs, http: aiohttp.ClientSession) -> None:
    prefill, decode = procs.pair()
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}, "n": {"type": "integer", "maximum": 3}}}}}]
    body = chat("find it with grep", tools=tools, max_tokens=64)
    (_, _), (ds, db) = await pd(http, prefill, decode, "/v1/chat/completions", body)
    whole = orjson.loads(db)["choices"][0]
    assert ds == 200 and whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    call = whole["message"]["tool_calls"][0]
    args = orjson.loads(call["function"]["arguments"])
    assert call["type"] == "function" and call["function"]["name"] == "grep" and set(args) == {"pattern", "n"}
    (_, _), (_, sb) = await pd(http, prefill, decode, "/v1/chat/completions", {**body, "stream": True})
    chunks = [orjson.loads(e[6:]) for e in sb.decode().split("\n\n") if e.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["tool_calls"][0]["id"] == call["id"] and deltas[0]["tool_calls"][0]["function"]["name"] == "grep"
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:]), "later deltas carry argument pieces only"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cut = {**body, "max_tokens": 2}
    (_, _), (_, db) = await pd(http, prefill, decode, "/v1/chat/completions", cut)
    assert orjson.loads(db)["choices"][0]["finish_reason"] == "length", "max_tokens cuts the arguments short"
    after = {**body, "messages": [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},  # type: ignore[list-item]
                                  {"role": "tool", "tool_call_id": call["id"], "content": "x.py:1"}]}
    (_, _), (_, db) = await pd(http, prefill, decode, "/v1/chat/completions", after)
    assert orjson.loads(db)["choices"][0]["message"]["content"], "after the result: text"
    (_, _), (ds, db) = await pd(http, prefill, decode, "/v1/chat/completions", {**body, "tools": [{"type": "x"}]})
    assert ds == 400 and b"tools[0]" in db


def test_schema_values_and_hostile_schemas() -> None:
    rng = random.Random(0)
    v = agent.value_for({"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": ["null", "number"]},
                                                          "c": {"anyOf": [{"type": "boolean"}]}}}, rng)
    assert v["a"] == "x" and isinstance(v["b"], int) and v["c"] is False
    deep: dict[str, object] = {"type": "object", "properties": {}}
    node = deep
    for _ in range(50):  # nested past MAX_DEPTH: answered with null, no recursion error
        child: dict[str, object] = {"type": "object", "properties": {}}
        node["properties"] = {"k": child}  # type: ignore[index]
        node = child
    orjson.dumps(agent.value_for(deep, rng))
    for n in range(1, 12):
        s = agent.script_for({"response_format": {"type": "json_object"}}, "p", n)
        assert s is not None and len(s.tokens) <= n and isinstance(orjson.loads("".join(s.tokens)), dict)
    t0 = time.monotonic()  # a huge max_tokens does not make a huge script (both legs build it)
    big = agent.script_for({"response_format": {"type": "json_object"}}, "p", 10**8)
    assert big is not None and len(big.tokens) <= agent.MAX_JSON_WORDS and time.monotonic() - t0 < 0.5
    tool = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(agent.BadRequest, match="at most 128"):
        agent.script_for({"tools": [tool] * 129, "messages": [{"role": "user", "content": "x"}]}, "p", 8)
    s = agent.script_for({"tools": [tool], "tool_choice": None, "messages": [{"role": "user", "content": "x"}]}, "p", 8)
    assert s is not None and s.call is not None, "tool_choice null is auto"


def test_top_logprobs_one_is_one() -> None:
    from engine.sim.config import SimConfig
    from engine.sim.server import Parsed

    chat_ = Parsed("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                            "top_logprobs": 1}, SimConfig(role="decode"))
    comp = Parsed("/v1/completions", {"prompt": "x", "logprobs": 1}, SimConfig(role="decode"))
    assert chat_.top_logprobs == 1 and chat_.logprobs and comp.top_logprobs == 1 and comp.logprobs


def test_sampler_temperature_and_seed() -> None:
    def text(seed: int | None, t: float) -> str:
        s = Sampler("prompt", seed, t)
        return "".join(s.next() for _ in range(40))

    assert text(1, 0) == text(2, 0) == text(None, 0)
    assert text(1, 1.0) == text(1, 1.0) != text(2, 1.0)
    greedy = text(None, 0)

    def strays(t: float) -> int:
        s = Sampler("prompt", 7, t)
        return sum(s.next() != Sampler("prompt", 7, 0).preferred(i) for i in range(400))

    assert strays(0) == 0 < strays(0.3) < strays(2.0)
    s = Sampler("prompt", 0, 0)
    assert s.logprob(0, s.preferred(0)) == 0.0 and s.top(0, 3)[1][1] == -9999.0
    assert greedy.startswith(s.preferred(0))
