"""The embedded store: one process's limits in its own memory (no new dependency, nothing shared).

Live requests per tenant are counted here and requests and tokens per minute are token buckets
(``Bucket``); a worker's capacity is the local pool's own count (``Slots.limit``), so slots are taken by
the gate's pick alone. The registry knows this instance only: another instance's rids are never taken for a
dead one's (nothing here could say it is dead). The Redis store (``store/redis.py``) falls back to one of these,
its limits divided among the instances it last saw, while Redis cannot be reached.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdgate.store.base import Beat, Grant, TenantAsk

if TYPE_CHECKING:
    from pdgate.core.config import ResponsesConfig



class Bucket:
    """A per-minute allowance as a token bucket: full at ``per_min``, refilled at ``per_min``/60 a second.
    The level may go below zero (tokens charged after the fact); nothing more passes until it is back above."""

    __slots__ = ("at", "cap", "level", "rate")

    def __init__(self, per_min: int, now: float) -> None:
        self.cap = float(per_min)
        self.rate = per_min / 60.0
        self.level = self.cap
        self.at = now

    def _fill(self, now: float) -> None:
        self.level = min(self.cap, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait(self, need: float, now: float) -> float:
        """Seconds until ``need`` is available (0: now)."""
        self._fill(now)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: float, now: float) -> None:
        self._fill(now)
        self.level -= n

    def resize(self, per_min: int, now: float) -> None:
        """A new allowance (its share changed), as full as it was."""
        self._fill(now)
        self.level = self.level / self.cap * per_min if self.cap else float(per_min)
        self.cap, self.rate = float(per_min), per_min / 60.0


class EmbeddedStore:
    shared = False

    def __init__(self, lease_s: float = 10.0, share: Callable[[], int] = lambda: 1) -> None:
        self.lease_s = lease_s
        self.share = share  # into how many instances the limits are divided (1: this one alone)
        self.live: dict[str, int] = {}
        self.buckets: dict[tuple[str, str], Bucket] = {}
        # stored responses: per tenant, oldest first, (expires at, blob); and every tenant's in one order (the bytes
        # bound takes the oldest of anyone's)
        self.responses: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self.response_order: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.response_bytes = 0

    async def start(self, instance: str, on_workers: Callable[[], None]) -> None:
        return None

    async def close(self) -> None:
        return None

    def _bucket(self, name: str, kind: str, per_min: int, now: float) -> Bucket:
        per = max(1, math.ceil(per_min / self.share()))
        b = self.buckets.get((name, kind))
        if b is None:
            b = self.buckets[(name, kind)] = Bucket(per, now)
        elif b.cap != per:  # the instances that share the limit changed: its share, as full as it was
            b.resize(per, now)
        return b

    async def acquire(self, tenant: TenantAsk | None, workers: tuple[tuple[str, int | None], ...],
                      now: float, rid: str = "") -> Grant:
        return self.take(tenant, now)

    def take(self, t: TenantAsk | None, now: float) -> Grant:
        if t is None:
            return Grant(True)
        if t.hold and t.max_concurrent is not None and self.live.get(t.name, 0) >= max(1, t.max_concurrent // self.share()):
            return Grant(False, "concurrency", 1.0)
        rpm = self._bucket(t.name, "requests", t.requests_per_min, now) if t.requests_per_min else None
        if rpm is not None and (wait := rpm.wait(1.0, now)) > 0:
            return Grant(False, "requests", wait)
        tpm = self._bucket(t.name, "tokens", t.tokens_per_min, now) if t.tokens_per_min else None
        tokens = t.tokens
        if tpm is not None:
            if t.unbounded:  # it may use what the key has left, if that is more than its prompt
                tpm.wait(0.0, now)
                tokens = int(tpm.level)
                if tokens <= t.tokens:
                    return Grant(False, "tokens", tpm.wait(float(t.tokens + 1), now))
            elif tokens > tpm.cap:
                return Grant(False, "too_large", 60.0)
            elif (wait := tpm.wait(float(tokens), now)) > 0:
                return Grant(False, "tokens", wait)
            tpm.take(float(tokens), now)
        if rpm is not None:
            rpm.take(1.0, now)
        if t.hold:
            self.live[t.name] = self.live.get(t.name, 0) + 1
        return Grant(True, tokens=tokens)

    def release(self, tenant: str | None, workers: tuple[str, ...], now: float, rid: str = "") -> None:
        if tenant is not None:
            self.live[tenant] = max(0, self.live.get(tenant, 0) - 1)

    def charge(self, tenant: str, tokens_per_min: int, tokens: int, now: float) -> None:
        b = self.buckets.get((tenant, "tokens"))
        if b is not None and tokens:
            b.take(float(tokens), now)

    async def heartbeat(self, beat: Beat) -> dict[str, int] | None:
        return {}

    async def instances(self) -> dict[str, dict[str, Any]] | None:
        return None

    async def gone(self) -> list[str]:
        return []

    async def rids_of(self, instance: str) -> dict[str, tuple[str, ...]] | None:
        return None

    async def forget(self, instance: str) -> None:
        return None

    async def worker_set(self) -> tuple[int, list[dict[str, Any]]]:
        return 0, []

    async def add_worker(self, spec: dict[str, Any]) -> str | None:
        return None

    async def remove_worker(self, wid: str) -> bool:
        return False

    async def seed_workers(self, specs: list[dict[str, Any]]) -> None:
        return None

    # ---- stored responses -----------------------------------------------------------------------------
    async def put_response(self, tenant: str, rid: str, blob: bytes, now: float, limits: ResponsesConfig) -> bool:
        self._drop(tenant, rid)
        mine = self.responses.setdefault(tenant, OrderedDict())
        mine[rid] = (now + limits.ttl_s, blob)
        self.response_order[(tenant, rid)] = None
        self.response_bytes += len(blob)
        while mine and (len(mine) > limits.max_stored or next(iter(mine.values()))[0] <= now):
            self._drop(tenant, next(iter(mine)))
        while self.response_bytes > limits.max_total_bytes and self.response_order:
            self._drop(*next(iter(self.response_order)))
        return True

    async def get_response(self, tenant: str, rid: str, now: float) -> bytes | None:
        mine = self.responses.get(tenant)
        hit = mine.get(rid) if mine is not None else None
        if hit is None:
            return None
        if hit[0] <= now:
            self._drop(tenant, rid)
            return None
        return hit[1]

    async def delete_response(self, tenant: str, rid: str) -> bool:
        return self._drop(tenant, rid)

    def _drop(self, tenant: str, rid: str) -> bool:
        mine = self.responses.get(tenant)
        hit = mine.pop(rid, None) if mine is not None else None
        if hit is None:
            return False
        self.response_bytes -= len(hit[1])
        self.response_order.pop((tenant, rid), None)
        if not mine:
            del self.responses[tenant]
        return True
