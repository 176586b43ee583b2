"""Does a real vLLM PD pair in sessions of its own starve this session's processes? (BENCHMARKS.md, run AC)

For each mode, in turn: a real vLLM pair on this CPU (engine/vllm, the tiny model; prefill on core 0, decode on core
1, as the real tier starts them), started either in sessions of their own (``session``: what the real tier and
``pdgate up`` did) or in process groups of their own in this session (``group``: what they do now). Then, for
``--seconds``, a one-core CPU burner and a probe in this session: the probe sleeps 50 ms at a time and records every
wake-up more than 0.3 s late, with what /proc/stat says the CPUs did meanwhile (steal: the host's share); every 2 s
one request goes through the pair (a prefill, then its decode with the KV over NIXL), as vLLM's toy proxy sends it.

With the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled`` = 1) every session is a
scheduling group of its own. Prints one JSON line a mode; needs ``bash engine/vllm/install.sh`` first.

    .venv/bin/python scripts/sched_sessions.py --seconds 90 --modes session group
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.vllm import plan
from loadtest.procs import free_port

PROBE = """
import sys, time
def cpu():
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]
end = time.monotonic() + float(sys.argv[2]); out = open(sys.argv[1], "a", buffering=1)
last, c0 = time.monotonic(), cpu()
while last < end:
    time.sleep(0.05)
    now, c = time.monotonic(), cpu()
    if now - last > 0.3:
        d = [(b - a) / 100 for a, b in zip(c0, c)]
        out.write(f"{now - last:.3f} {d[0] + d[1]:.2f} {d[2]:.2f} {d[3]:.2f} {d[7]:.2f}\\n")
    last, c0 = now, c
"""
BURN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass"


def one_request(prefill: str, decode: str) -> None:
    plan.direct_request(prefill, decode, "tiny-llama")


def run(mode: str, seconds: float, tmp: Path) -> dict[str, Any]:
    kw: dict[str, Any] = {"start_new_session": True} if mode == "session" else {"process_group": 0}
    engines: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for role, cpu in (("prefill", 0), ("decode", 1)):
            port = free_port()
            w = {"name": f"vllm-{role}", "engine": "vllm", "role": role, "port": port, "cpu": cpu,
                 "side_channel_port": free_port()}
            with open(tmp / f"{mode}-{role}.log", "wb") as log:
                p = subprocess.Popen(plan.command(w), env={**os.environ, **plan.environment(w), "TMPDIR": str(tmp)},
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **kw)
            engines.append((p, f"http://127.0.0.1:{port}"))
        t0 = time.monotonic()
        for p, url in engines:
            while True:
                assert p.poll() is None, f"an engine exited; see {tmp}"
                assert time.monotonic() - t0 < 600, "the pair did not start within 600 s"
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
        started_s = time.monotonic() - t0
        one_request(engines[0][1], engines[1][1])  # NIXL's first handshake, before the measurement
        gaps_file = tmp / f"{mode}-gaps.txt"
        burner = subprocess.Popen([sys.executable, "-c", BURN, str(seconds + 5)])
        probe = subprocess.Popen([sys.executable, "-c", PROBE, str(gaps_file), str(seconds)])
        served, failed, end = 0, 0, time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                one_request(engines[0][1], engines[1][1])
                served += 1
            except OSError:
                failed += 1
            time.sleep(2)
        probe.wait()
        burner.kill()
        burner.wait()
        rows = [[float(x) for x in line.split()] for line in gaps_file.read_text().splitlines()]
        return {"mode": mode, "seconds": seconds, "pair_started_s": round(started_s, 1), "requests_served": served,
                "requests_failed": failed, "probe_wakeups_late_over_0.3s": len(rows),
                "probe_latest_s": max((r[0] for r in rows), default=0.0),
                "probe_late_total_s": round(sum(r[0] for r in rows), 2),
                "steal_during_late_wakeups_s": round(sum(r[4] for r in rows), 2),
                "idle_during_late_wakeups_s": round(sum(r[3] for r in rows), 2),
                "load_before": Path("/proc/loadavg").read_text().split()[:3]}
    finally:
        for p, _ in engines:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p, _ in engines:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--modes", nargs="+", choices=["session", "group"], default=["session", "group"])
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    a = ap.parse_args()
    print("autogroup:", Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip(), flush=True)
    with tempfile.TemporaryDirectory(prefix="pdgate-sched-") as d:
        for mode in a.modes:
            r = run(mode, a.seconds, Path(d))
            print(json.dumps(r), flush=True)
            if a.out:
                with a.out.open("a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
