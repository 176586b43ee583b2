"""Worker selection policies: pure, synchronous, named (the name is a metric label).

A policy picks an index among candidate workers given their loads; pair selection runs
it once per role. Add one by writing a ``select`` and registering it in ``POLICIES``.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class Candidate(Protocol):
    @property
    def load(self) -> int: ...


W = TypeVar("W", bound=Candidate)


class Policy(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def select(self, loads: Sequence[int]) -> int | None:
        """Index of the chosen worker given each candidate's live load, or None if there is none."""

    def pick(self, candidates: Sequence[W]) -> W | None:
        i = self.select([c.load for c in candidates])
        return None if i is None else candidates[i]


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, loads: Sequence[int]) -> int | None:
        if not loads:
            return None
        i = self._next % len(loads)
        self._next += 1
        return i


class LeastLoaded(Policy):
    """Fewest live requests of ours; ties broken in turn so equal workers share."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, loads: Sequence[int]) -> int | None:
        if not loads:
            return None
        low = min(loads)
        ties = [i for i, v in enumerate(loads) if v == low]
        self._turn += 1
        return ties[self._turn % len(ties)]


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: Callable[[int, int], int] | None = None) -> None:
        self._rng = rng or random.randint

    def select(self, loads: Sequence[int]) -> int | None:
        if not loads:
            return None
        if len(loads) == 1:
            return 0
        a = self._rng(0, len(loads) - 1)
        b = self._rng(0, len(loads) - 2)
        b = b + 1 if b >= a else b
        return a if loads[a] <= loads[b] else b


POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PowerOfTwo.name: PowerOfTwo,
}


def make(name: str) -> Policy:
    return POLICIES[name]()


def select_pair(prefills: Sequence[W], decodes: Sequence[W], prefill_policy: Policy, decode_policy: Policy,
                avoid: frozenset[int] = frozenset()) -> tuple[W, W] | None:
    """Pick a (prefill, decode) pair; workers whose id() is in ``avoid`` are used only if nothing else is left."""
    def pool(ws: Sequence[W]) -> Sequence[W]:
        fresh = [w for w in ws if id(w) not in avoid]
        return fresh or ws

    p = prefill_policy.pick(pool(prefills))
    d = decode_policy.pick(pool(decodes))
    return None if p is None or d is None else (p, d)
