"""The oracle's soak (``pytest -m slow``): >= 10,000 generated requests, 32 at a time, through one gateway
and four sims that re-segment every response, with faults switched on and off as it runs. Every request is
checked as in the oracle, on the client's clock, its answer against what the decode says it sent; at the end the
gateway's fds and RSS are back to their baseline (+ slack)."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import resource
import time
from pathlib import Path

import aiohttp
import pytest

from pdgate.core.config import DeadlineConfig, HealthConfig, ReconcileConfig
from tests.engine.simclient import set_faults
from tests.pdgate.harness import make_config, start_gateway
from tests.pdgate.oracle import OFF, ROUTES, Cluster, Req, check_client, client, lateness, leftovers, sent_by_decodes
from tests.procs import Procs

REQUESTS = int(os.environ.get("SOAK_REQUESTS", "10000"))


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def gen(rng: random.Random) -> Req:
    stream = rng.random() < 0.6
    pick = lambda: None if rng.random() < 0.6 else round(rng.uniform(0.2, 3.0), 2)  # noqa: E731
    return Req(route=rng.choice(ROUTES), stream=stream, max_tokens=rng.randint(1, 16), total=pick(), ttft=pick(),
               idle=pick() if stream else None,
               client=rng.choice(("reads",) * 6 + ("leaves_before_first", "leaves_mid", "slow_reader")),
               leave_after=rng.randint(1, 6), start=0.0)


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_soak(procs: Procs) -> None:
    cl = Cluster(procs)
    cl.start()
    rng = random.Random(20261201)
    cfg = make_config(cl.sims[:2], cl.sims[2:], prefill_grace_s=0.5, abort_timeout_s=0.5,
                      deadlines=DeadlineConfig(total_s=4, ttft_s=3, idle_s=2),
                      health=HealthConfig(interval_s=0.3, timeout_s=0.3, failures=2, degraded_after_s=30),
                      reconcile=ReconcileConfig(interval_s=0.5, grace_s=0.5))
    g = await start_gateway(cfg)
    problems: list[str] = []
    done = 0
    worst = 0.0
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for s in cl.sims:
                await set_faults(http, s, segment=0.5, segment_seed=7)
            gc.collect()
            base_fds, base_rss = fds(), rss_mb()
            t0 = time.monotonic()

            async def worker() -> None:
                nonlocal done, worst
                while done < REQUESTS:
                    done += 1
                    r = gen(rng)
                    seen = await client(http, g.url, r)
                    if seen.error == "left":
                        continue
                    for _ in range(50):  # its record ends when the gateway has noticed the end (a moment after the client)
                        rec = g.gw.traces.get(seen.rid) if seen.rid else None
                        if rec is None or not rec.live:
                            break
                        await asyncio.sleep(0.01)
                    problems.extend(check_client(g, r, seen, None, 0.0, await sent_by_decodes(http, cl), {}))
                    if r.client != "slow_reader":
                        worst = max(worst, lateness(r, seen))

            async def chaos() -> None:
                while done < REQUESTS:
                    await asyncio.sleep(rng.uniform(1, 3))
                    s = rng.choice(cl.sims)
                    kind = rng.choice(("slow_prefill", "http_500_rate", "decode_freeze", "slow_first_token"))
                    value = {"decode_freeze": True, "http_500_rate": 0.3}.get(kind, 0.8)
                    await set_faults(http, s, **{kind: value})
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                    await set_faults(http, s, **{kind: OFF[kind]})

            async def progress() -> None:
                while done < REQUESTS:
                    await asyncio.sleep(10)
                    print(f"soak: {done}/{REQUESTS} requests, {len(problems)} problems, "
                          f"{time.monotonic() - t0:.0f}s", flush=True)

            await asyncio.gather(*(worker() for _ in range(32)), chaos(), progress())
            for _ in range(300):
                if not g.gw.live:
                    break
                await asyncio.sleep(0.02)
            problems.extend(await leftovers(http, g, cl))
            took = time.monotonic() - t0
        # the clients' keep-alive connections close with their session (and the gateway's ends of them); the
        # gateway's idle engine connections are closed by the sims' keep-alive (5 s), as SGLang's would be
        await asyncio.sleep(6)
        gc.collect()
        end_fds, end_rss = fds(), rss_mb()
        print(f"soak: {done} requests in {took:.0f}s; worst end past what the budgets allowed (client clock) "
              f"{worst * 1000:.0f} ms; fds {base_fds} -> {end_fds}; "
              f"RSS {base_rss:.1f} -> {end_rss:.1f} MB; problems {len(problems)}", flush=True)
    finally:
        await g.close()
    assert not problems, "\n".join(problems[:20])
    assert end_fds <= base_fds + 8, (base_fds, end_fds)
    assert end_rss <= base_rss + 40, (base_rss, end_rss)
