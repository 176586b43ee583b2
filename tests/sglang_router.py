"""Run the real sglang-router wheel (PD mode) in front of sim workers."""

from __future__ import annotations

import sys
import time
import urllib.request

from tests.procs import Proc, Procs, Sim, free_port


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
    _wait_ready(url, proc)
    return url


def _wait_ready(url: str, proc: Proc, timeout: float = 30.0) -> None:
    """Ready once a chat request through the router answers 200 (workers registered)."""
    body = b'{"model":"sim-model","messages":[{"role":"user","content":"ping"}],"max_tokens":1}'
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.popen is not None
        if proc.popen.poll() is not None:
            raise RuntimeError(f"sglang-router exited: {proc.logs()[-2000:]}")
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"sglang-router at {url} not ready in {timeout}s")
