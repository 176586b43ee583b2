"""Switch one safety mechanism off, for the oracle's mutation check (``PDGATE_MUTATION=<name>``).

Each mutation puts back what the mechanism replaced (cea4624's behaviour, or no rule at all); the oracle
must fail with each, naming the invariant that broke.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pdgate import proxy, relay, scope


def _per_read_push(self: relay.Framer, chunk: bytes) -> bytes:
    """cea4624's relay: every read judged alone."""
    self.sep = b"\n\n"
    self.first_error = not self.tokens and not self.done and chunk.startswith(relay.ERROR)
    self.error = relay.ERROR in chunk
    self.done = chunk.endswith(relay.DONE + b"\n\n")
    self.tokens = chunk.count(b"\n\n")
    return chunk


def _last_reason_wins(self: scope.Scope, reason: scope.Reason) -> bool:
    self.reason = reason
    task = self._task
    if task is not None and task is not asyncio.current_task():
        self._issued = True
        task.cancel()
    return True


MUTATIONS: dict[str, tuple[Any, str, Callable[..., Any]]] = {
    "rearm": (scope.Watchdog, "rearm", lambda self: None),
    "framer": (relay.Framer, "push", _per_read_push),
    "drain": (proxy.Pipeline, "drain", lambda self, detail=None: 0),
    "first_wins": (scope.Scope, "cancel", _last_reason_wins),
}


def apply(name: str) -> Callable[[], None]:
    if not name:
        return lambda: None
    owner, attr, replacement = MUTATIONS[name]
    original = getattr(owner, attr)
    setattr(owner, attr, replacement)
    return lambda: setattr(owner, attr, original)
