"""Routing: the pool of workers and a policy per role, picking (prefill, decode) pairs and hearing what came of
them (``pdgate.pool.policies``). Both workers of a pair are of one engine kind."""

from __future__ import annotations

from pdgate.core.config import Role
from pdgate.pool.policies import Policy, RequestView, select_pair
from pdgate.pool.workers import Pool, Worker

Pair = tuple[Worker, Worker]


class Routing:
    def __init__(self, pool: Pool, prefill: Policy, decode: Policy) -> None:
        self.pool, self.prefill, self.decode = pool, prefill, decode

    def pick(self, avoid: frozenset[int], view: RequestView, now: float, limited: bool = True) -> Pair | None:
        """A pair by the policies among available workers (``limited``: only those below their limit)."""
        among = self.pool.with_room if limited else self.pool.available
        same = same_kind if self.pool.mixed else None  # pools of two kinds: a decode of the prefill's kind
        return select_pair(among(Role.PREFILL, now), among(Role.DECODE, now), self.prefill, self.decode, avoid, view, same)

    def ready(self, now: float) -> bool:
        return self.pool.ready(now)

    def dispatched(self, pw: Worker, dw: Worker, view: RequestView) -> None:
        self.prefill.dispatched(pw.id, view)
        self.decode.dispatched(dw.id, view)

    def completed(self, pw: Worker, dw: Worker, view: RequestView, ok: bool) -> None:
        self.prefill.completed(pw.id, view, ok)
        self.decode.completed(dw.id, view, ok)

    def forget(self, w: Worker) -> None:
        """Whatever ``w`` held is gone (it restarted, or was removed): the policies forget it."""
        (self.prefill if w.role == Role.PREFILL else self.decode).forget(w.id)


def same_kind(p: Worker, d: Worker) -> bool:
    return p.spec.engine == d.spec.engine
