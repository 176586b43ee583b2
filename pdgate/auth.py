"""Who sent a request, and what that key may do: client keys (tenants) with their limits, admin keys. No I/O.

- A key is looked up by the SHA-256 of what the client sent (``Keys.lookup``): the table holds only hashes,
  and the lookup's timing depends on the digest of the attacker's input, which reveals nothing about any
  stored key (the comparison is constant-time where it matters: with respect to the secrets).
- A tenant (``Tenant``, one per client key) has its limits: live requests at once, requests and tokens per
  minute as token buckets (``Bucket``: the minute's allowance refills continuously), deadline caps and a
  priority class. A limit reached is a ``RateLimited`` (429) that says when to come back (``Retry-After``).
- Tokens are charged twice: in full at admission, the prompt's estimate and the most the engines will generate
  for it, against what the key has left (so a burst of concurrent requests cannot pass on one minute's
  allowance: ``take_tokens``), then the difference to what the engines reported, at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdgate.config import AdminKey, DeadlineConfig, KeyConfig, hash_key
from pdgate.errors import RateLimited

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


def retry_after(wait: float) -> int:
    return max(1, math.ceil(wait))


class Tenant:
    """A client key's live state: its live count and its buckets. ``admit`` before a request, ``release`` after."""

    __slots__ = ("deadlines", "key", "live", "models", "name", "priority", "requests", "tokens")

    def __init__(self, key: KeyConfig, deadlines: DeadlineConfig, now: float) -> None:
        self.key = key
        self.name = key.name
        self.priority = key.priority
        self.models = frozenset(key.models)  # empty: every model
        self.live = 0
        self.requests = Bucket(key.requests_per_min, now) if key.requests_per_min else None
        self.tokens = Bucket(key.tokens_per_min, now) if key.tokens_per_min else None
        self.deadlines = capped(deadlines, key)

    def count(self, now: float) -> None:
        """One request against requests_per_min (any endpoint), or ``RateLimited``."""
        if self.requests is not None:
            wait = self.requests.wait(1.0, now)
            if wait > 0:
                raise RateLimited(f"key '{self.name}' has reached its requests_per_min of {self.key.requests_per_min}; "
                                  f"try again in {retry_after(wait)}s", limit="requests", retry_after_s=retry_after(wait))
            self.requests.take(1.0, now)

    def admit(self, now: float) -> None:
        """Count one more generation request against the limits, or raise ``RateLimited`` (nothing is counted
        then)."""
        k = self.key
        if k.max_concurrent is not None and self.live >= k.max_concurrent:
            raise RateLimited(f"key '{self.name}' has reached its max_concurrent of {k.max_concurrent} live requests",
                              limit="concurrency", retry_after_s=1)
        if self.requests is not None:
            wait = self.requests.wait(1.0, now)
            if wait > 0:
                raise RateLimited(f"key '{self.name}' has reached its requests_per_min of {k.requests_per_min}; "
                                  f"try again in {retry_after(wait)}s", limit="requests", retry_after_s=retry_after(wait))
        if self.tokens is not None:
            wait = self.tokens.wait(1.0, now)
            if wait > 0:
                raise RateLimited(f"key '{self.name}' has reached its tokens_per_min of {k.tokens_per_min}; "
                                  f"try again in {retry_after(wait)}s", limit="tokens", retry_after_s=retry_after(wait))
        if self.requests is not None:
            self.requests.take(1.0, now)
        self.live += 1

    def tokens_left(self, now: float) -> float:
        assert self.tokens is not None
        self.tokens.wait(0.0, now)  # refills it to now
        return self.tokens.level

    def take_tokens(self, n: int, now: float) -> None:
        """``n`` tokens charged now, if the key has them left; else ``RateLimited`` (nothing charged), saying when
        it could pass (never, for more than a minute's allowance)."""
        b, k = self.tokens, self.key
        assert b is not None
        if n > b.cap:
            raise RateLimited(f"this request may use {n} tokens (prompt and completion), more than the tokens_per_min "
                              f"of {k.tokens_per_min} of key '{self.name}': ask for fewer (max_tokens)",
                              limit="tokens", retry_after_s=60)
        wait = b.wait(float(n), now)
        if wait > 0:
            raise RateLimited(f"key '{self.name}' has {max(0, int(b.level))} of its tokens_per_min of {k.tokens_per_min} "
                              f"left and this request may use {n}; try again in {retry_after(wait)}s", limit="tokens",
                              retry_after_s=retry_after(wait))
        b.take(float(n), now)

    def charge(self, tokens: int, now: float) -> None:
        """Tokens used (or, negative, an estimate given back)."""
        if self.tokens is not None and tokens:
            self.tokens.take(float(tokens), now)

    def release(self) -> None:
        self.live -= 1

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


def tenants(keys: tuple[KeyConfig, ...], deadlines: DeadlineConfig, clock: Callable[[], float]) -> Keys[Tenant] | None:
    """The client key table (None: no keys, an open front door)."""
    if not keys:
        return None
    now = clock()
    return Keys({k.hash: Tenant(k, deadlines, now) for k in keys})


def admins(keys: tuple[AdminKey, ...]) -> Keys[Admin] | None:
    """The admin key table (None: an open admin plane, allowed on loopback only)."""
    return Keys({k.hash: Admin(k.name) for k in keys}) if keys else None


__all__ = ["Admin", "Bucket", "Keys", "Tenant", "admins", "bearer", "capped", "hash_key", "new_key", "tenants"]
