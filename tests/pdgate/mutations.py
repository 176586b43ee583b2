"""Switch one safety mechanism off, for the oracle's mutation check (``PDGATE_MUTATION=<name>``).

Each mutation puts back what the mechanism replaced (cea4624's behaviour, or no rule at all), or makes the
mistake a seam invites (an adapter's abort forgotten for one leg, an id read without its instance, a budget
read from another header); the oracle must fail with each, naming the invariant that broke.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pdgate.apis import responses
from pdgate.core import deadlines, rid
from pdgate.path import aborts, proxy, relay, scope


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


def _prefill_only(self: aborts.Aborts, att: Any, pw: Any, dw: Any, decode: Any, prefill: Any) -> None:
    """The abort of an attempt's decode leg forgotten."""
    self._let_go(decode, prefill)
    self.leg(att, pw, att.prefill_answered)


_parse = rid.Rid.parse


def _parse_without_instance(text: str) -> rid.Rid | None:
    r = _parse(text)
    return None if r is None else rid.Rid("0", r.seq, r.rand, r.attempt)


MUTATIONS: dict[str, tuple[Any, str, Any]] = {
    "rearm": (scope.Watchdog, "rearm", lambda self: None),
    "framer": (relay.Framer, "push", _per_read_push),
    "drain": (proxy.Pipeline, "drain", lambda self, detail=None: 0),
    "first_wins": (scope.Scope, "cancel", _last_reason_wins),
    "one_leg": (aborts.Aborts, "legs", _prefill_only),
    "rid_instance": (rid.Rid, "parse", staticmethod(_parse_without_instance)),
    "wrong_header": (deadlines, "HEADERS", {"total": "x-pdgate-timeout", "ttft": "x-pdgate-idle-timeout",
                                            "idle": "x-pdgate-ttft-timeout"}),
    # a Responses stream the gateway ends gets no terminal event (the cut the route exists to prevent)
    "responses_cut": (responses.Events, "failed", lambda self, err: b""),
}


def apply(name: str) -> Callable[[], None]:
    if not name:
        return lambda: None
    owner, attr, replacement = MUTATIONS[name]
    original = vars(owner)[attr]  # as defined (a classmethod stays one when it is put back)
    setattr(owner, attr, replacement)
    return lambda: setattr(owner, attr, original)
