"""pdgate in front of a real vLLM PD pair on this CPU (vLLM 0.32 for CPU, NIXL moving the KV through CPU memory, the
tiny random model): the OpenAI SDK and the Agents SDK through it, every deadline ending both legs, a client leaving,
an operator's abort, a retry before the first byte, a decode killed mid-stream and found restarted by its identity, a
prefill frozen, counts reconciled. Judged from outside: the client's clock, and what the engines' own ``/metrics``
say they hold (``vllm:num_requests_running`` + ``waiting``) and transferred (``vllm:nixl_*``). The model's words
are random; the protocol is what is tested. Timeouts are sized for two engines of three processes each on two
cores, whose NIXL progress threads poll without sleeping (docs/fidelity.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import aiohttp
import pytest

from engine.vllm import plan
from tests.pdgate.harness import Running, start_gateway
from tests.procs import Procs
from tests.real import common
from tests.real.conftest import Pair
from tests.real.engines import MSG, SLACK_S, clean, config, healthy, require_installed, sdk

pytestmark = pytest.mark.timeout(300)  # a decode restart (~40 s) and NIXL's stalls on two cores

# AMX's tile data (XTILEDATA, bit 18 of the extended state) as a process of the vLLM environment sees it: whether the
# kernel offers it (arch_prctl ARCH_GET_XCOMP_SUPP, 0x1021) and whether this process may run it (ARCH_GET_XCOMP_PERM)
XTILEDATA = """import ctypes
call, supp, perm = ctypes.CDLL(None).syscall, ctypes.c_ulong(), ctypes.c_ulong()
call(158, 0x1021, ctypes.byref(supp)), call(158, 0x1022, ctypes.byref(perm))
print(supp.value >> 18 & 1, perm.value >> 18 & 1)"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="AMX and arch_prctl's XCOMP calls are x86_64's")
def test_the_engines_may_run_amx_wherever_the_cpu_offers_it() -> None:
    """vLLM's CPU attention takes its AMX kernel wherever the CPU reports AMX and never asks Linux for it: on a VM
    reporting amx_tile the decode's worker died of SIGILL at its first step on a transferred KV (every request a 500,
    the tier's warm-up first). The environment asks at every interpreter's start (engine/vllm/install.sh)."""
    require_installed("vllm")
    out = subprocess.run([plan.python(), "-c", XTILEDATA], capture_output=True, text=True, timeout=60, check=True)
    offered, permitted = out.stdout.split()
    assert permitted == offered, f"the kernel offers AMX ({offered}) and vLLM's processes may run it ({permitted})"


async def direct_prompt_tokens(pair: Pair, messages: list[dict[str, Any]]) -> int:
    """What vLLM itself counts for this prompt: the decode asked directly, without PD (one token)."""
    async with aiohttp.ClientSession() as http, http.post(pair.decode.url + "/v1/chat/completions", json={
            "model": pair.model, "messages": messages, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()
        return int((await r.json())["usage"]["prompt_tokens"])


async def test_the_openai_sdk_chat_and_completions_stream_and_not(pair: Pair, gw: Running) -> None:
    """Chat and completions, streamed and not: 200s with usage equal to what vLLM counts; the KV really moved (the
    decode's NIXL transfers grew by one per request); nothing held afterwards."""
    before = pair.decode.metrics().get("vllm:nixl_xfer_time_seconds_count", 0.0)
    client = sdk(gw)
    try:
        r = await client.chat.completions.create(model=pair.model, messages=MSG, max_tokens=12)  # type: ignore[arg-type]
        assert r.choices[0].message.content is not None and r.usage is not None
        assert r.usage.prompt_tokens == await direct_prompt_tokens(pair, MSG)
        assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
        stream = await client.chat.completions.create(model=pair.model, messages=MSG, max_tokens=12,  # type: ignore[arg-type]
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage]
        assert text and usage
        assert usage[-1].completion_tokens == 12 or chunks[-2].choices[0].finish_reason == "stop"
        assert usage[-1].prompt_tokens == r.usage.prompt_tokens
        c = await client.completions.create(model=pair.model, prompt="The weather today is", max_tokens=8)
        assert c.choices[0].text is not None and c.usage is not None and c.usage.completion_tokens <= 8
        cs = await client.completions.create(model=pair.model, prompt="The weather today is", max_tokens=8, stream=True)
        assert "".join([x.choices[0].text async for x in cs if x.choices])
    finally:
        await client.close()
    after = pair.decode.metrics().get("vllm:nixl_xfer_time_seconds_count", 0.0)
    assert after - before >= 4, f"every request's KV read by the decode over NIXL: {before} -> {after}"
    await clean(pair)


async def test_tool_calls_are_accepted_and_the_agents_sdk_runs_a_turn(pair: Pair, gw: Running) -> None:
    """A request with tools (vLLM: auto tool choice, the hermes parser) is answered; the Agents SDK runs a tool-armed
    agent through the gateway to a final output (the model's words are random: it will not call the tool)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    tools = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                                "parameters": {"type": "object", "properties": {
                                                    "path": {"type": "string"}}, "required": ["path"]}}}]
    client = sdk(gw)
    try:
        r = await client.chat.completions.create(model=pair.model, messages=MSG, tools=tools,  # type: ignore[arg-type]
                                                 tool_choice="auto", max_tokens=16)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls

        @function_tool
        def read_file(path: str) -> str:
            """Read a file.

            Args:
                path: the file's path.
            """
            return "fine"

        set_tracing_disabled(True)
        agent = Agent(name="coder", instructions="Use read_file when asked.", tools=[read_file],
                      model=OpenAIChatCompletionsModel(model=pair.model, openai_client=client),
                      model_settings=ModelSettings(max_tokens=16))
        result = await Runner.run(agent, "please read the readme", max_turns=3)
        assert isinstance(result.final_output, str)
    finally:
        await client.close()
    await clean(pair)


async def test_anthropics_messages_api_and_count_tokens_on_the_real_pair(pair: Pair, gw: Running) -> None:
    """The Anthropic SDK through the gateway: a message and a stream with tools, usage as vLLM counts it, and
    count_tokens asked of vLLM's own /tokenize (the chat template's count, not an estimate)."""
    import anthropic

    tools = [{"name": "read_file", "description": "read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="none", max_retries=0, timeout=60)
    try:
        m = await client.messages.create(model=pair.model, messages=MSG, max_tokens=12)  # type: ignore[arg-type]
        assert m.stop_reason in ("end_turn", "max_tokens") and m.content and m.content[0].type == "text"
        prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
        assert prompt == await direct_prompt_tokens(pair, MSG)
        raw = await client.messages.with_raw_response.count_tokens(model=pair.model, messages=MSG)  # type: ignore[arg-type]
        assert "x-pdgate-token-count" not in raw.headers, "vLLM's own count, not an estimate"
        assert (await raw.parse()).input_tokens == prompt
        async with client.messages.stream(model=pair.model, messages=MSG, tools=tools,  # type: ignore[arg-type]
                                          max_tokens=12) as s:
            final = await s.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.usage.output_tokens > 0
    finally:
        await client.close()
    await clean(pair)


async def test_a_1ms_ttft_budget_is_a_504_and_both_engines_end_clean(pair: Pair, gw: Running) -> None:
    """TTFT budget 1 ms: a 504 naming it, at once; neither engine holds the request within seconds. The prefill's KV
    kept for a decode that never read it is freed by vLLM's own lease (30 s; counted as expired; docs/fidelity.md)."""
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        async with http.post(gw.url + "/v1/chat/completions", json={"model": pair.model, "messages": MSG,
                                                                     "max_tokens": 64},
                             headers={"x-pdgate-ttft-timeout": "0.001"}) as r:
            body = await r.json()
            took = time.monotonic() - t0
        assert r.status == 504 and "ttft" in body["error"]["message"], body
        async with http.get(f"{gw.admin}/v1/requests/{r.headers['x-request-id']}") as t:
            trace = await t.json()
        assert took < 1.0 + SLACK_S, (took, trace)
    await clean(pair)


@pytest.mark.parametrize("budget", ["total", "idle"])
async def test_a_deadline_mid_stream_ends_it_with_an_error_event_and_frees_both_legs(
        pair: Pair, gw: Running, budget: str) -> None:
    """A long stream whose decode is frozen (SIGSTOP) after its first events, cut by its total budget (4 s from its
    start) or by its idle budget (1 s from the freeze): one error event naming the budget, then [DONE], on time;
    after the decode runs again neither engine holds it. The case needs the stream to start within the 4 s: when the
    pair stalls before its first byte (seconds at times on two cores, docs/fidelity.md) the answer is a 504 naming
    the budget, checked on time, and the try is made again (at most 3)."""
    headers = {"x-pdgate-timeout": "4"} if budget == "total" else {"x-pdgate-idle-timeout": "1"}
    limit = 4.0 if budget == "total" else 1.0
    events: list[bytes] = []
    for _ in range(3):
        try:
            async with aiohttp.ClientSession() as http:
                t0 = time.monotonic()  # the total budget counts from here, the idle one from the decode's freeze
                events = []
                async with http.post(gw.url + "/v1/chat/completions", headers=headers, json={
                        "model": pair.model, "messages": MSG, "max_tokens": 1000, "stream": True,
                        "ignore_eos": True}) as r:
                    if r.status == 504 and budget == "total":  # the pair stalled before the stream began
                        body = await r.json()
                        took = time.monotonic() - t0
                        assert "total" in body["error"]["message"] and took < limit + SLACK_S, json.dumps(
                            [body, took, await late(gw, http, r.headers.get("x-request-id", ""), t0)], default=str)
                        await clean(pair)
                        continue
                    assert r.status == 200, await r.text()
                    rid = r.headers.get("x-request-id", "")
                    async for line in r.content:
                        if line.startswith(b"data:"):
                            events.append(line)
                            if len(events) == 2:
                                pair.decode.signal(signal.SIGSTOP)
                                if budget == "idle":
                                    t0 = time.monotonic()
                took = time.monotonic() - t0
        finally:
            pair.decode.signal(signal.SIGCONT)
        break
    else:
        raise AssertionError("three tries: the pair never began a stream within 4 s")
    assert events[-1].strip() == b"data: [DONE]" and b'"error"' in events[-2], events[-3:]
    assert budget.encode() in events[-2], events[-2]
    if took >= limit + SLACK_S:
        async with aiohttp.ClientSession() as http:
            raise AssertionError(json.dumps([took, await late(gw, http, rid, t0)], default=str))
    await clean(pair)


async def late(gw: Running, http: aiohttp.ClientSession, rid: str, t0: float) -> dict[str, Any]:
    """Where an answer's time went, for a failed check: the gateway's trace of the request (its events on the
    gateway's clock, from the request's creation), how long after the client sent it the gateway made its record,
    and the gateway loop's recent lag (this gateway runs in the test's own event loop)."""
    g = gw.gw
    out: dict[str, Any] = {"loop_lag_s": round(g.pool.lag.recent(g.clock()), 3)}
    async with http.get(f"{gw.admin}/v1/requests/{rid}") as t:
        trace = await t.json() if t.status == 200 else {"status": t.status}
    created = trace.get("created_at")  # wall clock, as the client's send below
    if isinstance(created, (int, float)):
        out["created_after_client_sent_s"] = round(created - (time.time() - (time.monotonic() - t0)), 3)
    out["trace"] = trace
    return out


async def test_a_decode_that_fails_before_the_first_byte_is_retried_on_another(pair: Pair, procs: Procs) -> None:
    """Two decodes, one answering 500 to everything (a vLLM-protocol sim): every request is served by the real pair,
    the failed attempts retried before the first byte."""
    bad = procs.sim("decode", "--protocol", "vllm", "--fault", "http_500_rate=1")
    g = await start_gateway(config(pair, (bad.url,), policy="round_robin"))
    try:
        await healthy(g)
        client = sdk(g)
        try:
            for i in range(4):
                r = await client.chat.completions.create(model=pair.model, messages=MSG, max_tokens=4,  # type: ignore[arg-type]
                                                         stream=bool(i % 2))
                if i % 2:
                    assert "".join([c.choices[0].delta.content or "" async for c in r if c.choices])  # type: ignore[union-attr]
        finally:
            await client.close()
        async with aiohttp.ClientSession() as http, http.get(bad.url + "/metrics") as m:
            text = await m.text()
        assert "vllm:num_requests_running" in text
        retried = [rec for rec in g.gw.traces.finished.values() if len(rec.attempts) > 1]
        assert retried, "the sim decode was tried and failed over"
    finally:
        await g.close()
    await clean(pair)


# The scenarios both tiers share (tests/real/common.py), collected here in this order and run with this tier's
# pair; the decode's kill last (it restarts the decode).
test_a_client_that_leaves_mid_stream_and_an_operators_abort_free_both_legs = common.test_a_client_that_leaves_mid_stream_and_an_operators_abort_free_both_legs
test_a_frozen_prefill_is_a_504_within_the_ttft_budget_and_leaves_nothing = common.test_a_frozen_prefill_is_a_504_within_the_ttft_budget_and_leaves_nothing
test_counts_are_reconciled_drift_reads_zero_while_streams_run = common.test_counts_are_reconciled_drift_reads_zero_while_streams_run
test_the_storms_verdict_on_the_real_pair = common.test_the_storms_verdict_on_the_real_pair
test_a_decode_killed_mid_stream_ends_it_and_its_restart_is_found = common.test_a_decode_killed_mid_stream_ends_it_and_its_restart_is_found
