"""Access control (issue 14): client keys and tenants, the admin plane apart from the front door, safe worker
registration, unguessable ids, rate limits, the engines' key, audit. Real sims, the real gateway on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from pdgate.core import config
from pdgate.core.config import AdminKey, ConfigError, GatewayConfig, KeyConfig, hash_key
from pdgate.core.errors import detail_of, one_line
from pdgate.core.rid import Ids, Rid
from pdgate.path.auth import Tenant, bearer, new_key
from pdgate.planes import admin as admin_module
from pdgate.pool.workers import State
from pdgate.store.embedded import Bucket
from tests.pdgate.harness import Running, make_config, start_gateway
from tests.pdgate.sse import call as sse_call
from tests.procs import ROOT, Procs, Sim, free_port, wait_http, workers_toml

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 4}
ADMIN_KEY, A_KEY, B_KEY = new_key(), new_key(), new_key()
WRONG = "pdg-sk-" + "x" * 43


def keyed(**a_limits: Any) -> dict[str, Any]:
    return {"admin_keys": (AdminKey("ops", hash_key(ADMIN_KEY)),),
            "keys": (KeyConfig("team-a", hash_key(A_KEY), **a_limits), KeyConfig("team-b", hash_key(B_KEY)))}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def gateway(gateways: list[Any], prefills: list[Sim], decodes: list[Sim],
                  clock: Callable[[], float] = time.monotonic, **kw: Any) -> Running:
    g = await start_gateway(make_config(prefills, decodes, **kw), clock)
    gateways.append(g)
    return g


async def call(http: aiohttp.ClientSession, method: str, url: str, key: str | None = None,
               body: Any = None) -> tuple[int, Any, Any]:
    headers = {**(auth(key) if key else {}), **({"Content-Type": "application/json"} if body is not None else {})}
    async with http.request(method, url, headers=headers,
                            data=json.dumps(body).encode() if body is not None else None) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw) if raw else None, r.headers
        except ValueError:
            return r.status, raw.decode(), r.headers


OPERATOR = [("GET", "/v1/workers"), ("POST", "/v1/workers"), ("DELETE", "/v1/workers/d9"),
            ("POST", "/v1/workers/d9/restart"), ("GET", "/v1/cluster"), ("GET", "/v1/requests"),
            ("GET", "/v1/requests/x"), ("POST", "/v1/requests/x/abort"), ("GET", "/metrics")]


async def test_every_operator_endpoint_wants_the_admin_key(procs: Procs, http: aiohttp.ClientSession,
                                                           gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], **keyed())
    for method, path in OPERATOR:
        status, body, headers = await call(http, method, g.admin + path)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (method, path, status, body)
        assert headers["WWW-Authenticate"].startswith("Bearer")
        for key in (WRONG, A_KEY):  # a wrong key and a client key
            status, body, _ = await call(http, method, g.admin + path, key)
            assert status == 403 and body["error"]["code"] == "permission_denied", (method, path, key[:9], status)
        status, _, _ = await call(http, method, g.admin + path, ADMIN_KEY)
        assert status not in (401, 403), (method, path, status)
    # the front door never serves the operator's endpoints, whatever the key (the request endpoints answer a
    # client key for its own requests: see the tenant test)
    for method, path in OPERATOR:
        if path.startswith("/v1/requests"):
            continue
        assert (await call(http, method, g.url + path))[0] == 401, path
        for key in (WRONG, A_KEY, ADMIN_KEY):
            assert (await call(http, method, g.url + path, key))[0] == 403, (path, key[:9])
    assert len(g.gw.pool.by_id) == 2, "nothing the refused calls asked for happened"


async def test_metrics_on_the_front_door_only_where_the_setting_says(procs: Procs, http: aiohttp.ClientSession,
                                                                    gateways: list[Any]) -> None:
    """``metrics_on_front`` serves ``/metrics`` at the front door, where SGLang's scrapers look, to any client key (a
    front door with no keys: to anyone, as SGLang does), and nothing else of the operator's; without it the front
    door refuses it to every key."""
    p, d = procs.pair()
    on = await gateway(gateways, [p], [d], **keyed(), metrics_on_front=True)
    assert (await call(http, "GET", on.url + "/metrics"))[0] == 401, "a keyed front door wants a key for it too"
    status, body, headers = await call(http, "GET", on.url + "/metrics", A_KEY)
    assert status == 200 and "pdgate_requests_total" in body, (status, str(body)[:200])
    assert headers["Content-Type"].startswith("text/plain")
    assert (await call(http, "GET", on.url + "/v1/workers", A_KEY))[0] == 403, "the setting opens /metrics alone"
    open_ = await gateway(gateways, [p], [d], metrics_on_front=True)
    assert (await call(http, "GET", open_.url + "/metrics"))[0] == 200
    off = await gateway(gateways, [p], [d], **keyed())
    assert (await call(http, "GET", off.url + "/metrics"))[0] == 401
    assert (await call(http, "GET", off.url + "/metrics", A_KEY))[0] == 403


async def test_front_door_without_the_admin_plane_split_would_serve_anyone(procs: Procs, http: aiohttp.ClientSession,
                                                                         gateways: list[Any]) -> None:
    """The mechanism switched off: an admin plane with no admin key answers anyone who reaches it; that is
    why it is allowed on loopback only (and the config refuses it anywhere else)."""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    assert (await call(http, "GET", g.admin + "/v1/workers"))[0] == 200
    with pytest.raises(ConfigError, match="admin plane beyond loopback needs an admin key"):
        config.validate(GatewayConfig(admin_host="0.0.0.0"))
    config.validate(GatewayConfig(admin_host="0.0.0.0", admin_keys=(AdminKey("ops", hash_key(ADMIN_KEY)),)))


async def rogue_listener(status: int, body: bytes) -> tuple[asyncio.Server, int, list[bytes]]:
    """Something that is not an engine: answers every request with ``status`` and ``body``, records requests."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


FORGED = json.dumps({"id": "forged", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "FORGED"}, "finish_reason": "stop"}]}).encode()


async def test_the_registration_and_forgery_sequence_fails_at_its_first_step(procs: Procs, http: aiohttp.ClientSession,
                                                                             gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], max_workers=3, **keyed())
    rogue, rport, seen = await rogue_listener(200, FORGED)
    secret, sport, _ = await rogue_listener(403, b"<html>\n<h1>internal admin console</h1>\nsecret=hunter2\n</html>")
    try:
        forged = {"role": "decode", "url": f"http://127.0.0.1:{rport}"}
        # step one, as the report did it: no credentials, then a client's own key, on both listeners
        for url, key in ((g.url, None), (g.url, A_KEY), (g.admin, None), (g.admin, A_KEY)):
            status, _, _ = await call(http, "POST", url + "/v1/workers", key, forged)
            assert status in (401, 403), (url, key)
        for wid in ("d0", "p0"):
            assert (await call(http, "DELETE", f"{g.url}/v1/workers/{wid}", A_KEY))[0] == 403
        assert sorted(g.gw.pool.by_id) == ["d0", "p0"] and seen == [], "the rogue was never registered nor called"
        status, body, _ = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, CHAT)
        assert status == 200 and "FORGED" not in json.dumps(body)

        # an operator with the admin key still cannot point the gateway anywhere, nor scan with it
        refused = [({"role": "decode", "url": "http://10.255.0.1:8000"}, 400, "not allowed"),
                   ({"role": "decode", "url": "http://127.0.0.1:99999"}, 400, "not a URL"),
                   ({"role": "decode", "url": "https://127.0.0.1:8000"}, 400, "https://"),
                   ({"role": "decode", "url": "http://user:pw@127.0.0.1:8000"}, 400, "no credentials"),
                   ({"role": "decode", "url": "http://127.0.0.1:8000/x?y"}, 400, "no credentials, path"),
                   ({"role": "prefill", "url": f"http://127.0.0.1:{rport}", "bootstrap_port": 70000}, 400, "TCP port")]
        for body_in, want, words in refused:
            status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY, body_in)
            assert status == want and words in body["error"]["message"], (body_in, status, body)
        closed = free_port()
        answers, took = {}, {}
        for port in (closed, sport, rport):  # nothing listening / a 403 page / something that answers 200 anything
            t0 = time.monotonic()
            status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY,
                                         {"role": "decode", "url": f"http://127.0.0.1:{port}"})
            took[port] = time.monotonic() - t0
            assert status == 502 and body["error"]["code"] == "worker_unreachable", (port, status, body)
            answers[port] = body["error"]["message"].replace(str(port), "PORT")
        assert answers[closed] == answers[sport] == answers[rport], "every failure reads the same (no port scanner)"
        assert max(took.values()) - min(took.values()) < 0.15, f"and takes as long: {took}"
        assert "hunter2" not in answers[sport] and "\n" not in answers[sport]
        assert len(g.gw.upstream.client.pools) == 2, "no connection pool is left for what failed"
        assert not any(b"authorization" in h.lower() for h in seen), "nor did it get any credentials"
        for url, why in ((g.url, "this gateway itself"), (g.admin, "this gateway itself")):
            status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY, {"role": "decode", "url": url})
            assert status == 400 and why in body["error"]["message"]
        status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY,
                                     {"role": "decode", "url": p.url})  # p0 itself, under another role
        assert status == 409 and "worker p0" in body["error"]["message"], body
        p2 = procs.sim("prefill")
        status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY,
                                     {"role": "decode", "url": p2.url})  # a prefill is no decode
        assert status == 502
        assert sorted(g.gw.pool.by_id) == ["d0", "p0"] and sorted(g.runner.control.health_tasks) == ["d0", "p0"], \
            "a failed registration leaves nothing behind"

        # a real worker registers once, however it is spelled and however many ask at once; the cap holds
        d2, d3 = procs.sim("decode"), procs.sim("decode")
        spellings = [d2.url, d2.url.replace("127.0.0.1", "127.0.0.1") + "/", d2.url.replace(f":{d2.port}", f":0{d2.port}"),
                     d3.url, d3.url]
        results = await asyncio.gather(*(call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY,
                                              {"role": "decode", "url": u}) for u in spellings))
        assert sorted(r[0] for r in results) == [201, 409, 409, 409, 409], [(r[0], r[1]) for r in results]
        assert len(g.gw.pool.by_id) == 3 and "d1" in g.gw.pool.by_id, "refused registrations consumed no worker id"
    finally:
        for s in (rogue, secret):
            s.close()
            await s.wait_closed()


async def test_an_open_admin_plane_answers_local_tools_not_web_pages(procs: Procs, http: aiohttp.ClientSession,
                                                                     gateways: list[Any]) -> None:
    """Without an admin key, a page in the operator's browser could reach 127.0.0.1 (a cross-site form, or
    DNS rebinding): Origin, Sec-Fetch-Site, a foreign Host and non-JSON bodies are refused."""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d])
    body = json.dumps({"role": "decode", "url": p.url}).encode()
    for headers in ({"Origin": "http://evil.example", "Content-Type": "application/json"},
                    {"Sec-Fetch-Site": "cross-site", "Content-Type": "application/json"},
                    {"Host": "rebind.evil.example", "Content-Type": "application/json"}):
        async with http.post(g.admin + "/v1/workers", data=body, headers=headers) as r:
            assert r.status == 403, headers
        async with http.get(g.admin + "/v1/requests", headers=headers) as r:
            assert r.status == 403, headers
    async with http.post(g.admin + "/v1/workers", data=body, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 400 and "application/json" in (await r.json())["error"]["message"]
    assert sorted(g.gw.pool.by_id) == ["d0", "p0"]
    async with http.get(g.admin + "/v1/workers") as r:  # curl, the CLI, scripts: as before
        assert r.status == 200


async def test_a_tenant_cannot_shadow_anothers_request_id(procs: Procs, http: aiohttp.ClientSession,
                                                          gateways: list[Any]) -> None:
    p = procs.sim("prefill")
    d = procs.sim("decode", "--speed", "15")
    g = await gateway(gateways, [p], [d], **keyed())
    async with http.post(g.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 30, "stream": True},
                         headers={**auth(A_KEY), "x-request-id": "job-42"}) as a_stream:
        a_id = a_stream.headers["x-request-id"]
        await a_stream.content.readline()
        async with http.post(g.url + "/v1/chat/completions", json=CHAT,
                             headers={**auth(B_KEY), "x-request-id": "job-42"}) as r:
            b_id = r.headers["x-request-id"]
        assert (await call(http, "GET", g.url + "/v1/requests/job-42", A_KEY))[1]["id"] == a_id
        assert (await call(http, "GET", g.url + "/v1/requests/job-42", B_KEY))[1]["id"] == b_id
        status, out, _ = await call(http, "POST", g.url + "/v1/requests/job-42/abort", A_KEY)
        assert status == 200 and out["id"] == a_id
        await a_stream.read()


async def test_audit_lines_cannot_be_forged_and_request_reads_are_counted(procs: Procs, http: aiohttp.ClientSession,
                                                                          gateways: list[Any],
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdgate.audit")
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], **keyed(requests_per_min=3))
    forged = "x status=200 actor=ops action=worker.remove target=d0"
    await call(http, "POST", g.url + "/v1/requests/" + forged.replace(" ", "%20") + "/abort", A_KEY)
    lines = [r.getMessage() for r in caplog.records if r.name == "pdgate.audit"]
    assert lines and all(line.count("actor=") == 1 for line in lines), lines
    statuses = [(await call(http, "GET", g.url + "/v1/requests", A_KEY))[0] for _ in range(4)]
    assert statuses[-1] == 429, f"reading requests counts against requests_per_min: {statuses}"


def test_engine_error_bodies_reach_clients_as_one_bounded_line() -> None:
    page = b"<html>\r\n<body>" + b"x" * 5000 + b"\nInjected: header\r\n</body></html>"
    assert "\n" not in detail_of(page) and "\r" not in detail_of(page) and len(detail_of(page)) <= 200
    assert detail_of(b'{"error": {"message": "bad\\nthing"}}') == "bad thing"
    assert len(detail_of(json.dumps({"error": {"message": "y" * 9000}}).encode())) == 200
    assert one_line("a\x00b\x1b[31mc") == "a b [31mc"


@pytest.mark.parametrize("guard", [True, False])
async def test_a_tenant_sees_and_aborts_only_its_own_requests(procs: Procs, http: aiohttp.ClientSession,
                                                             gateways: list[Any], monkeypatch: pytest.MonkeyPatch,
                                                             guard: bool) -> None:
    if not guard:  # the mechanism switched off: the filter lets every record through
        monkeypatch.setattr(admin_module, "visible", lambda rec, tenant: rec)
    p = procs.sim("prefill")
    d = procs.sim("decode", "--speed", "15")  # 30 tokens take ~2-3 s
    g = await gateway(gateways, [p], [d], **keyed())
    body = {**CHAT, "max_tokens": 30, "stream": True}
    async with http.post(g.url + "/v1/chat/completions", json=body,
                         headers={**auth(A_KEY), "x-request-id": "a-own-1"}) as a_stream:
        assert a_stream.status == 200
        a_id = a_stream.headers["x-request-id"]
        await a_stream.content.readline()
        leaks = []
        for method, path in (("GET", "/v1/requests"), ("GET", f"/v1/requests/{a_id}"), ("GET", "/v1/requests/a-own-1"),
                             ("GET", f"/v1/requests/{a_id}.1"), ("POST", f"/v1/requests/{a_id}/abort")):
            status, got, _ = await call(http, method, g.url + path, B_KEY)
            if method == "GET" and path == "/v1/requests":
                if got["count"]:
                    leaks.append(path)
            elif status != 404:
                leaks.append(path)
        if not guard:
            assert leaks, "without the filter another tenant's request shows (the test would catch that)"
            return
        assert leaks == [], leaks
        # its own client reads it, by id and by its own x-request-id, and it is labelled with its tenant
        status, mine, _ = await call(http, "GET", g.url + "/v1/requests", A_KEY)
        assert status == 200 and [r["id"] for r in mine["requests"]] == [a_id] and mine["requests"][0]["tenant"] == "team-a"
        assert (await call(http, "GET", g.url + "/v1/requests/a-own-1", A_KEY))[1]["id"] == a_id
        # without a key, the request endpoints are closed
        assert (await call(http, "GET", g.url + "/v1/requests"))[0] == 401
        status, out, _ = await call(http, "POST", f"{g.url}/v1/requests/{a_id}/abort", A_KEY)
        assert status == 200 and out["aborted"] is True
        rest = (await a_stream.read()).decode()
    assert "request aborted by its client (team-a)" in rest and rest.rstrip().endswith("data: [DONE]")
    t = (await call(http, "GET", f"{g.admin}/v1/requests/{a_id}", ADMIN_KEY))[1]
    assert t["outcome"] == "aborted" and t["cause"] == "operator_abort" and t["tenant"] == "team-a"


def test_the_longer_ids_are_never_cut_at_80_columns() -> None:
    from rich.console import Console

    from pdgate.planes import views

    rid = "pdg-1fc49fd0-000000019b30a10102e86876"
    data = {"count": 1, "requests": [{"id": rid, "phase": "prefill+transfer", "age_s": 1.23, "attempt": 1,
                                      "prefill": "p0", "decode": "d0", "deadline": {"next": "ttft", "left_s": 3.2},
                                      "chunks": 0}]}
    c = Console(width=80, record=True, file=io.StringIO())
    c.print(views.ps_table(data))
    assert rid in c.export_text()


def test_request_ids_are_fixed_width_and_unguessable() -> None:
    make = Ids("1fc49fd0")
    ids = [make.new() for _ in range(2000)]
    assert len({len(i) for i in ids}) == 1 and len(set(ids)) == len(ids)
    parsed = [Rid.parse(f"{i}.1") for i in ids]
    assert all(r is not None and r.instance == "1fc49fd0" and r.attempt == 1 and str(r.request) == i
               for r, i in zip(parsed, ids, strict=True)), "reconciliation recognises them"
    tails = [int(i[-16:], 16) for i in ids]
    assert len(set(tails)) == len(tails) and sum(b - a == 1 for a, b in itertools.pairwise(tails)) == 0
    # the next id is not the last one plus one (the report guessed x-request-id + 1)
    last = ids[-1]
    guess = last[:-24] + f"{int(last[-24:], 16) + 1:024x}"
    assert make.new() != guess


async def test_rate_limits_answer_429_with_retry_after_and_recover(procs: Procs, http: aiohttp.ClientSession,
                                                                   gateways: list[Any]) -> None:
    p = procs.sim("prefill")
    d = procs.sim("decode", "--speed", "15")
    shift = [0.0]  # the minute passes on the gateway's clock, not the test's
    g = await gateway(gateways, [p], [d], lambda: time.monotonic() + shift[0], **keyed(requests_per_min=6, max_concurrent=1))

    slow = asyncio.create_task(call(http, "POST", g.url + "/v1/chat/completions", A_KEY, {**CHAT, "max_tokens": 20}))
    await asyncio.sleep(0.5)
    status, body, headers = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, CHAT)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and "max_concurrent" in body["error"]["message"]
    assert headers["Retry-After"] == "1"
    assert (await call(http, "POST", g.url + "/v1/chat/completions", B_KEY, CHAT))[0] == 200, "other tenants unaffected"
    assert (await slow)[0] == 200
    for _ in range(4):  # 6 a minute: the slow one, the refused one did not count, these four, then one more
        assert (await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, CHAT))[0] == 200
    assert (await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, CHAT))[0] == 200
    status, body, headers = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, CHAT)
    assert status == 429 and body["error"]["type"] == "requests" and 1 <= int(headers["Retry-After"]) <= 10
    shift[0] += int(headers["Retry-After"])
    assert (await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, CHAT))[0] == 200, "recovered"
    status, metrics, _ = await call(http, "GET", g.admin + "/metrics", ADMIN_KEY)
    assert 'pdgate_tenant_rejected_total{reason="concurrency",tenant="team-a"} 1.0' in metrics
    assert 'pdgate_tenant_rejected_total{reason="requests",tenant="team-a"} 1.0' in metrics
    assert 'pdgate_tenant_requests_total{outcome="completed",tenant="team-a"} 7.0' in metrics


async def test_tokens_per_min_counts_what_the_engines_reported(procs: Procs, http: aiohttp.ClientSession,
                                                               gateways: list[Any]) -> None:
    p, d = procs.pair()
    shift = [0.0]
    g = await gateway(gateways, [p], [d], lambda: time.monotonic() + shift[0], **keyed(tokens_per_min=100))
    status, body, _ = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, {**CHAT, "max_tokens": 200})
    assert status == 429 and body["error"]["type"] == "tokens" and "more than the tokens_per_min" in body["error"]["message"]
    status, body, _ = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, {**CHAT, "max_tokens": 60})
    assert status == 200 and body["usage"]["total_tokens"] < 100
    status, body, headers = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, {**CHAT, "max_tokens": 60})
    assert status == 429 and body["error"]["type"] == "tokens", body
    shift[0] += int(headers["Retry-After"])
    assert (await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, {**CHAT, "max_tokens": 60}))[0] == 200


# the bodies of issue 26's probe: honest, and with a decoy field the engine does not read for that route
DECOYS = {
    "generate": ("/generate", {"text": "story " * 20, "stream": True, "sampling_params": {"max_new_tokens": 400}}),
    "generate+decoy": ("/generate", {"text": "story " * 20, "stream": True, "max_tokens": 1,
                                     "sampling_params": {"max_new_tokens": 400}}),
    "completions+decoy": ("/v1/completions", {"model": "sim-model", "prompt": "story " * 20, "stream": True,
                                              "max_tokens": 400, "max_completion_tokens": 1}),
    "chat+decoy": ("/v1/chat/completions", {"model": "sim-model", "stream": True, "max_tokens": 1,
                                            "max_completion_tokens": 400,
                                            "messages": [{"role": "user", "content": "story " * 20}]}),
}


@pytest.mark.parametrize("shape", list(DECOYS))
async def test_tokens_per_min_holds_whatever_decoy_fields_a_body_carries(procs: Procs, http: aiohttp.ClientSession,
                                                                         gateways: list[Any], shape: str) -> None:
    """tokens_per_min = 600, six concurrent 400-token streams: each is charged, in full, what the engine will
    generate for it (the field it reads for that route), so at most 600 tokens pass in the minute; the rest get
    429 ``tokens``. (With the estimate read from whichever field came first and one token enough to pass, a decoy
    ``max_tokens: 1`` let all six in: 2,400 tokens.)"""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], **keyed(tokens_per_min=600))
    path, body = DECOYS[shape]
    seen = await asyncio.gather(*(sse_call(http, g.url + path, body, auth(A_KEY)) for _ in range(6)))
    passed = [s for s in seen if s.status == 200]
    refused = [s for s in seen if s.status == 429]
    assert len(passed) + len(refused) == 6 and all(s.json["error"]["type"] == "tokens" for s in refused), seen
    got = sum(len(s.tokens) for s in passed)
    assert passed and got <= 600, f"{len(passed)} streams passed, {got} tokens"


async def test_a_request_without_a_limit_is_capped_at_what_the_key_has_left(procs: Procs, http: aiohttp.ClientSession,
                                                                            gateways: list[Any]) -> None:
    """A chat request that names no limit would run to the engine's context: it is capped at what the key has
    left, and the engine is told so (it generates no more than that; the sim's own default would be 128)."""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], **keyed(tokens_per_min=100))
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "story " * 20}]}
    status, answer, _ = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, body)
    assert status == 200 and answer["usage"]["total_tokens"] <= 100, answer["usage"]
    rid = answer["id"]
    async with http.get(d.url + "/pdgate/v1/seen") as r:
        sent = next(s for s in (await r.json())["seen"] if s["rid"] == rid)
    assert 0 < sent["max_tokens"] < 100, sent


def test_token_bucket_and_tenant_limits_without_a_loop() -> None:
    b = Bucket(60, now=0.0)
    b.take(60, 0.0)
    assert b.wait(1, 0.0) == pytest.approx(1.0) and b.wait(1, 1.0) == 0.0
    b.take(100, 1.0)  # charged after the fact: below zero
    assert b.wait(1, 1.0) == pytest.approx(100.0)
    t = Tenant(KeyConfig("t", hash_key("k"), models=("m1",), max_total_s=5), config.DeadlineConfig())
    assert t.deadlines.max_total_s == 5 and t.deadlines.total_s == 5
    assert t.allows("m1", frozenset({"m1", "m2"})) and not t.allows("m2", frozenset({"m1", "m2"}))
    assert not t.allows(None, frozenset({"m1", "m2"})) and t.allows(None, frozenset({"m1"}))
    assert bearer({"authorization": "bearer  abc "}) == "abc" and bearer({"authorization": "Basic abc"}) is None


async def test_openai_sdk_with_a_key_and_without_one(procs: Procs, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], **keyed(models=("sim-model",), max_total_s=30))
    ok = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=A_KEY, max_retries=0)
    bad = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="not-a-key", max_retries=0)
    try:
        resp = await ok.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3)
        assert resp.choices[0].message.content
        chunks = [c async for c in await ok.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)]
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 3
        assert [m.id for m in (await ok.models.list()).data] == ["sim-model"]
        with pytest.raises(openai.AuthenticationError) as err:
            await bad.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        assert "not-a-key" not in str(err.value), "the key is never echoed"
        with pytest.raises(openai.NotFoundError):
            await ok.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError):  # still validated first: a bad body is a 400, not a 401
            await ok.chat.completions.create(model="sim-model", messages="nope")  # type: ignore[arg-type]
    finally:
        await ok.close()
        await bad.close()
    t = next(iter(g.gw.traces.finished.values()))
    assert t.tenant == "team-a" and t.deadlines.total_s == 30, "the key's deadline cap applies"


async def test_keys_never_appear_in_logs_traces_or_metrics(procs: Procs, http: aiohttp.ClientSession,
                                                           gateways: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], **keyed())
    texts = []
    status, _, headers = await call(http, "POST", g.url + "/v1/chat/completions", A_KEY, CHAT)
    rid = headers["x-request-id"]
    assert status == 200
    for key in (WRONG, B_KEY + "x", ADMIN_KEY):
        await call(http, "POST", g.url + "/v1/chat/completions", key, CHAT)
        await call(http, "GET", g.admin + "/v1/workers", key)
    await call(http, "POST", g.admin + f"/v1/requests/{rid}/abort", ADMIN_KEY)
    for path in ("/metrics", "/v1/workers", f"/v1/requests/{rid}", "/v1/requests"):
        texts.append(json.dumps((await call(http, "GET", g.admin + path, ADMIN_KEY))[1]))
    texts.append(json.dumps((await call(http, "GET", g.url + f"/v1/requests/{rid}", A_KEY))[1]))
    texts.append(caplog.text)
    everything = "\n".join(texts)
    assert "audit actor=ops action=request.abort" in caplog.text and "actor=anonymous action=denied" in caplog.text
    for secret in (ADMIN_KEY, A_KEY, B_KEY, WRONG):
        assert secret not in everything and hash_key(secret)[7:] not in everything


async def test_audit_log_names_who_did_what(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdgate.audit")
    p, d = procs.pair()
    d2 = procs.sim("decode")
    g = await gateway(gateways, [p], [d], **keyed())
    assert (await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY, {"role": "decode", "url": d2.url}))[0] == 201
    assert (await call(http, "POST", g.admin + "/v1/workers/d1/restart", ADMIN_KEY))[0] == 404  # not under `pdgate up`
    assert (await call(http, "DELETE", g.admin + "/v1/workers/d1", ADMIN_KEY))[0] == 200
    assert (await call(http, "DELETE", g.admin + "/v1/workers/d1", A_KEY))[0] == 403
    lines = [r.getMessage() for r in caplog.records if r.name == "pdgate.audit"]
    assert lines == [
        f"audit actor=ops action=worker.register target=d1={d2.url} status=201",
        "audit actor=ops action=worker.restart target=d1 status=404 error=not_found",
        "audit actor=ops action=worker.remove target=d1 status=200",
        "audit actor=anonymous action=denied target=DELETE:/v1/workers/d1 status=403",
    ], lines
    metrics = (await call(http, "GET", g.admin + "/metrics", ADMIN_KEY))[1]
    assert 'pdgate_admin_actions_total{action="worker.register",actor="ops",status="201"} 1.0' in metrics


@pytest.mark.parametrize("with_key", [True, False])
async def test_engines_started_with_an_api_key(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                               with_key: bool) -> None:
    """SGLang's --api-key on the engines: with worker_api_key the gateway serves; without it (the mechanism off)
    every engine call is a 401, the workers stay down and clients get a clear 503."""
    env = {"SIM_API_KEY": "engine-secret"}
    p, d = procs.pair(env=env)
    async with http.get(d.url + "/server_info") as r:
        assert r.status == 401 and await r.json() == {"error": "Unauthorized"}  # SGLang's own answer
    g = await gateway(gateways, [p], [d], worker_api_key="engine-secret" if with_key else None)
    status, body, _ = await call(http, "POST", g.url + "/v1/chat/completions", None, CHAT)
    if with_key:
        assert status == 200
        return
    assert status == 503 and body["error"]["code"] == "no_healthy_pair", body
    assert "refuses the gateway's credentials" in (g.gw.pool.by_id["d0"].checks.last_error or "")
    # a worker that turns its key on later: its refusals are the gateway's failure, never the client's 401
    for w in g.gw.pool.by_id.values():
        w.checks.failures = 0
        w.transition(State.UP, g.gw.now(), "test: as if checked before the engine's key was set")
    status, body, _ = await call(http, "POST", g.url + "/v1/chat/completions", None, CHAT)
    assert status == 502 and body["error"]["code"] == "upstream_unauthorized", body


def test_supervisor_gives_the_engines_their_key() -> None:
    from engine.supervisor import Child, Supervisor, WorkerDef

    sim = Child(WorkerDef("d", "sim", "decode", 1))
    sup = Supervisor(config_cluster(), "k3y")
    cmd, env = sup.command(sim)
    assert env["SIM_API_KEY"] == "k3y" and "k3y" not in cmd, "the sim's key stays out of the process list"
    cmd, env = Supervisor(config_cluster()).command(sim)
    assert "SIM_API_KEY" not in env or env["SIM_API_KEY"] == os.environ.get("SIM_API_KEY")


def config_cluster() -> Any:
    from engine.supervisor import Cluster

    return Cluster(workers=())


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdgate", *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          input=stdin, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})})


def test_keys_file_cli_and_admin_socket_with_real_processes(procs: Procs, tmp_path: Path) -> None:
    """`pdgate keys new` makes keys (printed once, hashes in a 0600 file); `pdgate serve` loads them through
    keys_file; the CLI reaches the admin plane on a Unix socket with the admin key."""
    made = run_cli("keys", "new", "team-a", "--file", "keys.toml", "--requests-per-min", "100", "--models", "sim-model",
                   cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    client_key = made.stdout.strip()
    made = run_cli("keys", "new", "ops", "--admin", "--file", "keys.toml", cwd=tmp_path)
    admin_key = made.stdout.strip()
    text = (tmp_path / "keys.toml").read_text()
    assert client_key not in text and admin_key not in text and hash_key(client_key) in text
    assert (tmp_path / "keys.toml").stat().st_mode & 0o777 == 0o600
    dup = run_cli("keys", "new", "team-a", "--file", "keys.toml", cwd=tmp_path)
    assert dup.returncode == 2 and "appears twice" in dup.stderr
    assert run_cli("keys", "hash", cwd=tmp_path, stdin=client_key + "\n").stdout.strip() == hash_key(client_key)

    p, d = procs.pair()
    port, sock = free_port(), str(tmp_path / "admin.sock")
    (tmp_path / "gw.toml").write_text(
        f'[gateway]\nport = {port}\nadmin_socket = "{sock}"\nkeys_file = "keys.toml"\n'
        + workers_toml([p], [d]))
    gw = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(tmp_path / "gw.toml")], name="gateway")
    wait_http(f"http://127.0.0.1:{port}/readiness", proc=gw.popen)
    assert oct(os.stat(sock).st_mode & 0o777) == oct(0o600), "the admin socket is its owner's only"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=client_key, max_retries=0)
    try:
        assert client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2).choices[0].message.content
    finally:
        client.close()
    env = {"PDGATE_ADMIN_URL": f"unix:{sock}", "PDGATE_ADMIN_KEY": admin_key}
    out = run_cli("workers", cwd=tmp_path, env=env)
    assert out.returncode == 0 and "p0" in out.stdout and "d0" in out.stdout, out.stderr
    denied = run_cli("ps", cwd=tmp_path, env={**env, "PDGATE_ADMIN_KEY": client_key})
    assert denied.returncode != 0 and "403" in denied.stderr
    assert client_key not in gw.logs() and admin_key not in gw.logs()
    assert re.search(r"admin plane on unix:\S+admin\.sock \(admin key required\)", gw.logs())


def test_an_open_front_door_beyond_loopback_is_warned_about() -> None:
    from pdgate.planes.server import open_front_door

    assert open_front_door("0.0.0.0", keys=False) and "without client keys" in str(open_front_door("", keys=False))
    assert open_front_door("0.0.0.0", keys=True) is None and open_front_door("127.0.0.1", keys=False) is None
    assert open_front_door("::1", keys=False) is None and open_front_door("localhost", keys=False) is None


def test_worker_host_allow_list() -> None:
    default = config.worker_hosts_allowed(GatewayConfig())
    assert config.host_allowed("127.0.0.5", default) and config.host_allowed("::1", default)
    assert config.host_allowed("LOCALHOST", default) and not config.host_allowed("evil.example", default)
    assert config.host_allowed("10.1.2.3", ("10.0.0.0/8",)) and not config.host_allowed("11.0.0.1", ("10.0.0.0/8",))
    assert config.host_allowed("10.0.0.1", ("10.0.0.1",)) and not config.host_allowed("10.0.0.2", ("10.0.0.1",))
    assert not config.host_allowed("::ffff:10.0.0.1", ("10.0.0.0/8",)), "a mapped v6 form is not the v4 network"
    assert config.host_allowed("gpu-node-1", ("gpu-node-1",)) and config.host_allowed("anything", ("*",))


def test_config_refuses_bad_keys() -> None:
    ok = hash_key("k")
    for kw, words in (({"keys": (KeyConfig("bad name", ok),)}, "A-Z"),
                      ({"keys": (KeyConfig("a", "md5:abc"),)}, "sha256"),
                      ({"keys": (KeyConfig("a", ok), KeyConfig("b", ok))}, "appears twice"),
                      ({"keys": (KeyConfig("a", ok),), "admin_keys": (AdminKey("o", ok),)}, "appears twice"),
                      ({"keys": (KeyConfig("a", ok, priority="urgent"),)}, "priority"),
                      ({"keys": (KeyConfig("a", ok, requests_per_min=0),)}, "must be > 0"),
                      ({"allowed_worker_hosts": ("10.0.0.0/33",)}, "CIDR"),
                      ({"admin_port": 30001}, "must differ"),
                      ({"keys": (KeyConfig("anonymous", ok),)}, "reserved")):
        with pytest.raises(ConfigError, match=words):
            config.validate(dataclasses.replace(GatewayConfig(), **kw))
    with pytest.raises(ConfigError) as err:
        config.validate(GatewayConfig(keys=(KeyConfig("a", "sha256:" + "z" * 64),)))
    assert "z" * 64 not in str(err.value), "a bad hash is not printed back"
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"keys": [{"name": "a", "key": "pdg-sk-secret-in-the-wrong-field", "hash": ok}]})
    assert "secret-in-the-wrong-field" not in str(err.value) and "unknown key" in str(err.value)
    spec = config.validate_worker(config.WorkerSpec(url="http://LOCALHOST:080", role="decode"))
    assert spec.url == "http://localhost:80"
    for bad in ("http://127.0.0.1:8000\t", "http://127.0.0.1:8000?", "http://127.0.0.1:8000#"):
        with pytest.raises(ConfigError):
            config.validate_worker(config.WorkerSpec(url=bad, role="decode"))


async def forwarder(to_port: int) -> tuple[asyncio.Server, int]:
    """A TCP relay to ``to_port``: the same engine at another address."""
    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", to_port)
        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_one_engine_is_registered_once_whatever_its_address(procs: Procs, http: aiohttp.ClientSession,
                                                                  gateways: list[Any]) -> None:
    """A second spelling of a registered engine's address (``localhost`` for ``127.0.0.1``), or another address
    that reaches the same engine (its identity), is a 409 naming the worker it duplicates: one engine is never
    counted as two (its capacity and load doubled)."""
    p, d = procs.pair()
    g = await gateway(gateways, [p], [d], **keyed())
    relay, rport = await forwarder(d.port)
    try:
        status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY,
                                     {"role": "decode", "url": d.url.replace("127.0.0.1", "localhost")})
        assert status == 409 and "worker d0" in body["error"]["message"], body
        status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY,
                                     {"role": "decode", "url": f"http://127.0.0.1:{rport}"})
        assert status == 409 and "same identity" in body["error"]["message"] and "d0" in body["error"]["message"], body
        assert sorted(g.gw.pool.by_id) == ["d0", "p0"]
        d2 = procs.sim("decode")  # another engine still registers
        status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY, {"role": "decode", "url": d2.url})
        assert status == 201 and body["id"] == "d1", body
    finally:
        relay.close()


async def test_a_registration_target_gets_no_credentials(procs: Procs, http: aiohttp.ClientSession,
                                                         gateways: list[Any]) -> None:
    """The engine key goes only to registered workers: a target is identified without it (SGLang leaves /health,
    /ready and /metrics open under --api-key), so a target that is refused never sees the key; an engine with
    --api-key still registers (its /metrics says what it is) and is then checked with the key."""
    env = {"SIM_API_KEY": "engine-secret"}
    p, d = procs.pair(env=env)
    g = await gateway(gateways, [p], [d], worker_api_key="engine-secret", **keyed())
    answers_anything, aport, seen_a = await rogue_listener(200, FORGED)
    wants_a_key, kport, seen_k = await rogue_listener(401, b'{"error": "Unauthorized"}')
    try:
        for port in (aport, kport):
            status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY,
                                         {"role": "decode", "url": f"http://127.0.0.1:{port}"})
            assert status == 502 and body["error"]["code"] == "worker_unreachable", body
        heads = seen_a + seen_k
        assert heads and not any(b"engine-secret" in h or b"authorization" in h.lower() for h in heads), heads
        d2 = procs.sim("decode", env=env)
        status, body, _ = await call(http, "POST", g.admin + "/v1/workers", ADMIN_KEY, {"role": "decode", "url": d2.url})
        assert status == 201 and body["state"] == "up", body  # identified without the key, then checked with it
    finally:
        for s in (answers_anything, wants_a_key):
            s.close()
