"""``pdgate up --cluster config/cluster.vllm-cpu.toml`` (and ``cluster.sglang-cpu.toml``) as a new user runs it: a
real prefill and decode under the supervisor, the gateway in front; ready, a chat with usage, a stream to [DONE], a
1 ms TTFT budget a 504 with both engines holding nothing within 10 s (their own /metrics), ``pdgate workers`` naming
the engine (SGLang: its fixes and the CPU profile, which each worker's ``/pdgate/v1/info`` lists too); Ctrl-C stops
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
from tests.real.engines import START_S, require_installed, sglang_held
from tests.test_up import cli, post

pytestmark = pytest.mark.timeout(420)
ENGINES = {"vllm": ("http://127.0.0.1:30210", "http://127.0.0.1:30220"),
           "sglang": ("http://127.0.0.1:30410", "http://127.0.0.1:30420")}


def held(kind: str, url: str) -> float:
    if kind == "sglang":
        return sglang_held(url)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+-]+)$", text,
                                            re.M))


def info(url: str) -> dict:
    with urllib.request.urlopen(url + "/pdgate/v1/info", timeout=10) as r:
        return dict(json.loads(r.read()))


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_pdgate_up_with_a_real_engine_pair(procs: Procs, tmp_path: Path, kind: str) -> None:
    require_installed(kind)
    cluster = ROOT / "config" / f"cluster.{kind}-cpu.toml"
    port, admin = free_port(), free_port()
    key_file = tmp_path / "admin.key"
    up = procs.spawn([sys.executable, "-m", "pdgate", "up", "--cluster", str(cluster), "--port", str(port),
                      "--admin-port", str(admin), "--admin-key-file", str(key_file)], name="pdgate-up", cwd=tmp_path,
                     own_group=True)
    gw = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        wait_http(gw + "/readiness", timeout=START_S, proc=up.popen)
        ready_s = time.monotonic() - t0
        assert '"model":"tiny-llama"' in up.logs(), "the ready message names the model to ask for"
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "say hi"}], "max_tokens": 8}
        # vLLM's first transfer makes NIXL's handshake: up to ~35 s measured on two cores (tests/real/conftest.warm_up)
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
        engines = ENGINES[kind]
        t1 = time.monotonic()
        while True:
            try:
                if not sum(held(kind, u) for u in engines):
                    break
            except OSError:  # /metrics not answered in time on a busy box: look again
                pass
            assert time.monotonic() - t1 < 10, "both engines hold nothing within 10 s"
            time.sleep(0.2)
        out = cli(f"http://127.0.0.1:{admin}", "workers", "--wide", key_file=key_file)
        if kind == "vllm":
            assert out.count("prefill/vllm") == 1 and out.count("decode/vllm") == 1 and out.count("vllm 0.32.0") == 2, out
        else:  # SGLang is the gateway's default kind: its role alone; the worker names version, profile and fixes
            flat = " ".join(out.split())
            assert flat.count("sglang 0.5.23 profile cpu") == 2 and flat.count("A,B,C") == 2, out
            for u in engines:
                i = info(u)
                assert i["pdgate_fixes"] == ["A", "B", "C"] and i["kernel_profile"] == "cpu", i
                assert set(i["cpu_profile"]["stand_ins"]) >= {"sgl_kernel"}, i
        print(f"pdgate up with real {kind}: ready in {ready_s:.1f}s, the first request {first_s:.1f}s")
    finally:
        up.stop(signal.SIGINT, timeout=60)
    assert up.popen is not None and up.popen.returncode == 0, up.logs()[-2000:]
    for u in (f"{e}/health" for e in ENGINES[kind]):
        try:
            urllib.request.urlopen(u, timeout=2)
            raise AssertionError(f"{u} still answers after Ctrl-C")
        except OSError:
            pass
