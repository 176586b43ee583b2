"""Run the gateway in the test's event loop on a real loopback port, in front of real sim processes."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from pdgate.core.config import GatewayConfig, HealthConfig, WorkerSpec, validate
from pdgate.path.gateway import Gateway
from pdgate.planes.server import App, build_app, serve
from pdgate.pool.lineage import Lineage
from tests.engine.simclient import engine_requests
from tests.procs import Sim, free_port


@dataclasses.dataclass
class Running:
    url: str
    gw: Gateway
    runner: App
    admin: str = ""  # the admin plane's URL (workers, requests, cluster, metrics)

    async def close(self) -> None:
        await self.runner.cleanup()


def make_config(prefills: Iterable[Sim], decodes: Iterable[Sim], **kw: Any) -> GatewayConfig:
    health = kw.pop("health", HealthConfig(interval_s=0.5, timeout_s=0.5, failures=2, degraded_after_s=30))
    kw.setdefault("drain_s", 0.5)  # teardown of a test gateway does not wait for requests a test left running
    # a state directory of its own: a test's gateway never takes another test's killed process for its predecessor
    kw.setdefault("state_dir", tempfile.mkdtemp(prefix="pdgate-state-"))
    port = kw.pop("port", None) or free_port()
    if "admin_port" not in kw:  # free_port() may hand out the same port twice in a row
        kw["admin_port"] = next(p for p in iter(free_port, 0) if p != port)
    return validate(GatewayConfig(
        port=port,
        prefill=tuple(WorkerSpec(url=p.url, role="prefill", bootstrap_port=p.bootstrap_port) for p in prefills),
        decode=tuple(WorkerSpec(url=d.url, role="decode") for d in decodes),
        health=health,
        **kw,
    ))


async def start_gateway(cfg: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> Running:
    gw = Gateway(cfg, clock=clock)
    runner = await serve(build_app(cfg, gw), cfg.host, cfg.port)
    return Running(f"http://127.0.0.1:{cfg.port}", gw, runner, runner.admin_url)


async def assert_clean(http: aiohttp.ClientSession, gw: Gateway, workers: Iterable[Sim], within: float = 2.0) -> None:
    """Nothing leaked: every engine holds no request and the gateway has no live record, within ``within`` s.

    Clean must hold on two looks 0.3 s apart, so a leg still on its way cannot pass for clean."""
    workers = list(workers)
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    clean_since: float | None = None
    while True:
        held = {w.role + str(w.port): await engine_requests(http, w) for w in workers}
        held = {k: v for k, v in held.items() if v}
        live = list(gw.traces.live)
        if not held and not live and not gw.live:
            clean_since = clean_since or loop.time()
            if loop.time() - clean_since >= 0.3:
                return
        else:
            clean_since = None
        if loop.time() > end + 0.3:
            raise AssertionError(f"leaked after {within}s: engines={held} gateway live={live}")
        await asyncio.sleep(0.05)


def worker_id(gw: Gateway, sim: Sim) -> str:
    return next(w.id for w in gw.pool.by_id.values() if w.url == sim.url)


async def recorded(state_dir: Path, n: int, within: float = 10.0) -> int:
    """Wait until the gateways' records in ``state_dir`` (``pdgate.pool.lineage``: what a successor reads) hold ``n``
    rids between them; a kill after that loses none of them. A fixed sleep past ``lineage.RECORD_S`` did not do: under
    a CPU burner a gateway's record task had not run when it was killed, and its successor found the rids it left as
    strangers' (orphans), not as its predecessor's."""
    t0 = time.monotonic()
    while True:
        files = sorted((state_dir / "instances").glob("*.json")) if (state_dir / "instances").is_dir() else []
        got = sum(len(e["rids"]) for f in files if (e := Lineage._read(f)) is not None)
        if got >= n:
            return got
        assert time.monotonic() - t0 < within, f"the records in {state_dir} hold {got} rids, not {n}, after {within}s"
        await asyncio.sleep(0.02)
