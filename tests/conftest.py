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


REAL: dict[str, float] = {"s": 0.0, "n": 0, "failed": 0}
STARTED = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The real tier's share of the run: its tests' setup, call and teardown (the engines' start included)."""
    if report.nodeid.startswith("tests/real/"):
        REAL["s"] += report.duration
        if report.when == "call":
            REAL["n"] += 1
            REAL["failed"] += report.failed


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REAL["n"]:
        total = time.monotonic() - STARTED
        terminalreporter.write_line(f"real tier (tests/real, real vLLM PD on this CPU): {int(REAL['n'])} tests, "
                                    f"{int(REAL['failed'])} failed, {REAL['s']:.0f} s of this run's {total:.0f} s "
                                    f"({100 * REAL['s'] / max(total, 1):.0f}%)")
