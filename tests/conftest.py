from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

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
