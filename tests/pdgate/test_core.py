"""Pure core: record transitions, deadline resolution, policies, config validation. No event loop."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdgate.core import config, deadlines
from pdgate.core.config import BreakerConfig, Budgets, DeadlineConfig
from pdgate.core.errors import InvalidDeadline, InvalidField, UpstreamStatus
from pdgate.core.record import ALLOWED, TERMINAL, IllegalTransition, Phase, Record, transition
from pdgate.core.validation import validate
from pdgate.observe.traces import Traces
from pdgate.pool import policies
from pdgate.pool.workers import Breaker, CircuitBreaker

ROOT = Path(__file__).resolve().parents[2]


def rec(now: float = 100.0, total: float = 10, ttft: float = 3, idle: float = 2) -> Record:
    d = deadlines.resolve(now, {}, None, None, DeadlineConfig(total_s=total, ttft_s=ttft, idle_s=idle))
    return Record(id="pdg-x", route="/generate", model=None, stream=True, created=now, created_wall=0, deadlines=d)


IO = ("asyncio", "h1lite.server", "h1lite.client", "httptools", "uvloop", "aiohttp")  # today's I/O layer, and the old one


# every module of the pure core, and the pure ones of the layers above it
PURE = [f"core.{p.stem}" for p in sorted((ROOT / "pdgate" / "core").glob("*.py")) if p.stem != "__init__"] + [
    "apis.responses", "apis.anthropic", "observe.traces", "pool.policies", "pool.workers", "pool.capacity", "path.auth"]


@pytest.mark.parametrize("module", PURE)
def test_core_modules_import_no_io(module: str) -> None:
    code = f"import sys, pdgate.{module}; print(' '.join(m for m in {IO!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"pdgate.{module} pulls in {out.stdout.strip()}"


def test_transitions_follow_the_table_and_stamp_outcomes() -> None:
    r = rec()
    seen = []
    obs = (lambda rc, a, b, spent: seen.append((a, b, spent)),)
    transition(r, Phase.DISPATCHED, 100.5, obs)
    transition(r, Phase.PREFILL, 100.5, obs)
    transition(r, Phase.DECODE, 101.0, obs)
    with pytest.raises(IllegalTransition):
        transition(r, Phase.QUEUED, 101.1)
    transition(r, Phase.COMPLETED, 102.0, obs, reason=None)
    assert r.outcome is Phase.COMPLETED and r.ended_phase is Phase.DECODE and r.finished_at == 102.0
    assert [h[1] for h in r.history] == ["queued", "dispatched", "prefill", "decode", "completed"]
    assert seen[-1] == (Phase.DECODE, Phase.COMPLETED, 1.0)
    for t in TERMINAL:
        assert not ALLOWED[t], "terminal phases are final"
        with pytest.raises(IllegalTransition):
            transition(r, t, 103.0)


def test_deadline_due_moves_from_ttft_to_idle_to_total() -> None:
    r = rec(total=10, ttft=3, idle=2)
    assert r.deadlines.due(None, None) == ("ttft", 103.0)
    assert r.deadlines.due(101.0, 101.0) == ("idle", 103.0)
    assert r.deadlines.due(101.0, 109.0) == ("total", 110.0)
    long_ttft = rec(total=5, ttft=30)
    assert long_ttft.deadlines.due(None, None) == ("total", 105.0)


def test_the_due_time_only_moves_later_once_the_first_token_came() -> None:
    """The watchdog is armed at admission and re-armed at the first token only; tokens after that never
    touch it, so it is never late only if each later token moves the due time later, never earlier.
    The first token itself may move it earlier (TTFT -> idle): hence the re-arm there."""
    rng = random.Random(7)
    moved_earlier_at_first = 0
    for _ in range(2000):
        total, ttft, idle = (rng.choice([0.1, 1, 2, 5, 60, 600]) for _ in range(3))
        r = rec(total=total, ttft=ttft, idle=idle)
        stream = rng.random() < 0.7
        before = r.deadlines.due(None, None, stream)[1]
        first = 100 + rng.random() * 10
        due = r.deadlines.due(first, first, stream)[1]
        moved_earlier_at_first += due < before
        last = first
        for _ in range(5):
            last += rng.random() * 3
            later = r.deadlines.due(first, last, stream)[1]
            assert later >= due
            due = later
    assert moved_earlier_at_first > 0  # the case the re-arm exists for does occur


def test_non_streaming_requests_have_no_idle_budget() -> None:
    r = rec(total=10, ttft=3, idle=2)
    assert r.deadlines.due(101.0, 101.0, False) == ("total", 110.0)
    assert r.deadlines.due(101.0, 101.0, True) == ("idle", 103.0)


def test_deadline_precedence_and_caps() -> None:
    cfg = DeadlineConfig(total_s=60, ttft_s=20, idle_s=10, max_total_s=100, max_ttft_s=50, max_idle_s=30)
    model = Budgets(total_s=40, ttft_s=None, idle_s=5)
    d = deadlines.resolve(0, {}, None, model, cfg)
    assert (d.total_s, d.ttft_s, d.idle_s) == (40, 20, 5)
    d = deadlines.resolve(0, {}, 30, model, cfg)
    assert d.total_s == 30
    d = deadlines.resolve(0, {"x-pdgate-timeout": "7.5", "x-pdgate-idle-timeout": "999"}, 30, model, cfg)
    assert (d.total_s, d.idle_s, d.total_at) == (7.5, 30, 7.5)
    for bad in ("0", "-1", "x", "inf", "nan", ""):
        with pytest.raises(InvalidDeadline):
            deadlines.resolve(0, {"x-pdgate-ttft-timeout": bad}, None, None, cfg)
    with pytest.raises(InvalidDeadline):
        deadlines.resolve(0, {}, True, None, cfg)


class W:
    def __init__(self, load: int, wid: str = "w") -> None:
        self.load = load
        self.id = wid


def test_policies() -> None:
    rr = policies.make("round_robin")
    assert [rr.select([W(0), W(0), W(0)]) for _ in range(4)] == [0, 1, 2, 0]
    ll = policies.make("least_loaded")
    assert ll.select([W(3), W(1), W(2)]) == 1
    assert {ll.select([W(1), W(1), W(5)]) for _ in range(4)} == {0, 1}
    p2 = policies.PowerOfTwo(rng=lambda a, b: 0)  # samples workers 0 and 1, keeps the less loaded
    assert p2.by_load([5, 1, 2]) == 1 and p2.by_load([1, 5, 2]) == 0 and p2.by_load([7]) == 0
    for name in config.POLICIES:
        assert policies.make(name).select([]) is None
    a, b, c = W(0), W(0), W(0)
    pair = policies.select_pair([a, b], [c], policies.make("least_loaded"), policies.make("least_loaded"),
                                frozenset({id(a)}))
    assert pair == (b, c)
    assert policies.select_pair([a], [c], rr, rr, frozenset({id(a)})) == (a, c), "avoid is a preference"
    assert policies.select_pair([], [c], rr, rr) is None


def test_config_example_loads_and_errors_name_the_key() -> None:
    cfg = config.load(ROOT / "config" / "pdgate.toml")
    assert cfg.prefill and cfg.decode and cfg.prefill[0].bootstrap_port
    with pytest.raises(config.ConfigError, match=r"deadlines.ttf_s"):
        config.from_mapping({"deadlines": {"ttf_s": 3}})
    with pytest.raises(config.ConfigError, match=r"gateway.policy = 'random'"):
        config.from_mapping({"gateway": {"policy": "random"}})
    with pytest.raises(config.ConfigError, match=r"deadlines.total_s"):
        config.from_mapping({"deadlines": {"total_s": 9999}})
    with pytest.raises(config.ConfigError, match=r"prefill\[0\].url"):
        config.from_mapping({"prefill": [{"url": "ftp://x"}]})
    with pytest.raises(config.ConfigError, match=r"health.failures"):
        config.from_mapping({"health": {"failures": 1.5}})
    spec = config.parse_prefill_flag("http://[::1]:30000/", None)
    assert spec.host == "[::1]" and spec.bootstrap_port == 8998 and spec.url == "http://[::1]:30000"


def test_validation_and_error_mapping() -> None:
    assert validate("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}) == ("m", False)
    assert validate("/generate", {"text": "x", "stream": True}) == (None, True)
    with pytest.raises(InvalidField) as e:
        validate("/v1/chat/completions", {"model": "m", "messages": [], "max_tokens": 3})
    assert e.value.param == "messages" and e.value.body()["error"]["param"] == "messages"
    assert UpstreamStatus("x", role="decode", worker="d0", upstream_status=400).status == 400
    assert UpstreamStatus("x", role="decode", worker="d0", upstream_status=429).retryable
    assert not UpstreamStatus("x", role="decode", worker="d0", upstream_status=404).retryable
    assert UpstreamStatus("x", role="decode", worker="d0", upstream_status=503).status == 502


def test_circuit_breaker_opens_cools_down_and_probes_once() -> None:
    b = CircuitBreaker(BreakerConfig(failures=3, cooldown_s=10))
    b.failure(0.0)
    b.failure(1.0)
    assert b.allow(1.0) and b.state is Breaker.CLOSED
    b.failure(2.0)
    assert b.state is Breaker.OPEN and not b.allow(2.0) and not b.allow(11.9)
    assert b.allow(12.0) and b.state is Breaker.HALF_OPEN  # cooled down: one probe
    b.on_dispatch()
    assert not b.allow(12.1)  # a second request waits for the probe's answer
    b.failure(13.0)  # the probe failed: open again, for a full cooldown
    assert b.state is Breaker.OPEN and not b.allow(22.9) and b.allow(23.0)
    b.on_dispatch()
    b.success()
    assert b.state is Breaker.CLOSED and b.failures == 0 and b.allow(23.1)


def test_finished_traces_are_a_bounded_ring() -> None:
    t = Traces(ring_size=5)
    recs = [Record(id=f"pdg-{i}", route="/generate", model=None, stream=False, created=float(i), created_wall=0,
                   deadlines=rec().deadlines) for i in range(12)]
    for r in recs:
        t.add(r)
    assert len(t.live) == 12
    for r in recs:
        t.finish(r)
    assert not t.live and list(t.finished) == [f"pdg-{i}" for i in range(7, 12)]  # the newest five, oldest first
    assert t.get("pdg-6") is None and t.get("pdg-11") is recs[11]


def test_worker_state_machine_checks_moves_and_tells_observers() -> None:
    from pdgate.core.config import WorkerSpec
    from pdgate.pool.workers import ALLOWED as W_ALLOWED
    from pdgate.pool.workers import IllegalWorkerTransition, Pool, State

    seen: list[tuple[str, str, str, str]] = []
    pool = Pool(BreakerConfig(failures=2, cooldown_s=5), lambda kind: None, observers=(lambda w, a, b, c: seen.append((w.id, a.value, b.value, c)),))
    w = pool.add(WorkerSpec(url="http://127.0.0.1:1", role="decode"))
    assert w.state is State.UNKNOWN and not w.healthy and not w.available(0.0)
    w.transition(State.UP, 0.0, "health check passed")
    assert w.available(0.0)
    w.failure(1.0, "502")
    w.failure(2.0, "502")
    assert w.state is State.BREAKER_OPEN and not w.available(2.0) and w.healthy
    assert w.available(7.0) and w.state is State.HALF_OPEN  # cooled down: one probe
    w.success(7.5)
    assert w.state is State.UP
    with pytest.raises(IllegalWorkerTransition):
        w.transition(State.UNKNOWN, 8.0, "no way back")
    pool.remove(w.id, 9.0)
    assert w.state is State.REMOVED and not W_ALLOWED[State.REMOVED]
    assert [s[2] for s in seen] == ["up", "breaker_open", "half_open", "up", "removed"]
    assert seen[1][3].startswith("breaker opened after 2 failures: 502")
    assert [h[1] for h in w.history] == ["up", "breaker_open", "half_open", "up", "removed"]
