"""The access log (issue 17, first part): one line per request, text or JSON, refusals included, nothing forged."""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest

from pdgate.core.config import KeyConfig, hash_key
from tests.pdgate.harness import make_config, start_gateway
from tests.procs import Procs

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 3}
KEY = "pdg-sk-access-log-key"


def fields(text_line: str) -> dict[str, str]:
    assert text_line.startswith("access ")
    return {k: unquote(v) for k, v in (kv.split("=", 1) for kv in text_line[len("access "):].split(" "))}


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_one_line_per_request_with_what_ended_it(procs: Procs, http: aiohttp.ClientSession,
                                                       gateways: list[Any], caplog: pytest.LogCaptureFixture,
                                                       fmt: str) -> None:
    caplog.set_level(logging.INFO, logger="pdgate.access")
    p = procs.sim("prefill")
    d = procs.sim("decode")
    g = await start_gateway(make_config([p], [d], log_format=fmt, keys=(KeyConfig("team-a", hash_key(KEY)),)))
    gateways.append(g)
    auth = {"Authorization": f"Bearer {KEY}"}
    async with http.post(g.url + "/v1/chat/completions", json=CHAT,
                         headers={**auth, "x-request-id": "mine 1 access id=forged"}) as r:
        assert r.status == 200
        ok_id = r.headers["x-request-id"]
    async with http.post(g.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 400},
                         headers={**auth, "x-pdgate-timeout": "0.05"}) as r:
        assert r.status == 504
    async with http.post(g.url + "/v1/chat/completions", data=b"{nope", headers=auth) as r:
        assert r.status == 400
    async with http.post(g.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 401
    async with http.post(g.url + "/v1/chat/completion", json=CHAT, headers=auth) as r:  # a typo: the 404 helps
        msg = (await r.json())["error"]["message"]
        assert r.status == 404 and "served here: " in msg and "/v1/chat/completions" in msg and "/v1/messages" in msg
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "pdgate.access"]
    assert len(lines) == 5, lines
    parsed = [json.loads(x) if fmt == "json" else fields(x) for x in lines]
    ok, late, bad, anon, lost = parsed
    assert lost["outcome"] == "refused" and str(lost["status"]) == "404" and lost["route"] == "/v1/chat/completion"
    assert ok["id"] == ok_id and ok["status"] in (200, "200") and ok["outcome"] == "completed"
    assert ok["tenant"] == "team-a" and ok["prefill"] == "p0" and ok["decode"] == "d0"
    assert str(ok["completion_tokens"]) == "3" and str(ok["attempts"]) == "1"
    assert ok["client_id"] == "mine 1 access id=forged", "the client's id kept whole, quoted"
    if fmt == "text":  # the client's value cannot start a field of its own
        assert all(x.count(" id=") == 1 for x in lines) and not any(" id=forged" in x for x in lines), lines
    assert late["outcome"] == "deadline_exceeded" and late["budget"] == "total" and str(late["status"]) == "504"
    assert bad["outcome"] == "refused" and str(bad["status"]) == "400" and bad["code"] == "invalid_json"
    assert anon["outcome"] == "refused" and str(anon["status"]) == "401" and anon["code"] == "invalid_api_key"
    assert KEY not in caplog.text


async def test_the_access_log_can_be_switched_off(procs: Procs, http: aiohttp.ClientSession, gateways: list[Any],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdgate.access")
    p, d = procs.pair()
    g = await start_gateway(make_config([p], [d], access_log=False))
    gateways.append(g)
    async with http.post(g.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    assert not [rec for rec in caplog.records if rec.name == "pdgate.access"]
