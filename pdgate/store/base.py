"""The store seam's types: what several gateway processes must agree on, behind one Protocol
(``docs/architecture.md``, "The store").

Held in a store: the tenants' limits (live requests as counts per instance, requests and tokens per minute as
buckets), what each instance holds on each worker (so a worker's capacity holds in sum), the instance registry
(heartbeats with a lease: an instance is gone only when its entry expired), each instance's live rids per worker
(so survivors abort a dead one's requests on engines that list nothing), the worker set (versioned), and the
stored responses of ``/v1/responses`` (per tenant, with a TTL and a count bound). Nothing
else: health, breakers, traces stay per process. The embedded store holds it for one process; Redis for several.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdgate.core.config import ResponsesConfig


@dataclass(frozen=True, slots=True)
class TenantAsk:
    """A request's claim on its key's limits (None fields: no such limit)."""

    name: str
    max_concurrent: int | None
    requests_per_min: int | None
    tokens_per_min: int | None
    tokens: int = 0  # charged now: its estimate (prompt and the output it may generate)
    unbounded: bool = False  # its output has no limit: it gets what the key has left (``Grant.tokens``)
    hold: bool = True  # it holds one of max_concurrent until released (a generation request)


@dataclass(slots=True)
class Grant:
    ok: bool
    limit: str | None = None  # refused by: concurrency, requests, tokens, too_large; or "full" (a worker)
    retry_after_s: float = 0.0
    worker: str | None = None  # the worker found full
    tokens: int = 0  # charged (an unbounded request: what the key had left)
    others: dict[str, int] = field(default_factory=dict)  # what the other instances hold on each worker asked


@dataclass(slots=True)
class Beat:
    """An instance's heartbeat: its registry entry and what it holds, written whole (a store that lost
    everything has it back by the next one)."""

    info: dict[str, Any]  # its admin URLs, state (live, draining), pid, host
    rids: dict[str, tuple[str, ...]]  # live attempt rid -> the workers it is on
    held: dict[str, int]  # worker id -> live requests of this instance on it
    tenants: dict[str, int]  # tenant -> live requests holding one of its max_concurrent


class Store(Protocol):
    shared: bool  # other processes read and write it (False: the embedded store of one process)
    lease_s: float  # an instance whose heartbeat is older than this is gone

    async def start(self, instance: str, on_workers: Callable[[], None]) -> None:
        """Connect; ``on_workers`` is called when another process changed the worker set."""

    async def close(self) -> None: ...

    async def acquire(self, tenant: TenantAsk | None, workers: tuple[tuple[str, int | None], ...],
                      now: float, rid: str = "") -> Grant:
        """The key's limits taken and a slot on each worker (id, capacity), all or nothing, in at most one round
        trip (shared with the others that ask in the same turn of the loop; none when there is nothing to agree
        on); ``rid`` (the attempt's) recorded on those workers, for the survivors should this instance die."""

    def release(self, tenant: str | None, workers: tuple[str, ...], now: float, rid: str = "") -> None:
        """Give back what ``acquire`` took (``tenant``: its live request; ``workers``: their slots; ``rid``: its
        record), off the request's path."""

    def charge(self, tenant: str, tokens_per_min: int, tokens: int, now: float) -> None:
        """Tokens charged after the fact (negative: an estimate given back), off the request's path."""

    async def heartbeat(self, beat: Beat) -> dict[str, int] | None:
        """Write this instance's beat; what every instance holds on each worker, or None if unreachable."""

    async def instances(self) -> dict[str, dict[str, Any]] | None:
        """The live instances' registry entries (None: the store cannot say now: nobody is taken for dead)."""

    async def gone(self) -> list[str]:
        """Instances that are gone but whose rids are still recorded."""

    async def rids_of(self, instance: str) -> dict[str, tuple[str, ...]] | None:
        """A gone instance's live rids -> their workers, claimed by this instance (None: another survivor
        claimed them, or the store did not answer)."""

    async def forget(self, instance: str) -> None: ...

    async def worker_set(self) -> tuple[int, list[dict[str, Any]]]:
        """The version and the workers (each with its ``id``), as the store has them."""

    async def add_worker(self, spec: dict[str, Any]) -> str | None:
        """Add a worker and name it (None: one with that role and URL is there already)."""

    async def remove_worker(self, wid: str) -> bool: ...

    async def seed_workers(self, specs: list[dict[str, Any]]) -> None:
        """The config's workers, when the store has no worker set yet."""

    # ---- stored responses (/v1/responses with store: per tenant, bounded) -------------------------------
    async def put_response(self, tenant: str, rid: str, blob: bytes, now: float, limits: ResponsesConfig) -> bool:
        """Keep ``blob`` as ``tenant``'s response ``rid`` for ``limits.ttl_s``, the tenant's oldest going beyond
        ``limits.max_stored`` (False: not kept, the store could not be reached)."""

    async def get_response(self, tenant: str, rid: str, now: float) -> bytes | None:
        """``tenant``'s response ``rid`` (None: unknown, expired, or another tenant's). Raises
        ``StoreUnavailable`` when the store cannot say."""

    async def delete_response(self, tenant: str, rid: str) -> bool:
        """Forget ``tenant``'s response ``rid``; whether it was there. Raises ``StoreUnavailable``."""
