"""Anthropic's Messages API through PD: the ``anthropic`` SDK's calls (stream and not, tool use, count_tokens,
errors) against real sim processes that cut and merge their writes; the gateway's own ends as an ``error`` event
naming why; sessions and model aliases; the translation's rules as pure unit tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from pdgate.apis import anthropic as wire
from pdgate.core.config import Budgets, DeadlineConfig, KeyConfig, MessagesConfig
from pdgate.core.errors import InvalidField
from pdgate.path.auth import hash_key
from pdgate.pool.policies import client_session, user_id_session
from tests.pdgate.harness import Running, assert_clean, make_config, start_gateway
from tests.procs import Procs, Sim

TOOLS = [{"name": "Read", "description": "read a file",
          "input_schema": {"type": "object", "required": ["file_path"], "properties": {"file_path": {"type": "string"}}}},
         {"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
SPLIT = ("--fault", "segment=0.7", "--fault", "segment_seed=28")  # writes cut and merged at random offsets


async def gateway(gateways: list[Any], prefills: list[Sim], decodes: list[Sim], **kw: Any) -> Running:
    g = await start_gateway(make_config(prefills, decodes, **kw))
    gateways.append(g)
    return g


@pytest.fixture
async def sdk() -> Any:
    made: list[anthropic.AsyncAnthropic] = []

    def make(g: Running, key: str = "none", **kw: Any) -> anthropic.AsyncAnthropic:
        c = anthropic.AsyncAnthropic(base_url=g.url, api_key=key, max_retries=0, **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            await c.close()


# ---- end to end -------------------------------------------------------------------------------------------
async def test_sdk_tool_round_trip_stream_and_not(procs: Procs, gateways: list[Any], sdk: Any,
                                                  http: aiohttp.ClientSession) -> None:
    """The SDK's own calls: a tool_use, its tool_result sent back, the answer; streamed and not; the stream's
    events in Anthropic's order and its final message the same shape as the whole answer's."""
    p, d = procs.pair(*SPLIT)
    g = await gateway(gateways, [p], [d])
    client = sdk(g)
    ask = [{"role": "user", "content": "please Read `README.md`"}]
    first = await client.messages.create(model="sim-model", system="You are a coding agent.", messages=ask,
                                         tools=TOOLS, max_tokens=64)
    assert first.id.startswith("msg_") and first.stop_reason == "tool_use" and first.role == "assistant"
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "Read" and use.input == {"file_path": "README.md"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    turn = [*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42 lines"}]}]
    second = await client.messages.create(model="sim-model", messages=turn, tools=TOOLS, max_tokens=6)
    assert second.content[0].type == "text" and second.content[0].text and second.stop_reason == "max_tokens"
    # the same two rounds streamed
    kinds: list[str] = []
    async with client.messages.stream(model="sim-model", system="You are a coding agent.", messages=ask,
                                      tools=TOOLS, max_tokens=64) as s:
        async for ev in s:
            kinds.append(ev.type)
        streamed = await s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == {"file_path": "README.md"}
    assert streamed.usage.output_tokens == first.usage.output_tokens
    async with client.messages.stream(model="sim-model", messages=turn, tools=TOOLS, max_tokens=6) as s:
        text = await s.get_final_text()
        final = await s.get_final_message()
    assert text == second.content[0].text and final.stop_reason == "max_tokens"
    await assert_clean(http, g.gw, [p, d])


async def test_count_tokens_asks_the_engine_and_matches_the_usage(procs: Procs, gateways: list[Any], sdk: Any) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    client = sdk(g)
    msgs = [{"role": "user", "content": "count these words please"}]
    counted = await client.messages.count_tokens(model="sim-model", system="be brief", messages=msgs)
    answered = await client.messages.create(model="sim-model", system="be brief", messages=msgs, max_tokens=4)
    u = answered.usage
    assert counted.input_tokens == u.input_tokens + (u.cache_read_input_tokens or 0) > 0


async def test_errors_in_anthropics_shape(procs: Procs, gateways: list[Any], sdk: Any,
                                          http: aiohttp.ClientSession) -> None:
    """Each refusal as Anthropic's clients read it: a bad body, an unknown model naming the served ones, a missing
    or wrong key (x-api-key is a client key), a key's rate limit, an engine's refusal."""
    p, d = procs.pair()
    keys = (KeyConfig(name="a", hash=hash_key("sk-a")), KeyConfig(name="slow", hash=hash_key("sk-slow"),
                                                                   requests_per_min=1))
    g = await gateway(gateways, [p], [d], keys=keys)
    ok = sdk(g, "sk-a")
    with pytest.raises(anthropic.BadRequestError) as bad:
        await ok.messages.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.value.message
    with pytest.raises(anthropic.NotFoundError) as nf:
        await ok.messages.create(model="claude-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert nf.value.body == {"type": "error", "error": {"type": "not_found_error", "message":
                                                        "model 'claude-nope' is not served here; available: sim-model"}}
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await sdk(g, "sk-wrong").messages.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
    assert auth.value.body["error"]["type"] == "authentication_error"
    async with http.post(g.url + "/v1/messages", data=b"{", headers={"x-api-key": "sk-a"}) as r:
        assert r.status == 400 and (await r.json())["type"] == "error"
    async with http.get(g.url + "/v1/messages/batches", headers={"x-api-key": "sk-a"}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    slow = sdk(g, "sk-slow")
    await slow.messages.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(anthropic.RateLimitError) as rl:
        await slow.messages.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert rl.value.body["error"]["type"] == "rate_limit_error" and rl.value.response.headers["retry-after"]
    with pytest.raises(anthropic.BadRequestError) as eng:  # the engine's own 400, passed on
        await ok.messages.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                 tools=TOOLS, tool_choice={"type": "tool", "name": "Nope"})
    assert eng.value.body["error"]["type"] == "invalid_request_error" and "Nope" in eng.value.message
    await assert_clean(http, g.gw, [p, d])


async def test_a_ttft_deadline_on_a_stream_ends_with_an_error_event_naming_the_budget(
        procs: Procs, gateways: list[Any], http: aiohttp.ClientSession) -> None:
    """Before its first token (the prefill slow): the stream ends with Anthropic's error event naming the budget,
    within budget + 0.5 s, both legs aborted, the engines clean. Mid-stream (the decode frozen): the open block
    closed, then the error event, nothing after."""
    p, d = procs.pair("--fault", "slow_prefill=3")
    g = await gateway(gateways, [p], [d], deadlines=DeadlineConfig(ttft_s=0.5, idle_s=0.6))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with http.post(g.url + "/v1/messages", json={"model": "sim-model", "max_tokens": 8, "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]}) as r:
        raw = await r.read()
    took = loop.time() - t0
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert raw.startswith(b"event: error\n") and raw.count(b"event: ") == 1
    err = orjson.loads(raw.split(b"data: ", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == "timeout_error"
    assert "ttft deadline of 0.5s" in err["error"]["message"] and took < 0.5 + 0.5
    rec = g.gw.traces.get(r.headers["x-request-id"])
    assert rec is not None and rec.attempts and all(a.events for a in rec.attempts)
    await assert_clean(http, g.gw, [p, d])
    async with http.post(p.url + "/pdgate/v1/faults", json={"slow_prefill": 0}):
        pass
    async with http.post(g.url + "/v1/messages", json={"model": "sim-model", "max_tokens": 200, "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]}) as r:
        seen, lines = 0, []
        async for line in r.content:
            lines.append(line)
            if line.startswith(b"event: content_block_delta"):
                seen += 1
                if seen == 3:
                    async with http.post(d.url + "/pdgate/v1/faults", json={"decode_freeze": True}):
                        pass
    events = [ln[7:].strip() for ln in lines if ln.startswith(b"event: ")]
    assert seen >= 3 and events[-2:] == [b"content_block_stop", b"error"]
    assert b"idle deadline" in lines[-2] and b"timeout_error" in lines[-2]
    async with http.post(d.url + "/pdgate/v1/faults", json={"decode_freeze": False}):
        pass
    await assert_clean(http, g.gw, [p, d])


async def test_claude_code_names_its_session_and_model_aliases_serve_its_default_names(
        procs: Procs, gateways: list[Any], http: aiohttp.ClientSession) -> None:
    """Claude Code's session header routes its rounds together (session policy: one prefill for the session);
    ``[models."claude-*"] served_by`` serves its default model name, said in the trace."""
    p1, d1 = procs.pair()
    p2, d2 = procs.pair()
    models = {"claude-*": Budgets(served_by="sim-model")}
    g = await gateway(gateways, [p1, p2], [d1, d2], policy="session", models=models)
    prefills = set()
    for i in range(6):
        async with http.post(g.url + "/v1/messages", json={
                "model": "claude-opus-5-5", "max_tokens": 4, "messages": [{"role": "user", "content": f"round {i}"}]},
                headers={"X-Claude-Code-Session-Id": "s-1", "anthropic-version": "2023-06-01",
                         "anthropic-beta": "claude-code-20250219"}) as r:
            body = await r.json()
            assert r.status == 200 and body["model"] == "claude-opus-5-5", body
            rec = g.gw.traces.get(r.headers["x-request-id"])
        assert rec is not None and rec.session == "s-1" and rec.model == "sim-model"
        assert rec.notes == ["model 'claude-opus-5-5' is an alias of 'sim-model'"]
        prefills.add(rec.attempts[-1].prefill)
    assert len(prefills) == 1


# ---- the translation, pure --------------------------------------------------------------------------------
def test_a_claude_code_request_becomes_a_chat_body() -> None:
    body = {"model": "claude-opus-5-5", "max_tokens": 128000, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.593; "
                        "cc_entrypoint=cli; cch=4f2a9;"},
                       {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                             {"type": "text", "text": "run `ls`"}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                                  {"type": "text", "text": "ok"},
                                                  {"type": "tool_use", "id": "tu1", "name": "Bash",
                                                   "input": {"command": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "is_error": True,
                                              "content": [{"type": "text", "text": "no such dir"}]},
                                             {"type": "text", "text": "try again"}]},
                {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}],
            "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
                      {"name": "web_search", "type": "web_search_20250305"},
                      {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stop_sequences": ["END"],
            "top_k": 5, "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
            "output_config": {"effort": "medium"}, "metadata": {"user_id": "u"}}
    chat, dropped = wire.to_chat(body)
    assert dropped == ["web_search:web_search_20250305"]
    assert chat["messages"] == [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.328.593; cc_entrypoint=cli;\n"
                                      "You are Claude Code."},
        {"role": "user", "content": "<system-reminder>r</system-reminder>run `ls`"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "tu1", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "tu1", "content": "Error: no such dir"},
        {"role": "user", "content": "try again"},
        {"role": "system", "content": "# Environment"}]
    assert [t["function"]["name"] for t in chat["tools"]] == ["Bash", "Later"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["top_k"] == 5 and chat["max_tokens"] == 128000
    assert chat["stream_options"] == {"include_usage": True}
    kept, _ = wire.to_chat(body, normalise_billing=False)
    assert "cch=4f2a9;" in kept["messages"][0]["content"]


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t"}]},
     "tools"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "t", "input_schema": {}}], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"},
     "stop_sequences"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as e:
        wire.to_chat(body)
    assert e.value.param == param
    assert wire.Error(e.value).body()["error"]["type"] == "invalid_request_error"


def chat_stream(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def feed_all(stream: bytes, cut: int) -> list[dict[str, Any]]:
    ev = wire.Events({"model": "m", "stop_sequences": ["END"]}, "msg_1")
    out = b""
    buf = b""
    for i in range(0, len(stream), cut):  # the relay hands whole events: cut them here as its framer would
        buf += stream[i:i + cut]
        *whole, buf = buf.split(b"\n\n")
        if whole:
            out += ev.feed(b"\n\n".join(whole) + b"\n\n", b"\n\n")
    return [orjson.loads(block.split(b"data: ", 1)[1]) for block in out.split(b"\n\n") if block]


def test_a_chat_stream_fed_at_any_split_gives_the_same_events() -> None:
    stream = chat_stream(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "Bash"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"comm'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'and":"ls"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 4}}})
    want = feed_all(stream, len(stream))
    assert [e["type"] for e in want] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert want[6]["content_block"] == {"type": "tool_use", "id": "c1", "name": "Bash", "input": {}}
    assert want[7]["delta"] == {"type": "input_json_delta", "partial_json": '{"command":"ls"}'}
    assert want[9]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert want[9]["usage"] == {"input_tokens": 6, "output_tokens": 5, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 4}
    for cut in (1, 3, 7, 50):
        assert feed_all(stream, cut) == want


def test_stop_reasons_and_an_engine_error_mid_stream() -> None:
    whole = orjson.dumps({"choices": [{"message": {"content": "a"}, "finish_reason": "stop", "stop_reason": "END"}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    msg = wire.answer({"model": "m", "stop_sequences": ["END"]}, whole, "msg_x")
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == "END"
    assert wire.answer({"model": "m"}, whole, "msg_x")["stop_reason"] == "end_turn"
    garbage = wire.answer({"model": "m"}, b'{"choices": [{"message": {"tool_calls": [{"function": '
                                           b'{"name": "f", "arguments": "{not json"}}]}}]}', "msg_x")
    assert garbage["content"][0]["input"] == {"_arguments": "{not json"} and garbage["stop_reason"] == "tool_use"
    ev = wire.Events({"model": "m"}, "msg_1")
    out = ev.feed(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: {"error": {"message": "boom"}}\n\n'
                  b'data: {"choices": [{"delta": {"content": "y"}}]}\n\n', b"\n\n")
    kinds = [ln[7:] for ln in out.split(b"\n") if ln.startswith(b"event: ")]
    assert kinds[-2:] == [b"content_block_stop", b"error"] and b"boom" in out and b'"y"' not in out


def test_sessions_by_one_precedence() -> None:
    cc = '{"device_id":"d","account_uuid":"","session_id":"f870ca31"}'
    assert user_id_session({"user_id": cc}) == "f870ca31"
    assert user_id_session({"user_id": "user_ab_account_cd_session_9e1f-22"}) == "9e1f-22"
    assert user_id_session({"user_id": "alice"}) == "alice" and user_id_session(None) is None
    h = {"x-claude-code-session-id": "cc", "session-id": "codex", "x-session-id": "mine"}
    body = {"metadata": {"user_id": cc}, "prompt_cache_key": "pck", "user": "u"}
    assert client_session(h, body, "x-session-id") == "cc"
    assert client_session({**h, "x-claude-code-session-id": ""}, body, "x-session-id") == "f870ca31"
    assert client_session({"session-id": "codex", "x-session-id": "mine"}, {"prompt_cache_key": "p"},
                          "x-session-id") == "codex"
    assert client_session({"x-session-id": "mine"}, {"prompt_cache_key": "p"}, "x-session-id") == "p"
    assert client_session({"x-session-id": "mine"}, {"user": "u"}, "x-session-id") == "mine"
    assert client_session({}, {"user": "u"}, "x-session-id") is None  # user comes last, after a chain's


def test_the_billing_option_is_in_the_config() -> None:
    assert MessagesConfig().normalise_billing is True


async def test_an_operators_abort_is_answered_in_anthropics_shape(procs: Procs, gateways: list[Any],
                                                                  http: aiohttp.ClientSession) -> None:
    """Aborted before its first token (the prefill slow), not streamed: 499 in Anthropic's shape, legs aborted (the
    oracle found it answered in OpenAI's)."""
    p, d = procs.pair("--fault", "slow_prefill=3")
    g = await gateway(gateways, [p], [d])

    async def abort_soon() -> None:
        await asyncio.sleep(0.3)
        async with http.post(g.admin + "/v1/requests/job-7/abort") as r:
            assert r.status == 200, await r.text()

    task = asyncio.create_task(abort_soon())
    async with http.post(g.url + "/v1/messages", json={"model": "sim-model", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"}]}, headers={"x-request-id": "job-7"}) as r:
        body = await r.json()
    await task
    assert r.status == 499 and body == {"type": "error", "error": {"type": "api_error",
                                                                   "message": "request aborted by an operator (local)"}}
    await assert_clean(http, g.gw, [p, d])


async def test_a_full_queue_is_overloaded_error_with_retry_after_also_for_a_stream(
        procs: Procs, gateways: list[Any], http: aiohttp.ClientSession) -> None:
    """What a client should retry later stays an HTTP status (the SDK retries it), in Anthropic's shape."""
    from pdgate.core.config import AdmissionConfig

    p, d = procs.pair("--speed", "15")  # 30 tokens take ~2-3 s
    g = await gateway(gateways, [p], [d], admission=AdmissionConfig(capacity=1, max_queue=1, shed=False))
    body = {"model": "sim-model", "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}]}
    blocker = asyncio.create_task(http.post(g.url + "/v1/messages", json=body))
    await asyncio.sleep(0.3)
    waiting = asyncio.create_task(http.post(g.url + "/v1/messages", json=body))
    await asyncio.sleep(0.2)
    for stream in (False, True):
        async with http.post(g.url + "/v1/messages", json={**body, "stream": stream}) as r:
            got = await r.json()
            assert r.status == 503 and int(r.headers["Retry-After"]) >= 1, (r.status, got)
        assert got["type"] == "error" and got["error"]["type"] == "overloaded_error", got
    for t in (blocker, waiting):
        (await t).release()
    await assert_clean(http, g.gw, [p, d], within=15)


def test_interleaved_tool_arguments_and_text_lose_nothing() -> None:
    """A chat stream may send a call's arguments after text, or two calls' arguments in one chunk: each tool_use
    block goes out whole, its arguments complete (a hostile pass found them dropped)."""
    stream = chat_stream(
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"a":'}},
                                               {"index": 1, "id": "b", "function": {"name": "g"}}]}}]},
        {"choices": [{"delta": {"content": "\n"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}},
                                               {"index": 1, "function": {"arguments": '{"y":2}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    evs = feed_all(stream, len(stream))
    args = {}
    for i, e in enumerate(evs):
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            assert evs[i + 1]["type"] == "content_block_delta" and evs[i + 2]["type"] == "content_block_stop"
            args[e["content_block"]["id"]] = json.loads(evs[i + 1]["delta"]["partial_json"])
    assert args == {"a": {"a": 1}, "b": {"y": 2}}
    starts = [e["index"] for e in evs if e["type"] == "content_block_start"]
    stops = [e["index"] for e in evs if e["type"] == "content_block_stop"]
    assert starts == stops == sorted(starts), "each block started and stopped once, in order"


async def test_hostile_bodies_get_anthropic_400s_and_the_loop_stays_free(procs: Procs, gateways: list[Any],
                                                                         http: aiohttp.ClientSession) -> None:
    """What a hostile pass found: values nested past what the gateway can write back (a 500 before), a billing
    line of spaces (the loop held for seconds by a backtracking pattern), a server tool's name with a newline (an
    invalid response header), a body too large and an Expect refused (OpenAI's shape), count_tokens past a key's
    requests per minute (not counted)."""
    p, d = procs.pair()
    keys = (KeyConfig(name="a", hash=hash_key("sk-a"), requests_per_min=3),)
    g = await gateway(gateways, [p], [d], keys=keys, max_body_bytes=200_000)
    h = {"x-api-key": "sk-a"}
    deep: Any = 1
    for _ in range(300):
        deep = {"a": deep}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": deep}]}]
    async with http.post(g.url + "/v1/messages", json={"model": "sim-model", "max_tokens": 2, "messages": msgs},
                         headers=h) as r:
        got = await r.json()
        assert r.status == 400 and got["error"]["type"] == "invalid_request_error" and "nest" in got["error"]["message"]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with http.post(g.url + "/v1/messages/count_tokens", json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
            "system": "x-anthropic-billing-header:" + " " * 150_000}, headers=h) as r:
        assert r.status == 200, await r.text()
    assert loop.time() - t0 < 1.0
    async with http.post(g.url + "/v1/messages", json={
            "model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "evil\nX-Injected: 1", "type": "web_search_20250305"}]}, headers=h) as r:
        assert r.status == 200 and "X-Injected" not in r.headers
        assert r.headers["x-pdgate-tools-dropped"] == "evil?X-Injected: 1:web_search_20250305"
    async with http.post(g.url + "/v1/messages", data=b"x" * 300_000, headers=h) as r:
        got = await r.json()
        assert r.status == 413 and got["error"]["type"] == "request_too_large", got
    async with http.post(g.url + "/v1/messages", json={}, headers={**h, "Expect": "something"}) as r:
        got = await r.json()
        assert r.status == 417 and got["type"] == "error", got
    statuses = []
    for _ in range(4):
        async with http.post(g.url + "/v1/messages/count_tokens", json={
                "model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}, headers=h) as r:
            statuses.append(r.status)
            if r.status == 429:
                assert (await r.json())["error"]["type"] == "rate_limit_error"
    assert 429 in statuses, statuses
    await assert_clean(http, g.gw, [p, d])


def test_a_final_assistant_message_is_continued() -> None:
    chat, _ = wire.to_chat({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "json please"}, {"role": "assistant", "content": "{\"a\":"}]})
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    chat, _ = wire.to_chat({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert "continue_final_message" not in chat
