"""The learned limit's rules (pdgate.core.limits), pure: bounded, a monotone back-off under growing delay, recovery
after the engine speeds up again, and a closed-loop model of a serialised engine it must not overfill or empty."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgate.core.limits import Lag, Limiter, LimitRules

RULES = LimitRules(initial=16, floor=1, tolerance=2.0, window_s=10.0, update_s=0.5)


def drive(lim: Limiter, t: float, latency: float, budget: float = 60.0, engine_max: int | None = 1024,
          binding: bool = True, steps: int = 1, per_step: int = 4) -> float:
    """``steps`` updates, each with ``per_step`` samples of ``latency`` (and the limit binding)."""
    for _ in range(steps):
        for _ in range(per_step):
            lim.sample(latency, budget, t, engine_max)
        if binding:
            lim.held_back(t, engine_max)
        t += RULES.update_s
        lim.update(t, engine_max)
    return t


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-4, 100.0), st.integers(0, 50), st.booleans()), min_size=1, max_size=80),
       st.integers(1, 5000), st.one_of(st.none(), st.integers(1, 400)))
def test_bounded_whatever_it_sees(events: list[tuple[float, int, bool]], engine_max: int, cap: int | None) -> None:
    lim = Limiter(LimitRules(cap=cap))
    t = 0.0
    for latency, waiting, bound in events:
        t += 0.3
        lim.sample(latency, 30.0, t, engine_max)
        lim.queue(waiting, t, engine_max)
        if bound:
            lim.held_back(t, engine_max)
        v = lim.value(engine_max)
        assert 1 <= v <= min(engine_max, cap or math.inf)


def test_back_off_is_monotone_while_delay_grows() -> None:
    lim = Limiter(RULES)
    t = drive(lim, 0.0, 0.1, steps=2)  # baseline 0.1 s
    seen = [lim.value(1024)]
    for k in range(1, 12):
        t = drive(lim, t, 0.1 * (2 + k))  # ever slower: every update cuts or holds, never grows
        seen.append(lim.value(1024))
    assert all(b <= a for a, b in itertools.pairwise(seen)), seen
    assert seen[-1] == 1 and seen[0] > 1


def test_it_cuts_on_the_engines_own_queue_and_only_once_per_probe() -> None:
    lim = Limiter(RULES)
    t = drive(lim, 0.0, 0.1, steps=3)
    before = lim.value(1024)
    lim.queue(40, t + 1, 1024)
    assert lim.value(1024) == before, "one probe's queue may be a burst the engine drains"
    lim.queue(40, t + 3, 1024)  # the next check: still there
    cut = lim.value(1024)
    assert cut < before
    for k in range(4, 8):  # no new probe: the same figure does not cut again
        lim.update(t + k, 1024)
    assert lim.value(1024) == cut
    lim.queue(40, t + 9, 1024)  # a third probe, still queued: cut again
    assert lim.value(1024) < cut


@pytest.mark.parametrize("probes", [2, 1])
def test_a_burst_the_engine_drains_by_the_next_check_cuts_nothing(probes: int) -> None:
    """CI's sequence (test_reconcile's 30 pinned streams): a prefill that serialises and answers nothing (held until
    its decode is done), limit 4, requests waiting: doubled to 8 after 1 s; the next check caught 3 of those 4 new
    ones still queued, the next found its queue empty. One probe's queue is a burst, not overload: the limit keeps
    doubling. ``probes=1`` (the mechanism off): cut to 6 at the burst, and the 30 streams never all started."""
    lim = Limiter(dataclasses.replace(RULES, initial=4, queue_probes=probes))
    for k in range(3):
        lim.held_back(0.5 * k, 1024)
    assert lim.value(1024) == 8
    lim.queue(3, 1.5, 1024)  # the burst the doubling sent, caught by a check
    lim.held_back(2.0, 1024)
    lim.queue(0, 3.5, 1024)  # drained by the next check
    lim.held_back(4.0, 1024)
    if probes == 2:
        assert lim.value(1024) == 32 and lim.slow_start, lim.view(1024)
    else:
        assert lim.value(1024) == 6 and not lim.slow_start, lim.view(1024)


@pytest.mark.parametrize("on", [True, False])
def test_a_limit_on_an_engine_that_answers_nothing_grows_back_on_its_clear_queue(on: bool) -> None:
    """Cut on a queue that persisted, on an engine that answers nothing lately (no latency sample can say it keeps
    up): each later probe that finds its queue clear while requests wait grows it by a tenth. ``on=False`` (no
    window without samples, so the mechanism never applies): the cut stays, whatever the engine's queue says."""
    lim = Limiter(dataclasses.replace(RULES, initial=8, window_s=10.0 if on else math.inf))
    if not on:
        lim.sample(0.01, 60.0, -1e9, 1024)  # an answer long ago: with an endless window it always counts
    lim.queue(5, 0.0, 1024)
    lim.queue(5, 2.0, 1024)
    cut = lim.value(1024)
    assert cut < 8 and not lim.slow_start
    for k in range(2, 12):
        lim.held_back(2.0 * k - 0.1, 1024)
        lim.queue(0, 2.0 * k, 1024)
    if on:
        assert lim.value(1024) >= 12 and "queue clear" in lim.history[-1][2], lim.view(1024)
    else:
        assert lim.value(1024) == cut, lim.view(1024)


def test_it_grows_only_when_something_waited_for_it() -> None:
    lim = Limiter(RULES)
    drive(lim, 0.0, 0.1, binding=False, steps=10)
    assert lim.value(1024) == 16
    lim2 = Limiter(RULES)
    drive(lim2, 0.0, 0.1, binding=True, steps=10)
    assert lim2.value(1024) == 16 + 9 * 4  # slow start: one more for every answer in time while requests waited
    lim3 = Limiter(RULES)
    drive(lim3, 0.0, 0.1, binding=True, steps=10, per_step=200)
    assert lim3.value(1024) == 1024  # ... up to the engine's maximum


def test_slow_start_sends_a_slow_engine_no_more_than_its_answers_vouch_for() -> None:
    """A cold start on an engine serving one request at a time in 0.2 s, its answers the only evidence: it grows only
    on answers that show no queueing (here the first, to 5); doubling at the first queued request whatever came back
    (as before) sent it 32 at once, and those dispatched last missed a 1.5 s TTFT budget."""
    lim = Limiter(dataclasses.replace(RULES, initial=4))
    seen = []
    for k in range(1, 5):  # the four first ones waited behind each other in the engine
        lim.held_back(0.2 * k - 0.01, 1024)
        lim.sample(0.2 * k, 1.5, 0.2 * k, 1024)
        seen.append(lim.value(1024))
    assert seen[0] == 5 and max(seen) == 5 and seen[-1] < 5, (seen, lim.view(1024))  # then cut: it queues


def test_before_any_answer_it_doubles_only_once_requests_waited_a_second() -> None:
    """An engine that answers late (a prefill held until its decode is done): no answer at all, requests waiting:
    nothing grows within 2 updates (a cold start's first answers come in that time), then it doubles."""
    lim = Limiter(dataclasses.replace(RULES, initial=4))
    lim.held_back(0.0, 1024)
    lim.held_back(0.55, 1024)
    assert lim.value(1024) == 4, "nothing grows before the first answer, within a second"
    lim.held_back(1.1, 1024)
    assert lim.value(1024) == 8 and "no answer yet" in lim.history[-1][2], lim.view(1024)


def test_recovery_after_the_engine_speeds_up_again() -> None:
    lim = Limiter(RULES)
    t = drive(lim, 0.0, 0.1, steps=2)
    t = drive(lim, t, 1.0, steps=8)  # ten times slower: cut to the floor
    assert lim.value(1024) == 1
    t = drive(lim, t, 0.1, steps=30)  # fast again: it grows back (+0.25 an update while small, then by a tenth)
    assert lim.value(1024) >= 16


def test_the_ttft_budget_caps_the_latency_it_accepts() -> None:
    lim = Limiter(RULES)
    t = drive(lim, 0.0, 0.1, steps=2, budget=60.0)
    t = drive(lim, t, 0.18, steps=4, budget=60.0)  # 1.8x the baseline: within tolerance, it grows
    grown = lim.value(1024)
    drive(lim, t, 0.18, steps=2, budget=0.2)  # but most of a 0.2 s budget, and above 1.5x the baseline: it cuts
    assert lim.value(1024) < grown


def test_an_engine_slow_against_the_budget_may_still_queue_a_little() -> None:
    """Where the no-load latency is itself most of the budget's share, up to 1.5x the baseline is accepted: cut to
    the floor, a serialised engine would idle between its requests."""
    lim = Limiter(RULES)
    t = drive(lim, 0.0, 0.1, steps=2, budget=0.2)  # a quarter of the budget (0.05 s) is below the baseline
    before = lim.value(1024)
    drive(lim, t, 0.14, steps=4, budget=0.2)  # 1.4x the baseline: accepted
    assert lim.value(1024) >= before


def test_no_limit_off_the_rules_even_for_an_engine_that_lowers_its_maximum() -> None:
    lim = Limiter(RULES)
    drive(lim, 0.0, 0.1, steps=10, per_step=200)
    assert lim.value(1024) == 1024
    assert lim.value(8) == 8
    lim.update(100.0, 8)
    assert lim.limit <= 8


@pytest.mark.parametrize("service_s", [0.05, 0.2])
def test_closed_loop_on_a_serialised_engine_is_stable(service_s: float) -> None:
    """A model: an engine that serves one request at a time, offered more than it serves, its own queue probed
    every 2 s. The limit settles low (the engine's queue stays short) and never empties the engine (at least one
    in flight); when the engine's speed halves it follows within 10 s, and grows back."""
    rng = random.Random(1)
    lim = Limiter(RULES)
    t, busy_until = 0.0, 0.0
    inflight: list[float] = []  # finish times, in order
    trace: list[tuple[float, int, float]] = []

    def run(seconds: float, service: float) -> None:
        nonlocal t, busy_until
        end = t + seconds
        while t < end:
            t += 0.01
            while inflight and inflight[0] <= t:  # completions: latency = finish - dispatch
                done = inflight.pop(0)
                lim.sample(done - sent.pop(0), 1.5, done, 1024)
            while len(inflight) < lim.value(1024):  # the gateway queue always has more
                start = max(t, busy_until)
                busy_until = start + service * rng.uniform(0.9, 1.1)
                inflight.append(busy_until)
                sent.append(t)
            lim.held_back(t, 1024)
            if round(t * 100) % 200 == 0:  # a health check every 2 s reads the engine's own queue
                lim.queue(max(0, len(inflight) - 1), t, 1024)
            trace.append((t, lim.value(1024), busy_until - t))

    sent: list[float] = []
    run(20.0, service_s)
    steady = [n for ts, n, _ in trace if ts > 10.0]
    assert max(steady) <= 4, steady[-40:]  # the queue at the engine stays short
    assert min(steady) >= 1
    mark = t
    run(15.0, 2 * service_s)  # half the speed
    after = [n for ts, n, _ in trace if ts > mark + 10.0]
    assert max(after) <= 4
    mark = t
    run(20.0, service_s / 4)  # four times faster than that
    assert max(n for ts, n, _ in trace if ts > mark) >= 2  # it grew again


def test_connections_follow_what_the_engine_runs() -> None:
    """An engine's pool holds what it can run plus headroom, never below its limit (the 1,025th stream on a
    decode that runs thousands no longer waits for a connection: tests/loadtest and BENCHMARKS.md run R)."""
    from pdgate.pool.capacity import CONN_HEADROOM, UNKNOWN_MAX, Slots

    s = Slots("d0", learned=Limiter(RULES))
    assert s.conns() == UNKNOWN_MAX + CONN_HEADROOM, "an engine that reports nothing: the most it is given"
    s.reported = 8192
    assert s.conns() == 8192 + CONN_HEADROOM and s.capacity == 16, "the engine's figure, not the learned 16"
    s.configured = 20000
    assert s.conns() == 20000 + CONN_HEADROOM and s.capacity == 20000, "set by hand: that figure"


@pytest.mark.parametrize("watched", [True, False])
def test_latency_the_gateways_loop_lag_explains_cuts_nothing(watched: bool) -> None:
    """A prefill answering in 1 ms alone, 20 ms while the gateway's loop runs 10 ms late (400 paced streams on two
    cores): that is the gateway's and the host's load, and the limit holds (and says why). With the loop not watched
    (the mechanism off) it is cut to the floor in a few updates, as it was. Latency beyond what the lag explains
    (100 ms) is the engine's, watched or not."""
    lag = Lag()
    lim = Limiter(RULES, lag if watched else None)
    t = drive(lim, 0.0, 0.001, steps=2)  # baseline 1 ms
    before = lim.value(1024)
    for _ in range(8):
        lag.note(0.010, t)
        t = drive(lim, t, 0.020)
    if watched:  # within what the lag explains: in time (slow start may even grow it), never cut
        assert lim.value(1024) >= before and lim.held and "loop lag" in lim.held, lim.view(1024)
        assert lim.view(1024)["loop_lag_ms"] == 10.0
        lag.note(0.010, t)
        held = lim.value(1024)
        drive(lim, t, 0.100)
        assert lim.value(1024) < held and "engine latency" in lim.history[-1][2]
    else:
        assert lim.value(1024) == 1, lim.view(1024)


def test_workers_wide_says_which_signal_moved_a_limit_and_the_loops_lag() -> None:
    """``pdgate workers --wide``'s cell for a learned limit, from the limiter's own view: the loop's lag, the last
    moves, the signal of the last one, and a hold the lag explained."""
    from pdgate.planes.views import learned_line

    lag = Lag()
    lim = Limiter(RULES, lag)
    t = drive(lim, 0.0, 0.001, steps=2)
    for _ in range(3):
        lag.note(0.010, t)
        t = drive(lim, t, 0.020)
    cell = learned_line(lim.view(1024))
    assert "lag=10.0" in cell and "(last: grew: engine keeps up)" in cell and "held: the loop's lag" in cell, cell
    drive(lim, t, 0.5)
    assert "(last: engine latency)" in learned_line(lim.view(1024))
    late = Limiter(dataclasses.replace(RULES, initial=4))
    late.held_back(0.0, 1024)
    late.held_back(1.1, 1024)
    assert "(last: grew: no answer yet)" in learned_line(late.view(1024))
    quiet = Limiter(dataclasses.replace(RULES, initial=16))  # answers nothing; cut on its queue, then clear
    quiet.queue(5, 0.0, 1024)
    quiet.queue(5, 2.0, 1024)
    assert "(last: engine queue)" in learned_line(quiet.view(1024))
    quiet.queue(0, 4.0, 1024)
    quiet.held_back(4.6, 1024)
    assert "(last: grew: engine queue clear)" in learned_line(quiet.view(1024)), learned_line(quiet.view(1024))
