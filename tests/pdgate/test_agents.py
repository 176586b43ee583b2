"""Agents through the gateway: the OpenAI SDK's tool-call loop, JSON mode, logprobs and seeds on the sims; the
session and cache_aware policies on real prefill workers with a prefix cache; a session that moves when its
worker restarts, and the trace that says so."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from typing import Any

import aiohttp
import openai
import pytest

from pdgate.pool import policies
from tests.pdgate.harness import Running, make_config, start_gateway, worker_id
from tests.procs import Procs, Sim

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "read a file",
                                      "parameters": {"type": "object", "required": ["path"], "properties": {
                                          "path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1,
                                                                                "maximum": 50}}}}},
    {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {
        "suite": {"type": "string", "enum": ["unit", "slow"]}, "verbose": {"type": "boolean"}}}}},
]


async def gateway(gateways: list[Any], prefills: list[Sim], decodes: list[Sim], **kw: Any) -> Running:
    g = await start_gateway(make_config(prefills, decodes, **kw))
    gateways.append(g)
    return g


async def test_openai_sdk_agent_loop_with_tool_calls_for_8_rounds(procs: Procs, gateways: list[Any]) -> None:
    """A real agent loop: the model asks for a tool, the tool's result goes back, the model answers; 8 rounds,
    streaming on odd rounds, through pdgate with the cache_aware policy. The sims cut and merge their writes at
    random offsets (as a loaded engine and a real network do), so tool-call deltas arrive split across reads."""
    p, d = procs.pair("--fault", "segment=0.7", "--fault", "segment_seed=16")
    g = await gateway(gateways, [p], [d], policy="cache_aware")
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": "You are a coding agent."}]
    held = 0  # the prompt tokens of the last request whose answer we have
    try:
        for rnd in range(8):
            tool = "run_tests" if rnd % 3 == 2 else "read_file"
            messages.append({"role": "user", "content": f"round {rnd}: please use {tool}"})
            if rnd % 2:
                calls: dict[int, dict[str, str]] = {}
                finish = None
                async for c in await client.chat.completions.create(model="sim-model", messages=messages,
                                                                     tools=TOOLS, stream=True, max_tokens=64):
                    for tc in c.choices[0].delta.tool_calls or () if c.choices else ():
                        slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        slot["id"] += tc.id or ""
                        slot["name"] += (tc.function.name or "") if tc.function else ""
                        slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
                    finish = c.choices[0].finish_reason if c.choices else finish
                assert finish == "tool_calls" and list(calls) == [0]
                call = calls[0]
            else:
                resp = await client.chat.completions.create(model="sim-model", messages=messages, tools=TOOLS,
                                                            max_tokens=64)
                assert resp.choices[0].finish_reason == "tool_calls"
                tc = resp.choices[0].message.tool_calls[0]
                call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
            assert call["name"] == tool and call["id"].startswith("call_")
            args = json.loads(call["arguments"])  # well-formed, from the tool's schema
            if tool == "read_file":
                assert isinstance(args["path"], str) and "lines" not in args, "only the required ones"
            else:
                assert args["suite"] == "unit" and args["verbose"] is False
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result of {tool}: ok " * 50})
            answer = await client.chat.completions.create(model="sim-model", messages=messages, tools=TOOLS,
                                                          max_tokens=8)
            assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
            assert not answer.choices[0].message.tool_calls, "after the tool's result: a text answer"
            # the conversation so far is in the prefill's cache (in whole blocks of 16): only the new part is computed
            assert answer.usage.prompt_tokens_details.cached_tokens >= held - 16, (rnd, held, answer.usage)
            held = answer.usage.prompt_tokens
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    finally:
        await client.close()


async def test_json_mode_logprobs_and_seeds_through_the_gateway(procs: Procs, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "answer in JSON"}]
    try:
        for n in (1, 2, 3, 17):
            r = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=n,
                                                     response_format={"type": "json_object"})
            assert isinstance(json.loads(r.choices[0].message.content), dict), n
        chunks = [c async for c in await client.chat.completions.create(
            model="sim-model", messages=msgs, max_tokens=9, stream=True, response_format={"type": "json_object"})]
        assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), dict)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array",
                                                                                      "items": {"type": "string"}}}}
        r = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=64, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        obj = json.loads(r.choices[0].message.content)
        assert isinstance(obj["n"], int) and isinstance(obj["tags"][0], str)

        r = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=5, logprobs=True,
                                                 top_logprobs=3, temperature=0.7, seed=1)
        content = r.choices[0].logprobs.content
        assert len(content) == 5 and "".join(e.token for e in content) == r.choices[0].message.content
        for e in content:
            assert len(e.top_logprobs) == 3 and e.logprob <= 0
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
            assert e.logprob in [t.logprob for t in e.top_logprobs] or e.logprob < e.top_logprobs[-1].logprob + 1e-9
        streamed = [c async for c in await client.chat.completions.create(
            model="sim-model", messages=msgs, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0.7, seed=1,
            stream=True)]
        assert [c.choices[0].logprobs.content[0].token for c in streamed if c.choices] == [e.token for e in content]

        async def text(**kw: Any) -> str:
            r = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=24, **kw)
            return r.choices[0].message.content or ""

        greedy = await text(temperature=0, seed=1)
        assert greedy == await text(temperature=0, seed=2), "temperature 0: greedy, whatever the seed"
        hot = await text(temperature=1.5, seed=1)
        assert hot == await text(temperature=1.5, seed=1), "the same seed: the same text"
        assert hot != await text(temperature=1.5, seed=2) and hot != greedy
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="sim-model", messages=msgs, tools=TOOLS,
                                                 tool_choice={"type": "function", "function": {"name": "nope"}})
    finally:
        await client.close()


async def session_round(http: aiohttp.ClientSession, g: Running, sid: str, history: list[dict[str, str]],
                        growth: str) -> tuple[str, dict[str, Any]]:
    """One round of a session through the gateway; returns the request id and the answer."""
    history.append({"role": "user", "content": growth})
    async with http.post(g.url + "/v1/chat/completions", headers={"x-session-id": sid},
                         json={"model": "sim-model", "messages": history, "max_tokens": 4}) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
        rid = r.headers["x-request-id"]
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return rid, body


def prefill_of(g: Running, rid: str) -> str:
    return g.gw.traces.get(rid).attempts[-1].prefill


@pytest.mark.parametrize("policy", ["session", "cache_aware"])
async def test_sessions_stay_on_their_prefill_and_hit_its_cache(procs: Procs, gateways: list[Any],
                                                                policy: str) -> None:
    prefills = [procs.sim("prefill"), procs.sim("prefill")]
    d = procs.sim("decode")
    g = await gateway(gateways, prefills, [d], policy=policy)
    async with aiohttp.ClientSession() as http:
        homes: dict[str, set[str]] = {}
        cached = []
        hist = {f"s{i}": [{"role": "system", "content": f"agent s{i} " + "manual " * 400}] for i in range(6)}
        for rnd in range(4):
            for sid, h in hist.items():
                rid, body = await session_round(http, g, sid, h, f"round {rnd} output " + "x y z " * 300)
                homes.setdefault(sid, set()).add(prefill_of(g, rid))
                if rnd:
                    cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"] / body["usage"]["prompt_tokens"])
        assert all(len(v) == 1 for v in homes.values()), homes
        assert {next(iter(v)) for v in homes.values()} == {worker_id(g.gw, s) for s in prefills}, "sessions spread"
        assert min(cached) > 0.5, cached


async def test_round_robin_loses_the_cache_the_policies_keep(procs: Procs, gateways: list[Any]) -> None:
    """The failure the policies prevent: with round robin every round lands on the other prefill, which holds
    the session only up to the round before last, and computes the latest round's growth again."""
    prefills = [procs.sim("prefill"), procs.sim("prefill")]
    d = procs.sim("decode")
    g = await gateway(gateways, prefills, [d], policy="round_robin")
    async with aiohttp.ClientSession() as http:
        h = [{"role": "system", "content": "agent " + "manual " * 400}]
        usage = []
        for rnd in range(6):
            _, body = await session_round(http, g, "s", h, f"round {rnd} " + "x y z " * 300)
            usage.append(body["usage"])
        for prev, now in itertools.pairwise(usage):
            assert now["prompt_tokens_details"]["cached_tokens"] < prev["prompt_tokens"] - 800, usage


async def test_session_moves_when_its_worker_restarts_and_the_trace_says_so(procs: Procs, gateways: list[Any]) -> None:
    prefills = [procs.sim("prefill"), procs.sim("prefill")]
    d = procs.sim("decode")
    g = await gateway(gateways, prefills, [d], policy="session")
    async with aiohttp.ClientSession() as http:
        h: list[dict[str, str]] = [{"role": "system", "content": "agent"}]
        rid, _ = await session_round(http, g, "s1", h, "first")
        home = prefill_of(g, rid)
        sim = next(s for s in prefills if worker_id(g.gw, s) == home)
        other = next(s for s in prefills if s is not sim)
        sim.proc.stop()  # the prefill restarts: a new process on the same port (a new engine identity)
        restarted = procs.sim("prefill", port=sim.port, bootstrap_port=sim.bootstrap_port)
        w = g.gw.pool.by_id[home]
        for _ in range(200):  # the gateway sees it (down, or up again with a new identity: restarted)
            if w.restarts:
                break
            await asyncio.sleep(0.05)
        assert w.restarts == 1, w.view(g.gw.now())
        rid2, _ = await session_round(http, g, "s1", h, "second")
        assert prefill_of(g, rid2) == worker_id(g.gw, other), "its cache is gone: it goes by load (the other is idle)"
        async with http.get(g.admin + f"/v1/requests/{rid2}") as r:
            trace = await r.json()
        notes = [e for a in trace["attempts"] for e in a["events"] if e["event"] == "routing"]
        assert notes and re.search(f"session moved from {home} to {worker_id(g.gw, other)}: {home} "
                                   r"(unavailable|lost its cache since \(down or restarted\))", notes[0]["info"]), trace
        for _ in range(100):  # it comes back; the session stays where it moved (its history is cached there)
            if w.state.value == "up":
                break
            await asyncio.sleep(0.05)
        rid3, body = await session_round(http, g, "s1", h, "third")
        assert prefill_of(g, rid3) == worker_id(g.gw, other) and body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert restarted.proc.popen is not None and restarted.proc.popen.poll() is None
        async with http.get(g.admin + "/metrics") as r:
            text = await r.text()
        assert 'pdgate_policy_decisions_total{decision="moved",policy="session",role="prefill"} 1.0' in text or \
            'pdgate_policy_decisions_total{role="prefill",policy="session",decision="moved"} 1.0' in text, text[-3000:]


class Recording(policies.RoundRobin):
    """Round robin that writes down every hook the gateway calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, Any]] = []

    def dispatched(self, worker: str, req: policies.RequestView) -> None:
        self.calls.append(("dispatched", worker, req.session))

    def completed(self, worker: str, req: policies.RequestView, ok: bool) -> None:
        self.calls.append(("completed", worker, ok))

    def forget(self, worker: str) -> None:
        self.calls.append(("forget", worker, None))


async def test_policy_hooks_hear_dispatch_completion_retry_and_removal(procs: Procs, gateways: list[Any]) -> None:
    bad = procs.sim("prefill", "--fault", "http_500_rate=1")
    good = procs.sim("prefill")
    d = procs.sim("decode")
    g = await gateway(gateways, [bad, good], [d])
    rec = Recording()
    g.gw.routing.prefill = rec
    b, ok_id = worker_id(g.gw, bad), worker_id(g.gw, good)
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(g.url + "/v1/chat/completions", headers={"x-session-id": "s"},
                                 json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2}) as r:
                assert r.status == 200
        # one request went to the failing prefill first, was retried on the other; each attempt was heard
        assert ("dispatched", b, "s") in rec.calls and ("completed", b, False) in rec.calls, rec.calls
        assert rec.calls.count(("completed", ok_id, True)) == 2
        assert [c[0] for c in rec.calls].count("dispatched") == [c[0] for c in rec.calls].count("completed")
        async with http.delete(g.admin + f"/v1/workers/{b}") as r:
            assert r.status == 200, await r.text()
    assert rec.calls[-1] == ("forget", b, None)


class Failing(policies.LeastLoaded):
    """A policy that fails on requests whose session is "bad" (where it fails is the parameter)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def select(self, workers: Any, req: policies.RequestView = policies.NO_REQUEST) -> int | None:
        if self.where == "select" and req.session == "bad" and workers:  # fails only once a worker has room
            raise TypeError("policy bug")
        return super().select(workers, req)

    def dispatched(self, worker: str, req: policies.RequestView) -> None:
        if self.where == "dispatched" and req.session == "bad":
            raise TypeError("policy bug")


@pytest.mark.parametrize("where", ["select", "dispatched"])
async def test_a_policy_that_fails_on_one_request_ends_that_request_only(procs: Procs, gateways: list[Any],
                                                                         where: str) -> None:
    """The queue keeps serving and no slot or load is left behind (a policy raising in the pump used to leave
    its entry at the head of the queue, failing every pump after; one raising in dispatched left both workers
    bound, later degraded)."""
    p = procs.sim("prefill", "--fault", "slow_prefill=0.3")
    d = procs.sim("decode")
    from pdgate.core.config import AdmissionConfig

    g = await gateway(gateways, [p], [d], admission=AdmissionConfig(capacity=1))
    g.gw.routing.prefill = Failing(where)

    async def one(http: aiohttp.ClientSession, sid: str) -> int:
        async with http.post(g.url + "/v1/chat/completions", headers={"x-session-id": sid},
                             json={"model": "sim-model", "messages": [{"role": "user", "content": sid}],
                                   "max_tokens": 2}) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(one(http, "a"))  # holds the only slot: the rest queue behind it
        await asyncio.sleep(0.1)
        statuses = await asyncio.gather(first, one(http, "bad"), one(http, "b"), one(http, "c"))
    assert statuses[0] == 200 and statuses[2:] == [200, 200], statuses
    assert statuses[1] == 500, statuses
    assert g.gw.gate.queue.n == 0 and all(w.load == 0 and w.slots.reserved == 0 and w.busy_since is None
                                          for w in g.gw.pool.by_id.values())


async def test_session_header_is_matched_whatever_its_case_in_the_config(procs: Procs, gateways: list[Any]) -> None:
    from pdgate.core.config import RoutingConfig

    prefills = [procs.sim("prefill"), procs.sim("prefill")]
    d = procs.sim("decode")
    g = await gateway(gateways, prefills, [d], policy="session", routing=RoutingConfig(session_header="X-Agent-Run"))
    async with aiohttp.ClientSession() as http:
        homes = set()
        for i in range(4):
            async with http.post(g.url + "/v1/chat/completions", headers={"X-Agent-Run": "run-7"},
                                 json={"model": "sim-model", "messages": [{"role": "user", "content": f"{i}"}],
                                       "max_tokens": 2}) as r:
                assert r.status == 200
                homes.add(prefill_of(g, r.headers["x-request-id"]))
        assert len(homes) == 1
        async with http.post(g.url + "/v1/chat/completions", json={"model": "sim-model", "messages": [
                {"role": "assistant", "content": None, "tool_calls": 5}]}) as r:
            assert r.status == 400 and "tool_calls must be a list" in (await r.json())["error"]["message"]
