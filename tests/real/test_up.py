"""``pdgate up --cluster config/cluster.vllm-cpu.toml`` as a new user runs it: a real vLLM prefill and decode under
the supervisor, the gateway in front; ready, a chat with usage, a stream to [DONE], a 1 ms TTFT budget a 504 with
both engines holding nothing within 10 s (their own /metrics), ``pdgate workers`` naming them real vLLM; Ctrl-C stops
everything. Runs before the tier's shared pair starts (its ports are the cluster file's own)."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.procs import ROOT, Procs, free_port, wait_http
from tests.real.conftest import START_S, require_installed
from tests.test_up import cli, post

pytestmark = pytest.mark.timeout(420)
CLUSTER = ROOT / "config" / "cluster.vllm-cpu.toml"


def held(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+-]+)$", text,
                                            re.M))


def test_pdgate_up_with_real_vllm(procs: Procs, tmp_path: Path) -> None:
    require_installed()
    port, admin = free_port(), free_port()
    key_file = tmp_path / "admin.key"
    up = procs.spawn([sys.executable, "-m", "pdgate", "up", "--cluster", str(CLUSTER), "--port", str(port),
                      "--admin-port", str(admin), "--admin-key-file", str(key_file)], name="pdgate-up", cwd=tmp_path,
                     new_session=True)
    gw = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        wait_http(gw + "/readiness", timeout=START_S, proc=up.popen)
        ready_s = time.monotonic() - t0
        assert '"model":"tiny-llama"' in up.logs(), "the ready message names the model to ask for"
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}
        # the first transfer makes NIXL's handshake: up to ~35 s measured on two cores (tests/real/conftest.warm_up)
        t1 = time.monotonic()
        status, body, _ = post(gw + "/v1/chat/completions", chat, timeout=150)
        first_s = time.monotonic() - t1
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
        req = urllib.request.Request(gw + "/v1/chat/completions", data=json.dumps({**chat, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [ln for ln in r.read().decode().splitlines() if ln.startswith("data:")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3, events[-3:]
        req = urllib.request.Request(gw + "/v1/chat/completions", data=json.dumps(chat).encode(),
                                     headers={"Content-Type": "application/json", "x-pdgate-ttft-timeout": "0.001"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("a 1 ms TTFT budget answered 200")
        except urllib.error.HTTPError as exc:
            assert exc.code == 504, exc.read()
        engines = ["http://127.0.0.1:30210", "http://127.0.0.1:30220"]
        t1 = time.monotonic()
        while True:
            try:
                if not sum(held(u) for u in engines):
                    break
            except OSError:  # /metrics not answered in time on a busy box: look again
                pass
            assert time.monotonic() - t1 < 10, "both engines hold nothing within 10 s"
            time.sleep(0.2)
        out = cli(f"http://127.0.0.1:{admin}", "workers", "--wide", key_file=key_file)
        assert out.count("prefill/vllm") == 1 and out.count("decode/vllm") == 1 and out.count("vllm 0.32.0") == 2, out
        print(f"pdgate up with real vLLM: ready in {ready_s:.1f}s, the first request (NIXL's handshake) {first_s:.1f}s")
    finally:
        up.stop(signal.SIGINT, timeout=60)
    assert up.popen is not None and up.popen.returncode == 0, up.logs()[-2000:]
    for u in ("http://127.0.0.1:30210/health", "http://127.0.0.1:30220/health"):
        try:
            urllib.request.urlopen(u, timeout=2)
            raise AssertionError(f"{u} still answers after Ctrl-C")
        except OSError:
            pass
