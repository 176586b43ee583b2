"""The Responses API through PD: the OpenAI SDK's ``responses`` calls (stream and not) against real sim processes
that cut and merge their writes; stored responses per tenant; the gateway's own ends as ``response.failed``;
the translation's rules as pure unit tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from pdgate.apis import responses
from pdgate.core.config import DeadlineConfig, KeyConfig, ResponsesConfig
from pdgate.core.errors import InvalidField
from pdgate.path.auth import hash_key
from pdgate.store.embedded import EmbeddedStore
from tests.engine.simclient import set_faults
from tests.pdgate.harness import Running, assert_clean, make_config, start_gateway
from tests.procs import Procs, Sim

TOOLS = [{"type": "function", "name": "read_file", "description": "read a file",
          "parameters": {"type": "object", "required": ["path"], "properties": {"path": {"type": "string"}}}},
         {"type": "function", "name": "run_tests",
          "parameters": {"type": "object", "properties": {"suite": {"type": "string", "enum": ["unit"]}}}}]
SPLIT = ("--fault", "segment=0.7", "--fault", "segment_seed=28")  # writes cut and merged at random offsets


async def gateway(gateways: list[Any], prefills: list[Sim], decodes: list[Sim], **kw: Any) -> Running:
    g = await start_gateway(make_config(prefills, decodes, **kw))
    gateways.append(g)
    return g


class Clients:
    """SDK clients a test makes, closed at its end."""

    def __init__(self) -> None:
        self.made: list[openai.AsyncOpenAI] = []

    def __call__(self, g: Running, key: str = "none") -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
        self.made.append(c)
        return c


@pytest.fixture
async def sdk() -> Any:
    made = Clients()
    try:
        yield made
    finally:
        for c in made.made:
            await c.close()


# ---- end to end -------------------------------------------------------------------------------------------
async def test_sdk_tool_round_trip_stream_and_not_with_continuation(procs: Procs, gateways: list[Any], sdk: Clients,
                                                                    http: aiohttp.ClientSession) -> None:
    """The SDK's own calls: a tool call, its output sent back by previous_response_id, the answer; streamed and
    not; the stream's events in OpenAI's order, its final response the same as GET's."""
    p, d = procs.pair(*SPLIT)
    g = await gateway(gateways, [p], [d])
    client = sdk(g)
    first = await client.responses.create(model="sim-model", instructions="You are a coding agent.",
                                          input="please use read_file", tools=TOOLS, max_output_tokens=64)
    assert first.status == "completed" and first.id.startswith("resp_")
    call = first.output[0]
    assert call.type == "function_call" and call.name == "read_file" and json.loads(call.arguments)["path"]
    assert first.usage is not None and first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = await client.responses.create(model="sim-model", previous_response_id=first.id, tools=TOOLS,
                                           max_output_tokens=6, input=[{"type": "function_call_output",
                                                                        "call_id": call.call_id, "output": "42 lines"}])
    assert second.output[0].type == "message" and second.output_text
    assert second.status == "incomplete" and second.incomplete_details.reason == "max_output_tokens"
    assert second.previous_response_id == first.id
    # the same two rounds streamed
    kinds: list[str] = []
    final: Any = None
    args = ""
    async with await client.responses.create(model="sim-model", input="please use run_tests", tools=TOOLS,
                                             stream=True, max_output_tokens=64) as s:
        async for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                args += ev.delta
            if ev.type == "response.completed":
                final = ev.response
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert final.output[0].name == "run_tests" and final.output[0].arguments == args == '{"suite":"unit"}'
    text = ""
    seqs: list[int] = []
    async with await client.responses.create(model="sim-model", previous_response_id=final.id, stream=True,
                                             input=[{"type": "function_call_output", "call_id": final.output[0].call_id,
                                                     "output": "ok"}], max_output_tokens=12) as s:
        async for ev in s:
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                done = ev.response
    assert seqs == list(range(len(seqs))) and text and done.output_text == text
    got = await client.responses.retrieve(done.id)
    assert got.output_text == text and got.usage.output_tokens == done.usage.output_tokens == 12
    deleted = await client.responses.delete(done.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(done.id)
    await assert_clean(http, g.gw, [p, d])


async def test_store_false_keeps_nothing_and_unknown_ids_are_404(procs: Procs, gateways: list[Any], sdk: Clients) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    client = sdk(g)
    r = await client.responses.create(model="sim-model", input="hi", store=False, max_output_tokens=4)
    assert r.output_text and r.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    for bad in (r.id, "resp_nope", "resp_a:b", "x" * 300):
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model="sim-model", input="hi", previous_response_id=bad)
        assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    # a built-in tool the engines cannot act on is left out, and said so, never a 400 that stops an agent
    raw = await client.responses.with_raw_response.create(model="sim-model", input="hi", tools=[{"type": "web_search"}])
    assert raw.headers["x-pdgate-tools-dropped"] == "web_search" and raw.parse().output_text
    rec = g.gw.traces.get(raw.headers["x-request-id"])
    assert rec is not None and rec.notes == ["tools left out (the engines cannot act on them): web_search"]
    with pytest.raises(openai.BadRequestError) as bad_req:
        await client.responses.create(model="sim-model", input="hi", tools=[{"type": "namespace", "name": "n"}])
    assert bad_req.value.body["param"] == "tools"  # type: ignore[index]


async def test_a_tenant_never_reads_or_continues_anothers_response(procs: Procs, gateways: list[Any], sdk: Clients) -> None:
    p, d = procs.pair()
    keys = (KeyConfig("alice", hash_key("sk-alice-0123456789")), KeyConfig("bob", hash_key("sk-bob-0123456789")))
    g = await gateway(gateways, [p], [d], keys=keys)
    alice, bob = sdk(g, "sk-alice-0123456789"), sdk(g, "sk-bob-0123456789")
    r = await alice.responses.create(model="sim-model", input="secret plans", max_output_tokens=4)
    assert (await alice.responses.retrieve(r.id)).id == r.id
    with pytest.raises(openai.NotFoundError):
        await bob.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        await bob.responses.create(model="sim-model", input="continue", previous_response_id=r.id)
    assert "not found" in e.value.message
    with pytest.raises(openai.NotFoundError):
        await bob.responses.delete(r.id)
    assert (await alice.responses.retrieve(r.id)).id == r.id, "bob's delete did not touch alice's"
    with pytest.raises(openai.AuthenticationError):
        await sdk(g, "sk-nobody").responses.retrieve(r.id)


async def test_a_ttft_deadline_on_a_stream_ends_with_response_failed_naming_the_budget(
        procs: Procs, gateways: list[Any], sdk: Clients, http: aiohttp.ClientSession) -> None:
    """Before its first token (the prefill slow) and after it (the decode frozen): a stream, never a 504 or a cut."""
    p, d = procs.pair("--fault", "slow_prefill=3")
    g = await gateway(gateways, [p], [d], deadlines=DeadlineConfig(ttft_s=0.5, idle_s=0.6))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    kinds: list[str] = []
    async with await sdk(g).responses.create(model="sim-model", input="hi", stream=True, max_output_tokens=8) as s:
        async for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.failed":
                failed = ev.response
    assert kinds == ["response.created", "response.in_progress", "response.failed"]
    assert failed.status == "failed" and failed.error.code == "deadline_exceeded"
    assert "ttft deadline of 0.5s" in failed.error.message and loop.time() - t0 < 0.5 + 0.5
    await assert_clean(http, g.gw, [p, d])


async def test_an_idle_deadline_mid_stream_and_a_drain_end_with_response_failed(
        procs: Procs, gateways: list[Any], sdk: Clients, http: aiohttp.ClientSession) -> None:
    p, d = procs.pair("--speed", "8")
    g = await gateway(gateways, [p], [d], deadlines=DeadlineConfig(idle_s=0.5))
    async with http.post(g.url + "/v1/responses", json={"model": "sim-model", "input": "hi", "stream": True,
                                                        "max_output_tokens": 200}) as r:
        assert r.status == 200
        seen = 0
        async for line in r.content:
            if line.startswith(b"event: response.output_text.delta"):
                seen += 1
                if seen == 3:
                    async with http.post(d.url + "/pdgate/v1/faults", json={"decode_freeze": True}):
                        pass
            if line.startswith(b"data:") and b'"response.failed"' in line:
                ev = orjson.loads(line[5:])
                break
    assert seen >= 3 and ev["response"]["error"]["code"] == "deadline_exceeded"
    assert "idle deadline" in ev["response"]["error"]["message"]
    async with http.post(d.url + "/pdgate/v1/faults", json={"decode_freeze": False}):
        pass
    await assert_clean(http, g.gw, [p, d])
    async with http.post(g.url + "/v1/responses", json={"model": "sim-model", "input": "hi", "stream": True,
                                                        "max_output_tokens": 200}) as r:
        seen = 0
        async for line in r.content:
            if line.startswith(b"event: response.output_text.delta"):
                seen += 1
                if seen == 3:
                    assert g.gw.pipeline.drain("the test drains") == 1
            if line.startswith(b"data:") and b'"response.failed"' in line:
                ev = orjson.loads(line[5:])
        rest = await r.content.read()
    assert ev["response"]["error"]["code"] == "gateway_draining" and "the test drains" in ev["response"]["error"]["message"]
    assert rest == b"", "nothing after the terminal event"
    await assert_clean(http, g.gw, [p, d])


# ---- the translation, pure --------------------------------------------------------------------------------
def test_input_items_become_chat_messages() -> None:
    chat, turn = responses.to_chat({
        "model": "m", "instructions": "be brief", "max_output_tokens": 9, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f"}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}, "stream": True,
        "input": [{"role": "developer", "content": "rules"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                  {"type": "input_text", "text": "b"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "one"},
                  {"type": "reasoning", "id": "rs", "summary": []}]},
        [{"role": "user", "content": "before"}])
    assert chat["messages"][0] == {"role": "system", "content": "be brief"}
    assert chat["messages"][1] == {"role": "user", "content": "before"}, "history after the instructions"
    assert turn[0] == {"role": "system", "content": "rules"} and turn[1] == {"role": "user", "content": "ab"}
    assert [c["id"] for c in turn[2]["tool_calls"]] == ["c1", "c2"], "parallel calls: one assistant message"
    assert turn[3] == {"role": "tool", "tool_call_id": "c1", "content": "one"} and len(turn) == 4
    assert chat["max_completion_tokens"] == 9 and chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "x" and chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"type": "mystery_call", "id": "x"}]}, "input"),
    ({"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c"}]}, "input"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": "custom"}]}, "tools"),
    ({"model": "m", "input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom"}]}]},
     "tools"),
    ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "store": "yes"}, "store"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as e:
        responses.to_chat(body, [])
    assert e.value.param == param


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def parse(out: bytes) -> list[dict[str, Any]]:
    evs = []
    for ev in out.split(b"\n\n"):
        if ev:
            kind, data = ev.split(b"\n")
            obj = orjson.loads(data[6:])
            assert kind == b"event: " + obj["type"].encode()
            evs.append(obj)
    return evs


def test_a_chat_stream_fed_at_any_split_gives_the_same_events() -> None:
    """The relay hands whole events, but any grouping of them; the event sequence depends on none."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              *({"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("Hel", "lo", " there")),
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {
                  "name": "f", "arguments": ""}}]}}]},
              *({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": a}}]}}]}
                for a in ('{"a"', ':1}')),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5,
                                        "prompt_tokens_details": {"cached_tokens": 3}}}]
    whole = sse(*chunks)
    events = whole.split(b"\n\n")[:-1]
    outs = []
    for cut in ([len(events)], [1] * len(events), [3, 2, 4, 1]):
        ev = responses.Events({"model": "m"}, "resp_x", 1)
        out, i = b"", 0
        for n in cut:
            out += ev.feed(b"\n\n".join(events[i:i + n]) + b"\n\n", b"\n\n")
            i += n
        outs.append(parse(out + ev.final))
    assert outs[0] == outs[1] == outs[2]
    got = outs[0]
    kinds = [e["type"] for e in got]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_item.added",
                     *["response.function_call_arguments.delta"] * 2, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = got[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello there"
    assert final["output"][1] == {"type": "function_call", "id": "fc_x_0", "call_id": "call_1", "name": "f",
                                  "arguments": '{"a":1}', "status": "completed"}
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 3 and final["usage"]["total_tokens"] == 12


def test_an_engine_error_mid_stream_is_response_failed_and_nothing_after() -> None:
    ev = responses.Events({"model": "m"}, "resp_x", 1)
    out = ev.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\ndata: {"error": {"message": "oom"}}'
                  b"\n\ndata: [DONE]\n\n", b"\n\n")
    got = parse(out)
    assert got[-1]["type"] == "response.failed" and "oom" in got[-1]["response"]["error"]["message"]
    assert ev.final == b""


async def test_the_embedded_store_is_bounded_by_count_bytes_and_time() -> None:
    s = EmbeddedStore()
    lim = ResponsesConfig(ttl_s=10, max_stored=3, max_total_bytes=250)
    for i in range(5):
        await s.put_response("a", f"resp_{i}", b"x" * 10, float(i), lim)
    assert [await s.get_response("a", f"resp_{i}", 5.0) for i in range(5)] == [None, None, b"x" * 10, b"x" * 10,
                                                                               b"x" * 10]
    assert await s.get_response("b", "resp_4", 5.0) is None, "another tenant's"
    assert await s.get_response("a", "resp_4", 14.0) is None, "expired"
    for i in range(30):
        await s.put_response(f"t{i}", "resp_1", b"y" * 100, 20.0, lim)
    assert s.response_bytes <= 250 and len(s.response_order) == 2
    assert await s.delete_response("t29", "resp_1") and not await s.delete_response("t29", "resp_1")


async def test_a_sessions_rounds_in_one_view_and_a_response_found_by_its_id(
        procs: Procs, gateways: list[Any], sdk: Clients, http: aiohttp.ClientSession) -> None:
    """A Responses chain names its session by its first response when the client names none; its rounds, with
    TTFT, cached tokens and the pair of each, are listed by the admin plane and by ``pdgate trace --session``; each
    round's trace is found by its ``resp_`` id."""
    p1, p2 = procs.sim("prefill"), procs.sim("prefill")
    d = procs.sim("decode")
    g = await gateway(gateways, [p1, p2], [d], policy="session")
    client = sdk(g)
    first = await client.responses.create(model="sim-model", input="a long shared prompt " * 100, max_output_tokens=4)
    ids = [first.id]
    for n in range(3):
        prev = await client.responses.create(model="sim-model", previous_response_id=ids[-1], input=f"round {n}",
                                             max_output_tokens=4, stream=n == 1)
        if n == 1:
            async for ev in prev:
                if ev.type == "response.incomplete":  # max_output_tokens reached
                    ids.append(ev.response.id)
        else:
            ids.append(prev.id)
    named = await client.responses.create(model="sim-model", input="elsewhere", max_output_tokens=2,
                                          extra_headers={"x-session-id": "named-1"})
    async with http.get(g.admin + "/v1/sessions/" + ids[0]) as r:
        assert r.status == 200
        view = await r.json()
    rounds = view["rounds"]
    assert [r["response_id"] for r in rounds] == ids, "every round of the chain, in order, none of another session"
    assert len({r["prefill"] for r in rounds}) == 1, "the session policy kept the chain on one prefill"
    assert all(r["outcome"] == "completed" and r["ttft_s"] > 0 and r["prompt_tokens"] for r in rounds)
    assert all(r["cached_tokens"] > 0 for r in rounds[1:]), "later rounds found the history in the prefill's cache"
    async with http.get(g.admin + "/v1/sessions/named-1") as r:
        assert [x["response_id"] for x in (await r.json())["rounds"]] == [named.id]
    async with http.get(g.admin + "/v1/sessions") as r:
        listed = {s["session"]: s["rounds"] for s in (await r.json())["sessions"]}
    assert listed == {ids[0]: 4, "named-1": 1}
    async with http.get(g.admin + "/v1/requests/" + ids[2]) as r:
        trace = await r.json()
    assert trace["id"] == ids[2].removeprefix("resp_") and trace["route"] == "/v1/responses"
    out = await asyncio.to_thread(cli_trace_session, g.admin, ids[0])
    assert out.count("completed") == 4 and all(i.removeprefix("resp_") in out for i in ids), out
    await assert_clean(http, g.gw, [p1, p2, d])


def cli_trace_session(admin: str, key: str) -> str:
    import os
    import subprocess
    import sys

    from tests.procs import ROOT
    env = {**os.environ, "COLUMNS": "200", "PDGATE_ADMIN_URL": admin}
    run = subprocess.run([sys.executable, "-m", "pdgate", "trace", "--session", key], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, env=env)
    assert run.returncode == 0, run.stderr
    return run.stdout


async def test_two_gateways_on_one_redis_continue_each_others_responses(
        procs: Procs, gateways: list[Any], sdk: Clients) -> None:
    """Stored responses live in the shared store: a conversation begun on one replica goes on on the other, streamed
    or not; a tenant's ids stay its own there too."""
    from pdgate.core.config import StoreConfig

    redis = procs.redis()
    p, d = procs.pair()
    store = StoreConfig(url=redis.url, lease_s=2.0, heartbeat_s=0.5)
    keys = (KeyConfig("alice", hash_key("sk-alice-0123456789")), KeyConfig("bob", hash_key("sk-bob-0123456789")))
    a = await gateway(gateways, [p], [d], store=store, keys=keys)
    b = await gateway(gateways, [p], [d], store=store, keys=keys)
    on_a, on_b = sdk(a, "sk-alice-0123456789"), sdk(b, "sk-alice-0123456789")
    first = await on_a.responses.create(model="sim-model", input="please use read_file", tools=TOOLS,
                                        max_output_tokens=32)
    call = first.output[0]
    assert call.type == "function_call"
    kinds = []
    async with await on_b.responses.create(model="sim-model", previous_response_id=first.id, tools=TOOLS, stream=True,
                                           max_output_tokens=4, input=[{"type": "function_call_output",
                                                                        "call_id": call.call_id, "output": "ok"}]) as s:
        async for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.incomplete":
                second = ev.response
    assert kinds[-1] == "response.incomplete" and second.output_text
    assert (await on_a.responses.retrieve(second.id)).output_text == second.output_text, "written by b, read on a"
    with pytest.raises(openai.NotFoundError):
        await sdk(b, "sk-bob-0123456789").responses.retrieve(second.id)


async def test_retried_before_its_first_byte_left_and_aborted_by_its_resp_id(
        procs: Procs, gateways: list[Any], sdk: Clients, http: aiohttp.ClientSession) -> None:
    """A decode that answers 500: the round is retried on the other pair (nothing reached the client); a client
    that leaves mid-stream, and an operator's abort by the response's id, leave nothing on the engines."""
    p = procs.sim("prefill")
    bad, good = procs.sim("decode", "--fault", "http_500_rate=1"), procs.sim("decode", "--speed", "8")
    g = await gateway(gateways, [p], [bad, good], policy="round_robin")
    client = sdk(g)
    for stream in (False, True, False, True):
        if stream:
            async with await client.responses.create(model="sim-model", input="hi", stream=True,
                                                     max_output_tokens=3) as s:
                kinds = [ev.type async for ev in s]
            assert kinds[-1] == "response.incomplete" and "response.failed" not in kinds
        else:
            r = await client.responses.create(model="sim-model", input="hi", max_output_tokens=3)
            assert r.status == "incomplete" and r.output_text
    retried = [rec for rec in g.gw.traces.finished.values() if len(rec.attempts) == 2]
    assert retried, "some rounds met the failing decode first and were retried"
    await set_faults(http, bad, http_500_rate=0)
    # the client leaves after three deltas
    async with http.post(g.url + "/v1/responses", json={"model": "sim-model", "input": "hi", "stream": True,
                                                        "max_output_tokens": 400}) as r:
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"event: response.output_text.delta")
            if seen == 3:
                break
    await assert_clean(http, g.gw, [p, bad, good])
    # an operator aborts a live stream by its resp_ id
    async with http.post(g.url + "/v1/responses", json={"model": "sim-model", "input": "hi", "stream": True,
                                                        "max_output_tokens": 400}) as r:
        seen = 0
        async for line in r.content:
            if line.startswith(b"data:") and b'"response.created"' in line:
                rid = orjson.loads(line[5:])["response"]["id"]
                async with http.post(g.admin + f"/v1/requests/{rid}/abort") as a:
                    assert a.status == 200 and (await a.json())["aborted"] is True
            if line.startswith(b"data:") and b'"response.failed"' in line:
                err = orjson.loads(line[5:])["response"]["error"]
    assert err["code"] == "request_aborted" and "by an operator" in err["message"]
    await assert_clean(http, g.gw, [p, bad, good])


@pytest.mark.parametrize("garbage", [
    b'data: {"choices": [{"delta": "text"}]}\n\n', b'data: {"choices": [{"delta": {"tool_calls": [{"index": [1]}]}}]}\n\n',
    b'data: {"choices": [{"delta": {"tool_calls": "x", "content": 5}}]}\n\n', b'data: {"choices": "x"}\n\n',
    b'data: [1, 2]\n\n', b'data: {not json\n\n', b'data: {"choices": [{"delta": {"tool_calls": [{"function": 7}]}}]}\n\n'])
def test_an_engine_answering_garbage_loses_nothing_else(garbage: bytes) -> None:
    """Whatever an engine puts in its events, the stream goes on and ends with its terminal event."""
    ev = responses.Events({"model": "m"}, "resp_x", 1)
    ev.feed(garbage + b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n', b"\n\n")
    ev.feed(b"data: [DONE]\n\n", b"\n\n")
    final = parse(ev.final)[-1]["response"]
    msg = next(it for it in final["output"] if it["type"] == "message")
    assert final["status"] == "completed" and msg["content"][0]["text"] == "ok"
    obj, said = responses.answer({"model": "m"}, b'{"choices": [{"message": {"content": 3, "tool_calls": [1, {}]}}]}',
                                 "resp_x", 1)
    assert obj["output"] == [{"type": "function_call", "id": "fc_x_0", "call_id": "call_x_0", "name": "",
                              "arguments": "", "status": "completed"}] and said[0]["role"] == "assistant"


async def test_json_schema_output_and_an_engine_failure_as_response_failed(
        procs: Procs, gateways: list[Any], sdk: Clients, http: aiohttp.ClientSession) -> None:
    p, d = procs.pair(*SPLIT)
    g = await gateway(gateways, [p], [d], max_attempts=2)
    client = sdk(g)
    schema = {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": ["Lisbon"]}, "days": {"type": "integer", "minimum": 2, "maximum": 5}}}
    r = await client.responses.create(model="sim-model", input="plan a trip", max_output_tokens=64,
                                      text={"format": {"type": "json_schema", "name": "trip", "schema": schema}})
    got = json.loads(r.output_text)
    assert got["city"] == "Lisbon" and 2 <= got["days"] <= 5 and r.text.format.type == "json_schema"
    await set_faults(http, d, http_500_rate=1)
    async with await client.responses.create(model="sim-model", input="hi", stream=True, max_output_tokens=4) as s:
        evs = [ev async for ev in s]
    assert [e.type for e in evs] == ["response.created", "response.in_progress", "response.failed"]
    assert evs[-1].response.error.code == "upstream_5xx" and "answered 500" in evs[-1].response.error.message
    with pytest.raises(openai.InternalServerError):
        await client.responses.create(model="sim-model", input="hi", max_output_tokens=4)
    await set_faults(http, d, http_500_rate=0)
    await assert_clean(http, g.gw, [p, d])


# ---- Codex's tool kinds ---------------------------------------------------------------------------------------
CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [
        {"type": "function", "name": "spawn_agent", "strict": False, "parameters": {"type": "object", "properties": {
            "message": {"type": "string"}}}}]},
    {"type": "custom", "name": "apply_patch", "description": "edit files",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}},
    {"type": "local_shell"},
    {"type": "web_search", "external_web_access": False},
    {"type": "tool_search", "execution": "client", "parameters": {"type": "object"}}]
CODEX_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
    {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
    {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
    {"type": "local_shell_call", "id": "lsc_1", "call_id": "c2", "status": "completed",
     "action": {"type": "exec", "command": ["ls", "-la"], "timeout_ms": 1000}},
    {"type": "local_shell_call_output", "call_id": "c2", "output": "a.txt"},
    {"type": "function_call", "call_id": "c3", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c3", "output": "spawned"},
    {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "now more"}]}]


def test_codex_tool_kinds_become_functions_and_its_replayed_items_messages() -> None:
    body = {"model": "m", "input": CODEX_INPUT, "tools": CODEX_TOOLS, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1", "reasoning": {"effort": "low"},
            "client_metadata": {"x": "y"}, "text": {"verbosity": "low"}, "tool_choice": "auto"}
    chat, turn = responses.to_chat(body, [])
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names == ["exec_command", "multi_agent_v1__spawn_agent", "apply_patch", "local_shell"]
    assert chat["tools"][2]["function"]["parameters"]["required"] == ["input"]
    assert "start: begin_patch" in chat["tools"][2]["function"]["description"]
    assert responses.dropped_tools(body) == ["web_search", "tool_search"]
    calls = [m["tool_calls"][0]["function"] for m in turn if m.get("tool_calls")]
    assert calls == [{"name": "apply_patch", "arguments": '{"input":"*** Begin Patch"}'},
                     {"name": "local_shell", "arguments": '{"command":["ls","-la"],"timeout_ms":1000}'},
                     {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"}]
    assert [m["content"] for m in turn if m["role"] == "tool"] == ["Done!", "a.txt", "spawned"]
    # the engine's calls answered as the kinds asked for, whole and streamed
    answer = orjson.dumps({"choices": [{"finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"id": "k1", "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch\\n"}'}},
        {"id": "k2", "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"message": "hi"}'}},
        {"id": "k3", "function": {"name": "local_shell", "arguments": '{"command": ["ls"]}'}}]}}]})
    resp, said = responses.answer(body, answer, "resp_x", 0)
    custom, fn, shell = resp["output"]
    assert custom == {"type": "custom_tool_call", "id": "fc_x_0", "call_id": "k1", "name": "apply_patch",
                      "input": "*** Begin Patch\n", "status": "completed"}
    assert fn["type"] == "function_call" and fn["name"] == "spawn_agent" and fn["namespace"] == "multi_agent_v1"
    assert shell["type"] == "local_shell_call" and shell["action"]["command"] == ["ls"]
    assert [c["function"]["name"] for c in said[0]["tool_calls"]] == ["apply_patch", "multi_agent_v1__spawn_agent",
                                                                      "local_shell"]
    ev = responses.Events(body, "resp_y", 0)
    out = ev.feed(sse({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "k1", "function": {
        "name": "apply_patch", "arguments": '{"input": "*** Beg'}}]}}]},
                      {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'in"}'}}]}}]},
                      {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}), b"\n\n")
    kinds = [e["type"] for e in parse(out)]
    assert "response.function_call_arguments.delta" not in kinds and "response.custom_tool_call_input.done" in kinds
    done = next(e for e in parse(out) if e["type"] == "response.output_item.done")["item"]
    assert done["type"] == "custom_tool_call" and done["input"] == "*** Begin"
    assert [it["type"] for it in parse(ev.final)[0]["response"]["output"]] == ["custom_tool_call"]


async def test_a_codex_request_is_served_with_its_tools_and_the_dropped_ones_said(
        procs: Procs, gateways: list[Any], http: aiohttp.ClientSession) -> None:
    """Codex's first request as it sends it (tool kinds beyond function, store false, include, a prompt cache key,
    its session header): served, the sim calling the freeform apply_patch, streamed as Codex reads it."""
    p, d = procs.pair(*SPLIT)
    g = await gateway(gateways, [p], [d])
    body = {"model": "sim-model", "stream": True, "store": False, "tools": CODEX_TOOLS, "prompt_cache_key": "t-1",
            "include": ["reasoning.encrypted_content"], "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                 "text": "use apply_patch: `*** Begin Patch`"}]}]}
    async with http.post(g.url + "/v1/responses", json=body, headers={"session-id": "codex-1"}) as r:
        assert r.status == 200 and r.headers["x-pdgate-tools-dropped"] == "web_search,tool_search"
        raw = await r.read()
    evs = [orjson.loads(ln[6:]) for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    item = next(e for e in evs if e["type"] == "response.output_item.done")["item"]
    assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch" and item["input"] == "*** Begin Patch"
    assert evs[-1]["type"] == "response.completed"
    rec = g.gw.traces.get(r.headers["x-request-id"])
    assert rec is not None and rec.session == "codex-1"
    await assert_clean(http, g.gw, [p, d])


def test_flattened_tool_names_never_collide() -> None:
    """A plain function named as a namespace's flattened one, or two tools of one name: a 400, never a call
    answered as the wrong tool (a hostile pass found ``ns__f`` answered as namespace ns's ``f``)."""
    for tools in ([{"type": "function", "name": "ns__f"}, {"type": "namespace", "name": "ns", "tools": [
                      {"type": "function", "name": "f"}]}],
                  [{"type": "local_shell"}, {"type": "function", "name": "local_shell"}],
                  [{"type": "custom", "name": "x"}, {"type": "function", "name": "x"}]):
        with pytest.raises(InvalidField) as e:
            responses.to_chat({"model": "m", "input": "x", "tools": tools}, [])
        assert e.value.param == "tools" and "given twice" in e.value.message


async def test_values_nested_past_what_the_store_writes_are_a_400(procs: Procs, gateways: list[Any],
                                                                  http: aiohttp.ClientSession) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    deep: Any = 1
    for _ in range(245):  # parses, fits a chat body, but not the stored response wrapped around it
        deep = [deep]
    for stream in (False, True):
        async with http.post(g.url + "/v1/responses", json={"model": "sim-model", "input": "x", "stream": stream,
                                                            "max_output_tokens": 2, "metadata": None,
                                                            "tools": [{"type": "web_search", "x": deep}]}) as r:
            got = await r.json()
            assert r.status == 400 and "nest" in got["error"]["message"], got
    await assert_clean(http, g.gw, [p, d])
