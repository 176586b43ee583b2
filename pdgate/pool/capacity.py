"""A worker's capacity in one place: how many of our live requests it may hold, from the config's figure, the
engine's reported maximum or the limit learned from what it serves in time (``pdgate.core.limits``), shared out
with the other gateway processes of a store (``docs/architecture.md``, "The learned limit"). The gate asks one
question of it (``Slots.limit``, through ``Worker.has_room``); the health checks, the latencies the gate measures and
the store's heartbeat feed it. No I/O."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pdgate.core.limits import Limiter, Move

log = logging.getLogger("pdgate.limits")

UNKNOWN_MAX = 4096  # an engine that reports no maximum: the most of our requests (and connections) it is given
CONN_HEADROOM = 64  # connections to an engine beyond what it runs: health checks, aborts, a leg ending


@dataclass(slots=True)
class Slots:
    """What admission control keeps of one worker (``id``: its id, for the log)."""

    id: str = ""
    configured: int | None = None  # the config's capacity (None: none set)
    reported: int | None = None  # what the engine reports it runs at most (Probe.capacity)
    reserved: int = 0  # slots handed to queued requests that have not bound yet
    cut_until: float = 0.0  # after its 429/503: no more than it holds until then
    foreign: int = 0  # requests the engine holds beyond what gateways sharing our store hold (direct clients)
    others: int = 0  # what the other gateway processes sharing our store hold on it (pdgate.store)
    share: int = 1  # the store unreachable: its capacity is divided among this many instances, last seen
    learned: Limiter | None = None  # the limit learned from what it serves in time (None: off)
    peers: int | None = None  # the least limit other gateway processes sharing our store learned of it lately

    @property
    def engine_max(self) -> int:
        """The most the engine runs as it reports it (``UNKNOWN_MAX`` where it reports none)."""
        return self.reported or UNKNOWN_MAX

    @property
    def capacity(self) -> int | None:
        """The most requests it runs for all gateway processes: the config's capacity, else the learned limit
        (within the engine's reported maximum), else the engine's maximum."""
        if self.configured:
            cap: int | None = self.configured
        elif self.learned is not None:  # one figure for every process: the least any of them measured lately
            cap = self.learned.value(self.engine_max)
            if self.peers is not None:
                cap = min(cap, self.peers)
        else:
            cap = self.reported
        return cap if cap is None or self.share == 1 else max(1, cap // self.share)

    def conns(self) -> int:
        """Connections its engine is given: what it can run (as configured, reported or, reporting nothing,
        ``UNKNOWN_MAX``), never fewer than the learned limit, plus headroom."""
        return max(self.configured or self.engine_max, self.capacity or 0) + CONN_HEADROOM

    def limit(self, now: float, load: int) -> int | None:
        """How many of our requests it may hold now, holding ``load``: its capacity less what the engine holds for
        others, lowered to what it holds (at least one) for a while after the engine said 429/503."""
        cap = self.capacity
        if cap is not None and self.foreign:  # slots others use are not ours to fill
            cap = max(1, cap - self.foreign)
        if now < self.cut_until:
            held = max(1, load)
            return held if cap is None else min(cap, held)
        return cap

    # ---- what feeds the learned limit
    def sample(self, latency: float, budget: float, now: float) -> None:
        """A request's latency against its budget (the gate: dispatch to the prefill's answer)."""
        if self.learned is not None:
            self.moved(self.learned.sample(latency, budget, now, self.engine_max))

    def held_back(self, now: float) -> None:
        """A request queued while it was full: its limit is binding."""
        if self.learned is not None:
            self.moved(self.learned.held_back(now, self.engine_max))

    def queued(self, waiting: int | None, now: float) -> None:
        """What the engine queues itself, as its health check read it."""
        if self.learned is not None:
            self.moved(self.learned.queue(waiting, now, self.engine_max))

    def measured(self, now: float) -> int | None:
        """The learned limit, if measured lately (the store's heartbeat tells the other processes)."""
        lim = self.learned
        return lim.value(self.engine_max) if lim is not None and lim.measured(now) else None

    def moved(self, m: Move | None) -> None:
        """A learned limit that halved or doubled says so in the log."""
        if m is not None and m.large:
            log.info("worker %s: learned limit %d -> %d (%s)", self.id, m.before, m.after, m.why)

    def view(self, now: float, load: int) -> dict[str, Any]:
        return {"capacity": self.limit(now, load), "engine_max": self.reported, "configured": self.configured,
                "learned": {**self.learned.view(self.engine_max), "peers": self.peers} if self.learned else None}
