"""``python -m loadtest bench``: throughput and latency of gateways; ``--compare`` runs them side by side.

``--compare`` starts one prefill + one decode sim worker (``--speed 0``: free compute; or, with
``--workers fake``, zero-cost fake workers that answer at once) once,
then measures, in one run and on the same workers: direct (the load generator plays the
router and sends both legs itself), pdgate, sglang-router PD, SMG 1.13 PD and, with ``--mini-lb``,
sglang's Python mini load balancer. Workloads: closed loops at 16 and 64 connections (the most
each target serves) and open loops at 200 requests/s (Poisson arrivals, far below every
target's capacity: the latency a gateway adds over direct, without queueing for the CPU).
For each target and workload it reports requests/s,
latency percentiles, CPU per request (from /proc) of the target (its process tree), of the
two workers and of the load generator, and each result as a ratio to direct. The three CPU
figures add up to what a request costs the whole machine; at ``cores * 1e6 / that`` req/s
every core is busy, so a result near this bound is CPU-bound, and two targets that are both
CPU-bound can differ in req/s by at most the ratio of their totals. Writes JSON and a PNG.

``--compare --workers vllm``: the same on a real vLLM PD pair on this CPU (``engine/vllm``, the tiny model; installed
by ``bash engine/vllm/install.sh``), started once through the supervisor: direct (the load generator does as vLLM's
toy proxy: the prefill with ``kv_transfer_params``, then the decode), pdgate, and SMG (``smg launch
--pd-disaggregation``, which relays vLLM's ``kv_transfer_params``); sglang-router does not speak vLLM's PD.
Workloads ns4, s4 (4 connections: the engines run 8 at most) and ns2rps (2 requests/s). The pair's NIXL progress
threads keep both cores busy (docs/fidelity.md): every run on it is on a busy machine, and says so.

``--streams-workload`` (loadtest/streams.py): N long-lived SSE streams at ``--tokens-per-s`` each (default
10) through direct, pdgate, sglang-router and SMG on paced fake engines, for each N of ``--streams``
(default 250 500 1000 2000): the relay delay each target adds over direct (p50/p99/p99.9), CPU per
relayed event, KB per live stream, errors, and the events/s at which the p99 added passes 10 ms.
``--overload`` (loadtest/overload.py): goodput under overload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from loadtest import overload, streams
from loadtest.output import pyplot, save, write
from loadtest.procs import (
    FLOOR,
    KNOCKED,
    PEERS,
    ROOT,
    Proc,
    Stack,
    cpu_seconds,
    floor_cmd,
    free_port,
    knockout_names,
    peer_cmd,
    require_router,
    wait_http,
)
from pdgate.planes.views import layout

PING = b'{"model":"sim-model","messages":[{"role":"user","content":"ping"}],"max_tokens":1}'
CORES = os.cpu_count() or 1
# name -> (connections, streaming, rate): closed loops find the most each target serves; the paced ones
# (open loop, Poisson arrivals, far below every target's capacity) show the latency a gateway adds
WORKLOADS = {"ns16": (16, False, 0.0), "ns64": (64, False, 0.0), "s64": (64, True, 0.0),
             "ns200rps": (0, False, 200.0), "s200rps": (0, True, 200.0),
             # a real vLLM pair on this CPU (--workers vllm): a few at once, and a rate it serves
             "ns4": (4, False, 0.0), "s4": (4, True, 0.0), "ns2rps": (0, False, 2.0)}
VLLM_WORKLOADS = ["ns4", "s4", "ns2rps"]
VLLM_MODEL = "tiny-llama"


def is_paced(workload: str) -> bool:
    return workload in WORKLOADS and WORKLOADS[workload][2] > 0


def gen(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "loadtest.gen", *args], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def start_targets(stack: Stack, mini_lb: bool, fake: bool = False, floor: bool = False, knockout: str = "") -> tuple[
        dict[str, Any], dict[str, tuple[str, Proc | None]]]:
    require_router()
    py = sys.executable
    pp, bp, dp = free_port(), free_port(), free_port()
    if fake:  # zero-cost workers: the gateways, not the workers, bound throughput
        pre = stack.spawn("prefill", [py, "-m", "loadtest.fakeworker", "--role", "prefill", "--port", str(pp)])
        dec = stack.spawn("decode", [py, "-m", "loadtest.fakeworker", "--role", "decode", "--port", str(dp)])
    else:
        pre = stack.spawn("prefill", [py, "-m", "engine.sim", "--role", "prefill", "--port", str(pp),
                                      "--bootstrap-port", str(bp), "--speed", "0", "--log-level", "WARNING"])
        dec = stack.spawn("decode", [py, "-m", "engine.sim", "--role", "decode", "--port", str(dp), "--speed", "0",
                                     "--log-level", "WARNING"])
    workers: dict[str, Any] = {"prefill": f"http://127.0.0.1:{pp}", "bootstrap_port": bp,
                               "decode": f"http://127.0.0.1:{dp}", "pids": [pre.pid, dec.pid]}
    wait_http(workers["prefill"] + "/health", proc=pre.popen)
    wait_http(workers["decode"] + "/health", proc=dec.popen)
    targets: dict[str, tuple[str, Proc | None]] = {"direct": ("", None)}
    gp = free_port()
    g = stack.spawn("pdgate", [py, "-m", "pdgate", "serve", "--port", str(gp), "--admin-port", str(free_port()),
                               "--prefill", workers["prefill"], str(bp),
                               "--decode", workers["decode"], "--log-level", "WARNING"])
    targets["pdgate"] = (f"http://127.0.0.1:{gp}", g)
    for name in (*PEERS, *(("mini_lb",) if mini_lb else ())):  # SMG 1.13 and sglang-router on their defaults
        rp = free_port()
        r = stack.spawn(name, peer_cmd(name, rp, [(workers["prefill"], bp)], [workers["decode"]]))
        targets[name] = (f"http://127.0.0.1:{rp}", r)
    if floor:  # the least a Python PD relay on h1lite does (benchmarks/h1lite_floor.py): what pdgate's features cost
        fp = free_port()
        targets[FLOOR] = (f"http://127.0.0.1:{fp}", stack.spawn(FLOOR, floor_cmd(fp, workers["prefill"], bp,
                                                                                  [workers["decode"]])))
    if knockout:  # pdgate with those features' per-request work replaced by nothing: what is left when they are gone
        kp = free_port()
        targets[KNOCKED] = (f"http://127.0.0.1:{kp}", stack.spawn(KNOCKED, [
            py, str(ROOT / "scripts" / "knockout_serve.py"), "serve", "--port", str(kp), "--admin-port", str(free_port()),
            "--prefill", workers["prefill"], str(bp), "--decode", workers["decode"], "--log-level", "WARNING"],
            env={"KNOCK": knockout}))
    for url, proc in targets.values():
        if url:
            wait_http(url + "/v1/chat/completions", timeout=60, proc=proc.popen if proc else None, data=PING)
    return workers, targets


def start_vllm_targets(stack: Stack, tmp: Path) -> tuple[dict[str, Any], dict[str, tuple[str, Proc | None]]]:
    """A real vLLM pair (through the supervisor, as ``pdgate up`` runs it), pdgate and SMG in front of it."""
    py = sys.executable
    pp, dp = free_port(), free_port()
    cluster = tmp / "cluster.vllm.toml"
    cluster.write_text(f'[cluster]\nlog_dir = "{tmp}/engines"\nready_timeout_s = 300\n'
                       f'[[worker]]\nname = "vllm-prefill"\nengine = "vllm"\nrole = "prefill"\nport = {pp}\ncpu = 0\n'
                       f'side_channel_port = {free_port()}\n'
                       f'[[worker]]\nname = "vllm-decode"\nengine = "vllm"\nrole = "decode"\nport = {dp}\ncpu = 1\n'
                       f'side_channel_port = {free_port()}\n')
    sup = stack.spawn("engines", [py, "-m", "engine.supervisor", "--cluster", str(cluster)])
    workers: dict[str, Any] = {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}",
                               "pids": [sup.pid], "direct": "direct-vllm", "model": VLLM_MODEL}
    wait_http(workers["prefill"] + "/health", timeout=300, proc=sup.popen)
    wait_http(workers["decode"] + "/health", timeout=300, proc=sup.popen)
    targets: dict[str, tuple[str, Proc | None]] = {"direct": ("", None)}
    gp = free_port()
    cfg = tmp / "pdgate.toml"
    cfg.write_text(f'[gateway]\nport = {gp}\nadmin_port = {free_port()}\nstate_dir = "{tmp}/state"\n'
                   f'[[prefill]]\nurl = "{workers["prefill"]}"\nengine = "vllm"\n'
                   f'[[decode]]\nurl = "{workers["decode"]}"\nengine = "vllm"\n')
    g = stack.spawn("pdgate", [py, "-m", "pdgate", "serve", "--config", str(cfg), "--log-level", "WARNING"])
    targets["pdgate"] = (f"http://127.0.0.1:{gp}", g)
    require_router()
    sp = free_port()
    targets["smg"] = (f"http://127.0.0.1:{sp}", stack.spawn("smg", peer_cmd(
        "smg", sp, [(workers["prefill"], None)], [workers["decode"]])))
    ping = PING.replace(b"sim-model", VLLM_MODEL.encode())
    for url, proc in targets.values():  # the first transfer makes NIXL's handshake (up to ~35 s here)
        if url:
            wait_http(url + "/v1/chat/completions", timeout=180, proc=proc.popen if proc else None, data=ping)
    return workers, targets


def measure(workers: dict[str, Any], url: str, proc: Proc | None, conc: int, stream: bool, duration: float,
            rate: float = 0, slo: tuple[float, float] = (500.0, 2000.0)) -> dict[str, Any]:
    args = ["--concurrency", str(conc), "--duration", str(duration), "--rate", str(rate), "--slo-ttft-ms", str(slo[0]),
            "--slo-total-ms", str(slo[1]), "--model", workers.get("model", "sim-model")] + (["--stream"] if stream else [])
    if url:
        args += ["--mode", "gateway", "--url", url]
    elif workers.get("direct") == "direct-vllm":
        args += ["--mode", "direct-vllm", "--prefill", workers["prefill"], "--decode", workers["decode"]]
    else:
        args += ["--mode", "direct", "--prefill", workers["prefill"], "--bootstrap-port", str(workers["bootstrap_port"]),
                 "--decode", workers["decode"]]
    pids = workers.get("pids", [])
    cpu0 = cpu_seconds(proc.pid) if proc else 0.0
    w0 = sum(cpu_seconds(pid) for pid in pids)
    t0 = time.monotonic()
    res = gen(args)
    total = time.monotonic() - t0
    n_total = max(res["ok"] * total / max(res["seconds"], 1e-9), 1)  # include warm-up requests in the CPU shares
    if proc is not None:
        cpu = cpu_seconds(proc.pid) - cpu0
        res["target_cpu_us_per_req"] = round(cpu / n_total * 1e6, 1)
        res["target_cpu_share"] = round(cpu / total, 3)
    if pids:  # what the engines and the load generator cost per request: the rest of the machine's CPU
        res["workers_cpu_us_per_req"] = round((sum(cpu_seconds(pid) for pid in pids) - w0) / n_total * 1e6, 1)
    res["generator_cpu_us_per_req"] = round(res["generator_cpu_s"] / n_total * 1e6, 1)
    return res


def compare(a: argparse.Namespace) -> dict[str, Any]:
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="pdgate-bench-"))
    stack = Stack(tmp)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        if a.workers == "vllm":
            workers, targets = start_vllm_targets(stack, tmp)
            if a.workloads == list(WORKLOADS):
                a.workloads = VLLM_WORKLOADS
        else:
            workers, targets = start_targets(stack, a.mini_lb, a.workers == "fake", a.floor, a.knockout)
        # targets alternate within each workload and repeat, so a slow moment of the machine is shared
        runs = [(w, t, r) for r in range(a.repeats) for w in a.workloads
                for t in (list(targets) if r % 2 == 0 else list(reversed(targets)))]
        with Progress(console=console) as bar:
            job = bar.add_task("bench", total=len(runs))
            for wl, name, rep in runs:
                conc, stream, rate = WORKLOADS[wl]
                bar.update(job, description=f"{wl} {name} #{rep + 1}")
                url, proc = targets[name]
                res = measure(workers, url, proc, conc, stream, a.duration, rate, (a.slo_ttft_ms, a.slo_total_ms))
                results.setdefault(wl, {}).setdefault(name, []).append(res)
                bar.advance(job)
    finally:
        stack.close()
    summary = summarize(results)
    out = {"command": " ".join(sys.argv), "workers": a.workers, "duration_s": a.duration, "repeats": a.repeats,
           "slo": {"ttft_ms": a.slo_ttft_ms, "total_ms": a.slo_total_ms}, "logs": str(tmp),
           "results": summary, "raw": results}
    print_table(console, summary, "PD gateways on the same " + {"fake": "zero-cost fake workers",
                                                                 "vllm": "real vLLM PD pair (CPU, busy: docs/fidelity.md)"}
                .get(a.workers, "sim workers (speed 0)")
                + f"; goodput: TTFT <= {a.slo_ttft_ms:g} ms and total <= {a.slo_total_ms:g} ms")
    write(out, a.out, lambda _, png: plot(summary, png))
    console.print(f"wrote {a.out} and {Path(a.out).with_suffix('.png')}")
    return out


def summarize(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Median over repeats; ratios to direct."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for wl, by_target in results.items():
        out[wl] = {}
        for name, runs in by_target.items():
            keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
            out[wl][name] = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
        direct = out[wl].get("direct", {})
        base = direct.get("rps") or 0
        for m in out[wl].values():
            m["rps_vs_direct"] = round(m["rps"] / base, 3) if base else None
            for k in ("p50_ms", "p99_ms", "ttft_p50_ms"):  # latency added over direct (meaningful when paced)
                if k in direct:
                    m[k.replace("_ms", "_added_ms")] = round(m[k] - direct[k], 3)
            parts = ("target_cpu_us_per_req", "workers_cpu_us_per_req", "generator_cpu_us_per_req")
            if "workers_cpu_us_per_req" in m:  # every process of the run: what bounds req/s when the cores are full
                m["machine_cpu_us_per_req"] = round(sum(m.get(k, 0.0) for k in parts), 1)
                if not is_paced(wl):  # paced runs are not at a bound; idle wake-ups count
                    m["cpu_bound_rps"] = round(CORES * 1e6 / m["machine_cpu_us_per_req"], 1)
    return out


def print_table(console: Console, summary: dict[str, dict[str, dict[str, Any]]], title: str) -> None:
    """As the CLI lays tables out (``pdgate.planes.views.layout``): every value whole; where the columns do not fit the
    terminal (or a pipe's 80 columns), one record per row."""
    cols = ["target", "workload", "req/s", "goodput req/s", "tok/s", "goodput tok/s", "vs direct", "p50 ms", "p99 ms",
            "p50 +ms over direct", "ttft p50 ms", "target CPU µs/req", "workers CPU µs/req", "gen CPU µs/req", "all CPU µs/req", "CPU-bound req/s", "errors"]
    rows: list[list[Any]] = []
    for wl, by in summary.items():
        for name, m in by.items():
            added = f"{m['p50_added_ms']:+.1f}" if "p50_added_ms" in m and name != "direct" else "-"
            rows.append([name, wl, f"{m['rps']:.0f}", f"{m.get('goodput_rps', 0):.0f}", f"{m.get('tokens_s', 0):.0f}",
                      f"{m.get('goodput_tokens_s', 0):.0f}",
                      "-" if m.get("rps_vs_direct") is None else f"{m['rps_vs_direct']:.2f}", f"{m['p50_ms']:.1f}",
                      f"{m['p99_ms']:.1f}",
                      added, f"{m['ttft_p50_ms']:.1f}",
                      str(m.get("target_cpu_us_per_req", "-")), str(m.get("workers_cpu_us_per_req", "-")),
                      str(m.get("generator_cpu_us_per_req", "-")), str(m.get("machine_cpu_us_per_req", "-")),
                      f"{m['cpu_bound_rps']:.0f}" if "cpu_bound_rps" in m else "-", str(int(m["errors"]))])
    console.print(layout(title, cols, rows, console.width))


def plot(summary: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    wls = list(summary)
    names = list(next(iter(summary.values())))
    names = [n for n in names if all(n in summary[w] for w in wls)]
    machine = all("machine_cpu_us_per_req" in summary[w][n] for w in wls for n in names)
    paced = [w for w in wls if is_paced(w) and "direct" in summary[w]]
    panels = 2 + machine + bool(paced)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    width = 0.8 / len(names)
    titles = ["requests/s (higher is better)", "target CPU µs per request (lower is better)"]
    ylabels = ["requests per second", "CPU of the target (µs per request)"]
    for i, n in enumerate(names):
        xs = [j + i * width for j in range(len(wls))]
        axes[0].bar(xs, [summary[w][n]["rps"] for w in wls], width, label=n)
        axes[1].bar(xs, [summary[w][n].get("target_cpu_us_per_req", 0) for w in wls], width, label=n)
    if machine:  # what a request costs the whole machine, stacked: target, workers, load generator
        titles.append("all processes' CPU µs per request (target / workers / generator)")
        ylabels.append("CPU of every process (µs per request)")
        for i, n in enumerate(names):
            xs = [j + i * width for j in range(len(wls))]
            bottom = [0.0] * len(wls)
            for key, shade, part in (("target_cpu_us_per_req", 1.0, "target"), ("workers_cpu_us_per_req", 0.6, "workers"),
                                     ("generator_cpu_us_per_req", 0.3, "generator")):
                vals = [summary[w][n].get(key, 0.0) for w in wls]
                axes[2].bar(xs, vals, width, bottom=bottom, color=f"C{i}", alpha=shade, label=f"{n}: {part}")
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if paced:  # what each gateway adds over direct where nobody queues for the CPU: p50 solid, p99 light
        ax = axes[-1]
        others = [n for n in names if n != "direct"]
        w2 = 0.8 / len(others)
        for i, n in enumerate(others):
            xs = [j + i * w2 for j in range(len(paced))]
            color = f"C{names.index(n)}"
            ax.bar(xs, [summary[w][n]["p99_added_ms"] for w in paced], w2, color=color, alpha=0.35, label=f"{n} p99")
            ax.bar(xs, [summary[w][n]["p50_added_ms"] for w in paced], w2, color=color, label=f"{n} p50")
        ax.set_xticks([j + 0.4 - w2 / 2 for j in range(len(paced))], paced)
        ax.set_title("ms added over direct, paced (p50 solid, p99 light)", fontsize=9)
        ax.set_ylabel("latency added over direct (ms)")
        ax.set_xlabel("workload")
    for ax, title, ylabel in zip(axes, titles, ylabels, strict=False):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wls))], wls)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("workload")
    for ax in axes:
        ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    save(fig, path)


def targets_run(a: argparse.Namespace) -> dict[str, Any]:
    """Measure the given gateway URLs as they are (no processes started)."""
    console = Console()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    wl = f"{'s' if a.stream else 'ns'}{a.rate:g}rps" if a.rate else f"{'s' if a.stream else 'ns'}{a.concurrency}"
    with Progress(console=console) as bar:
        job = bar.add_task("bench", total=len(a.target) * a.repeats)
        for rep in range(a.repeats):
            for url in a.target:
                bar.update(job, description=f"{wl} {url} #{rep + 1}")
                res = measure({}, url.rstrip("/"), None, a.concurrency, a.stream, a.duration, a.rate,
                              (a.slo_ttft_ms, a.slo_total_ms))
                results.setdefault(wl, {}).setdefault(url, []).append(res)
                bar.advance(job)
    summary = summarize(results)
    out = {"command": " ".join(sys.argv), "slo": {"ttft_ms": a.slo_ttft_ms, "total_ms": a.slo_total_ms},
           "results": summary, "raw": results}
    cols = ["target", "req/s", "goodput req/s", "tok/s", "goodput tok/s", "p50 ms", "p99 ms", "ttft p50 ms",
            "ttft p99 ms", "tpot p50 ms", "tpot p99 ms", "errors", "gen CPU"]
    rows = [[url, f"{m['rps']:.0f}", f"{m['goodput_rps']:.0f}", f"{m['tokens_s']:.0f}", f"{m['goodput_tokens_s']:.0f}",
             str(m["p50_ms"]), str(m["p99_ms"]), str(m["ttft_p50_ms"]), str(m["ttft_p99_ms"]), str(m["tpot_p50_ms"]),
             str(m["tpot_p99_ms"]), str(int(m["errors"])), f"{m['generator_cpu_share']:.2f}"]
            for url, m in summary[wl].items()]
    console.print(layout(f"bench {wl}; goodput: TTFT <= {a.slo_ttft_ms:g} ms and total <= {a.slo_total_ms:g} ms",
                         cols, rows, console.width))
    write(out, a.out, lambda _, png: plot(summary, png))
    return out


def check_knockout(a: argparse.Namespace) -> None:
    """``--knockout``: names ``scripts/knockout_serve.py`` knows, on the fake or sim workers (before anything starts)."""
    if a.workers == "vllm":
        raise SystemExit("bench: --knockout runs beside the fake or sim workers only, not --workers vllm")
    known = knockout_names()
    unknown = [n for n in a.knockout.split(",") if n not in known] if a.knockout != "all" else []
    if unknown:
        raise SystemExit(f"bench: --knockout: unknown feature {unknown[0]!r} (known: {', '.join(known)}, or all)")


def run(a: argparse.Namespace) -> dict[str, Any]:
    """The workload asked for; with ``--json`` its results go to stdout as one JSON object, the tables and the
    progress to stderr (a pipe gets what it can parse)."""
    if not a.json:
        return run_one(a)
    with contextlib.redirect_stdout(sys.stderr):
        out = run_one(a)
    sys.stdout.write(json.dumps(out) + "\n")
    return out


def run_one(a: argparse.Namespace) -> dict[str, Any]:
    if a.streams_workload:
        return streams.run(a)
    if a.overload:
        if a.out == "runs/bench.json":
            a.out = "runs/overload.json"
        return overload.run(a)
    if a.compare:
        if a.knockout:
            check_knockout(a)
        return compare(a)
    if not a.target:
        raise SystemExit("bench: give --target URL (repeatable) or --compare")
    return targets_run(a)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="throughput/latency of gateways; --compare runs direct, pdgate, sglang-router and SMG "
                       "side by side; --streams-workload: many long-lived paced streams through each",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", default=[], metavar="URL", help="an OpenAI-compatible gateway (repeatable)")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop: connections")
    p.add_argument("--rate", type=float, default=0, help="open loop: requests/s (Poisson arrivals)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--compare", action="store_true",
                   help="start sim workers and measure direct, pdgate, sglang-router, SMG (and --mini-lb) on them")
    p.add_argument("--mini-lb", action="store_true", help="also measure sglang's Python mini_lb")
    p.add_argument("--floor", action="store_true",
                   help="also measure the least a Python PD relay on h1lite does (benchmarks/h1lite_floor.py)")
    p.add_argument("--knockout", default="", metavar="NAMES",
                   help=f"also measure pdgate with these features knocked out ({KNOCKED}: scripts/knockout_serve.py, "
                        "comma-separated, 'all' for every one); for measurement only")
    p.add_argument("--workers", choices=("sim", "fake", "vllm"), default="sim",
                   help="--compare on engine.sim workers at speed 0 (default), on zero-cost fake workers "
                        "(loadtest.fakeworker: the gateways bound throughput), or on a real vLLM PD pair (direct, "
                        "pdgate, SMG)")
    p.add_argument("--duration", type=float, default=10, help="seconds per measurement (--streams-workload: the steady window)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--out", default="runs/bench.json")
    p.add_argument("--json", action="store_true", help="the results as one JSON object on stdout (tables to stderr)")
    p.add_argument("--slo-ttft-ms", type=float, default=500,
                   help="goodput: requests (and tokens) whose first token came within this, ...")
    p.add_argument("--slo-total-ms", type=float, default=2000, help="... and whose whole answer within this")
    overload.add_flags(p)
    streams.add_flags(p)
    p.set_defaults(func=run)
