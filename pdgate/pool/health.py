"""Active health checks, restart detection and progress-based (gray failure) detection.

One task per worker, owned by the app. Each check asks the worker's engine adapter (``Engine.probe``: health,
identity, served model, fixes, capacity, queue counts) and moves the worker's state from the ``Probe`` it
answers:
- A check fails when the engine does not say it is up (``/health``) and serving (its models); what only informs
  (identity, queue counts) may go unanswered without failing it (``Probe.partial``).
- ``failures`` consecutive failed checks -> down: its live requests are failed or retried at once (not left
  to their deadlines).
- A new identity, or up again after down -> restarted: the same, and counted.
- Holding our requests with no progress for ``degraded_after_s`` -> degraded (no new requests; the affected
  traces get an event); it recovers on progress, or once none of our requests is left on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdgate.adapters import Probe
from pdgate.core.config import HealthConfig
from pdgate.core.errors import one_line
from pdgate.pool.workers import Breaker, Pool, State, Worker

log = logging.getLogger("pdgate.health")
UNCOUNTED_FACTOR = 2  # timed-out checks in a row forgiven: this many times health.failures, then they count


class Health:
    def __init__(self, cfg: HealthConfig, pool: Pool, pump: Callable[[], None], clock: Callable[[], float],
                 probed: Callable[[Worker], None] = lambda w: None) -> None:
        self.cfg, self.pool, self.pump, self.clock = cfg, pool, pump, clock
        self.probed = probed  # told after each passed check (the worker's connections follow its capacity)
        self.kicks: dict[str, asyncio.Event] = {}  # worker id -> "check me now"

    def kick(self, w: Worker) -> None:
        """Ask for an immediate health check of ``w`` (after a connection failure)."""
        ev = self.kicks.get(w.id)
        if ev is not None:
            ev.set()

    async def check(self, w: Worker) -> None:
        started, before = self.clock(), w.load
        p = await w.adapter.probe(w.url, w.role, self.cfg.timeout_s)
        c = w.checks
        if p.ok:
            c.uncounted = 0
            if p.partial is None:  # a new engine count (reconciliation by counts judges each once, from here: a
                # later check that could not read one leaves it), and what it may include of ours: any request
                # live while the check was out
                w.probe_load, w.probe_seq, w.probe_held = max(before, w.load), w.probe_seq + 1, p.held
            self.on_up(w, p)
        else:
            inconclusive = late_not_lost(w, started, p)
            c.last_error = one_line(p.error or "health check failed") + (
                " (not counted against it, unless it keeps happening)" if inconclusive else "")
            if inconclusive and c.uncounted < UNCOUNTED_FACTOR * self.cfg.failures:
                c.uncounted += 1  # forgiven, a few times in a row at most: a hung worker on a late loop goes down
            else:
                self.on_failed(w)
        c.checked = True
        self.check_progress(w)
        self.pump()  # its capacity, its backoff or its state may have changed

    def on_up(self, w: Worker, p: Probe) -> None:
        restarted = None
        if w.identity is not None and p.identity is not None and p.identity != w.identity:
            restarted = "new identity"
        elif w.checks.checked and w.state is State.DOWN and p.identity is None:
            restarted = "health down->up"
        if restarted or p.identity is not None:  # a restart found without one: the next identity read is its own
            w.identity = p.identity
        self.pool.set_info(w, p)
        w.slots.reported = p.capacity
        w.slots.foreign = max(0, p.running - len(w.bound) - w.slots.others) if p.running is not None else 0
        w.checks.failures = 0
        w.checks.last_error = None if p.partial is None else f"{p.partial} (up: its counts read unknown)"
        now = self.clock()
        w.slots.queued(p.waiting, now)
        self.probed(w)
        if restarted:
            w.restarts += 1
            w.breaker.success()
            w.transition(State.RESTARTED, now, restarted)
        if not w.healthy:
            w.transition(State.UP if w.breaker.state is Breaker.CLOSED else State.BREAKER_OPEN, now,
                         "health check passed")

    def on_failed(self, w: Worker) -> None:
        w.checks.failures += 1
        if w.checks.failures >= self.cfg.failures and w.state is not State.DOWN:
            w.adapter.forget(w.url)  # whatever comes back up may be another engine
            w.transition(State.DOWN, self.clock(), w.checks.last_error or "health check failed")

    def check_progress(self, w: Worker) -> None:
        now = self.clock()
        if w.degraded and w.busy_since is None:
            # the evidence (our stuck requests) is gone; it gets new requests again and, if still
            # stuck, is degraded again after degraded_after_s
            w.transition(State.UP, now, "no longer holds stuck requests")
            return
        stalled = w.stalled_for(now)
        if stalled >= self.cfg.degraded_after_s and w.state in (State.UP, State.HALF_OPEN):
            w.transition(State.DEGRADED, now, f"holds {w.load} of our requests with no progress for {stalled:.1f}s")

    async def run(self, w: Worker) -> None:
        kick = self.kicks.setdefault(w.id, asyncio.Event())
        while w.id in self.pool.by_id:
            kick.clear()
            try:
                await self.check(w)
            except Exception:  # a health loop must survive anything a worker answers
                log.exception("health check of %s failed", w.id)
            try:
                await asyncio.wait_for(kick.wait(), self.cfg.interval_s)
            except TimeoutError:
                pass
        self.kicks.pop(w.id, None)


def late_not_lost(w: Worker, started: float, p: Probe) -> bool:
    """Whether a timed-out check says nothing against the worker, and is not counted as a failure: this gateway's
    own loop ran behind (a saturated relay reads everything late, and its timers fire before the reads), or the
    worker kept sending our requests' tokens while we waited for its answer."""
    if p.loop_late:
        return True
    return p.timed_out and w.last_progress >= started and w.busy_since is not None
