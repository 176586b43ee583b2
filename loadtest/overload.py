"""``python -m loadtest bench --overload``: goodput under overload, with and without admission control.

One prefill sim serialised at about ``--prefill-s`` seconds per request (its ``--speed``), one decode sim,
reporting ``max_running_requests`` = ``--capacity`` from the prefill (what pdgate reads as its capacity).
First the pair's capacity is measured (a closed loop through pdgate, no deadlines). Then each target gets
open-loop Poisson arrivals at 1x, 2x and 3x that capacity for ``--duration`` seconds, every request with a
TTFT budget (``x-pdgate-ttft-timeout``) and a total budget (``x-pdgate-timeout``); the client gives up at
the total budget plus a second (a router that ignores deadlines is then seen answering late, or not at all).

Targets, in one run on the same workers: pdgate on its defaults (the limit learned), pdgate with ``[admission]
capacity`` set by hand to ``--hand-capacity`` (the engine's real concurrency), pdgate with admission off
(``[admission] enabled = false``), sglang-router and SMG 1.13 as they are, and sglang-router with its concurrency limit
(``--hand-capacity``) and queue (``--max-concurrent-requests``, ``--queue-size``, ``--queue-timeout-secs`` = the
TTFT budget).

Reported per target and load: goodput (requests answered 200 within their total budget, per second, counted
in steady state: answers from 2 s after the first arrival to the last arrival; and as a share of the measured
capacity), the share of requests that got any terminal answer within their budget,
how long shed requests waited (p50/p99 of 429/503 answers), 504s, and the engine's wasted prefill work
(prefills computed for requests that did not complete within their budget, from the sim's
``num_prefill_forwards``). JSON and a PNG under ``runs/``.

``--speed-change``: the engine's speed changes under load. pdgate on its defaults (the limit learned) and with
admission off, each in turn, get ``--change-load`` x capacity for three phases of ``--phase-s`` seconds; in the
second the prefill takes twice as long (sim fault ``slow_prefill`` = ``--prefill-s``: it serves half as many), in
the third it is back. Reported per phase: goodput against that phase's capacity, the learned limit (read from
the admin plane every 0.5 s) and how long after each change it took the limit to reach its new level (the
phase's last-half median, within one); per second: goodput and the limit, plotted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from rich.console import Console

from loadtest.output import pyplot, save, write
from loadtest.procs import Proc, free_port, peer_cmd, require_router, stop_all, wait_http, worker_tables
from pdgate.planes.views import layout

BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}
SLACK_S = 0.05  # an answer this late past its budget still counts as within it (timer and network)


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else None


async def prefill_forwards(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(r"^sglang:num_prefill_forwards_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def engine_idle(http: aiohttp.ClientSession, workers: list[str], within: float = 30.0) -> None:
    """Wait until the engines hold nothing (the previous run's leftovers must not load the next)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        held = 0
        for w in workers:
            async with http.get(w + "/pdgate/v1/requests") as r:
                held += len((await r.json())["requests"])
        if not held:
            return
        await asyncio.sleep(0.2)


async def closed_loop(url: str, conns: int, seconds: float) -> float:
    """Requests/s a target completes with ``conns`` connections and no deadlines: the capacity at 1x."""
    done = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                async with http.post(url + "/v1/chat/completions", json=BODY) as r:
                    await r.read()
                    done += r.status == 200
        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(conns)))
        return done / (time.monotonic() - t0)


async def open_loop(url: str, rate: float, seconds: float, ttft_s: float, total_s: float,
                    seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    headers = {"x-pdgate-ttft-timeout": f"{ttft_s:g}", "x-pdgate-timeout": f"{total_s:g}"}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=total_s + 1.0)) as http:
        async def one(t0: float) -> None:
            rec: dict[str, Any] = {"t": t0}
            try:
                async with http.post(url + "/v1/chat/completions", json=BODY, headers=headers) as r:
                    raw = await r.read()
                    rec["status"] = r.status
                    if r.status != 200:
                        try:
                            rec["code"] = json.loads(raw)["error"]["code"]
                        except (ValueError, KeyError, TypeError):
                            rec["code"] = None
            except (aiohttp.ClientError, TimeoutError):
                rec["status"] = 0  # no answer: the client gave up
            rec["s"] = time.monotonic() - t0
            out.append(rec)

        tasks = []
        start = time.monotonic()
        t = start
        while t < start + seconds:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.create_task(one(t)))
        await asyncio.gather(*tasks)
    return out


WARMUP_S = 2.0  # goodput is counted in steady state: answers from this long after the first arrival to the last one


def summarize(reqs: list[dict[str, Any]], seconds: float, capacity: float, total_s: float,
              forwards: float) -> dict[str, Any]:
    """``seconds``: the arrivals' span. Goodput counts the good answers that came in steady state, from
    ``WARMUP_S`` after the first arrival to the last arrival (neither the queue's filling nor its draining)."""
    n = len(reqs)
    t0 = min((r["t"] for r in reqs), default=0.0)
    t_end = max((r["t"] for r in reqs), default=0.0)
    window = max(t_end - t0 - WARMUP_S, 1e-3)
    good = [r for r in reqs if r["status"] == 200 and r["s"] <= total_s + SLACK_S]
    steady = [r for r in good if t0 + WARMUP_S <= r["t"] + r["s"] <= t_end]
    terminal = [r for r in reqs if r["status"] != 0 and r["s"] <= total_s + SLACK_S]
    shed = [r["s"] for r in reqs if r["status"] in (429, 503)]
    late = [r for r in reqs if r["status"] == 0 or r["s"] > total_s + SLACK_S]
    codes: dict[str, int] = {}
    for r in reqs:
        key = "ok" if r["status"] == 200 else f"{r['status']} {r.get('code') or ''}".strip()
        codes[key] = codes.get(key, 0) + 1
    return {
        "requests": n, "offered_rps": round(n / seconds, 2), "completed_in_deadline": len(good),
        "goodput_rps": round(len(steady) / window, 2), "goodput_x_capacity": round(len(steady) / window / capacity, 3),
        "terminal_within_deadline": round(len(terminal) / n, 4) if n else None,
        "late_or_unanswered": len(late),
        "shed": len(shed), "shed_p50_ms": pct(shed, 0.5), "shed_p90_ms": pct(shed, 0.9),
        "shed_p99_ms": pct(shed, 0.99),
        "deadline_504": sum(1 for r in reqs if r["status"] == 504),
        "e2e_ok_p50_ms": pct([r["s"] for r in good], 0.5), "e2e_ok_p99_ms": pct([r["s"] for r in good], 0.99),
        "prefill_forwards": int(forwards), "wasted_prefills": max(0, int(forwards) - len(good)),
        "codes": codes,
    }


def start(tmp: Path, a: argparse.Namespace, procs: list[Proc],
          admins: dict[str, str] | None = None) -> tuple[dict[str, str], str, str]:
    """The workers and the six targets; every process goes into ``procs`` as soon as it starts (``admins``: the
    pdgate targets' admin planes, filled)."""
    require_router()
    py = sys.executable
    pp, bp, dp = free_port(), free_port(), free_port()
    speed = a.prefill_s / 0.004  # the sim's prefill costs speed * 4 ms (plus a little per token)
    procs.append(Proc([py, "-m", "engine.sim", "--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp),
                       "--speed", f"{speed:g}", "--max-running-requests", str(a.capacity), "--log-level", "WARNING"],
                      {}, tmp / "prefill.log").start())
    procs.append(Proc([py, "-m", "engine.sim", "--role", "decode", "--port", str(dp), "--speed", "1",
                       "--log-level", "WARNING"], {}, tmp / "decode.log").start())
    pre, dec = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    wait_http(pre + "/health", proc=procs[0].popen)
    wait_http(dec + "/health", proc=procs[1].popen)
    targets: dict[str, str] = {}
    hand = a.hand_capacity
    for name, admission in (("pdgate-learned", ""), (f"pdgate-capacity-{hand}", f"capacity = {hand}\n"),
                            ("pdgate-no-admission", "enabled = false\n")):
        port, admin_port = free_port(), free_port()
        if admins is not None:
            admins[name] = f"http://127.0.0.1:{admin_port}"
        cfg = tmp / f"{name}.toml"
        cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {admin_port}\n[admission]\n{admission}"
                       "[reconcile]\nenabled = false\n" + worker_tables([(pre, bp)], [dec]))
        procs.append(Proc([py, "-m", "pdgate", "serve", "--config", str(cfg), "--log-level", "WARNING"], {},
                          tmp / f"{name}.log").start())
        targets[name] = f"http://127.0.0.1:{port}"
    routers: list[tuple[str, str, tuple[str, ...]]] = [("sglang-router", "sglang-router", ()), ("smg", "smg", ()), (
        # its queue timeout takes whole seconds: the TTFT budget, rounded down (a request waits no longer)
        "sglang-router+queue", "sglang-router", ("--max-concurrent-requests", str(hand), "--queue-size", "1024",
                                                 "--queue-timeout-secs", str(max(1, int(a.ttft)))))]
    for name, kind, extra in routers:
        port = free_port()
        procs.append(Proc(peer_cmd(kind, port, [(pre, bp)], [dec], extra), {}, tmp / f"{name}.log").start())
        targets[name] = f"http://127.0.0.1:{port}"
    for (name, url), proc in zip(targets.items(), procs[2:], strict=True):
        wait_http(url + ("/readiness" if name.startswith("pdgate") else "/health"), timeout=60, proc=proc.popen)
    return targets, pre, dec


async def measure(a: argparse.Namespace, targets: dict[str, str], pre: str, dec: str, console: Console) -> dict[str, Any]:
    await asyncio.sleep(1.0)  # the gateways' first health checks have read the engines' capacity
    capacity = await closed_loop(targets["pdgate-no-admission"], 8, a.calibrate)
    console.print(f"measured capacity: {capacity:.2f} requests/s (closed loop, 8 connections, {a.calibrate:g} s)")
    results: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession() as http:
        for load in a.loads:
            for name, url in targets.items():
                await engine_idle(http, [pre, dec])
                before = await prefill_forwards(http, pre)
                console.print(f"  {name} at {load:g}x ({load * capacity:.1f} requests/s) for {a.duration:g} s ...")
                reqs = await open_loop(url, load * capacity, a.duration, a.ttft, a.total, a.seed)
                await engine_idle(http, [pre, dec])
                forwards = await prefill_forwards(http, pre) - before
                results.setdefault(f"{load:g}x", {})[name] = summarize(reqs, a.duration, capacity, a.total, forwards)
    return {"capacity_rps": round(capacity, 3), "results": results}


def report(console: Console, out: dict[str, Any]) -> None:
    """As the CLI lays tables out (``pdgate.planes.views.layout``): values whole, records where the columns do not fit."""
    cols = ["target", "load", "offered/s", "goodput/s", "x cap", "terminal in deadline", "shed", "shed p90/p99 ms",
            "504", "late", "ok p50 ms", "wasted prefills"]
    rows: list[list[Any]] = []
    for load, per in out["results"].items():
        for name, m in per.items():
            rows.append([name, load, str(m["offered_rps"]), str(m["goodput_rps"]), str(m["goodput_x_capacity"]),
                      f"{m['terminal_within_deadline']:.1%}", str(m["shed"]), f"{m['shed_p90_ms']}/{m['shed_p99_ms']}",
                      str(m["deadline_504"]), str(m["late_or_unanswered"]), str(m["e2e_ok_p50_ms"]),
                      str(m["wasted_prefills"])])
    console.print(layout(f"overload: capacity {out['capacity_rps']} req/s, ttft budget {out['ttft_s']} s, total "
                         f"{out['total_s']} s", cols, rows, console.width))


def plot(out: dict[str, Any], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    loads = list(out["results"])
    names = list(next(iter(out["results"].values())))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(names)
    panels = (("goodput_x_capacity", "goodput (x capacity measured at 1x)"),
              ("terminal_within_deadline", "share of requests terminal within their deadline"),
              ("wasted_prefills", "wasted prefills (computed, not delivered in time)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            ax.bar([j + i * width for j in range(len(loads))], [out["results"][ld][name][key] or 0 for ld in loads],
                   width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))], [f"{ld} offered" for ld in loads])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("offered load (x measured capacity)")
        ax.set_ylabel({"goodput_x_capacity": "x capacity", "terminal_within_deadline": "share of requests",
                       "wasted_prefills": "prefills"}[key])
    for ax in axes:
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"overload: capacity {out['capacity_rps']} req/s, ttft budget {out['ttft_s']} s, total {out['total_s']} s",
                 fontsize=10)
    fig.tight_layout()
    save(fig, path)


async def limit_series(admin: str, until: float, into: list[tuple[float, int | None]]) -> None:
    """The prefill's capacity as the admin plane says it, every 0.5 s until ``until`` (loop time)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < until:
            try:
                async with http.get(admin + "/v1/workers") as r:
                    ws = (await r.json())["workers"]
                into.append((time.monotonic(), next((w["capacity"] for w in ws if w["role"] == "prefill"), None)))
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                into.append((time.monotonic(), None))
            await asyncio.sleep(0.5)


async def set_slow(pre: str, seconds: float) -> None:
    async with aiohttp.ClientSession() as http, http.post(pre + "/pdgate/v1/faults", json={"slow_prefill": seconds}) as r:
        r.raise_for_status()


def settle_s(series: list[tuple[float, int]], since: float, until: float) -> float | None:
    """Seconds after ``since`` until the limit came within one of the level it holds in [since, until]'s second
    half (its median there) and stayed so; None: it never did."""
    phase = [(t, v) for t, v in series if since <= t < until]
    late = sorted(v for t, v in phase if t >= (since + until) / 2)
    if not late:
        return None
    level = late[len(late) // 2]
    off = [t for t, v in phase if abs(v - level) > 1]
    return round(max(off) - since + 0.5, 2) if off else 0.0


async def speed_change(a: argparse.Namespace, targets: dict[str, str], admins: dict[str, str], pre: str, dec: str,
                       console: Console) -> dict[str, Any]:
    await asyncio.sleep(1.0)
    capacity = await closed_loop(targets["pdgate-no-admission"], 8, a.calibrate)
    console.print(f"measured capacity: {capacity:.2f} requests/s (closed loop, 8 connections, {a.calibrate:g} s)")
    ph = a.phase_s
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        for name in ("pdgate-learned", "pdgate-no-admission"):
            await engine_idle(http, [pre, dec])
            console.print(f"  {name}: {a.change_load:g}x for {3 * ph:g} s, the prefill half as fast from {ph:g} s to "
                          f"{2 * ph:g} s ...")
            t0 = time.monotonic()
            series: list[tuple[float, int | None]] = []
            poll = asyncio.create_task(limit_series(admins[name], t0 + 3 * ph + 1, series))

            async def changes() -> None:
                await asyncio.sleep(ph)
                await set_slow(pre, a.prefill_s)
                await asyncio.sleep(ph)
                await set_slow(pre, 0.0)

            flip = asyncio.create_task(changes())
            reqs = await open_loop(targets[name], a.change_load * capacity, 3 * ph, a.ttft, a.total, a.seed)
            await flip
            await poll
            await set_slow(pre, 0.0)
            good = [r["t"] + r["s"] - t0 for r in reqs if r["status"] == 200 and r["s"] <= a.total + SLACK_S]
            seconds = int(3 * ph) + 3
            per_s = [sum(1 for g in good if i <= g < i + 1) for i in range(seconds)]
            lim = [(t - t0, v) for t, v in series if v is not None]
            phases = []
            for i, cap in enumerate((capacity, capacity / 2, capacity)):
                lo, hi = i * ph, (i + 1) * ph
                g = sum(1 for x in good if lo + 2 <= x < hi) / max(ph - 2, 1e-3)  # its first 2 s: the change settling
                vals = [v for t, v in lim if lo <= t < hi]
                phases.append({"phase": ("before", "half speed", "back")[i], "capacity_rps": round(cap, 2),
                               "goodput_rps": round(g, 2), "goodput_x_capacity": round(g / cap, 3),
                               "limit_median": sorted(vals)[len(vals) // 2] if vals else None,
                               "limit_settled_s": settle_s(lim, lo, hi) if i else None})
            out[name] = {"phases": phases, "goodput_per_s": per_s, "limit": [(round(t, 2), v) for t, v in lim],
                         "codes": summarize(reqs, 3 * ph, capacity, a.total, 0)["codes"]}
    return {"capacity_rps": round(capacity, 3), "speed_change": out}


def report_change(console: Console, out: dict[str, Any]) -> None:
    cols = ["target", "phase", "capacity/s", "goodput/s", "x cap", "limit", "limit settled s"]
    rows = [[name, p["phase"], str(p["capacity_rps"]), str(p["goodput_rps"]), str(p["goodput_x_capacity"]),
             str(p["limit_median"]), str(p["limit_settled_s"] if p["limit_settled_s"] is not None else "-")]
            for name, m in out["speed_change"].items() for p in m["phases"]]
    console.print(layout(f"speed change: capacity {out['capacity_rps']} req/s before and after, half of it between; "
                         f"{out['change_load']}x offered", cols, rows, console.width))


def plot_change(out: dict[str, Any], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    ph = out["phase_s"]
    for i, (name, m) in enumerate(out["speed_change"].items()):
        axes[0].plot(range(len(m["goodput_per_s"])), m["goodput_per_s"], marker=".", color=f"C{i}", label=name)
        if any(v for _, v in m["limit"]) and name == "pdgate-learned":
            axes[1].step([t for t, _ in m["limit"]], [v for _, v in m["limit"]], where="post", color=f"C{i}",
                         label=f"{name}: learned limit")
    cap = out["capacity_rps"]
    axes[0].plot([0, ph, ph, 2 * ph, 2 * ph, 3 * ph], [cap, cap, cap / 2, cap / 2, cap, cap], "k--",
                 label="the engine's capacity")
    for ax in axes:
        for x in (ph, 2 * ph):
            ax.axvline(x, color="grey", lw=0.8)
        ax.set_xlabel("seconds since the first arrival (grey: the prefill halves its speed, then recovers)")
        ax.legend(fontsize=7, loc="best")
    axes[0].set_ylabel("requests answered in their deadline per second")
    axes[0].set_title("goodput per second", fontsize=9)
    axes[1].set_ylabel("limit (requests on the prefill)")
    axes[1].set_title("the prefill's learned limit, read from /v1/workers", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def run(a: argparse.Namespace) -> dict[str, Any]:
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="pdgate-overload-"))
    procs: list[Proc] = []
    admins: dict[str, str] = {}
    try:
        targets, pre, dec = start(tmp, a, procs, admins)
        if a.speed_change:
            out = uvloop.run(speed_change(a, targets, admins, pre, dec, console))
        else:
            out = uvloop.run(measure(a, targets, pre, dec, console))
    finally:
        stop_all(procs)
    if a.speed_change:
        out = {"command": " ".join(sys.argv), "ttft_s": a.ttft, "total_s": a.total, "prefill_s": a.prefill_s,
               "engine_capacity": a.capacity, "phase_s": a.phase_s, "change_load": a.change_load, **out}
        report_change(console, out)
        write(out, a.out, plot_change)
        return out
    out = {"command": " ".join(sys.argv), "ttft_s": a.ttft, "total_s": a.total, "prefill_s": a.prefill_s,
           "engine_capacity": a.capacity, "duration_s": a.duration, **out}
    report(console, out)
    write(out, a.out, plot)
    return out


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overload", action="store_true", help="goodput under 1x/2x/3x overload, admission on and off "
                   "and sglang-router (loadtest/overload.py)")
    p.add_argument("--loads", nargs="+", type=float, default=[1.0, 2.0, 3.0], help="--overload: offered x capacity")
    p.add_argument("--ttft", type=float, default=1.5, help="--overload: every request's TTFT budget, s")
    p.add_argument("--total", type=float, default=2.5, help="--overload: every request's total budget, s")
    p.add_argument("--prefill-s", type=float, default=0.2, help="--overload: the prefill sim's seconds per request")
    p.add_argument("--capacity", type=int, default=1024,
                   help="--overload: the prefill's max_running_requests (SGLang reports thousands on a large GPU)")
    p.add_argument("--hand-capacity", type=int, default=2, help="--overload: the real concurrency, set by hand for "
                   "pdgate's [admission] capacity and sglang-router's --max-concurrent-requests")
    p.add_argument("--calibrate", type=float, default=6.0, help="--overload: seconds of the capacity measurement")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--speed-change", action="store_true", help="--overload: the prefill halves its speed mid-run, "
                   "then recovers; the learned limit and goodput followed over time")
    p.add_argument("--phase-s", type=float, default=10.0, help="--speed-change: seconds of each phase")
    p.add_argument("--change-load", type=float, default=2.0, help="--speed-change: offered x capacity")
