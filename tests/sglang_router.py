"""Run the real sglang-router wheel (PD mode) in front of sim workers."""

from __future__ import annotations

import sys

from loadtest.procs import wait_http
from tests.procs import Procs, Sim, free_port

PING = b'{"model":"sim-model","messages":[{"role":"user","content":"ping"}],"max_tokens":1}'


def start_router(procs: Procs, prefills: list[Sim], decodes: list[Sim], *extra: str) -> str:
    port = free_port()
    args = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    for p in prefills:
        args += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        args += ["--decode", d.url]
    proc = procs.spawn([*args, *extra], name="sglang-router")
    url = f"http://127.0.0.1:{port}"
    # ready once a chat request through it answers 200 (workers registered)
    wait_http(url + "/v1/chat/completions", timeout=30, proc=proc.popen, data=PING)
    return url
