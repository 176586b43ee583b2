"""pdgate in front of a real SGLang PD pair on this CPU (SGLang 0.5.23 with fixes A/B/C and the CPU profile,
mooncake moving the KV over TCP, the tiny random model): the OpenAI SDK and SGLang's ``/generate`` through it, a
deadline ending both legs; the engines alone: fix C's watchdog ending a real inflight-queue pin, and what that pin
is without the fixes (and an abort mid-transfer); then the scenarios both tiers share (tests/real/common.py). Judged
from outside: the client's clock and the engines' own counts (``/v1/loads``: running, waiting and every PD queue;
fix C's counter on ``/metrics``). The model's words are random."""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.pdgate.harness import Running
from tests.real import common
from tests.real.engines import MSG, SLACK_S, clean, sdk
from tests.real_sglang.conftest import WATCHDOG_S, Engine, Pair, engine, pd_body, pd_generate, post

pytestmark = pytest.mark.timeout(300)
FORCE_FAILED = "sglang:num_prefill_inflight_timeout_reqs_total"
LONG = "def f(x): return x * 2\n" * 60  # ~700 tokens: the KV transfer takes a moment to stop in


async def test_the_openai_sdk_and_generate_through_the_gateway(pair: Pair, gw: Running) -> None:
    """Chat and completions, streamed and not, and SGLang's own /generate: 200s, usage as SGLang counts it, the
    gateway's request id as the engines' rid; the KV really moved (the prefill's /v1/loads reports a transfer); nothing
    held afterwards."""
    client = sdk(gw)
    try:
        r = await client.chat.completions.create(model=pair.model, messages=MSG, max_tokens=12)  # type: ignore[arg-type]
        assert r.choices[0].message.content is not None and r.usage is not None and r.usage.prompt_tokens > 0
        assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
        stream = await client.chat.completions.create(model=pair.model, messages=MSG, max_tokens=12,  # type: ignore[arg-type]
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        usage = [c.usage for c in chunks if c.usage]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) and usage
        assert usage[-1].prompt_tokens == r.usage.prompt_tokens
        c = await client.completions.create(model=pair.model, prompt="The weather today is", max_tokens=8)
        assert c.choices[0].text is not None and c.usage is not None and c.usage.completion_tokens <= 8
    finally:
        await client.close()
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/generate", json={"text": "The weather today is",
                                                          "sampling_params": {"max_new_tokens": 6}}) as g:
            body = await g.json()
            assert g.status == 200 and body["meta_info"]["completion_tokens"] <= 6, body
            assert body["meta_info"]["id"].startswith(g.headers["x-request-id"]), (body["meta_info"], g.headers)
        async with http.get(pair.prefill.url + "/v1/loads?include=disagg") as loads:
            disagg = (await loads.json())["loads"][0]["disaggregation"]
    assert disagg["mode"] == "prefill" and disagg["kv_transfer_latency_ms"] > 0, disagg
    await clean(pair)


async def test_a_deadline_mid_stream_ends_it_with_an_error_event_and_frees_both_legs(pair: Pair, gw: Running) -> None:
    """A long stream whose decode is frozen (SIGSTOP) after its first events, cut by its idle budget (1 s from the
    freeze): one error event naming the budget, then [DONE], on time; after the decode runs again neither engine
    holds it (their own gauges)."""
    events: list[bytes] = []
    t0 = 0.0
    try:
        async with aiohttp.ClientSession() as http, http.post(
                gw.url + "/v1/chat/completions", headers={"x-pdgate-idle-timeout": "1"},
                json={"model": pair.model, "messages": MSG, "max_tokens": 900, "stream": True,
                      "ignore_eos": True}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data:"):
                    events.append(line)
                    if len(events) == 2:
                        pair.decode.signal(signal.SIGSTOP)
                        t0 = time.monotonic()
        took = time.monotonic() - t0
    finally:
        pair.decode.signal(signal.SIGCONT)
    assert events[-1].strip() == b"data: [DONE]" and b'"error"' in events[-2] and b"idle" in events[-2], events[-3:]
    assert took < 1.0 + SLACK_S, took
    await clean(pair)


def queue(e: Engine, name: str) -> int:
    """One PD queue's count as the engine's scheduler last published it (``/v1/loads``; its /metrics gauges lag)."""
    with urllib.request.urlopen(e.url + "/v1/loads?include=disagg", timeout=20) as r:
        return sum(int(ld["disaggregation"][name]) for ld in json.loads(r.read())["loads"])


def pin(prefill: Engine, decode: Engine, hold_s: float, n: int = 4, abort_at: float | None = None) -> dict[str, Any]:
    """The seed's pin, made on purpose: n requests' decode legs first, until the decode has made room for their KV
    and told the prefill where (its transfer queue holds them); then the decode stopped (SIGSTOP), then the prefill
    legs: the prefill computes them and its transfers to the stopped decode do not end, so they sit in its real
    inflight queue. Once all n are there, sampled each 0.5 s for hold_s as (seconds, inflight, force-failed); then the
    decode runs again. A prefill leg that fails has its decode leg aborted by rid, as a router does; on any failure
    here every leg is aborted on both engines. ``abort_at``: that many seconds into the hold, the first request is
    aborted on the prefill (SGLang's ``/abort_request``), mid-transfer."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [pd_body(prefill, f"{i} {LONG}", 4) for i in range(n)]
    samples: list[tuple[float, float, float]] = []
    aborted = done = False
    with ThreadPoolExecutor(2 * n) as pool:
        try:
            decode_legs = [pool.submit(post, decode, "/generate", b) for b in bodies]
            t0 = time.monotonic()
            while queue(decode, "decode_transfer_queue_reqs") < n:  # room made, the prefill told where: waiting
                assert time.monotonic() - t0 < 30, f"the decode did not take the {n} requests"
                time.sleep(0.05)
            decode.signal(signal.SIGSTOP)
            try:
                prefill_legs = [pool.submit(post, prefill, "/generate", b) for b in bodies]
                t0 = time.monotonic()
                while queue(prefill, "prefill_inflight_queue_reqs") < n:  # computed, their transfers not ending
                    assert time.monotonic() - t0 < 30, f"the prefill did not pin the {n} requests"
                    time.sleep(0.05)
                t0 = time.monotonic()
                while time.monotonic() - t0 < hold_s:
                    if abort_at is not None and not aborted and time.monotonic() - t0 >= abort_at:
                        post(prefill, "/abort_request", {"rid": bodies[0]["rid"]})
                        aborted = True
                    inflight = queue(prefill, "prefill_inflight_queue_reqs")
                    samples.append((time.monotonic() - t0, float(inflight),
                                    prefill.metrics().get(FORCE_FAILED, 0.0)))
                    time.sleep(0.5)
            finally:
                decode.signal(signal.SIGCONT)
            prefills = [f.result() for f in prefill_legs]
            for i, (b, p) in enumerate(zip(bodies, prefills, strict=True)):
                if p["status"] != 200 or (i == 0 and aborted):  # failed, or aborted on purpose
                    post(decode, "/abort_request", {"rid": b["rid"]})
            decodes = [f.result() for f in decode_legs]
            done = True
        finally:
            if not done:  # nothing of this one may stay on the shared pair for the next tests
                for b in bodies:
                    for e in (prefill, decode):
                        post(e, "/abort_request", {"rid": b["rid"]}, timeout=20)
    return {"samples": samples, "prefill": prefills, "decode": decodes}


async def test_fix_c_ends_a_real_inflight_queue_pin_while_the_decode_is_stopped(pair: Pair) -> None:
    """The decode stopped mid-transfer pins requests in the prefill's real inflight queue (the seed's pin). With fix C
    the watchdog ends them while the decode is still stopped: the queue back to 0 within the watchdog (8 s) and a
    poll's slack, its counter up by as many, a log line each, each prefill leg answered 500; once the decode runs
    again (their decode legs aborted) neither engine holds anything."""
    n = 4
    log_before = pair.prefill.log.read_text(errors="replace").count("inflight watchdog: force-failing")
    got = await asyncio.to_thread(pin, pair.prefill, pair.decode, WATCHDOG_S + 6, n)
    samples = got["samples"]
    assert samples[0][1] == n, f"the {n} requests were not pinned: {samples}"
    cleared = [s for s in samples if s[1] == 0]
    assert cleared and cleared[0][0] < WATCHDOG_S + 4, f"the inflight queue did not clear while stopped: {samples}"
    assert samples[-1][2] - samples[0][2] == n, f"fix C's counter did not count them: {samples}"
    assert [p["status"] for p in got["prefill"]] == [500] * n, got["prefill"]
    lines = pair.prefill.log.read_text(errors="replace").count("inflight watchdog: force-failing")
    assert lines - log_before == n, "each force-fail is logged"
    await clean(pair)


async def test_without_the_fixes_the_pin_lasts_as_long_as_the_decode_is_stopped(pair: Pair) -> None:
    """The same pin against a prefill started with ``PDGATE_FIXES=none`` (beside the pair's, with the pair's decode):
    the requests stay in its inflight queue past the watchdog's 8 s and 4 s more — SGLang itself bounds nothing there
    (no counter, no log line) — and end, served, only when the decode runs again. What the seed saw on its GPUs,
    where the decode did not come back. And an abort mid-transfer: one of them aborted on the prefill 3 s in leaves
    the queue at once, without fix A — upstream loses an abort only for a sender that does not own its bootstrap
    room, which needs ``--disaggregation-decode-allocation-policy prefill_complete`` (here the default, ``early``)."""
    n = 4
    bare = engine("prefill", Path(tempfile.mkdtemp(prefix="pdgate-real-sglang-bare-")), fixes="none")
    bare.start()
    try:
        await asyncio.to_thread(bare.wait)
        warm = await asyncio.to_thread(pd_generate, bare, pair.decode, "warm up", 2)
        assert warm["decode"]["status"] == 200, warm
        got = await asyncio.to_thread(pin, bare, pair.decode, WATCHDOG_S + 4, n, 3.0)
        samples = got["samples"]
        before = [s for s in samples if s[0] < 3.0]
        after = [s for s in samples if s[0] > 4.5]
        assert before and all(s[1] == n for s in before), f"{n} pinned before the abort: {samples}"
        assert after and all(s[1] == n - 1 for s in after), \
            f"the aborted one gone, the others pinned while the decode is stopped: {samples}"
        assert samples[-1][0] >= WATCHDOG_S + 3 and all(s[2] == 0 for s in samples), samples
        assert "inflight watchdog" not in bare.log.read_text(errors="replace")
        assert [p["status"] for p in got["prefill"][1:]] == [200] * (n - 1), got["prefill"]  # served once it ran
        assert [d["status"] for d in got["decode"][1:]] == [200] * (n - 1), got["decode"]
        pair.notes["aborted_mid_transfer"] = (got["prefill"][0], got["decode"][0])
    finally:
        await asyncio.to_thread(bare.stop)
    await clean(pair)


# The scenarios both tiers share (tests/real/common.py), collected here in this order and run with this tier's
# pair; the decode's kill last (it restarts the decode).
test_a_client_that_leaves_mid_stream_and_an_operators_abort_free_both_legs = common.test_a_client_that_leaves_mid_stream_and_an_operators_abort_free_both_legs
test_a_frozen_prefill_is_a_504_within_the_ttft_budget_and_leaves_nothing = common.test_a_frozen_prefill_is_a_504_within_the_ttft_budget_and_leaves_nothing
test_counts_are_reconciled_drift_reads_zero_while_streams_run = common.test_counts_are_reconciled_drift_reads_zero_while_streams_run
test_the_storms_verdict_on_the_real_pair = common.test_the_storms_verdict_on_the_real_pair
test_a_decode_killed_mid_stream_ends_it_and_its_restart_is_found = common.test_a_decode_killed_mid_stream_ends_it_and_its_restart_is_found
