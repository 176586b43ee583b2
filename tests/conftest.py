from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from tests.procs import Procs


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


@pytest.fixture
async def gateways() -> AsyncIterator[list[object]]:
    """Collects gateways a test starts (tests.pdgate.harness.start_gateway) and stops them."""
    started: list[object] = []
    try:
        yield started
    finally:
        for g in reversed(started):
            await g.close()  # type: ignore[attr-defined]


# the real tiers: folder -> what runs there
TIERS = {"tests/real/": "real vLLM PD on this CPU (and pdgate up with either engine)",
         "tests/real_sglang/": "real SGLang PD on this CPU"}
REAL: dict[str, dict[str, float]] = {t: {"s": 0.0, "n": 0, "failed": 0} for t in TIERS}
STARTED = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each real tier's share of the run: its tests' setup, call and teardown (the engines' start included)."""
    for tier, r in REAL.items():
        if report.nodeid.startswith(tier):
            r["s"] += report.duration
            if report.when == "call":
                r["n"] += 1
                r["failed"] += report.failed


def pytest_terminal_summary(terminalreporter: Any) -> None:
    total = time.monotonic() - STARTED
    for tier, r in REAL.items():
        if r["n"]:
            terminalreporter.write_line(f"real tier ({tier.rstrip('/')}, {TIERS[tier]}): {int(r['n'])} tests, "
                                        f"{int(r['failed'])} failed, {r['s']:.0f} s of this run's {total:.0f} s "
                                        f"({100 * r['s'] / max(total, 1):.0f}%)")
