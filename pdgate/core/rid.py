"""Request ids: one type that makes them and reads them back (``docs/architecture.md``, "Ids").

    pdg-<instance>-<seq: 8 hex><random: 16 hex>[.<attempt>]

The request's id is also its ``x-request-id``; attempt ``n`` sends ``<id>.<n>`` as the ``rid`` of both legs.
Fixed width, so no id is a prefix of another (engines abort by rid prefix); in order within an instance; and
unguessable (64 random bits: one client's id tells nothing of the next one's). The instance tags the gateway
process that owns the request: reconciliation, the admin plane and the CLI read it back with ``Rid.parse``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

PATTERN = re.compile(r"pdg-([0-9a-f]{1,16})-([0-9a-f]{8})([0-9a-f]{16})(?:\.([1-9]))?")
MAX_ATTEMPT = 9  # config's max_attempts bound: one digit keeps every attempt's rid the same width


@dataclass(frozen=True, slots=True)
class Rid:
    """An id read back (``parse``); made only by ``Ids.new`` (a request's) and ``attempt_rid`` (an attempt's)."""

    instance: str
    seq: int
    rand: int
    attempt: int = 0  # 0: the request itself

    def __str__(self) -> str:
        base = f"pdg-{self.instance}-{self.seq & 0xFFFFFFFF:08x}{self.rand:016x}"
        return f"{base}.{self.attempt}" if self.attempt else base

    @property
    def request(self) -> Rid:
        return Rid(self.instance, self.seq, self.rand)

    @classmethod
    def parse(cls, text: str) -> Rid | None:
        """The id ``text`` spells, or None when it is not one of ours (a client's own x-request-id, another
        router's rid)."""
        m = PATTERN.fullmatch(text)
        if m is None:
            return None
        inst, seq, rand, n = m.groups()
        return cls(inst, int(seq, 16), int(rand, 16), int(n) if n else 0)


def attempt_rid(request_id: str, n: int) -> str:
    """Attempt ``n``'s rid of the request ``request_id`` (made per attempt on the hot path: no parse)."""
    return f"{request_id}.{n}"


class Ids:
    """The ids one gateway instance makes: in order, each unguessable (the random part drawn from the OS's
    CSPRNG, a few kilobytes at a time: no system call per request)."""

    def __init__(self, instance: str) -> None:
        self.prefix = f"pdg-{instance}-"
        self._seq = 0
        self._random = b""
        self._at = 0

    def new(self) -> str:
        self._seq += 1
        at = self._at
        if at >= len(self._random):
            self._random, at = os.urandom(4096), 0
        self._at = at + 8
        return f"{self.prefix}{self._seq & 0xFFFFFFFF:08x}{self._random[at:at + 8].hex()}"
