from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.procs import Procs

RUN_TMP = pytest.StashKey[tuple[Path, "str | None", "str | None"]]()


def pytest_configure(config: pytest.Config) -> None:
    """Every temporary file of a run in one folder of its own, removed when the run ends: ours (sims' logs, gateways'
    state directories), and every process's we start, which inherit ``TMPDIR`` (vLLM's and SGLang's ZMQ sockets, a
    ``--workers`` supervisor's folder). A run, or a test killed mid-way, leaves nothing in the machine's temp folder:
    runs here had left thousands of folders and sockets there."""
    base = Path(tempfile.mkdtemp(prefix="pdgate-run-"))
    config.stash[RUN_TMP] = (base, os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = tempfile.tempdir = str(base)


def pytest_unconfigure(config: pytest.Config) -> None:
    base, env, before = config.stash[RUN_TMP]
    if env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = env
    tempfile.tempdir = before
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def leaks_found_where_made() -> Iterator[None]:
    """After each test (its other fixtures torn down), the cycle collector runs: a connection, a socket or a transport
    it left unclosed is reported (``filterwarnings = error``) by the test that left it. Without this, a leak is found
    wherever the collector happens to run next: a burner CI run failed test_responses' first test on a socket some
    earlier test had left (``ResourceWarning: unclosed transport``), and nothing said which."""
    yield
    gc.collect()


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
