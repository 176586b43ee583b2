"""``pdgate serve --workers N``: processes that share one port, an admin plane that answers for all of them, a
supervisor that restarts the one that dies, a store they share (``pdgate.planes.multi``, ``pdgate.planes.peers``, ``pdgate.store``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from pdgate.core.config import StoreConfig
from pdgate.observe.metrics import Metrics
from pdgate.planes import multi, peers
from tests.engine.simclient import gauge
from tests.pdgate.harness import recorded
from tests.pdgate.test_outcomes import CHAT
from tests.procs import Procs, free_port, wait_http, workers_toml


def children(pid: int) -> set[int]:
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


async def wait_for(cond: Any, within: float, what: str) -> Any:
    end = time.monotonic() + within
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {within}s: {what}")


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-request-id", "")


def dead(pid: int) -> bool:
    """Exited, its files closed: the leader is a zombie once it exits, but its threads may hold the fds a moment
    longer."""
    try:
        zombie = "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def instance(rid: str) -> str:
    return rid.split("-")[1]


@pytest.fixture
async def fresh() -> Any:
    """A client that opens a new connection per request: the kernel picks a process for each."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


async def test_processes_share_the_port_answer_for_each_other_and_one_killed_is_restarted(
        procs: Procs, fresh: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = procs.sim("prefill", "--fixes", "none")
    d = procs.sim("decode", "--fixes", "none", "--speed", "15")  # 30 tokens last ~2-3 s: past grace and lease
    port, admin = free_port(), free_port()
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {admin}\naccess_log = false\n"
                   "[reconcile]\ninterval_s = 0.3\ngrace_s = 0.5\n[store]\nlease_s = 1.5\nheartbeat_s = 0.5\n"
                   + workers_toml([p], [d]))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name="group")
    url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    wait_http(url + "/readiness", proc=sup.popen)
    await group_members(sup.pid)  # both in the store's registry
    first = gateways_of(sup.pid)

    # long requests on new connections: both processes take some; every one is seen from the one admin port
    long_body = {**CHAT, "max_tokens": 30}
    tasks = [asyncio.create_task(post(fresh, url, long_body)) for _ in range(12)]
    await asyncio.sleep(1.0)
    seen_live: set[str] = set()
    for _ in range(6):  # each call lands on either process: each answers for both
        async with fresh.get(admin_url + "/v1/requests") as r:
            assert r.status == 200
            listed = await r.json()
        assert listed["processes"] == {"answered": 2, "of": 2}
        seen_live |= {x["id"] for x in listed["requests"]}
    results = await asyncio.gather(*tasks)
    assert [s for s, _ in results] == [200] * 12
    owners = {instance(rid) for _, rid in results}
    assert len(owners) == 2, f"the kernel spread the connections over both processes: {owners}"
    assert {rid for _, rid in results} <= seen_live, "every live request was listed, whichever process answered"
    for _, rid in results:
        for _ in range(2):
            async with fresh.get(f"{admin_url}/v1/requests/{rid}") as r:
                assert r.status == 200, rid
                t = await r.json()
            assert t["outcome"] == "completed", t
            assert not any(e["event"] == "reconcile_abort" for e in t["attempts"][0]["events"]), \
                "a sibling's live request is never an orphan"
    assert await gauge(fresh, d, "num_aborted_requests_total") == 0
    async def summed() -> bool:  # each process writes its files every FLUSH_S: a scrape sees them that late
        async with fresh.get(admin_url + "/metrics") as r:
            text = await r.text()
        return 'pdgate_requests_total{outcome="completed",route="/v1/chat/completions"} 12.0' in text

    await wait_for_async(summed, 3, "the counters of both processes, summed (multiprocess files)")

    # one process dies: the other keeps serving, the supervisor starts a new one (a new instance id)
    victim = sorted(first)[0]
    os.kill(victim, signal.SIGKILL)
    # its listening sockets close when all its threads have exited: a connection made before then could
    # land in its accept queue and be reset, as with any process that dies (SO_REUSEPORT does not move it)
    await wait_for(lambda: dead(victim), 5, "the killed process exits")
    statuses = [s for s, _ in await asyncio.gather(*(post(fresh, url, CHAT) for _ in range(20)))]
    assert statuses == [200] * 20
    now = await wait_for(lambda: gateways_of(sup.pid) if len(gateways_of(sup.pid)) == 2 and victim not in
                         gateways_of(sup.pid) else None, 10, "the supervisor restarts the dead process")
    assert victim not in now and sup.popen is not None and sup.popen.poll() is None
    wait_http(url + "/readiness", proc=sup.popen)
    after: set[str] = set()
    for _ in range(40):
        after.add(instance((await post(fresh, url, CHAT))[1]))
        if len(after - owners) >= 1 and len(after) == 2:
            break
    assert len(after - owners) == 1 and len(after) == 2, f"the restarted process serves under a new id: {after}"

    sup.stop(signal.SIGTERM)
    assert sup.popen is not None and sup.popen.returncode == 0
    await wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in now), 5, "its processes stop with it")


# restart=True failed one run in two of this file (never alone): the process was killed right after both were in the
# registry, before the supervisor's own look saw them, and the supervisor took that for a failed start and stopped
# the group (``Supervisor.ready``; the test below).
@pytest.mark.parametrize("restart", [False, True])
async def test_a_change_on_the_admin_plane_is_made_by_every_process(procs: Procs, fresh: aiohttp.ClientSession,
                                                                   tmp_path: Path, restart: bool) -> None:
    p, d = procs.pair()
    d2 = procs.sim("decode")
    port, admin = free_port(), free_port()
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {admin}\naccess_log = false\n" + workers_toml([p], [d]))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name="group")
    admin_url = f"http://127.0.0.1:{admin}"
    wait_http(f"http://127.0.0.1:{port}/readiness", proc=sup.popen)
    members = await group_members(sup.pid)
    async with fresh.post(admin_url + "/v1/workers", json={"role": "decode", "url": d2.url}) as r:
        assert r.status == 201, await r.text()
    # each process on its own (the header asks one alone): both route to it, pushed through the store
    await wait_for_async(lambda: views_of(fresh, members, lambda v: all(d2.url in x for x in v)), 3,
                         "every process has the new worker")
    # a process started after the change (here: restarted) routes to the worker too, though its config lacks it
    if restart:
        victim = sorted(gateways_of(sup.pid))[0]
        os.kill(victim, signal.SIGKILL)
        # restarted (0.5 s backoff), imported and announced: seconds alone, more on a loaded 2-core CI machine
        members = await group_members(sup.pid, without=victim, within=40.0)
    views = await views_of(fresh, members, lambda v: True)
    assert d2.url in views[0] and views[0] == views[1], f"the same workers under the same ids: {views}"
    # so a removal made through one process names the same worker in each
    async with fresh.delete(f"{admin_url}/v1/workers/{views[0][d2.url]}") as r:
        assert r.status == 200, await r.text()
    await wait_for_async(lambda: views_of(fresh, members, lambda v: all(d2.url not in x for x in v)), 3,
                         "every process dropped it")


async def views_of(http: aiohttp.ClientSession, members: list[dict[str, Any]], good: Any) -> Any:
    """Each process's own workers (url -> id), if ``good`` says they are what the test waits for."""
    views = []
    for m in members:
        async with http.get(m["admin"] + "/v1/workers", headers={peers.LOCAL: "1"}) as r:
            views.append({w["url"]: w["id"] for w in (await r.json())["workers"]})
    return views if good(views) else None


async def wait_for_async(cond: Any, within: float, what: str) -> Any:
    end = time.monotonic() + within
    while time.monotonic() < end:
        got = await cond()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {within}s: {what}")


def environ(pid: int) -> dict[str, str]:
    try:
        return dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in x)
    except OSError:
        return {}


def gateways_of(pid: int) -> set[int]:
    """A supervisor's gateway processes (its redis-server is a child too)."""
    return {c for c in children(pid) if multi.ENV_INDEX in environ(c)}


def redis_of(pid: int) -> int | None:
    return next(iter(children(pid) - gateways_of(pid)), None)


async def group_members(pid: int, n: int = 2, without: int | None = None, within: float = 15.0) -> list[dict[str, Any]]:
    """The store's registry entries of a supervisor's ``n`` processes (the store found in a child's environment),
    once there are ``n`` (none of them ``without``)."""
    async def look() -> list[dict[str, Any]] | None:
        for child in gateways_of(pid):
            url = environ(child).get(multi.ENV_STORE)
            if url:
                live = set(gateways_of(pid)) - {without}
                got = [m for m in (await multi.registered(StoreConfig(url=url)) or {}).values() if m.get("pid") in live]
                return sorted(got, key=lambda m: m["pid"]) if len(got) == n else None
        return None

    return list(await wait_for_async(look, within, f"{n} processes in the registry"))


@pytest.mark.parametrize("came_up", [True, False])
async def test_a_process_that_died_after_it_came_up_is_not_a_failed_start(monkeypatch: pytest.MonkeyPatch,
                                                                          came_up: bool) -> None:
    """The supervisor's start check (``ProcessGroup.ready``) after both processes were in the registry and one was
    killed before the check looked: up (the dead one is restarted as any other). Before, it counted only the live
    ones and stopped the whole group. One that died before it ever registered still fails the start."""
    group = multi.ProcessGroup(["serve"], 2, 1.0, store=StoreConfig(url="redis://unused"))
    try:
        live, dead = SimpleNamespace(pid=101, returncode=None), SimpleNamespace(pid=102, returncode=-9)
        group.children[0].proc, group.children[1].proc = live, dead  # type: ignore[assignment]
        entries = {"a": {"pid": 101}, **({"b": {"pid": 102}} if came_up else {})}  # a killed one's outlives it

        async def registered(_: StoreConfig) -> dict[str, dict[str, Any]]:
            return entries

        monkeypatch.setattr(multi, "registered", registered)
        assert await group.ready(timeout_s=1.0) is came_up
    finally:
        shutil.rmtree(group.dir, ignore_errors=True)


def test_the_workers_flag_is_taken_out_of_what_each_process_runs() -> None:
    argv = ["serve", "--workers", "3", "--port", "1", "--workers=2", "--decode", "http://x:1"]
    assert multi.without_workers_flag(argv) == ["serve", "--port", "1", "--decode", "http://x:1"]


def test_metrics_of_processes_are_merged_by_prometheus_multiprocess_files(tmp_path: Path) -> None:
    """Each process writes its series into the group's directory; a scrape of any merges them (the library's
    MultiProcessCollector): counters and histograms summed, live requests summed, per-worker gauges per process.
    Without the files (one process's own registry) a scrape shows only that process's counts."""
    procs = [Metrics(), Metrics()]
    for n, m in enumerate(procs, start=1):
        m.finished[("/v1/chat/completions", "completed")] = 3 * n
        m.queue_wait.observe(0.02 * n)
        m.drift.labels("p0").set(n)
    alone = procs[0].render().decode()
    assert 'pdgate_requests_total{outcome="completed",route="/v1/chat/completions"} 3.0' in alone
    for pid, m in enumerate(procs, start=100):
        m.share(tmp_path / "metrics")
        assert m.shared is not None
        m.shared.pid = pid  # two processes' files (the test runs in one)
        m.shared.flush()
    text = procs[0].render().decode()
    assert 'pdgate_requests_total{outcome="completed",route="/v1/chat/completions"} 9.0' in text
    assert 'pdgate_queue_wait_seconds_count 2.0' in text and 'pdgate_queue_wait_seconds_bucket{le="0.025"} 1.0' in text
    assert 'pdgate_queue_wait_seconds_bucket{le="0.05"} 2.0' in text
    assert 'pdgate_worker_drift{pid="100",worker="p0"} 1.0' in text and 'pid="101"' in text
    procs[1].finished[("/v1/chat/completions", "completed")] += 1  # counted after the last flush: the next scrape
    assert 'route="/v1/chat/completions"} 10.0' in procs[1].render().decode()
    for m in procs:
        assert m.shared is not None
        m.shared.close()


def test_a_pool_takes_the_stores_ids_and_goes_on_from_them() -> None:
    from pdgate.core.config import BreakerConfig, WorkerSpec
    from pdgate.pool.workers import Pool

    pool = Pool(BreakerConfig(), lambda kind: None)  # type: ignore[arg-type,return-value]
    assert pool.add(WorkerSpec(url="http://127.0.0.1:1", role="decode")).id == "d0"
    assert pool.add(WorkerSpec(url="http://127.0.0.1:2", role="decode"), "d5").id == "d5"
    assert pool.add(WorkerSpec(url="http://127.0.0.1:3", role="decode")).id == "d6"
    with pytest.raises(ValueError):
        pool.add(WorkerSpec(url="http://127.0.0.1:4", role="decode"), "d5")
    with pytest.raises(ValueError):
        pool.add(WorkerSpec(url="http://127.0.0.1:4", role="decode"), "p9")


async def start_group(procs: Procs, tmp_path: Path, extra: str = "", *workers: Any, name: str = "group") -> Any:
    port, admin = free_port(), free_port()
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {admin}\naccess_log = false\n{extra}"
                   + workers_toml([workers[0]], list(workers[1:])))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name=name)
    wait_http(f"http://127.0.0.1:{port}/readiness", proc=sup.popen)
    await group_members(sup.pid)
    return sup, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", cfg


async def test_a_group_drains_on_sigterm_without_its_processes_aborting_each_other(
        procs: Procs, fresh: aiohttp.ClientSession, tmp_path: Path) -> None:
    """While a process drains its registry entry stays (marked draining, heartbeats going on): the other does not
    take its live rids for a dead instance's, even with drain_s well past the store's lease_s."""
    p = procs.sim("prefill", "--fixes", "none")
    d = procs.sim("decode", "--fixes", "none", "--speed", "15")
    sup, url, _, _ = await start_group(procs, tmp_path, "drain_s = 10\n[reconcile]\ninterval_s = 0.3\ngrace_s = 0.5\n"
                                       "[store]\nlease_s = 1.5\nheartbeat_s = 0.5\n", p, d)
    body = {**CHAT, "max_tokens": 60, "stream": True}

    async def stream() -> str:
        async with fresh.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            return (await r.read()).decode()

    tasks = [asyncio.create_task(stream()) for _ in range(8)]
    await asyncio.sleep(1.0)
    assert sup.popen is not None
    sup.popen.send_signal(signal.SIGTERM)
    texts = await asyncio.gather(*tasks)
    assert all(t.rstrip().endswith("data: [DONE]") and '"error"' not in t for t in texts), \
        [t[-200:] for t in texts if '"error"' in t]
    assert await gauge(fresh, d, "num_aborted_requests_total") == 0
    assert sup.popen.wait(20) == 0


async def test_changes_made_at_once_through_both_processes_keep_one_id_per_worker(
        procs: Procs, fresh: aiohttp.ClientSession, tmp_path: Path) -> None:
    """Two registrations at the same moment, each to another process: the store names both, so an id means one
    worker in every process."""
    p, d = procs.pair()
    extra = [procs.sim("decode"), procs.sim("decode")]
    sup, _, _, _ = await start_group(procs, tmp_path, "", p, d)
    members = await group_members(sup.pid)
    results = await asyncio.gather(*(fresh.post(m["admin"] + "/v1/workers", json={"role": "decode", "url": x.url})
                                     for m, x in zip(members, extra, strict=True)))
    for r in results:
        assert r.status == 201, await r.text()
        r.release()
    views = await wait_for_async(lambda: views_of(fresh, members, lambda v: v[0] == v[1] and {
        x.url for x in extra} <= set(v[0])), 3, "one id per worker in both")
    assert len(set(views[0].values())) == len(views[0]), views


async def test_a_second_group_on_the_same_ports_is_refused(procs: Procs, fresh: aiohttp.ClientSession,
                                                          tmp_path: Path) -> None:
    p, d = procs.pair()
    _, _, _, cfg = await start_group(procs, tmp_path, "", p, d)
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "pdgate", "serve", "--config", str(cfg),
                                                    "--workers", "2"],
                              capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "in use" in out.stderr, out.stderr[-500:]


async def test_processes_stop_when_their_supervisor_dies_before_they_are_up(procs: Procs, tmp_path: Path) -> None:
    p, d = procs.pair()
    port, admin = free_port(), free_port()
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {admin}\n" + workers_toml([p], [d]))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name="group")
    kids = await wait_for(lambda: gateways_of(sup.pid) if len(gateways_of(sup.pid)) == 2 else None, 10, "spawned")
    store = redis_of(sup.pid)
    assert store is not None, "the group's own redis-server"
    assert sup.popen is not None
    sup.popen.kill()  # before they got far: they learn of it from the pid it gave them, not their first parent
    sup.popen.wait(5)
    await wait_for(lambda: all(dead(k) for k in kids), 15, "the processes stop by themselves")
    await wait_for(lambda: dead(store), 5, "the group's redis-server stops with its supervisor")


async def test_a_frozen_process_is_killed_and_restarted(procs: Procs, fresh: aiohttp.ClientSession,
                                                       tmp_path: Path) -> None:
    p, d = procs.pair()
    sup, url, _, _ = await start_group(procs, tmp_path, "", p, d)
    victim = sorted(gateways_of(sup.pid))[0]
    os.kill(victim, signal.SIGSTOP)  # alive, holding its share of the port, answering nothing
    try:
        await wait_for(lambda: victim not in gateways_of(sup.pid) and len(gateways_of(sup.pid)) == 2, 25,
                       "the supervisor kills and replaces it")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    wait_http(url + "/readiness", proc=sup.popen)
    statuses = [s for s, _ in await asyncio.gather(*(post(fresh, url, CHAT) for _ in range(10)))]
    assert statuses == [200] * 10


def test_what_a_group_needs_of_the_config_is_not_asked_of_one_process() -> None:
    from pdgate.core.config import ConfigError, GatewayConfig

    on_a_socket = GatewayConfig(admin_socket="/tmp/pdgate-admin.sock")
    multi.check(on_a_socket, 1)  # one process: an admin socket is fine, as it always was
    with pytest.raises(ConfigError, match="admin_socket"):
        multi.check(on_a_socket, 2)
    with pytest.raises(ConfigError, match=r"1\.\.64"):
        multi.check(GatewayConfig(), 0)


async def test_a_killed_process_of_a_group_leaves_nothing_pinned(procs: Procs, fresh: aiohttp.ClientSession,
                                                                  tmp_path: Path) -> None:
    """``--workers 2`` on engines without the fixes (their first abort in the inflight queue lost, the KV acks
    dropped), streams through both processes, one SIGKILLed: its pins are aborted by rid — by its sibling or by the
    process the supervisor starts in its place, whichever claims it first — within interval + grace + 10 s, long
    before its registry entry would expire (lease 60 s): a process of the same state directory that is not running
    is gone for certain."""
    from tests.pdgate.test_reconcile import pinning_sims, wait_held

    sims = pinning_sims(procs, "exact")
    port, admin = free_port(), free_port()
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[gateway]\nport = {port}\nadmin_port = {admin}\naccess_log = false\nstate_dir = "{tmp_path}/s"\n'
                   "[reconcile]\ninterval_s = 0.5\ngrace_s = 1.0\n[store]\nlease_s = 60\nheartbeat_s = 0.5\n"
                   + workers_toml(sims[:2], sims[2:]))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name="group")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readiness", proc=sup.popen)
    members = await group_members(sup.pid)
    # ~8 s at the decodes' --speed 15: every stream decoding at once, with room for the prefills' learned limits to
    # grow from 4 (test_reconcile's 30 streams of 4 s missed that moment 1 in 9 runs)
    body = {**CHAT, "stream": True, "max_tokens": 120}

    async def one() -> str:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with fresh.post(url + "/v1/chat/completions", json=body) as r:
                rid = r.headers["x-request-id"]
                async for _ in r.content.iter_any():
                    pass
                return rid
        return ""

    tasks = [asyncio.create_task(one()) for _ in range(16)]
    await wait_for_async(lambda: _held(fresh, sims, 16), 20, "every stream decoding")
    await recorded(tmp_path / "s", 16)  # the processes' records hold every stream: a kill loses none of them
    victim = members[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    done = await asyncio.gather(*tasks)
    killed_at = time.monotonic()
    await wait_for(lambda: dead(victim), 5, "the killed process exits")
    assert 0 < sum(1 for r in done if not r) < 16, "the kernel spread the streams over both processes"
    await wait_held(fresh, sims, 0, within=0.5 + 1.0 + 10)
    assert time.monotonic() - killed_at < 60
    await wait_for(lambda: len(gateways_of(sup.pid)) == 2 and victim not in gateways_of(sup.pid), 15,
                   "the supervisor starts a process in its place")

    async def reaped() -> bool:  # the group's counters, summed: whichever process claimed the dead one
        async with fresh.get(f"http://127.0.0.1:{admin}/metrics") as r:
            return 'pdgate_reconcile_aborts_total{mode="gone",worker="p' in await r.text()

    await wait_for_async(reaped, 5, "the dead process's rids aborted as a gone instance's")
    sup.stop(signal.SIGTERM)
    assert not list((tmp_path / "s" / "instances").glob("*.json")), "a clean stop leaves no record"


async def _held(http: aiohttp.ClientSession, sims: list[Any], n: int) -> bool:
    from tests.pdgate.test_reconcile import engine_held

    return await engine_held(http, [s for s in sims if s.role == "decode"]) >= n


@pytest.mark.parametrize("stops_first", [True, False])
async def test_the_groups_redis_is_not_started_again_while_the_group_stops(tmp_path: Path, stops_first: bool) -> None:
    """An operator's Ctrl-C reaches the supervisor's whole process group: the redis-server exits at once while the
    gateway processes still drain. Its watcher must not start another one then (it did, and one started while
    the group was being stopped could outlive it). Switched off (the watcher told only at the very end, as
    before), it starts one during the drain."""
    from pdgate.planes.redis_server import RedisServer

    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()

    class Proc:  # the group's redis-server, and one gateway process that takes a second to drain
        returncode: int | None = None

        def __init__(self, wait_s: float, fut: asyncio.Future[int] | None = None) -> None:
            self.wait_s, self.fut, self.pid = wait_s, fut, 0

        async def wait(self) -> int:
            if self.fut is not None:
                return await self.fut
            await asyncio.sleep(self.wait_s)
            self.returncode = 0
            return 0

        def send_signal(self, sig: int) -> None: ...

        def terminate(self) -> None: ...

    group = multi.ProcessGroup([], 1, drain_s=0.0)
    group.children[0].proc = Proc(1.0)  # type: ignore[assignment]
    rs = RedisServer(tmp_path, StoreConfig(), 1)
    started: list[float] = []

    async def start() -> None:
        started.append(loop.time())

    rs.start = start  # type: ignore[method-assign]
    rs.proc = Proc(0.0, exited)  # type: ignore[assignment]
    group.redis = rs if stops_first else None  # switched off: stop() does not tell the watcher first
    watcher = asyncio.create_task(rs.watch())
    exited.set_result(-2)  # redis-server got the Ctrl-C
    await group.stop()
    if not stops_first:
        rs.stopping = True  # what RedisServer.stop() did, after the drain
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    assert bool(started) is not stops_first, started
