"""``python -m loadtest storm``: the seed's verification protocol, with a verdict.

1. baseline: each prefill's inflight queue (SGLang's ``/v1/loads``, live; else its ``/metrics``) and an e2e probe
   ("say hi", max_tokens 8: status and time);
2. storm: ``iterations`` x ``instances`` concurrent requests, each cancelled by the client
   at a random point (before the first token, mid-stream) or let finish; optionally a decode
   worker restarted through the gateway mid-storm;
3. monitor: every prefill's gauge sampled every second for ``window`` seconds;
4. verify: pins cleared by watchdog + grace after the storm, every client request reached a
   terminal state, force-fail events (the engines' watchdog counter) reported;
5. final probe.
Prints a verdict table, writes JSON and a PNG timeline; exits 0 only if every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from loadtest.output import pyplot, save, verdict_command
from pdgate.planes.cli import admin_default, admin_key, started

GAUGE = "num_prefill_inflight_queue_reqs"
FORCE_FAILS = "num_prefill_inflight_timeout_reqs_total"
PROBE = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}


def metric(text: str, name: str, prefix: str = "sglang") -> float | None:
    """Sum of a metric over its label sets; both 'sglang:' and 'sglang_' prefixes are read."""
    vals = [float(m.group(1)) for m in re.finditer(rf"^{prefix}[:_]{name}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)]
    return sum(vals) if vals else None


def pinned(text: str) -> float | None:
    """What a prefill holds of our requests: SGLang's inflight queue (requests whose KV waits for its decode); a
    vLLM prefill (which lists no such queue: its unread KV is freed by its own timeout) the requests it runs or
    queues."""
    got = metric(text, GAUGE)
    if got is not None:
        return got
    running, waiting = metric(text, "num_requests_running", "vllm"), metric(text, "num_requests_waiting", "vllm")
    return None if running is None and waiting is None else (running or 0) + (waiting or 0)


async def held(http: aiohttp.ClientSession, url: str) -> float | None:
    """What a prefill holds now (``url``: its /metrics). SGLang's inflight queue as ``/v1/loads`` counts it (the
    scheduler's published snapshot: republished when idle, every 50 ms while stalled, on batch results): its /metrics
    queue gauges are set only when the scheduler logs its stats (a real decode's
    ``num_decode_transfer_queue_reqs`` read 0 while /v1/loads counted 4 waiting for their KV). Else (vLLM, which
    has no /v1/loads) what its /metrics say."""
    base = url.rsplit("/metrics", 1)[0]
    try:
        async with http.get(base + "/v1/loads?include=disagg", timeout=aiohttp.ClientTimeout(total=3)) as r:
            data = await r.json(content_type=None) if r.status == 200 else None
        counts = [ld["disaggregation"]["prefill_inflight_queue_reqs"] for ld in data["loads"]] \
            if isinstance(data, dict) and isinstance(data.get("loads"), list) else []
        if counts and all(isinstance(c, int) for c in counts):
            return float(sum(counts))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError):
        pass
    return pinned(await scrape(http, url))


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=3)) as r:
            return await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return ""


async def probe(http: aiohttp.ClientSession, gateway: str, model: str, timeout: float = 30) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        async with http.post(gateway + "/v1/chat/completions", json={**PROBE, "model": model},
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            await r.read()
            return {"status": r.status, "seconds": round(time.monotonic() - t0, 3)}
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return {"status": None, "error": str(exc), "seconds": round(time.monotonic() - t0, 3)}


async def one(http: aiohttp.ClientSession, gateway: str, model: str, rng: random.Random, timeout: float) -> dict[str, Any]:
    """One storm request: cancelled before its first token, mid-stream, or let finish."""
    plan = rng.choice(("before_first_token", "mid_stream", "mid_stream", "finish"))
    body = {**PROBE, "model": model, "max_tokens": rng.randint(8, 64), "stream": plan != "before_first_token"}
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            if plan == "before_first_token":
                task = asyncio.ensure_future(http.post(gateway + "/v1/chat/completions", json=body))
                await asyncio.sleep(rng.uniform(0, 0.05))
                if not task.done():
                    task.cancel()
                    return {"plan": plan, "outcome": "cancelled", "seconds": round(time.monotonic() - t0, 3)}
                resp = task.result()
                resp.close()
                return {"plan": plan, "outcome": f"http_{resp.status}", "seconds": round(time.monotonic() - t0, 3)}
            async with http.post(gateway + "/v1/chat/completions", json=body) as r:
                if plan == "mid_stream" and r.status == 200:
                    for _ in range(rng.randint(1, 4)):
                        await r.content.readuntil(b"\n\n")
                    r.close()
                    return {"plan": plan, "outcome": "cancelled", "seconds": round(time.monotonic() - t0, 3)}
                await r.read()
                return {"plan": plan, "outcome": f"http_{r.status}", "seconds": round(time.monotonic() - t0, 3)}
    except TimeoutError:
        return {"plan": plan, "outcome": "hung", "seconds": round(time.monotonic() - t0, 3)}
    except (aiohttp.ClientError, asyncio.IncompleteReadError, OSError) as exc:
        return {"plan": plan, "outcome": f"error:{exc.__class__.__name__}", "seconds": round(time.monotonic() - t0, 3)}


def admin_headers(a: argparse.Namespace) -> dict[str, str]:
    key = admin_key(a.admin_key)  # the flag, PDGATE_ADMIN_KEY(_FILE), or the key `pdgate up` wrote
    return {"Authorization": f"Bearer {key}"} if key else {}


async def find_prefills(http: aiohttp.ClientSession, admin: str, headers: dict[str, str]) -> tuple[list[str], list[str]]:
    async with http.get(admin + "/v1/workers", headers=headers) as r:
        data = await r.json(content_type=None) if r.content_type == "application/json" else None
    if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
        raise SystemExit(f"loadtest storm needs the gateway's admin plane (it lists the workers and their engines): "
                         f"{admin}/v1/workers answered {r.status} without a worker list; give it with --admin URL "
                         "(and --admin-key where the plane wants one)")
    workers = data["workers"]
    return ([w["url"] + "/metrics" for w in workers if w["role"] == "prefill"],
            [w["id"] for w in workers if w["role"] == "decode"])


async def run(a: argparse.Namespace) -> dict[str, Any]:
    if getattr(a, "compare", False):
        from loadtest import stormcompare

        return await stormcompare.compare(a)
    if not a.gateway:
        raise SystemExit("loadtest storm: --gateway URL is needed (no `pdgate up` runs from this directory), "
                         "or --compare to start its own engines and gateways")
    console = Console(stderr=True)
    rng = random.Random(a.seed)
    async with aiohttp.ClientSession() as http:
        decodes: list[str] = []
        metrics_urls = list(a.prefill_metrics)
        if not metrics_urls or a.restart_decode:
            found, decodes = await find_prefills(http, a.admin, admin_headers(a))
            metrics_urls = metrics_urls or found
        t_start = time.monotonic()

        def now() -> float:
            return round(time.monotonic() - t_start, 3)

        texts = [await scrape(http, u) for u in metrics_urls]
        baseline = {u: await held(http, u) for u in metrics_urls}
        force0 = sum(metric(t, FORCE_FAILS) or 0 for t in texts)
        probe0 = await probe(http, a.gateway, a.model, a.probe_timeout)
        samples: list[dict[str, Any]] = []
        marks: list[dict[str, Any]] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                vals = await asyncio.gather(*(held(http, u) for u in metrics_urls))
                samples.append({"t": now(), **dict(zip(metrics_urls, vals, strict=True))})
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except TimeoutError:
                    pass

        sampling = asyncio.create_task(sampler())
        marks.append({"t": now(), "event": "storm_start"})
        results: list[dict[str, Any]] = []
        with Progress(console=console) as bar:
            job = bar.add_task("storm", total=a.iterations)
            for i in range(a.iterations):
                if a.restart_decode and decodes and i == a.iterations // 2:
                    marks.append({"t": now(), "event": f"restart {decodes[0]}"})
                    async with http.post(f"{a.admin}/v1/workers/{decodes[0]}/restart", headers=admin_headers(a)) as r:
                        marks[-1]["status"] = r.status
                results += await asyncio.gather(*(one(http, a.gateway, a.model, rng, a.request_timeout)
                                                  for _ in range(a.instances)))
                bar.advance(job)
        storm_end = now()
        marks.append({"t": storm_end, "event": "storm_end"})
        deadline = storm_end + a.watchdog + a.grace
        with Progress(console=console) as bar:
            job = bar.add_task("monitor", total=a.window)
            while now() < storm_end + a.window:
                await asyncio.sleep(1)
                bar.update(job, completed=min(a.window, now() - storm_end))
        stop.set()
        await sampling
        texts = [await scrape(http, u) for u in metrics_urls]
        force = sum(metric(t, FORCE_FAILS) or 0 for t in texts) - force0
        probe1 = await probe(http, a.gateway, a.model, a.probe_timeout)

    after = [s for s in samples if s["t"] >= deadline]
    peak = max((max((v or 0) for k, v in s.items() if k != "t") for s in samples), default=0)
    pins_cleared = bool(after) and all((s[u] or 0) <= (baseline[u] or 0) for s in after for u in metrics_urls)
    hung = [r for r in results if r["outcome"] == "hung"]
    checks = [
        ("baseline probe", probe0.get("status") == 200, f"status {probe0.get('status')} in {probe0['seconds']}s"),
        ("pins cleared by watchdog + grace", pins_cleared,
         f"the prefills' inflight queues peaked at {peak:g} requests during the storm; after the watchdog + grace "
         f"line (t={deadline:g}s) "
         + (f"{len(after)} samples, the last: " + ", ".join(
             f"{short_url(u)} {(s[u] or 0):g} (baseline {(baseline[u] or 0):g})" for s in after[-1:] for u in metrics_urls)
            if after else "no samples (the window is too short: --window)")),
        ("every client request terminal", not hung, f"{len(results)} requests, {len(hung)} hung"),
        ("final probe", probe1.get("status") == 200, f"status {probe1.get('status')} in {probe1['seconds']}s"),
    ]
    out = {"gateway": a.gateway, "prefill_metrics": metrics_urls, "baseline": baseline, "probe_before": probe0,
           "probe_after": probe1, "force_fails": force, "samples": samples, "marks": marks, "storm_end": storm_end,
           "watchdog_line": deadline, "requests": results,
           "outcomes": {o: sum(1 for r in results if r["outcome"] == o) for o in sorted({r["outcome"] for r in results})},
           "checks": [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks],
           "verdict": "PASS" if all(ok for _, ok, _ in checks) else "FAIL"}
    return out


def short_url(u: str) -> str:
    """A /metrics URL as its host:port."""
    return u.split("://", 1)[-1].split("/", 1)[0]


def report(console: Console, out: dict[str, Any]) -> None:
    if out.get("compare"):
        from loadtest import stormcompare

        stormcompare.report(console, out)
        return
    t = Table(title=f"storm verdict: {out['verdict']}")
    t.add_column("check")
    t.add_column("result")
    t.add_column("detail")
    for c in out["checks"]:
        t.add_row(c["check"], "[green]ok[/]" if c["ok"] else "[red]FAILED[/]", c["detail"])
    for m in out["marks"]:
        if m["event"].startswith("restart"):
            t.add_row("decode restarted mid-storm", "info", f"{m['event'].removeprefix('restart ')} at "
                      f"t={m['t']:.1f}s (--restart-decode)")
    t.add_row("force-fail events (engine watchdog)", "info", f"{out['force_fails']:g} (requests the engines' own "
              "watchdog failed)")
    t.add_row("client outcomes", "info", ", ".join(f"{k}={v}" for k, v in out["outcomes"].items()))
    console.print(t)


def plot(out: dict[str, Any], path: Path) -> None:
    if out.get("compare"):
        from loadtest import stormcompare

        stormcompare.plot(out, path)
        return
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    for u in out["prefill_metrics"]:
        ax.step([s["t"] for s in out["samples"]], [s[u] or 0 for s in out["samples"]], where="post", label=u)
    if not out["samples"]:
        ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center")
    top = max((v or 0 for smp in out["samples"] for k, v in smp.items() if k != "t"), default=0) or 1
    ax.set_ylim(0, top * 1.25)
    for i, m in enumerate(out["marks"]):  # staggered: marks close in time do not print over each other
        ax.axvline(m["t"], color="grey", linestyle=":", linewidth=1)
        ax.annotate(m["event"], (m["t"], top * (1.02 + 0.08 * (i % 3))), fontsize=7, ha="left", va="bottom",
                    xytext=(2, 0), textcoords="offset points")
    ax.axvline(out["watchdog_line"], color="red", linestyle="--", label="watchdog + grace")
    ax.set_xlabel("time since the baseline (s)")
    ax.set_ylabel("prefill inflight queue (requests)")
    ax.set_title(f"storm: {out['verdict']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("storm", help="the seed's verification protocol: baseline, abort storm, monitor, verdict")
    up = started()  # a `pdgate up` run from this directory: found with no flag
    p.add_argument("--gateway", default=up["front"] if up else None,
                   help="the gateway's front door (default: where a `pdgate up` run from this directory listens)")
    p.add_argument("--compare", action="store_true",
                   help="start fresh sims that pin (no engine fixes, KV acks dropped, first aborts lost) for each run "
                   "and storm them through pdgate, sglang-router and SMG 1.13 on their defaults, alternating, with the "
                   "machine's load beside each run (loadtest/stormcompare.py); the verdict is pdgate's")
    p.add_argument("--targets", nargs="+", choices=("pdgate", "sglang-router", "smg"),
                   default=["pdgate", "sglang-router", "smg"], help="with --compare: the gateways, in the first order")
    p.add_argument("--repeats", type=int, default=1, help="with --compare: runs per target (the order rotates)")
    p.add_argument("--admin", default=admin_default()[0],
                   help="the gateway's admin plane (workers, restart; env PDGATE_ADMIN_URL, else the `pdgate up` "
                   "run from this directory)")
    p.add_argument("--admin-key", help="the admin key (as the pdgate CLI finds it when not given)")
    p.add_argument("--prefill-metrics", action="append", default=[], metavar="URL",
                   help="a prefill's /metrics URL (repeatable; default: found through the admin plane's /v1/workers)")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--watchdog", type=float, default=60, help="the engines' inflight watchdog, seconds")
    p.add_argument("--grace", type=float, default=5)
    p.add_argument("--window", type=float, default=90, help="seconds to monitor after the storm")
    p.add_argument("--restart-decode", action="store_true", help="restart a decode worker through the gateway mid-storm")
    p.add_argument("--request-timeout", type=float, default=120, help="a client request still open after this is hung")
    p.add_argument("--probe-timeout", type=float, default=30,
                   help="how long the probes before and after wait for their answer (past the gateway's TTFT budget, "
                   "they judge the gateway's answer, not the client's patience)")
    verdict_command(p, "storm", run, report, plot)
