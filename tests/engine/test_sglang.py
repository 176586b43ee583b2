"""engine/sglang without a GPU: golden command lines, the kernel-profile guard, the patches'
logic against stand-ins that mirror SGLang 0.5.23's signatures, and a compatibility check of
the patch targets against the installed SGLang source (``pip install --no-deps sglang==0.5.23``)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.sglang import patches
from engine.sglang.plan import UnsafeProfile, environment, plan
from engine.supervisor import load_cluster
from tests.procs import ROOT

FAILED, BOOTSTRAPPING, TRANSFERRING, SUCCESS = 0, 1, 3, 4  # KVPoll


def test_plan_golden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    workers = plan(ROOT / "config" / "cluster.sm120-8gpu.toml")
    assert [w["name"] for w in workers] == ["prefill-0", "decode-0"]
    py = sys.executable
    assert workers[0]["command"] == [
        py, "-m", "engine.sglang.worker", "--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--host", "127.0.0.1",
        "--port", "30310", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nixl",
        "--tp-size", "4", "--dp-size", "1", "--enable-metrics", "--disaggregation-bootstrap-port", "30913",
        "--served-model-name", "deepseek-v4-flash", "--mem-fraction-static", "0.85", "--trust-remote-code"]
    assert workers[1]["command"][workers[1]["command"].index("--disaggregation-mode") + 1] == "decode"
    assert "--disaggregation-bootstrap-port" not in workers[1]["command"]
    assert workers[0]["env"] == {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PDGATE_KERNEL_PROFILE": "sm120-safe",
        "SGLANG_SM120_FLASHMLA_BACKEND": "flashinfer", "SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT": "60",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300", "PYTHONPATH": str(ROOT)}
    assert workers[1]["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    out = subprocess.run([sys.executable, "-m", "engine.sglang", "plan", "--cluster", "config/cluster.sm120-8gpu.toml"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "CUDA_VISIBLE_DEVICES=4,5,6,7" in out.stdout
    cluster = load_cluster(ROOT / "config" / "cluster.sm120-8gpu.toml")  # the supervisor runs the same lines
    assert cluster.workers[0].command() == workers[0]["command"]
    assert dict(cluster.workers[0].env)["PDGATE_KERNEL_PROFILE"] == "sm120-safe"


def test_kernel_profile_guard_refuses_the_known_bad_knob(tmp_path: Path) -> None:
    bad = {"name": "decode-0", "role": "decode", "port": 1, "model": "m", "kernel_profile": "sm120",
           "env": {"SGLANG_SM120_MMA_TARGET_CTAS": "512"}}
    with pytest.raises(UnsafeProfile, match="stalls long-context decode"):
        environment(bad)
    env, warnings = environment(bad, allow_unsafe=True)
    assert warnings and env["PDGATE_KERNEL_PROFILE"] == "sm120-safe+unsafe"  # part of the worker's identity
    assert environment({**bad, "role": "prefill"})[1] == []  # the knob is known-bad for decode only
    assert environment({**bad, "env": {"SGLANG_SM120_MMA_TARGET_CTAS": "256"}})[1] == []
    f = tmp_path / "c.toml"
    f.write_text('[[worker]]\nname = "d"\nengine = "sglang"\nrole = "decode"\nport = 1\nmodel = "m"\n'
                 'kernel_profile = "sm120"\nenv = { SGLANG_SM120_MMA_TARGET_CTAS = "512" }\n')
    out = subprocess.run([sys.executable, "-m", "engine.sglang", "plan", "--cluster", str(f)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "plan refused" in out.stderr
    with pytest.raises(UnsafeProfile):
        load_cluster(f)


# ---- stand-ins mirroring SGLang 0.5.23 ----------------------------------------------------------
class KVManager:
    def __init__(self, defer: bool = False, bootstrap_timeout: float = 300) -> None:
        self.request_status: dict[int, int] = {}
        self.failures: dict[int, str] = {}
        self.defer_decode_allocation = defer
        self.bootstrap_timeout = bootstrap_timeout
        self.deferred_bootstrap: Any = object() if defer else None

    def record_failure(self, room: int, reason: str) -> None:
        self.failures[room] = reason

    def update_status(self, room: int, status: int) -> None:
        self.request_status[room] = status


class CommonKVSender:
    """poll / abort / _check_bootstrap_timeout as in sglang/srt/disaggregation/common/conn.py."""

    def __init__(self, mgr: KVManager, room: int, owns: bool = True, init_time: float = 0.0) -> None:
        self.kv_mgr, self.bootstrap_room, self._owns_bootstrap_room = mgr, room, owns
        self.conclude_state: int | None = None
        self.init_time = init_time
        self._prefill_complete_time: float | None = None
        mgr.request_status[room] = BOOTSTRAPPING
        self.now = init_time

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.request_status.get(self.bootstrap_room, FAILED)
        if status == BOOTSTRAPPING and (t := self._check_bootstrap_timeout()) is not None:
            status = t
        if status in (SUCCESS, FAILED):
            self.conclude_state = status
        return status

    def _check_bootstrap_timeout(self) -> int | None:
        start = self._prefill_complete_time if self.kv_mgr.defer_decode_allocation else self.init_time
        if start is None:
            return None
        if self.now - start < self.kv_mgr.bootstrap_timeout:
            return None
        self.kv_mgr.update_status(self.bootstrap_room, FAILED)
        return FAILED

    def abort(self) -> None:
        if self.kv_mgr.deferred_bootstrap is not None and not self._owns_bootstrap_room:
            return
        self.kv_mgr.update_status(self.bootstrap_room, FAILED)
        self.conclude_state = FAILED


class Req:
    def __init__(self, rid: str, sender: CommonKVSender) -> None:
        self.rid, self.bootstrap_room, self.disagg_kv_sender = rid, sender.bootstrap_room, sender
        self.status: int | None = None


def conclude(sched: Any, polls: list[int]) -> list[Req]:
    """Success -> 200 and out, Failed -> 500 and out (handle_inflight_transfer_failure), else stay."""
    done, undone = [], []
    for req, poll in zip(sched.disagg_prefill_inflight_queue, polls, strict=True):
        if poll in (SUCCESS, FAILED):
            req.status = 200 if poll == SUCCESS else 500
            done.append(req)
        else:
            undone.append(req)
    sched.disagg_prefill_inflight_queue = undone
    return done


class SchedulerDisaggregationPrefillMixin:
    """process_disagg_prefill_inflight_queue: MIN all-reduce of polls across ranks, Failed -> 500 and out."""

    def __init__(self, reqs: list[Req]) -> None:
        self.disagg_prefill_inflight_queue = reqs

    def process_disagg_prefill_inflight_queue(self, rids_to_check: Any = None) -> list[Req]:
        return conclude(self, [r.disagg_kv_sender.poll() for r in self.disagg_prefill_inflight_queue])


def fresh_classes() -> tuple[type, type]:
    mixin = type("Mixin", (SchedulerDisaggregationPrefillMixin,), {})
    sender = type("Sender", (CommonKVSender,), {})
    return mixin, sender


@pytest.mark.parametrize("fixed", [False, True])
def test_fix_c_inflight_watchdog(fixed: bool, caplog: pytest.LogCaptureFixture) -> None:
    mixin, sender_cls = fresh_classes()
    clock = [0.0]
    fired: list[str] = []
    if fixed:
        patches.patch_inflight_watchdog(mixin, FAILED, timeout=lambda: 60, clock=lambda: clock[0],
                                        on_force_fail=lambda req, age: fired.append(req.rid))
    mgr = KVManager()
    s = sender_cls(mgr, room=7)
    mgr.request_status[7] = TRANSFERRING  # a silent peer: never Success, never Failed
    req = Req("r7", s)
    sched = mixin([req])
    for t in range(0, 200, 5):
        clock[0] = float(t)
        sched.process_disagg_prefill_inflight_queue()
    if fixed:
        assert req.status == 500 and sched.disagg_prefill_inflight_queue == [] and fired == ["r7"]
        assert "force-failing rid=r7" in caplog.text and mgr.failures[7].startswith("inflight watchdog")
    else:
        assert req.status is None and sched.disagg_prefill_inflight_queue == [req], "upstream: pinned forever"


class AllReduceMin:
    """poll_and_all_reduce: every rank contributes its local polls, all get the elementwise MIN."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.slots: dict[int, list[int]] = {}

    def __call__(self, rank: int, polls: list[int]) -> list[int]:
        self.slots[rank] = polls
        self.barrier.wait()
        out = [min(col) for col in zip(*self.slots.values(), strict=True)]
        self.barrier.wait()
        return out


class TPRank(SchedulerDisaggregationPrefillMixin):
    def __init__(self, reqs: list[Req], rank: int, reduce: AllReduceMin) -> None:
        super().__init__(reqs)
        self.rank, self.reduce = rank, reduce

    def process_disagg_prefill_inflight_queue(self, rids_to_check: Any = None) -> list[Req]:
        polls = self.reduce(self.rank, [r.disagg_kv_sender.poll() for r in self.disagg_prefill_inflight_queue])
        return conclude(self, polls)


def test_fix_c_is_consistent_across_tp_ranks() -> None:
    """Each rank has its own clock and first saw the request at its own time (rank 1: 5 s later); the
    MIN all-reduce still drops it on every rank in the same round, in whatever order the ranks run."""
    reduce = AllReduceMin(2)
    clocks = [0.0, 0.0]
    ranks, reqs = [], []
    for i in range(2):
        cls = type(f"Rank{i}", (TPRank,), {})
        patches.patch_inflight_watchdog(cls, FAILED, timeout=lambda: 60, clock=lambda i=i: clocks[i])
        mgr = KVManager()
        s = CommonKVSender(mgr, room=9)
        mgr.request_status[9] = TRANSFERRING
        reqs.append(Req("r9", s))
        reqs[-1]._pdgate_inflight_since = 5.0 * i  # type: ignore[attr-defined]
        ranks.append(cls([reqs[-1]], i, reduce))
    for t in (0.0, 50.0, 61.0, 62.0):
        clocks[0], clocks[1] = t, t + 0.25
        threads = [threading.Thread(target=r.process_disagg_prefill_inflight_queue) for r in reversed(ranks)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(5)
        lengths = [len(r.disagg_prefill_inflight_queue) for r in ranks]
        assert lengths[0] == lengths[1], f"ranks diverged at t={t}: {lengths}"
    assert [q.status for q in reqs] == [500, 500]
    assert getattr(reqs[1], "_pdgate_force_failed", False) is False, "rank 1 never fired itself: rank 0's Failed won"


@pytest.mark.parametrize("fixed", [False, True])
def test_fix_a_abort_during_transfer_always_releases(fixed: bool) -> None:
    mixin, sender_cls = fresh_classes()
    if fixed:
        patches.patch_abort_concludes(sender_cls, FAILED)
    mgr = KVManager(defer=True)
    s = sender_cls(mgr, room=3, owns=False)  # deferred bootstrap, room owned by another sender
    mgr.request_status[3] = TRANSFERRING
    req = Req("r3", s)
    sched = mixin([req])
    s.abort()  # what Scheduler.abort_request does for inflight requests
    sched.process_disagg_prefill_inflight_queue()
    if fixed:
        assert req.status == 500 and sched.disagg_prefill_inflight_queue == []
    else:
        assert req.status is None and sched.disagg_prefill_inflight_queue == [req], "upstream: the abort is lost"


@pytest.mark.parametrize("fixed", [False, True])
def test_fix_b_bootstrap_wait_is_bounded(fixed: bool) -> None:
    _, sender_cls = fresh_classes()
    clock = [0.0]
    if fixed:
        patches.patch_bounded_bootstrap(sender_cls, FAILED, clock=lambda: clock[0])
    mgr = KVManager(defer=True, bootstrap_timeout=300)
    s = sender_cls(mgr, room=5, init_time=0.0)  # decode never arrives; prefill not complete yet
    for t in (100.0, 299.0, 301.0, 10_000.0):
        clock[0] = s.now = t
        state = s.poll()
    assert state == (FAILED if fixed else BOOTSTRAPPING)


def _installed_sglang() -> Path | None:
    try:
        spec = importlib.util.find_spec("sglang")  # finds, does not import (sglang would import torch)
    except (ImportError, ValueError):
        return None
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


SGLANG = _installed_sglang()


@pytest.mark.skipif(SGLANG is None, reason="sglang not installed: pip install --no-deps sglang==0.5.23")
def test_patch_targets_exist_in_installed_sglang() -> None:
    assert importlib.metadata.version("sglang") in patches.SUPPORTED_VERSIONS
    assert SGLANG is not None
    for fix, (module, cls, method, params) in patches.TARGETS.items():
        tree = ast.parse((SGLANG.parent / (module.replace(".", "/") + ".py")).read_text())
        klass = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
        assert klass is not None, f"fix {fix}: class {cls} missing in {module}"
        fn = next((n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
        assert fn is not None, f"fix {fix}: {cls}.{method} missing"
        names = tuple(a.arg for a in fn.args.args)
        assert names[: len(params)] == params, f"fix {fix}: {cls}.{method}{names}"
    conn = ast.parse((SGLANG / "srt" / "disaggregation" / "base" / "conn.py").read_text())
    kvpoll = next(n for n in ast.walk(conn) if isinstance(n, ast.ClassDef) and n.name == "KVPoll")
    values = {t.targets[0].id: t.value.value for t in kvpoll.body if isinstance(t, ast.Assign)}  # type: ignore[attr-defined]
    assert values["Failed"] == 0, "fix C's cross-rank consistency relies on Failed being the minimum"
    common = (SGLANG / "srt" / "disaggregation" / "common" / "conn.py").read_text()
    for attr in ("conclude_state", "_prefill_complete_time", "defer_decode_allocation", "init_time", "record_failure"):
        assert attr in common, f"the patches rely on {attr}"
