"""Attempts: a lease on a pair from the gate, the legs run under it, and another pair if they failed before the
first byte reached the client (``docs/architecture.md``, "One request's way").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdgate.core.errors import NoHealthyPair, UpstreamError
from pdgate.path.gate import Gate
from pdgate.path.legs import Legs
from pdgate.path.observers import Observers

if TYPE_CHECKING:
    from pdgate.path.context import Ctx


class Attempts:
    def __init__(self, max_attempts: int, gate: Gate, legs: Legs, obs: Observers, clock: Callable[[], float]) -> None:
        self.max_attempts, self.gate, self.legs, self.obs, self.clock = max_attempts, gate, legs, obs, clock

    async def dispatch(self, ctx: Ctx) -> bytes:
        """Attempts until one succeeds, one fails after the first byte went out, or none is left: each holds its
        lease (``gate.Lease``) while it runs and gives it back as it ends."""
        avoid: set[int] = set()
        last: UpstreamError | None = None
        for n in range(1, self.max_attempts + 1):
            try:  # at once, or after the queue
                lease = await self.gate.lease(ctx, frozenset(avoid), n)
            except NoHealthyPair:
                if last is not None:
                    raise last from None
                raise
            try:  # not ``with lease``: the same close, two calls fewer a request
                body = await self.legs.fly(ctx, lease)
                lease.ok = True
                return body
            except UpstreamError as exc:
                att = lease.att
                att.error = exc.message
                att.event(self.clock(), "error", exc.message)
                if ctx.rec.bytes_sent or not exc.retryable:
                    raise
                self.obs.retried(exc.reason)
                avoid.update(id(w) for w in lease.pair if exc.worker in ("", w.id))
                last = exc
                lease.retrying = n < self.max_attempts
            finally:
                lease.close()
        assert last is not None
        raise last
