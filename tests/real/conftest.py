"""The real tier: one real vLLM PD pair on this CPU (engine/vllm, the tiny model), started once for the tier, shared
by its tests, restarted by the tests that kill a part of it, stopped when the tier ends. Judged from outside: the
client's clock and the engines' own ``/metrics`` (``vllm:num_requests_running``/``waiting``, NIXL counters).

Not installed: in CI (``CI`` set) a failure naming the install command, never a skip; elsewhere a skip with it."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.vllm import plan
from tests.procs import free_port
from tests.real.common import gw  # noqa: F401 - the gateway fixture of either tier
from tests.real.engines import Engine, Pair, require_installed, running

__all__ = ["Engine", "Pair"]


def warm_up(p: Pair) -> float:
    """One request through the pair as vLLM's toy proxy sends it, before any test: the first KV transfer makes NIXL's
    handshake between the two, which took up to ~30 s here (measured: 0.3-35 s); a test's budget is not for that."""
    t0 = time.monotonic()
    plan.direct_request(p.prefill.url, p.decode.url, p.model, "warm up", "pdgate-warm-up")
    return time.monotonic() - t0


@pytest.fixture(scope="package")
def pair() -> Iterator[Pair]:
    require_installed("vllm")
    logs = Path(tempfile.mkdtemp(prefix="pdgate-real-"))
    pp, dp = free_port(), free_port()
    engines = [Engine(role, port, {"name": f"vllm-{role}", "engine": "vllm", "role": role, "port": port,
                                   "cpu": cpu, "side_channel_port": free_port()}, logs / f"vllm-{role}.log")
               for role, port, cpu in (("prefill", pp, 0), ("decode", dp, 1))]
    with running(*engines) as p:
        p.notes["first_transfer_s"] = warm_up(p)
        yield p
