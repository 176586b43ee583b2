"""``python -m loadtest storm --compare``: the seed's storm through pdgate, sglang-router and SMG 1.13, each on its
defaults, on the same kind of engines, with the machine's load beside each run.

Each run gets fresh sims (one prefill, one decode: SGLang's protocol without the engine fixes, the decode dropping
every KV acknowledgement and the prefill losing the first abort of each request: the seed's pins), its gateway on
them, and ``loadtest storm`` through that gateway with the same flags and seed; then all of it stops, so no run
inherits another's pins. Targets alternate across ``--repeats`` (each repeat starts one target later), so a slow
moment of the machine is not always one target's. There is no "direct" target: a storm needs a PD front door (the
client of a direct run would play the router, as sglang-router does).

Beside each run: the load average before it and after it, and the share of the machine's CPU that processes outside
the run used meanwhile (``/proc/stat`` less the run's own process trees): a run with others busy is marked busy, not
a result. The verdict (exit status) is pdgate's: PASS only if every pdgate run passed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.output import pyplot, save
from loadtest.procs import Stack, cpu_seconds, free_port, peer_cmd, require_router, wait_http
from loadtest.streams import machine_busy_s

TARGETS = ("pdgate", "sglang-router", "smg")
# the sims' environment: a dead client is noticed within 0.3 s (that abort is the one lost), as in test_storm
SIM_ENV = {"SGLANG_REQUEST_STATE_WAIT_TIMEOUT": "0.3"}
BUSY_SHARE = 0.25  # others used more than this share of the machine's cores during a run: it is marked busy
CORES = os.cpu_count() or 1


def order(targets: list[str], repeat: int) -> list[str]:
    """The targets of repeat ``repeat``: each repeat starts one later (alternating)."""
    k = repeat % len(targets)
    return targets[k:] + targets[:k]


def start(stack: Stack, target: str) -> tuple[str, str]:
    """Fresh sims and ``target`` on them: (its front door, the prefill's metrics URL)."""
    py = sys.executable
    pp, bp, dp = free_port(), free_port(), free_port()
    pre = stack.spawn(f"{target}-prefill", [py, "-m", "engine.sim", "--role", "prefill", "--port", str(pp),
                                            "--bootstrap-port", str(bp), "--fixes", "none", "--fault", "abort_race=1",
                                            "--log-level", "WARNING"], SIM_ENV)
    dec = stack.spawn(f"{target}-decode", [py, "-m", "engine.sim", "--role", "decode", "--port", str(dp),
                                           "--fixes", "none", "--fault", "ack_loss=1", "--speed", "5",
                                           "--log-level", "WARNING"], SIM_ENV)
    prefill, decode = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    wait_http(prefill + "/health", proc=pre.popen)
    wait_http(decode + "/health", proc=dec.popen)
    gp = free_port()
    if target == "pdgate":  # its defaults (aborts on both legs, reconciliation, learned admission); its state
        # directory is the run's own: no other pdgate's record is taken for a predecessor's, nor this one's for theirs
        cfg = stack.tmp / f"pdgate-{gp}.toml"
        cfg.write_text(f'[gateway]\nstate_dir = "{stack.tmp / f"state-{gp}"}"\n')
        cmd = [py, "-m", "pdgate", "serve", "--config", str(cfg), "--port", str(gp), "--admin-port", str(free_port()),
               "--prefill", prefill, str(bp), "--decode", decode, "--log-level", "WARNING"]
    else:
        cmd = peer_cmd(target, gp, [(prefill, bp)], [decode])
    g = stack.spawn(target, cmd)
    front = f"http://127.0.0.1:{gp}"
    wait_http(front + ("/readiness" if target == "pdgate" else "/health"), timeout=60, proc=g.popen)
    return front, prefill + "/metrics"


def storm_args(a: argparse.Namespace, front: str, metrics: str, out: Path) -> argparse.Namespace:
    """The storm's own flags for one run (``compare`` off: this run is one storm)."""
    return argparse.Namespace(**{**vars(a), "compare": False, "gateway": front, "admin": None,
                                 "prefill_metrics": [metrics], "restart_decode": False, "out": str(out)})


async def compare(a: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    console = Console(stderr=True)
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    assert me is not None
    loop.add_signal_handler(signal.SIGTERM, me.cancel)  # stopped: every process of the run is stopped too
    targets = list(a.targets)
    if any(t != "pdgate" for t in targets):
        require_router()
    try:
        return await _compare(a, targets, console)
    except asyncio.CancelledError:
        raise SystemExit("loadtest storm --compare: stopped; the engines and gateways it started are stopped") from None


async def _compare(a: argparse.Namespace, targets: list[str], console: Any) -> dict[str, Any]:
    from loadtest import storm

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="storm-compare-") as tmp:
        for r in range(a.repeats):
            for target in order(targets, r):
                stack = Stack(Path(tmp))
                try:
                    console.print(f"[bold]storm {len(runs) + 1}/{a.repeats * len(targets)}: {target}[/]")
                    front, metrics = start(stack, target)
                    load0 = os.getloadavg()
                    mine0, busy0, t0 = cpu_seconds(os.getpid()), machine_busy_s(), time.monotonic()
                    out = await storm.run(storm_args(a, front, metrics, Path(tmp) / f"{target}-{r}.json"))
                    spent = time.monotonic() - t0
                    mine = cpu_seconds(os.getpid()) - mine0  # this process and everything it started (the run)
                    others = max(0.0, machine_busy_s() - busy0 - mine) / (spent * CORES)
                finally:
                    stack.close()
                checks = {c["check"]: c["ok"] for c in out["checks"]}
                peak = max((max((v or 0) for k, v in s.items() if k != "t") for s in out["samples"]), default=0)
                after = [s for s in out["samples"] if s["t"] >= out["watchdog_line"]]
                runs.append({
                    "target": target, "repeat": r, "verdict": out["verdict"], "checks": out["checks"],
                    "pins_peak": peak, "pins_left": max(((v or 0) for s in after[-1:] for k, v in s.items() if k != "t"),
                                                        default=None),
                    "outcomes": out["outcomes"], "probe_before": out["probe_before"], "probe_after": out["probe_after"],
                    "samples": out["samples"], "storm_end": out["storm_end"], "watchdog_line": out["watchdog_line"],
                    "seconds": round(spent, 1), "load_before": [round(x, 2) for x in load0],
                    "load_after": [round(x, 2) for x in os.getloadavg()], "others_cpu_share": round(others, 3),
                    "busy": others > BUSY_SHARE, "pins_cleared": checks.get("pins cleared by watchdog + grace")})
    ours = [x for x in runs if x["target"] == "pdgate"]
    return {"compare": True, "targets": targets, "repeats": a.repeats, "runs": runs,
            "settings": {k: getattr(a, k) for k in ("iterations", "instances", "watchdog", "grace", "window",
                                                   "request_timeout", "probe_timeout", "seed")},
            "sims": {"prefill": "--fixes none --fault abort_race=1", "decode": "--fixes none --fault ack_loss=1 --speed 5",
                     "env": SIM_ENV},
            "verdict": "PASS" if ours and all(x["verdict"] == "PASS" for x in ours) else "FAIL"}


def report(console: Any, out: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"the seed's storm, compared (verdict: pdgate's, {out['verdict']})")
    for c in ("run", "target", "verdict", "pins peak", "pins left after watchdog+grace", "client outcomes",
              "load before/after (1 min)", "others' CPU", "s"):
        t.add_column(c)
    for i, x in enumerate(out["runs"], 1):
        t.add_row(str(i), x["target"], "[green]PASS[/]" if x["verdict"] == "PASS" else "[red]FAIL[/]",
                  f"{x['pins_peak']:g}", "-" if x["pins_left"] is None else f"{x['pins_left']:g}",
                  ", ".join(f"{k}={v}" for k, v in x["outcomes"].items()),
                  f"{x['load_before'][0]:.2f}/{x['load_after'][0]:.2f}",
                  f"{100 * x['others_cpu_share']:.0f}%" + (" [red]busy[/]" if x["busy"] else ""), f"{x['seconds']:g}")
    console.print(t)


def plot(out: dict[str, Any], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    targets = out["targets"]
    fig, axes = plt.subplots(len(targets), 1, figsize=(10, 2.6 * len(targets)), sharex=True, squeeze=False)
    for ax, target in zip(axes[:, 0], targets, strict=True):
        for x in (x for x in out["runs"] if x["target"] == target):
            ts = [s["t"] for s in x["samples"]]
            vals = [max((v or 0) for k, v in s.items() if k != "t") for s in x["samples"]]
            ax.step(ts, vals, where="post", label=f"repeat {x['repeat'] + 1}: {x['verdict']}")
            ax.axvline(x["watchdog_line"], color="red", linestyle="--", linewidth=1)
        ax.set_ylim(bottom=0)
        ax.set_title(target, fontsize=9)
        ax.set_ylabel("prefill inflight\n(requests)")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the run's baseline (s); red dashes: storm end + watchdog + grace")
    fig.suptitle("the seed's storm through each gateway: requests pinned in the prefill's inflight queue")
    fig.tight_layout()
    save(fig, path)
