"""The SGLang real tier: one real SGLang 0.5.23 PD pair on this CPU (engine/sglang with fixes A/B/C and the CPU
profile, mooncake over TCP, the tiny model), started once for the tier after vLLM's pair has stopped (one pair at a
time: each engine takes ~3 GiB and a core), shared by its tests, stopped when the tier ends. Judged from outside:
the client's clock and the engines' own counts (``/v1/loads``: running, waiting and every PD queue).

The prefill's inflight watchdog (fix C) is 8 s here, not the profile's 60: a pinned request ends within a test.
Not installed: in CI (``CI`` set) a failure naming the install command, never a skip; elsewhere a skip with it."""

from __future__ import annotations

import json
import random
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import free_port
from tests.real.common import gw  # noqa: F401 - the gateway fixture of either tier
from tests.real.engines import Engine, Pair, require_installed, running

__all__ = ["WATCHDOG_S", "Engine", "Pair", "engine", "pd_body", "pd_generate", "post"]
WATCHDOG_S = 8.0
ARGS = ["--dtype", "bfloat16", "--max-total-tokens", "8192", "--context-length", "1024"]


def engine(role: str, logs: Path, fixes: str = "A,B,C") -> Engine:
    port = free_port()
    entry: dict[str, Any] = {"name": f"sglang-{role}", "engine": "sglang", "role": role, "port": port,
                             "transfer_backend": "mooncake_tcp", "kernel_profile": "cpu", "args": ARGS}
    if role == "prefill":
        entry["bootstrap_port"] = free_port()
    return Engine(role, port, entry, logs / f"sglang-{role}-{port}.log", kind="sglang",
                  env={"SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT": str(WATCHDOG_S), "PDGATE_FIXES": fixes})


def pd_body(prefill: Engine, text: str, max_new_tokens: int) -> dict[str, Any]:
    """One request's body for both legs, as a router makes it: a rid of its own, the prefill's bootstrap address, a
    random room."""
    return {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "rid": f"pdgate-test-{random.getrandbits(48):012x}", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.entry["bootstrap_port"], "bootstrap_room": random.getrandbits(63)}


def post(e: Engine, path: str, payload: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """POST JSON to one engine: status (None: no answer), seconds, answer."""
    t0 = time.monotonic()
    req = urllib.request.Request(e.url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return {"status": r.status, "s": time.monotonic() - t0, "body": json.loads(r.read() or b"null")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "s": time.monotonic() - t0, "body": exc.read().decode(errors="replace")}
    except OSError as exc:
        return {"status": None, "s": time.monotonic() - t0, "body": str(exc)}


def pd_generate(prefill: Engine, decode: Engine, text: str, max_new_tokens: int) -> dict[str, Any]:
    """Both legs of one request at once; each leg's answer by role."""
    from concurrent.futures import ThreadPoolExecutor

    body = pd_body(prefill, text, max_new_tokens)
    with ThreadPoolExecutor(2) as pool:
        legs = {e.role: pool.submit(post, e, "/generate", body) for e in (prefill, decode)}
        return {role: f.result() for role, f in legs.items()}


@pytest.fixture(scope="package")
def pair() -> Iterator[Pair]:
    require_installed("sglang")
    logs = Path(tempfile.mkdtemp(prefix="pdgate-real-sglang-"))
    with running(engine("prefill", logs), engine("decode", logs), watchdog_s=WATCHDOG_S) as p:
        first = pd_generate(p.prefill, p.decode, "warm up", 2)  # the first transfer connects mooncake's two ends
        assert first["decode"]["status"] == 200, first
        yield p
