"""``python -m loadtest bench --streams-workload``: N long-lived SSE streams at a paced token rate, per target.

Starts one fake prefill and ``--decodes`` paced fake decodes (``loadtest.fakeworker --tokens-per-s R``:
every event is stamped with its emission time) once, then, for each N of ``--streams`` and each target in
turn, on the same engines: direct (the load generator streams straight from the decodes, round robin;
the fake decode needs no prefill leg), pdgate (and ``pdgate-wK`` for each ``--pdgate-workers K`` > 1,
``pdgate serve --workers K``), sglang-router PD and SMG 1.13 PD. Each gateway is started afresh for each N (its idle
memory is then its own) and stopped after it.

Per (target, N): the N streams start evenly over ``--ramp-s`` (default max(1, N/500) s: 500 new streams a
second, so the steady window measures the relay rather than a burst of connections), each asking
``R * (ramp + duration + margin)`` tokens; the steady window opens once every stream has its first event
and lasts ``--duration`` s. The load generator (``loadtest.streamclient``, its own process) records every
event's relay delay (receive time - the engine's stamp, both CLOCK_MONOTONIC) in the window. Reported:
delay p50/p99/p99.9 and what the target ADDS over direct at the same N; CPU per relayed event (from
/proc, over the window) of the target's process tree, of the engines and of the load generator (their
sum: what an event costs the whole machine); the target's RSS (process tree) idle, before the streams,
and with the N streams live, mid-window: KB per live stream = (live - idle) / N;
errors (a non-200 answer, a connection that failed or was cut, a stream without ``[DONE]`` or with fewer
events than asked). Over the sweep, each gateway's relay capacity: the events/s (N x R) at which its p99
added delay passes ``--limit-ms`` (10 ms), interpolated linearly between sweep points ("> max" if never).
Writes ``runs/streams.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import orjson
from rich import box
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from loadtest.output import pyplot, save, write
from loadtest.procs import (
    FLOOR,
    PEERS,
    Proc,
    Stack,
    cpu_seconds,
    floor_cmd,
    free_port,
    peer_cmd,
    require_router,
    tree,
    wait_http,
    worker_tables,
)
from loadtest.streamclient import raise_nofile

RAMP_PER_S = 500  # new streams a second, by default
PING = b'{"model":"sim-model","messages":[{"role":"user","content":"ping"}],"max_tokens":1}'
QUIET_SHARE = 0.05  # a process tree using less of a core than this is idle
TICK = os.sysconf("SC_CLK_TCK")
PCTS = (("p50", "delay_p50_ms"), ("p99", "delay_p99_ms"), ("p99.9", "delay_p999_ms"))


def rss_kb(pid: int) -> int:
    """VmRSS of ``pid``'s process tree, in KiB."""
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (every core, every process: /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def cpu_of(pids: list[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def wait_quiet(pids: list[int], within: float = 15.0, step: float = 0.5) -> bool:
    """Wait until these process trees use less than ``QUIET_SHARE`` of a core (over ``step`` s)."""
    end = time.monotonic() + within
    prev, t = cpu_of(pids), time.monotonic()
    while time.monotonic() < end:
        time.sleep(step)
        cur, now = cpu_of(pids), time.monotonic()
        if (cur - prev) / (now - t) < QUIET_SHARE:
            return True
        prev, t = cur, now
    return False


def capacity(points: list[tuple[float, float | None]], limit_ms: float = 10.0) -> dict[str, Any]:
    """The events/s at which the added p99 passes ``limit_ms``, interpolated linearly between the sweep's
    points ``(events/s, added p99 ms)``: ``events_per_s`` (None when not bracketed) and a ``label``
    (the number, ``"> max"`` when never passed, ``"< min"`` when passed at the first point). A point whose delay
    is ``inf`` is one where the target fell behind (``kept_up``)."""
    pts = sorted((x, y) for x, y in points if y is not None)
    if not pts:
        return {"events_per_s": None, "label": "-"}
    if pts[0][1] > limit_ms:
        return {"events_per_s": None, "label": f"< {pts[0][0]:.0f}"}
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if y0 <= limit_ms < y1:
            if math.isinf(y1):  # it fell behind at x1 (``kept_up``): no delay to interpolate, x0 is what it held
                return {"events_per_s": round(x0, 1), "label": f">= {x0:.0f} (behind at {x1:.0f})"}
            x = x0 + (limit_ms - y0) * (x1 - x0) / (y1 - y0)
            return {"events_per_s": round(x, 1), "label": f"{x:.0f}"}
    return {"events_per_s": None, "label": f"> {pts[-1][0]:.0f}"}


def start_engines(stack: Stack, a: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    pp, bp = free_port(), free_port()
    pre = stack.spawn("prefill", [py, "-m", "loadtest.fakeworker", "--role", "prefill", "--port", str(pp)])
    decs = []
    for i in range(a.decodes):
        port = free_port()
        decs.append((port, stack.spawn(f"decode{i}", [py, "-m", "loadtest.fakeworker", "--role", "decode", "--port",
                                                      str(port), "--tokens-per-s", f"{a.tokens_per_s:g}"])))
    eng: dict[str, Any] = {"prefill": f"http://127.0.0.1:{pp}", "bootstrap_port": bp,
                           "decodes": [f"http://127.0.0.1:{port}" for port, _ in decs],
                           "pids": [pre.pid] + [p.pid for _, p in decs]}
    wait_http(eng["prefill"] + "/health", proc=pre.popen)
    for url, (_, p) in zip(eng["decodes"], decs, strict=True):
        wait_http(url + "/health", proc=p.popen)
    return eng


def target_names(a: argparse.Namespace) -> list[str]:
    names = ["direct"]
    for t in a.streams_targets:
        if t == "pdgate":
            names += ["pdgate" if w == 1 else f"pdgate-w{w}" for w in a.pdgate_workers]
        elif t not in names:
            names.append(t)
    return names


def gateway_args(name: str, eng: dict[str, Any], port: int, cfg: Path) -> list[str]:
    """The command line of gateway ``name`` (``pdgate``, ``pdgate-wK``, ``sglang-router``, ``smg``) on ``port``."""
    py = sys.executable
    if name.startswith("pdgate"):
        # the defaults but two: no access log in a benchmark; the fake engines keep no request list to reconcile with
        # (every stream holds an engine connection: the pool follows what the engine runs, no setting needed)
        cfg.write_text("[gateway]\naccess_log = false\n[reconcile]\nenabled = false\n"
                       + worker_tables([(eng["prefill"], eng["bootstrap_port"])], eng["decodes"]))
        workers = int(name.split("-w", 1)[1]) if "-w" in name else 1
        return [py, "-m", "pdgate", "serve", "--config", str(cfg), "--port", str(port), "--admin-port", str(free_port()),
                "--log-level", "WARNING"] + (["--workers", str(workers)] if workers > 1 else [])
    if name == FLOOR:
        return floor_cmd(port, eng["prefill"], eng["bootstrap_port"], eng["decodes"])
    return peer_cmd(name, port, [(eng["prefill"], eng["bootstrap_port"])], eng["decodes"])


def start_target(stack: Stack, name: str, eng: dict[str, Any]) -> tuple[str, Proc]:
    """Start one gateway on the engines and wait until it relays a request; RuntimeError (with the last line of
    its log) if it exits first or never answers."""
    port = free_port()
    args = gateway_args(name, eng, port, stack.tmp / f"{name}.toml")
    p = stack.spawn(f"{name}-{port}", args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/v1/chat/completions", timeout=60, proc=p.popen, data=PING)
    except (RuntimeError, TimeoutError) as exc:
        stack.stop(p)
        lines = [ln for ln in p.logs().strip().splitlines() if ln.strip()]
        raise RuntimeError(f"{exc}" + (f"; its log ends: {lines[-1].strip()}" if lines else "")) from exc
    return url, p


def read_phase(out: IO[bytes]) -> dict[str, Any]:
    line = out.readline()
    if not line:
        raise RuntimeError("the stream client ended early (see its log)")
    return dict(orjson.loads(line))


def measure(a: argparse.Namespace, eng: dict[str, Any], urls: list[str], proc: Proc | None, n: int,
            on_phase: Any = None) -> dict[str, Any]:
    """One (target, N): idle RSS, the streams, CPU over the window, live RSS mid-window."""
    rate = a.tokens_per_s
    ramp = a.ramp_s if a.ramp_s is not None else max(1.0, n / RAMP_PER_S)
    margin = max(a.margin_s, 3.0 / rate)
    max_tokens = math.ceil(rate * (ramp + a.duration + margin))
    quiet = wait_quiet([proc.pid]) if proc is not None else True
    idle = rss_kb(proc.pid) if proc is not None else 0
    args = [sys.executable, "-m", "loadtest.streamclient", *[x for u in urls for x in ("--url", u)], "--streams", str(n),
            "--ramp-s", f"{ramp:g}", "--max-tokens", str(max_tokens), "--duration", f"{a.duration:g}",
            "--tokens-per-s", f"{rate:g}"]
    log = open(a.tmp / f"client-{n}-{len(os.listdir(a.tmp))}.log", "wb")  # closed below
    client = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log)
    # the client ends itself past its streams' end; this is the backstop
    guard = threading.Timer(ramp + max_tokens / rate + a.duration + 60, client.kill)
    guard.start()
    try:
        assert client.stdout is not None
        samples: dict[str, tuple[float, float, float, float, float]] = {}
        live: int | None = None  # the target's RSS mid-window (none if every stream ended before)
        live_streams: dict[str, int] = {}
        while True:
            ev = read_phase(client.stdout)
            kind = ev["event"]
            if on_phase is not None:
                on_phase(kind)
            if kind in ("window_start", "mid", "window_end"):
                live_streams[kind] = ev["live"]
            if kind in ("window_start", "window_end"):
                samples[kind] = (time.monotonic(), cpu_seconds(proc.pid) if proc is not None else 0.0,
                                 cpu_of(eng["pids"]), cpu_seconds(client.pid), machine_busy_s())
            elif kind == "mid":
                live = rss_kb(proc.pid) if proc is not None else 0
            elif kind == "result":
                res = ev
                break
        client.wait(30)
    finally:
        guard.cancel()
        if client.poll() is None:
            client.kill()
            client.wait(5)
        if client.stdout is not None:
            client.stdout.close()
        log.close()
    for k in ("event", "t_ns"):
        res.pop(k, None)
    none = (0.0, 0.0, 0.0, 0.0, 0.0)
    (t0, tc0, ec0, cc0, mb0), (t1, tc1, ec1, cc1, mb1) = samples.get("window_start", none), samples.get("window_end", none)
    span = max(t1 - t0, 1e-6)
    ev_rate = res["window_events"] / res["window_s"] if res["window_s"] else 0.0

    def per_event(cpu: float) -> float | None:
        return round(cpu / span / ev_rate * 1e6, 2) if ev_rate else None

    # streams live (answer head in, not ended) when the window opened, mid-window and when it closed: N, unless
    # streams failed or the window opened so late that some had ended (then raise --margin-s)
    res.update({"events_per_s_offered": round(n * rate, 1), "live_at_window_start": live_streams.get("window_start"),
                "live_at_mid": live_streams.get("mid"), "live_at_window_end": live_streams.get("window_end"),
                "engines_cpu_us_per_event": per_event(ec1 - ec0), "client_cpu_us_per_event": per_event(cc1 - cc0),
                "engines_cpu_share": round((ec1 - ec0) / span, 3), "client_cpu_share": round((cc1 - cc0) / span, 3),
                # every process on the machine, ours or not (in cores): what is not ours in it is noise
                "machine_busy_cores": round((mb1 - mb0) / span, 3)})
    if proc is not None:
        res.update({"target_cpu_us_per_event": per_event(tc1 - tc0), "target_cpu_share": round((tc1 - tc0) / span, 3),
                    "idle_rss_kb": idle, "live_rss_kb": live, "target_quiet_before": quiet,
                    "kb_per_stream": round((live - idle) / n, 2) if live is not None else None})
    parts = [res.get("target_cpu_us_per_event") or 0.0, res["engines_cpu_us_per_event"] or 0.0,
             res["client_cpu_us_per_event"] or 0.0]
    res["machine_cpu_us_per_event"] = round(sum(parts), 2) if ev_rate else None
    ours = res["engines_cpu_share"] + res["client_cpu_share"] + res.get("target_cpu_share", 0.0)
    res["others_cpu_cores"] = round(max(0.0, res["machine_busy_cores"] - ours), 3)
    return res


def medians(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per target and N, the median over repeats of every number (the first run's other fields)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, by_n in runs.items():
        for n, ms in by_n.items():
            m = dict(ms[0])
            for k, v in ms[0].items():
                vals = [r.get(k) for r in ms]
                nums = [float(x) for x in vals if isinstance(x, (int, float)) and not isinstance(x, bool)]
                if isinstance(v, (int, float)) and not isinstance(v, bool) and len(nums) == len(ms):
                    m[k] = statistics.median(nums)
            m["kept_up"] = sum(1 for r in ms if kept_up(r)) * 2 > len(ms)  # in most of the repeats
            out.setdefault(name, {})[n] = m
    return out


def kept_up(m: dict[str, Any]) -> bool:
    """Whether the target relayed what was offered: every stream live through the window, no error, and at
    least 95% of the offered events/s. A target that fell behind is past its capacity, whatever its delay says
    (the delays of the events it did relay)."""
    n = int(m.get("streams") or 0)
    return (not m.get("errors") and m.get("live_at_window_start") == n and m.get("live_at_window_end") == n
            and float(m.get("window_events_per_s") or 0) >= 0.95 * float(m.get("events_per_s_offered") or 0))


def summarize(results: dict[str, dict[str, dict[str, Any]]], limit_ms: float) -> dict[str, dict[str, Any]]:
    """Delay added over direct at the same N, per percentile, and each gateway's relay capacity."""
    direct = results.get("direct", {})
    caps: dict[str, dict[str, Any]] = {}
    for name, by_n in results.items():
        for n, m in by_n.items():
            base = direct.get(n)
            for short, key in PCTS:
                added = f"added_{short.replace('.', '')}_ms"
                if base is not None and m.get(key) is not None and base.get(key) is not None:
                    m[added] = round(m[key] - base[key], 3)
                else:
                    m[added] = None
        if name != "direct":
            caps[name] = capacity([(m["events_per_s_offered"], m.get("added_p99_ms") if m.get("kept_up", True)
                                    else math.inf) for m in by_n.values()], limit_ms)
    return caps


def print_table(console: Console, out: dict[str, Any]) -> None:
    """Three tables, each within 80 columns."""
    def f(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    width = max([len(n) for n in out["results"]] + [6])
    rows = [(n, name, by_n[str(n)]) for n in out["streams"] for name, by_n in out["results"].items() if str(n) in by_n]
    d = Table(title=f"relay delay, ms ({out['tokens_per_s']:g} tokens/s per stream, {out['duration_s']:g} s window; "
                    "+: added over direct)", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for col in ("N", "target", "p50", "p99", "p99.9", "+p50", "+p99", "+p99.9", "errors"):
        d.add_column(col, justify="left" if col == "target" else "right", no_wrap=True,
                     min_width=width if col == "target" else None)
    for n, name, m in rows:
        added = ["-"] * 3 if name == "direct" else [f(m[f"added_{k}_ms"], "+.2f") for k in ("p50", "p99", "p999")]
        d.add_row(str(n), name, f(m["delay_p50_ms"]), f(m["delay_p99_ms"]), f(m["delay_p999_ms"]), *added,
                  str(m["errors"]) + ("" if m.get("kept_up", True) else " behind"))
    console.print(d)
    c = Table(title="CPU µs per relayed event: the target, engines, load generator, all; others: cores "
                    "busy outside the run; the target's idle RSS and KB per live stream", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for col in ("N", "target", "ev/s", "own", "engines", "client", "all", "others", "idle MB", "KB"):
        c.add_column(col, justify="left" if col == "target" else "right", no_wrap=True,
                     min_width=width if col == "target" else None)
    for n, name, m in rows:
        c.add_row(str(n), name, f(m["window_events_per_s"], ".0f"), f(m.get("target_cpu_us_per_event"), ".1f"),
                  f(m["engines_cpu_us_per_event"], ".1f"), f(m["client_cpu_us_per_event"], ".1f"),
                  f(m["machine_cpu_us_per_event"], ".1f"), f(m["others_cpu_cores"]),
                  f(m["idle_rss_kb"] / 1024, ".1f") if "idle_rss_kb" in m else "-", f(m.get("kb_per_stream"), ".1f"))
    console.print(c)
    k = Table(title=f"relay capacity: events/s where the p99 added passes {out['limit_ms']:g} ms", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    k.add_column("target", no_wrap=True)
    k.add_column("events/s", justify="right")
    for name, cap in out["capacity"].items():
        k.add_row(name, cap["label"])
    for name in out["skipped"]:
        k.add_row(name, "skipped")
    console.print(k)
    for name, why in out["skipped"].items():
        console.print(f"{name} skipped: {why}", markup=False)


def plot(out: dict[str, Any], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    res: dict[str, dict[str, dict[str, Any]]] = out["results"]
    names = list(res)
    gws = [n for n in names if n != "direct"]
    limit = out.get("limit_ms", 10.0)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (cpu_ax, delay_ax), (mem_ax, bar_ax) = axes

    def series(name: str, key: str, x: str = "events_per_s_offered") -> tuple[list[float], list[float]]:
        pts = sorted((m[x], m[key]) for m in res[name].values() if m.get(key) is not None)
        return [p[0] for p in pts], [p[1] for p in pts]

    for name in names:
        color = f"C{names.index(name)}"
        if name != "direct":
            cpu_ax.plot(*series(name, "target_cpu_us_per_event"), "o-", color=color, label=f"{name}: its own")
        cpu_ax.plot(*series(name, "machine_cpu_us_per_event"), "s--", color=color, alpha=0.6,
                    label=f"{name}: every process")
    cpu_ax.set_title("CPU per relayed event (solid: the target, dashed: every process)", fontsize=9)
    cpu_ax.set_xlabel("events/s (streams x tokens/s)")
    cpu_ax.set_ylabel("CPU µs per relayed event")

    for name in gws:
        color = f"C{names.index(name)}"
        delay_ax.plot(*series(name, "added_p99_ms"), "o-", color=color, label=f"{name} p99")
        delay_ax.plot(*series(name, "added_p50_ms"), "^:", color=color, alpha=0.7, label=f"{name} p50")
    delay_ax.axhline(limit, color="gray", ls="--", lw=1, label=f"{limit:g} ms limit")
    delay_ax.set_title("relay delay added over direct at the same N", fontsize=9)
    delay_ax.set_xlabel("events/s (streams x tokens/s)")
    delay_ax.set_ylabel("delay added over direct (ms, log above 1)")
    delay_ax.set_yscale("symlog", linthresh=1.0)  # sub-ms and seconds on one axis

    for name in gws:
        mem_ax.plot(*series(name, "kb_per_stream", "streams"), "o-", color=f"C{names.index(name)}", label=name)
    mem_ax.set_title("target memory per live stream ((live RSS - idle RSS) / N)", fontsize=9)
    mem_ax.set_xlabel("live streams")
    mem_ax.set_ylabel("KB per live stream")

    head = str(out.get("headline_streams") or max(out.get("streams") or [0]))
    shown = [n for n in gws if head in res[n]]
    width = 0.8 / len(PCTS)
    for i, (short, _) in enumerate(PCTS):
        key = f"added_{short.replace('.', '')}_ms"
        bar_ax.bar([j + i * width for j in range(len(shown))], [res[n][head].get(key) or 0.0 for n in shown], width,
                   color=f"C{i}", alpha=1.0 - 0.25 * i, label=f"{short} added")
    bar_ax.set_xticks([j + width for j in range(len(shown))], shown)
    bar_ax.axhline(limit, color="gray", ls="--", lw=1, label=f"{limit:g} ms limit")
    bar_ax.set_title(f"delay added over direct at {head} streams", fontsize=9)
    bar_ax.set_xlabel("target")
    bar_ax.set_ylabel("delay added over direct (ms)")
    for ax in axes.flat:
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{out.get('tokens_per_s', 0):g} tokens/s per stream through each target, on the same paced fake engines",
                 fontsize=10)
    fig.tight_layout()
    save(fig, path)


def run(a: argparse.Namespace) -> dict[str, Any]:
    if min(a.pdgate_workers) < 1 or min(a.streams) < 1 or a.tokens_per_s <= 0 or a.decodes < 1:
        raise SystemExit("bench --streams-workload: --pdgate-workers, --streams, --decodes must be >= 1 and "
                         "--tokens-per-s > 0")
    if a.out == "runs/bench.json":
        a.out = "runs/streams.json"
    names = target_names(a)
    if any(n in PEERS for n in names):
        require_router()
    raise_nofile()  # the children inherit it
    console = Console()
    a.tmp = Path(tempfile.mkdtemp(prefix="pdgate-streams-"))
    stack = Stack(a.tmp)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}  # every repeat (--repeats), medians in results
    skipped: dict[str, str] = {}
    try:
        eng = start_engines(stack, a)
        with Progress(console=console) as bar:
            job: TaskID = bar.add_task("streams", total=len(a.streams) * len(names) * a.repeats)
            for n, rep, name in ((n, rep, name) for n in a.streams for rep in range(a.repeats) for name in names):
                if name in skipped:
                    bar.advance(job)
                    continue
                desc = f"{n} streams, {name}" + (f" #{rep + 1}" if a.repeats > 1 else "")
                bar.update(job, description=f"{desc}: starting")
                proc: Proc | None = None
                if name == "direct":
                    urls = eng["decodes"]
                else:
                    try:
                        url, proc = start_target(stack, name, eng)
                    except RuntimeError as exc:  # it exited at start (or never answered): the rest goes on
                        skipped[name] = str(exc)
                        console.print(f"[yellow]skipping {name}[/]: {skipped[name]}")
                        bar.advance(job)
                        continue
                    urls = [url]

                def phase(kind: str, desc: str = desc) -> None:
                    bar.update(job, description=f"{desc}: {kind.replace('_', ' ')}")

                try:
                    m = measure(a, eng, urls, proc, n, phase)
                    runs.setdefault(name, {}).setdefault(str(n), []).append(m)
                finally:
                    if proc is not None:
                        stack.stop(proc)
                if m["errors"] or m["live_at_window_end"] != n:
                    console.print(f"[yellow]{desc}[/]: {m['errors']} streams failed {m['error_kinds']}, "
                                  f"{m['live_at_window_end']} live at the window's end")
                bar.update(job, description=f"{desc}: waiting for the engines to be idle")
                wait_quiet(eng["pids"])
                bar.advance(job)
    finally:
        stack.close()
    results.update(medians(runs))
    caps = summarize(results, a.limit_ms)
    out = {"command": " ".join(sys.argv), "tokens_per_s": a.tokens_per_s, "duration_s": a.duration,
           "decodes": a.decodes, "streams": a.streams, "headline_streams": a.headline or max(a.streams),
           "limit_ms": a.limit_ms, "cores": os.cpu_count(), "targets": [n for n in names if n in results],
           "skipped": skipped, "logs": str(a.tmp), "repeats": a.repeats, "results": results, "capacity": caps,
           "raw": runs}
    print_table(console, out)
    write(out, a.out, plot)
    console.print(f"wrote {a.out} and {Path(a.out).with_suffix('.png')}")
    return out


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams-workload", action="store_true",
                   help="N long-lived paced SSE streams per target: relay delay added, CPU per event, KB per stream, "
                        "relay capacity (loadtest/streams.py; writes runs/streams.json)")
    p.add_argument("--streams", type=int, nargs="+", default=[250, 500, 1000, 2000], metavar="N",
                   help="--streams-workload: the sweep of live streams")
    p.add_argument("--tokens-per-s", type=float, default=10.0, help="--streams-workload: each stream's events per second")
    p.add_argument("--decodes", type=int, default=2, help="--streams-workload: fake decode engines")
    p.add_argument("--ramp-s", type=float, default=None,
                   help="--streams-workload: the streams start evenly over this long (default max(1, N/1000) s)")
    p.add_argument("--margin-s", type=float, default=3.0,
                   help="--streams-workload: each stream lasts ramp + duration + this (tokens asked: rate x that)")
    p.add_argument("--headline", type=int, default=None,
                   help="--streams-workload: the N of the bar panel (default the largest)")
    p.add_argument("--limit-ms", type=float, default=10.0,
                   help="--streams-workload: relay capacity is where the p99 added over direct passes this")
    p.add_argument("--pdgate-workers", type=int, nargs="+", default=[1], metavar="K",
                   help="--streams-workload: pdgate once per K (K > 1: a target 'pdgate-wK', pdgate serve --workers K)")
    p.add_argument("--streams-targets", nargs="+", choices=("pdgate", *PEERS, FLOOR),
                   default=["pdgate", *PEERS],
                   help="--streams-workload: the gateways measured (direct always is: it is the baseline); "
                        f"{FLOOR}: the least a Python relay on h1lite does (benchmarks/h1lite_floor.py)")
