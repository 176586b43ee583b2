"""``pdgate serve --workers N``: processes that share one port, an admin plane that answers for all of them, a
supervisor that restarts the one that dies (``pdgate.multi``, ``pdgate.siblings``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from pdgate import multi, siblings
from pdgate.config import ReconcileConfig
from pdgate.reconcile import Reconciler
from tests.engine.simclient import gauge
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
                   "[reconcile]\ninterval_s = 0.3\ngrace_s = 0.5\nlease_s = 1.5\n" + workers_toml([p], [d]))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name="group")
    url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    wait_http(url + "/readiness", proc=sup.popen)
    first = await wait_for(lambda: children(sup.pid) if len(children(sup.pid)) == 2 else None, 10, "two processes")

    async def lease_names_both() -> Any:
        async with fresh.get(admin_url + "/v1/lease") as r:
            body = await r.json()
        return body if len(body.get("instances", [])) == 2 else None

    end = time.monotonic() + 10
    while not await lease_names_both():
        assert time.monotonic() < end, "both processes' record files are read"
        await asyncio.sleep(0.1)

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
    async with fresh.get(admin_url + "/metrics") as r:
        text = await r.text()
    assert 'pdgate_requests_total{outcome="completed",route="/v1/chat/completions"} 12.0' in text, \
        "the counters of both processes, summed"

    # one process dies: the other keeps serving, the supervisor starts a new one (a new instance id)
    victim = sorted(first)[0]
    os.kill(victim, signal.SIGKILL)
    # its listening sockets close when all its threads have exited: a connection made before then could
    # land in its accept queue and be reset, as with any process that dies (SO_REUSEPORT does not move it)
    await wait_for(lambda: dead(victim), 5, "the killed process exits")
    statuses = [s for s, _ in await asyncio.gather(*(post(fresh, url, CHAT) for _ in range(20)))]
    assert statuses == [200] * 20
    now = await wait_for(lambda: children(sup.pid) if len(children(sup.pid)) == 2 and victim not in
                         children(sup.pid) else None, 10, "the supervisor restarts the dead process")
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


async def test_a_change_on_the_admin_plane_is_made_by_every_process(procs: Procs, fresh: aiohttp.ClientSession,
                                                                   tmp_path: Path) -> None:
    p, d = procs.pair()
    d2 = procs.sim("decode")
    port, admin = free_port(), free_port()
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {admin}\naccess_log = false\n" + workers_toml([p], [d]))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name="group")
    admin_url = f"http://127.0.0.1:{admin}"
    wait_http(f"http://127.0.0.1:{port}/readiness", proc=sup.popen)
    await wait_for(lambda: group_members(sup.pid), 10, "both processes announced")
    async with fresh.post(admin_url + "/v1/workers", json={"role": "decode", "url": d2.url}) as r:
        assert r.status == 201, await r.text()
        assert "x-pdgate-siblings-failed" not in r.headers
    for _ in range(6):
        async with fresh.get(admin_url + "/v1/workers") as r:
            body = await r.json()
        assert body["processes"]["answered"] == 2
        assert d2.url in {w["url"] for w in body["workers"]}, "whichever process answers routes to it"
    # each process on its own (the header asks one alone): both have it
    for m in await wait_for(lambda: group_members(sup.pid), 5, "record files"):
        async with fresh.get(m["admin"] + "/v1/workers", headers={siblings.LOCAL: "1"}) as r:
            assert d2.url in {w["url"] for w in (await r.json())["workers"]}
    # a process started after the change (here: restarted) routes to the worker too, though its config lacks it
    victim = sorted(children(sup.pid))[0]
    os.kill(victim, signal.SIGKILL)
    members = await wait_for(lambda: [m for m in group_members(sup.pid) if m["pid"] != victim] if len(
        [m for m in group_members(sup.pid) if m["pid"] != victim]) == 2 else None, 15, "restarted and announced")
    views = []
    for m in members:
        async with fresh.get(m["admin"] + "/v1/workers", headers={siblings.LOCAL: "1"}) as r:
            views.append({w["url"]: w["id"] for w in (await r.json())["workers"]})
    assert d2.url in views[0] and views[0] == views[1], f"the same workers under the same ids: {views}"
    # so a removal made by every process names the same worker in each
    async with fresh.delete(f"{admin_url}/v1/workers/{views[0][d2.url]}") as r:
        assert r.status == 200 and "x-pdgate-siblings-failed" not in r.headers, await r.text()
    for m in members:
        async with fresh.get(m["admin"] + "/v1/workers", headers={siblings.LOCAL: "1"}) as r:
            assert d2.url not in {w["url"] for w in (await r.json())["workers"]}


def group_members(pid: int) -> list[dict[str, Any]]:
    """The record files of a supervisor's processes (found through a child's environment)."""
    for child in children(pid):
        try:
            env = dict(x.split("=", 1) for x in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in x)
        except OSError:
            continue
        if multi.ENV_DIR in env:
            members = multi.Group(Path(env[multi.ENV_DIR]), -1).members()
            return members if len(members) == 2 else []
    return []


def test_the_workers_flag_is_taken_out_of_what_each_process_runs() -> None:
    argv = ["serve", "--workers", "3", "--port", "1", "--workers=2", "--decode", "http://x:1"]
    assert multi.without_workers_flag(argv) == ["serve", "--port", "1", "--decode", "http://x:1"]


def test_metrics_of_processes_are_summed_by_label_set() -> None:
    a = ('# HELP pdgate_requests_total Requests\n# TYPE pdgate_requests_total counter\n'
         'pdgate_requests_total{outcome="completed"} 3.0\npdgate_requests_total{outcome="failed"} 1.0\n'
         '# HELP pdgate_live gauge\n# TYPE pdgate_live gauge\npdgate_live 2.0\n')
    b = ('# HELP pdgate_requests_total Requests\n# TYPE pdgate_requests_total counter\n'
         'pdgate_requests_total{outcome="completed"} 4.0\n# HELP pdgate_live gauge\n# TYPE pdgate_live gauge\n'
         'pdgate_live 5.0\n')
    out = siblings.merge_metrics([a, b]).decode()
    assert 'pdgate_requests_total{outcome="completed"} 7.0' in out
    assert 'pdgate_requests_total{outcome="failed"} 1.0' in out
    assert "pdgate_live 7.0" in out and "# TYPE pdgate_requests_total counter" in out


def test_a_siblings_instance_never_lapses_and_without_its_record_it_would(tmp_path: Path) -> None:
    """The safety: a sibling's live rids are not orphans. With the record files switched off (no siblings), the
    same sibling lapses after lease_s and its requests would be aborted."""
    clock = [100.0]

    async def no_peers() -> None:
        return None

    cfg: Any = SimpleNamespace(reconcile=ReconcileConfig(lease_s=1.5), peers=())
    on, off = (Reconciler(cfg, "aa", None, None, None, deque(), None, lambda: clock[0])  # type: ignore[arg-type]
               for _ in range(2))
    on.siblings = lambda: ["bb"]
    for r in (on, off):
        asyncio.run(r.refresh_leases())
        assert not r.lapsed("bb")  # first sight starts the clock
    clock[0] += 2.0
    for r in (on, off):
        asyncio.run(r.refresh_leases())
    assert not on.lapsed("bb")
    assert off.lapsed("bb"), "without the siblings' records the sibling's rids would be aborted"


def test_a_pool_takes_a_siblings_ids_and_goes_on_from_them() -> None:
    from pdgate.config import BreakerConfig, WorkerSpec
    from pdgate.workers import Pool

    pool = Pool(BreakerConfig(), lambda kind: None)  # type: ignore[arg-type,return-value]
    assert pool.add(WorkerSpec(url="http://127.0.0.1:1", role="decode")).id == "d0"
    assert pool.add(WorkerSpec(url="http://127.0.0.1:2", role="decode"), "d5").id == "d5"
    assert pool.add(WorkerSpec(url="http://127.0.0.1:3", role="decode")).id == "d6"
    with pytest.raises(ValueError):
        pool.add(WorkerSpec(url="http://127.0.0.1:4", role="decode"), "d5")
    with pytest.raises(ValueError):
        pool.add(WorkerSpec(url="http://127.0.0.1:4", role="decode"), "p9")
    pool.continue_ids({"decode": 9, "prefill": 2})
    assert pool.next_ids == {"decode": 9, "prefill": 2}
    assert pool.add(WorkerSpec(url="http://127.0.0.1:5", role="prefill", bootstrap_port=9)).id == "p2"


async def start_group(procs: Procs, tmp_path: Path, extra: str = "", *workers: Any, name: str = "group") -> Any:
    port, admin = free_port(), free_port()
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f"[gateway]\nport = {port}\nadmin_port = {admin}\naccess_log = false\n{extra}"
                   + workers_toml([workers[0]], list(workers[1:])))
    sup = procs.spawn([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg), "--workers", "2"], name=name)
    wait_http(f"http://127.0.0.1:{port}/readiness", proc=sup.popen)
    await wait_for(lambda: group_members(sup.pid), 10, "both processes announced")
    return sup, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", cfg


async def test_a_group_drains_on_sigterm_without_its_processes_aborting_each_other(
        procs: Procs, fresh: aiohttp.ClientSession, tmp_path: Path) -> None:
    """While a process drains its record stays (marked draining): its siblings do not take its live rids for a dead
    instance's, even with drain_s well past lease_s (the record withdrawn first: they were aborted at lease_s)."""
    p = procs.sim("prefill", "--fixes", "none")
    d = procs.sim("decode", "--fixes", "none", "--speed", "15")
    sup, url, _, _ = await start_group(procs, tmp_path, "drain_s = 10\n[reconcile]\ninterval_s = 0.3\ngrace_s = 0.5\n"
                                       "lease_s = 1.5\n", p, d)
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
    """Two registrations at the same moment, each to another process: the leader names both, so an id means one
    worker in every process."""
    p, d = procs.pair()
    extra = [procs.sim("decode"), procs.sim("decode")]
    sup, _, _, _ = await start_group(procs, tmp_path, "", p, d)
    members = group_members(sup.pid)
    results = await asyncio.gather(*(fresh.post(m["admin"] + "/v1/workers", json={"role": "decode", "url": x.url})
                                     for m, x in zip(members, extra, strict=True)))
    for r in results:
        assert r.status == 201, await r.text()
        assert "x-pdgate-siblings-failed" not in r.headers
        r.release()
    views = []
    for m in members:
        async with fresh.get(m["admin"] + "/v1/workers", headers={siblings.LOCAL: "1"}) as r:
            views.append({w["id"]: w["url"] for w in (await r.json())["workers"]})
    assert views[0] == views[1] and {x.url for x in extra} <= set(views[0].values()), views


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
    kids = await wait_for(lambda: children(sup.pid) if len(children(sup.pid)) == 2 else None, 10, "spawned")
    assert sup.popen is not None
    sup.popen.kill()  # before they got far: they learn of it from the pid it gave them, not their first parent
    sup.popen.wait(5)
    await wait_for(lambda: all(dead(k) for k in kids), 15, "the processes stop by themselves")


async def test_a_frozen_process_is_killed_and_restarted(procs: Procs, fresh: aiohttp.ClientSession,
                                                       tmp_path: Path) -> None:
    p, d = procs.pair()
    sup, url, _, _ = await start_group(procs, tmp_path, "", p, d)
    victim = sorted(children(sup.pid))[0]
    os.kill(victim, signal.SIGSTOP)  # alive, holding its share of the port, answering nothing
    try:
        await wait_for(lambda: victim not in children(sup.pid) and len(children(sup.pid)) == 2, 25,
                       "the supervisor kills and replaces it")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    wait_http(url + "/readiness", proc=sup.popen)
    statuses = [s for s, _ in await asyncio.gather(*(post(fresh, url, CHAT) for _ in range(10)))]
    assert statuses == [200] * 10


def test_what_a_group_needs_of_the_config_is_not_asked_of_one_process() -> None:
    from pdgate.config import ConfigError, GatewayConfig

    on_a_socket = GatewayConfig(admin_socket="/tmp/pdgate-admin.sock")
    multi.check(on_a_socket, 1)  # one process: an admin socket is fine, as it always was
    with pytest.raises(ConfigError, match="admin_socket"):
        multi.check(on_a_socket, 2)
    with pytest.raises(ConfigError, match=r"1\.\.64"):
        multi.check(GatewayConfig(), 0)
