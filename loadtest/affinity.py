"""``python -m loadtest agents --compare``: the same multi-round agent sessions against each routing policy.

One set of sims: ``--prefills`` prefill workers with a prefix cache of ``--cache-tokens`` each (an engine's KV
memory is finite, so sessions spread over every prefill need more of it than sessions kept on one),
``--prefill-us`` microseconds of compute per uncached prompt token, one forward at a time (as one GPU), and
``--decodes`` decode workers. Targets, one
after the other on those workers, each with the prefills' caches flushed first and the same sessions (same
seed): pdgate with round_robin, least_loaded, session and cache_aware, and sglang-router with
``--prefill-policy cache_aware`` (its decode by round_robin; pdgate's decode goes by least_loaded).

Reported per target: TTFT p50/p99 over all requests and per round, the prompt tokens the prefills computed
(not found in their caches, from their ``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total``),
the cache hit rate, how the prompt tokens split across the prefills, and failures. JSON + PNG.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from rich.console import Console
from rich.table import Table

from loadtest import agents
from loadtest.output import pyplot, save, write
from loadtest.procs import Proc, free_port, require_router, stop_all, wait_http, worker_tables

POLICIES = ("round_robin", "least_loaded", "session", "cache_aware")
ROUTER = "sglang-router cache_aware"
PING = b'{"model":"sim-model","messages":[{"role":"user","content":"ping"}],"max_tokens":1}'


def counter(text: str, name: str) -> float:
    m = re.search(rf"^sglang:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def prefill_counts(http: aiohttp.ClientSession, prefills: list[str]) -> list[tuple[float, float]]:
    """(prompt tokens, cached tokens) so far, per prefill."""
    out = []
    for url in prefills:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        out.append((counter(text, "prompt_tokens_total"), counter(text, "cached_tokens_total")))
    return out


async def flush(http: aiohttp.ClientSession, prefills: list[str]) -> None:
    for url in prefills:
        async with http.post(url + "/flush_cache") as r:
            assert r.status == 200


def start_workers(tmp: Path, a: argparse.Namespace, procs: list[Proc]) -> tuple[list[tuple[str, int]], list[str]]:
    py = sys.executable
    prefills, decodes = [], []
    for i in range(a.prefills):
        port, bport = free_port(), free_port()
        procs.append(Proc([py, "-m", "engine.sim", "--role", "prefill", "--port", str(port), "--bootstrap-port",
                           str(bport), "--prefill-per-token-us", f"{a.prefill_us:g}", "--prefix-cache-tokens",
                           str(a.cache_tokens), "--log-level", "WARNING"],
                          {}, tmp / f"prefill-{i}.log").start())
        prefills.append((f"http://127.0.0.1:{port}", bport))
    for i in range(a.decodes):
        port = free_port()
        procs.append(Proc([py, "-m", "engine.sim", "--role", "decode", "--port", str(port), "--log-level", "WARNING"],
                          {}, tmp / f"decode-{i}.log").start())
        decodes.append(f"http://127.0.0.1:{port}")
    for url, p in zip([u for u, _ in prefills] + decodes, procs, strict=True):
        wait_http(url + "/health", proc=p.popen)
    return prefills, decodes


def start_target(tmp: Path, name: str, prefills: list[tuple[str, int]], decodes: list[str]) -> tuple[Proc, str]:
    py = sys.executable
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name == ROUTER:
        args = [py, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1", "--port",
                str(port), "--prefill-policy", "cache_aware", "--decode-policy", "round_robin", "--prometheus-host",
                "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
        for u, b in prefills:
            args += ["--prefill", u, str(b)]
        for u in decodes:
            args += ["--decode", u]
        proc = Proc(args, {}, tmp / "router.log").start()
        wait_http(url + "/v1/chat/completions", timeout=60, proc=proc.popen, data=PING)
        return proc, url
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {free_port()}\npolicy = \"{name}\"\n"
                   + worker_tables(prefills, decodes))
    proc = Proc([py, "-m", "pdgate", "serve", "--config", str(cfg), "--log-level", "WARNING"], {},
                tmp / f"{name}.log").start()
    wait_http(url + "/readiness", timeout=60, proc=proc.popen)
    return proc, url


async def one(a: argparse.Namespace, url: str, prefills: list[str]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        await flush(http, prefills)
        before = await prefill_counts(http, prefills)
        b = copy.copy(a)
        b.gateway = url
        res = await agents.run(b)
        after = await prefill_counts(http, prefills)
    prompt = [x[0] - y[0] for x, y in zip(after, before, strict=True)]
    cached = [x[1] - y[1] for x, y in zip(after, before, strict=True)]
    total = sum(prompt)
    res["prefill_prompt_tokens"] = int(total)
    res["prefill_tokens_computed"] = int(total - sum(cached))
    res["cache_hit_rate"] = round(sum(cached) / total, 4) if total else None
    res["prompt_share_per_prefill"] = [round(p / total, 3) if total else None for p in prompt]
    return res


def run(a: argparse.Namespace) -> dict[str, Any]:
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="pdgate-affinity-"))
    procs: list[Proc] = []
    results: dict[str, Any] = {}
    if a.router:
        require_router()
    try:
        prefills, decodes = start_workers(tmp, a, procs)
        names = [*POLICIES, ROUTER] if a.router else list(POLICIES)
        for name in names:
            console.print(f"[bold]{name}[/]: {a.sessions} sessions x {a.rounds} rounds ...")
            proc, url = start_target(tmp, name, prefills, decodes)
            try:
                time.sleep(1.0)  # the first health checks are done
                results[name] = uvloop.run(one(a, url, [u for u, _ in prefills]))
            finally:
                proc.stop()
    finally:
        stop_all(procs)
    rr = results["round_robin"]["ttft_p50_ms"]
    ca = results["cache_aware"]["ttft_p50_ms"]
    router = results.get(ROUTER, {}).get("ttft_p50_ms")
    verdict = {"cache_aware_vs_round_robin_ttft_p50": round(ca / rr, 3) if rr and ca else None,
               "cache_aware_vs_router_ttft_p50": round(ca / router, 3) if router and ca else None}
    ok = all(not r["failures"] for r in results.values())
    return {"command": " ".join(sys.argv), "prefills": a.prefills, "decodes": a.decodes, "prefill_us_per_token": a.prefill_us,
            "cache_tokens_per_prefill": a.cache_tokens, "think_ms": a.think_ms,
            "sessions": a.sessions, "rounds": a.rounds, "growth": a.growth, "tools": a.tools, "max_tokens": a.max_tokens,
            "targets": results, "ratios": verdict,
            "verdict": "PASS" if ok and (verdict["cache_aware_vs_round_robin_ttft_p50"] or 1) <= 0.5
            and (verdict["cache_aware_vs_router_ttft_p50"] or 0) <= 1.0 else "FAIL"}


def report(console: Console, out: dict[str, Any]) -> None:
    t = Table(title=f"agents --compare: {out['sessions']} sessions x {out['rounds']} rounds, +{out['growth']} tokens "
                    f"per tool result, {out['prefills']} prefills at {out['prefill_us_per_token']:g} us/token: {out['verdict']}")
    for col in ("target", "ok", "ttft p50 ms", "ttft p99 ms", "prefill tokens computed", "cache hit", "prompt split",
                "seconds"):
        t.add_column(col, justify="right")
    for name, r in out["targets"].items():
        ok = sum(x["ok"] for x in r["per_round"])
        sent = sum(x["requests"] for x in r["per_round"])
        t.add_row(name, f"{ok}/{sent}", str(r["ttft_p50_ms"]), str(r["ttft_p99_ms"]), f"{r['prefill_tokens_computed']:,}",
                  f"{r['cache_hit_rate']:.1%}" if r["cache_hit_rate"] is not None else "-",
                  " / ".join(f"{s:.2f}" for s in r["prompt_share_per_prefill"] if s is not None), str(r["seconds"]))
    console.print(t)
    console.print(f"ratios: {out['ratios']}")


def plot(out: dict[str, Any], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(1, 4, figsize=(18, 4.2))
    names = list(out["targets"])
    for name in names:
        pr = out["targets"][name]["per_round"]
        xs = [r["round"] for r in pr]
        ax[0].plot(xs, [r["ttft_p50_ms"] for r in pr], marker="o", label=name)
        ax[1].plot(xs, [r["ttft_p99_ms"] for r in pr], marker="o", label=name)
    for a_, title in ((ax[0], "TTFT p50 by round"), (ax[1], "TTFT p99 by round")):
        a_.set_xlabel("round (odd: tool call, even: answer after the tool result)")
        a_.set_ylabel("TTFT (ms)")
        a_.set_title(title)
        a_.legend(fontsize=7)
    xs = range(len(names))
    ax[2].bar(xs, [out["targets"][n]["prefill_tokens_computed"] / 1000 for n in names],
              color=[f"C{i}" for i in xs], label="computed (not cached)")
    ax[2].set_ylabel("prompt tokens computed by the prefills (thousands)")
    ax[2].set_title("prefill work")
    ax[3].bar(xs, [100 * (out["targets"][n]["cache_hit_rate"] or 0) for n in names], color=[f"C{i}" for i in xs],
              label="prompt tokens found cached")
    ax[3].set_ylabel("prefix cache hit rate (% of prompt tokens)")
    ax[3].set_title("cache hits")
    for a_ in (ax[2], ax[3]):
        a_.set_xticks(list(xs), names, rotation=20, fontsize=7, ha="right")
        a_.set_xlabel("target")
        a_.legend(fontsize=7)
    fig.suptitle(f"agents --compare: {out['sessions']} sessions x {out['rounds']} rounds, {out['prefills']} prefills: "
                 f"{out['ratios']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def main(a: argparse.Namespace) -> None:
    out = run(a)
    report(Console(), out)
    write(out, a.out, plot)
    raise SystemExit(0 if out["verdict"] == "PASS" else 1)


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compare", action="store_true", help="start sims and compare the routing policies on the same "
                   "sessions (loadtest/affinity.py)")
    p.add_argument("--prefills", type=int, default=2, help="--compare: prefill workers")
    p.add_argument("--decodes", type=int, default=1, help="--compare: decode workers")
    p.add_argument("--prefill-us", type=float, default=20.0,
                   help="--compare: prefill compute per uncached prompt token, microseconds (20: 50k tokens/s)")
    p.add_argument("--cache-tokens", type=int, default=150_000,
                   help="--compare: each prefill's prefix cache, tokens (an engine's KV memory is finite: sessions "
                   "spread over every prefill need more of it than sessions kept on one)")
    p.add_argument("--router", action=argparse.BooleanOptionalAction, default=True,
                   help="--compare: include sglang-router's cache_aware")


