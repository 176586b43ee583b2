"""Who sent a request, and what that key may do: client keys (tenants) with their limits, admin keys. No I/O.

- A key is looked up by the SHA-256 of what the client sent (``Keys.lookup``): the table holds only hashes,
  and the lookup's timing depends on the digest of the attacker's input, which reveals nothing about any
  stored key (the comparison is constant-time where it matters: with respect to the secrets).
- A tenant (``Tenant``, one per client key) has its limits: live requests at once, requests and tokens per
  minute as token buckets (``store.embedded.Bucket``: the minute's allowance refills continuously), deadline caps and a
  priority class. The store keeps their live state (``pdgate.store``: one process's memory, or Redis shared by
  all); a limit reached is a ``RateLimited`` (429) that says when to come back (``Retry-After``).
- Tokens are charged twice: in full when the request is dispatched, the prompt's estimate and the most the
  engines will generate for it, against what the key has left (so a burst of concurrent requests cannot pass
  on one minute's allowance), then the difference to what the engines reported, at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdgate.core.config import AdminKey, DeadlineConfig, KeyConfig, hash_key
from pdgate.core.errors import RateLimited
from pdgate.store.base import TenantAsk

T = TypeVar("T")
KEY_PREFIX = "pdg-sk-"


def new_key() -> str:
    """A fresh key: 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (what the OpenAI SDK sends), else None."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Keys(Generic[T]):
    """Stored key hashes -> what each key stands for."""

    def __init__(self, entries: Mapping[str, T]) -> None:
        self._by_digest = {bytes.fromhex(h.removeprefix("sha256:")): v for h, v in entries.items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def values(self) -> list[T]:
        return list(self._by_digest.values())

    def lookup(self, token: str) -> T | None:
        # What is compared is the SHA-256 of the token, never the token: how long the lookup takes depends on
        # that digest, which an attacker can steer no better than by guessing a key (a preimage), so timing
        # tells nothing about the stored keys; the same reasoning as comparing HMACs with compare_digest.
        return self._by_digest.get(hashlib.sha256(token.encode(errors="surrogateescape")).digest())


@dataclass(frozen=True, slots=True)
class Admin:
    """An operator on the admin plane: ``name`` is the admin key's name ("local" on an open admin plane)."""

    name: str


def retry_after(wait: float) -> int:
    return max(1, math.ceil(wait))


class Tenant:
    """A client key: the tenant's name, what it may use, its limits. Their live state (live requests, the
    buckets) is the store's (``pdgate.store``): shared by every gateway process when the store is."""

    __slots__ = ("deadlines", "key", "limited", "models", "name", "priority")

    def __init__(self, key: KeyConfig, deadlines: DeadlineConfig) -> None:
        self.key = key
        self.name = key.name
        self.priority = key.priority
        self.models = frozenset(key.models)  # empty: every model
        self.deadlines = capped(deadlines, key)
        self.limited = bool(key.max_concurrent or key.requests_per_min or key.tokens_per_min)

    def ask(self, tokens: int = 0, unbounded: bool = False, hold: bool = True) -> TenantAsk:
        """Its claim on its limits for one request (``hold``: a generation request, live until released)."""
        k = self.key
        return TenantAsk(self.name, k.max_concurrent, k.requests_per_min, k.tokens_per_min, tokens, unbounded, hold)

    def refused(self, limit: str, retry_after_s: float, tokens: int = 0) -> RateLimited:
        """The 429 for a claim the store refused, saying which limit and when to come back."""
        k, wait = self.key, retry_after(retry_after_s)
        if limit == "concurrency":
            return RateLimited(f"key '{self.name}' has reached its max_concurrent of {k.max_concurrent} live requests",
                               limit="concurrency", retry_after_s=1)
        if limit == "requests":
            return RateLimited(f"key '{self.name}' has reached its requests_per_min of {k.requests_per_min}; try again "
                               f"in {wait}s", limit="requests", retry_after_s=wait)
        if limit == "too_large":
            return RateLimited(f"this request may use {tokens} tokens (prompt and completion), more than the "
                               f"tokens_per_min of {k.tokens_per_min} of key '{self.name}': ask for fewer (max_tokens)",
                               limit="tokens", retry_after_s=60)
        return RateLimited(f"key '{self.name}' has too little of its tokens_per_min of {k.tokens_per_min} left for "
                           f"this request ({tokens} tokens); try again in {wait}s", limit="tokens", retry_after_s=wait)

    def allows(self, model: str | None, served: frozenset[str]) -> bool:
        """Whether this key may use ``model`` (None: whatever is served, so every served model must be allowed)."""
        if not self.models:
            return True
        if model is None:
            return bool(served) and served <= self.models
        return model in self.models


def capped(cfg: DeadlineConfig, key: KeyConfig) -> DeadlineConfig:
    """The deadline settings for a key: its caps lower the maxima (and the defaults with them)."""
    changes: dict[str, float] = {}
    for name in ("total", "ttft", "idle"):
        cap = getattr(key, f"max_{name}_s")
        if cap is not None:
            top = min(getattr(cfg, f"max_{name}_s"), cap)
            changes[f"max_{name}_s"] = top
            changes[f"{name}_s"] = min(getattr(cfg, f"{name}_s"), top)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def tenants(keys: tuple[KeyConfig, ...], deadlines: DeadlineConfig) -> Keys[Tenant] | None:
    """The client key table (None: no keys, an open front door)."""
    if not keys:
        return None
    return Keys({k.hash: Tenant(k, deadlines) for k in keys})


def admins(keys: tuple[AdminKey, ...]) -> Keys[Admin] | None:
    """The admin key table (None: an open admin plane, allowed on loopback only)."""
    return Keys({k.hash: Admin(k.name) for k in keys}) if keys else None


__all__ = ["Admin", "Keys", "Tenant", "admins", "bearer", "capped", "hash_key", "new_key", "tenants"]
