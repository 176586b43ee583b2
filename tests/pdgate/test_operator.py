"""The operator's metrics: tokens, TPOT and TTFT by model, and the Grafana board in config/grafana, whose every
expression must name a metric the gateway exports."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp

from pdgate.core.record import Phase
from pdgate.observe.metrics import OTHER_MODEL, Metrics
from tests.pdgate.harness import make_config, start_gateway
from tests.procs import ROOT, Procs

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def exported(text: str) -> set[str]:
    """Series names the exposition offers (a counter's _total, a histogram's _bucket/_count/_sum)."""
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        counter = name if name.endswith("_total") else f"{name}_total"  # prometheus_client's TYPE line has _total
        names |= {"counter": {counter}, "histogram": {f"{name}_bucket", f"{name}_count", f"{name}_sum"}}.get(kind, {name})
    return names


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in /metrics")


async def test_tokens_tpot_and_ttft_by_model_and_the_grafana_board(procs: Procs, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await start_gateway(make_config([p], [d], policy="cache_aware"))
    gateways.append(g)
    async with aiohttp.ClientSession() as http:
        async with http.post(g.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with http.post(g.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            await r.read()
        async with http.get(g.admin + "/metrics") as r:
            text = await r.text()
    assert sample(text, "pdgate_tokens_total", model="sim-model", kind="completion") == 10
    assert sample(text, "pdgate_tokens_total", model="sim-model", kind="prompt") > 0  # from the non-stream's usage
    assert sample(text, "pdgate_tpot_seconds_count", model="sim-model") == 1, "the stream's 5 tokens: one TPOT"
    assert sample(text, "pdgate_ttft_seconds_count", model="sim-model") == 2
    assert sample(text, "pdgate_model_requests_total", model="sim-model", outcome="completed") == 2
    assert sample(text, "pdgate_policy_decisions_total", role="prefill", policy="cache_aware", decision="only") == 2
    board = json.loads((ROOT / "config" / "grafana" / "pdgate.json").read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    assert len(exprs) >= 16
    offered = exported(text)
    for e in exprs:
        for name in re.findall(r"\bpdgate_[a-z0-9_]+", e):
            assert name in offered, f"{name} (in {e!r}) is not a metric the gateway exports"


def test_model_labels_stay_bounded() -> None:
    m = Metrics()
    m.models = lambda: frozenset({"m1"})
    assert m.model_label("m1") == "m1" and m.model_label("anything a client sends") == OTHER_MODEL
    assert m.model_label(None) == ""

    class Rec:
        route, model, tenant, created, finished_at = "/v1/chat/completions", "x" * 100, None, 0.0, 1.0
        first_token_at, last_token_at, completion_tokens, prompt_tokens, chunks = 0.1, 0.5, 5, 3, 5

    for i in range(100):
        Rec.model = f"client-{i}"
        m.on_transition(Rec(), Phase.DECODE, Phase.COMPLETED, 0.1)  # type: ignore[arg-type]
    assert set(m.ttft_hist) == {OTHER_MODEL} and set(m.tpot_hist) == {OTHER_MODEL}
    assert m.tokens == {(OTHER_MODEL, "prompt"): 300, (OTHER_MODEL, "completion"): 500}
    assert abs(m.tpot_hist[OTHER_MODEL].total - 100 * 0.1) < 1e-9  # (0.5 - 0.1) / (5 - 1) each


async def test_a_worker_that_never_answers_is_down_with_a_reason(gateways: list[Any]) -> None:
    """`down: TimeoutError: ` said nothing: a timeout's message is empty. Now the reason names the wait."""
    import asyncio
    import socket

    from pdgate.core.config import HealthConfig
    from tests.procs import Sim

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts, never answers
    port = silent.getsockname()[1]
    try:
        fake = Sim("prefill", port, port, None)  # type: ignore[arg-type]
        g = await start_gateway(make_config([fake], [], health=HealthConfig(interval_s=0.2, timeout_s=0.3, failures=1)))
        gateways.append(g)
        w = g.gw.pool.by_id["p0"]
        for _ in range(50):
            if w.checks.last_error:
                break
            await asyncio.sleep(0.1)
        assert w.checks.last_error == "TimeoutError: /health: no answer within 0.3s", w.checks.last_error
        assert w.state.value == "down"
    finally:
        silent.close()


async def test_a_second_gateway_cannot_take_a_live_admin_socket(procs: Procs, gateways: list[Any], tmp_path: Any) -> None:
    """create_unix_server replaces whatever file is at the path: a second gateway took over the first one's admin
    plane, and unlinked it when it stopped. A live socket is now refused; a stale one is still replaced."""
    import pytest

    from pdgate.core.config import ConfigError

    p, d = procs.pair()
    path = str(tmp_path / "admin.sock")
    g = await start_gateway(make_config([p], [d], admin_socket=path))
    gateways.append(g)
    with pytest.raises(ConfigError, match="--admin-socket"):
        await start_gateway(make_config([p], [d], admin_socket=path))
    conn = aiohttp.UnixConnector(path=path)
    async with aiohttp.ClientSession(connector=conn) as http:
        async with http.get("http://localhost/v1/workers") as r:
            assert r.status == 200, "the first gateway's admin plane is still its own"


def test_views_print_values_as_they_are_and_never_cut_one() -> None:
    from rich.console import Console

    from pdgate.planes import views

    long_id = "pdg-0123456789abcdef-00000001940ca33b156d1f04"
    req = {"id": long_id, "phase": "prefill+transfer", "age_s": 3.21, "prefill": "p0", "decode": "d0",
           "deadline": {"next": "idle", "left_s": 0.5}, "attempt": 1, "chunks": 3, "model": "m[/x]", "tenant": "t"}
    ws = [{"id": "p0", "role": "prefill", "url": "http://[fd00:1234:5678::17]:30011", "degraded": False,
           "healthy": True, "breaker": "closed", "load": 0, "restarts": 0, "engine": {},
           "last_error": "HTTP 500: [/oops] \x1b]0;title\x07"}]
    for wide in (False, True):
        console = Console(width=80, record=True, color_system=None)
        console.print(views.ps_table({"count": 1, "requests": [req]}, wide, 80))
        console.print(views.workers_table({"workers": ws}, wide, 80))
        text = console.export_text()
        assert all(len(line) <= 80 for line in text.splitlines()), text
        assert long_id in text and "…" not in text and "3.21" in text and "0.50" in text, text
        assert "fd00:1234:5678::17" in text.replace("\n", "").replace(" ", ""), "an IPv6 URL is not markup"
        assert "\x1b" not in text and "\x07" not in text, "no escape sequence reaches the terminal"
        if wide:
            assert "m[/x]" in text and "[/oops]" in text, text


def test_workers_say_unknown_not_idle_when_a_check_could_not_read_the_counts() -> None:
    """A worker up whose last check could not read its queue counts (``counts_unknown``) reads "unknown", not "idle"
    (an engine slow to answer ``/metrics`` is not an idle one)."""
    from rich.console import Console

    from pdgate.planes import views

    row = {"id": "d0", "role": "decode", "url": "http://127.0.0.1:1", "degraded": False, "healthy": True,
           "breaker": "closed", "load": 3, "restarts": 0, "queues": {}}
    for unknown, word in ((True, "unknown"), (False, "idle")):
        console = Console(width=120, record=True, color_system=None)
        console.print(views.workers_table({"workers": [{**row, "counts_unknown": unknown}]}, False, 120))
        text = console.export_text()
        assert word in text and ("idle" not in text if unknown else "unknown" not in text), text
