"""Cancel scopes: who ended a request (or one attempt of it) early, decided once, first reason wins.

A request's handler task can be ended by a deadline, an operator's abort, its client leaving,
a drain, or the gateway stopping; one attempt of it by a leg that failed or a worker that was
lost. Every one of these goes through ``Scope.cancel(reason)``: the first reason is kept and
later ones are ignored (trio: ``if self._cancel_reason is None: ...``), and the task is
cancelled once. The handler never reconstructs why from side flags: when the ``with scope:``
block ends by that cancellation, the block raises ``Cancelled(scope.reason)`` instead, and
``pdgate.path.outcome`` maps the reason to an outcome, a status and a message in one place.

Scopes nest as trio's do: an attempt's scope inside its request's. The inner scope turns the
cancellation into ``Cancelled`` only when it was the only canceller; when the request was
cancelled as well, the cancellation passes on to the request's scope, whose reason then wins.
Each scope takes back exactly the one cancellation it issued (``Task.uncancel``), whatever
else happened, so an outer ``task.cancel()`` (the gateway stopping) is never swallowed.

Here too: the request's deadline ``Watchdog`` (the one timer that cancels its scope with ``Cause.DEADLINE``)
and ``Tasks``, the background work the gateway owns.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

log = logging.getLogger("pdgate")


class Cause(enum.Enum):
    DEADLINE = "deadline"
    OPERATOR = "operator_abort"
    CLIENT_GONE = "client_gone"
    DRAIN = "drain"
    # attempt-level: the request may go on with another attempt
    LEG_FAILED = "leg_failed"
    WORKER_LOST = "worker_lost"

    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class Reason:
    cause: Cause
    budget: str | None = None  # DEADLINE: which budget ran out
    error: BaseException | None = None  # LEG_FAILED / WORKER_LOST: the attempt's error (an UpstreamError)
    detail: str | None = None


class Cancelled(Exception):
    """The block of a scope was ended by ``Scope.cancel``; ``reason`` says why."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.cause.value)
        self.reason = reason


class Scope:
    """One cancellation cause for the task that runs the ``with`` block; first reason wins.

    ``cancel()`` before the block is entered records the reason; entering then raises
    ``Cancelled`` at once. ``cancel()`` after the block has left records the reason (if it is the
    first) and cancels nothing: the request's outcome still reads it (a client that left while
    its answer was being written), an attempt's is never read again."""

    __slots__ = ("_issued", "_task", "reason", "task")

    def __init__(self, task: asyncio.Task[Any] | None = None) -> None:
        self.reason: Reason | None = None
        self.task = task  # the task that will run the block, when known (else asked on entering)
        self._task: asyncio.Task[Any] | None = None
        self._issued = False

    def cancel(self, reason: Reason) -> bool:
        """Record ``reason`` if it is the first; cancel the block's task. True if this reason won."""
        if self.reason is not None:
            return False
        self.reason = reason
        task = self._task
        # From inside the task itself a cancel would only land at its next await, possibly outside
        # the block: the block checks ``reason`` at its next step instead (``check()``).
        if task is not None and task is not asyncio.current_task():
            self._issued = True
            task.cancel()
        return True

    def check(self) -> None:
        """Raise ``Cancelled`` if a reason is recorded (for steps that start new work)."""
        if self.reason is not None:
            raise Cancelled(self.reason)

    def __enter__(self) -> Scope:
        # asking the loop for the current task costs a system call (getpid, the fork check of get_running_loop)
        self._task = self.task or asyncio.current_task()
        self.check()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        task, self._task = self._task, None
        if self._issued:
            assert task is not None
            self._issued = False
            task.uncancel()  # take back the one cancellation this scope issued, whatever the block raised
            if typ is asyncio.CancelledError and task.cancelling() == 0:
                assert self.reason is not None
                raise Cancelled(self.reason) from None


class Watchdog:
    """Cancels a request's scope when the budget due next runs out (``due``: ``Record.due``).

    One timer per request, armed at the next due time. Tokens never touch it: the idle budget only moves later
    with each token, so a timer that fires early re-arms itself at the new due time. The one move earlier, from
    TTFT to idle at the first token, re-arms it (``rearm``, when ``record.first_token`` says so)."""

    __slots__ = ("at", "clock", "due", "handle", "loop", "scope")

    def __init__(self, scope: Scope, due: Callable[[], tuple[str, float]], clock: Callable[[], float],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.scope, self.due, self.clock, self.loop = scope, due, clock, loop
        self.handle: asyncio.TimerHandle | None = None
        self.at = 0.0  # when the timer fires (the record's clock)

    def arm(self) -> None:
        self.at = self.due()[1]
        self.handle = self.loop.call_later(self.at - self.clock(), self._fire)

    def rearm(self) -> None:
        """The due time may have moved earlier (the first token: TTFT -> idle): set the timer there."""
        if self.handle is not None and self.due()[1] < self.at:
            self.handle.cancel()
            self.arm()

    def _fire(self) -> None:
        kind, when = self.due()
        now = self.clock()
        if when > now:
            self.at = when
            self.handle = self.loop.call_later(when - now, self._fire)
            return
        self.handle = None
        self.scope.cancel(Reason(Cause.DEADLINE, budget=kind))

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def __enter__(self) -> Watchdog:
        self.arm()
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()


class Tasks:
    """Background work the gateway owns (aborts, a prefill's tail): a failure is logged, and ``stop`` awaits
    what is still running (bounded), never only cancels it."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.adopt(task)
        return task

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """A task made elsewhere that outlives its maker (a prefill leg still answering after its request)."""
        self.running.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())

    async def stop(self, timeout_s: float) -> None:
        """Awaits what runs, and what it starts as it ends (a prefill cancelled at the end of its grace starts its
        abort), for ``timeout_s`` at most; then what is left is cancelled and awaited. Nothing of the gateway runs on
        past its stop: a task that did would call engines through a transport already closed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self.running and (left := end - loop.time()) > 0:
            await asyncio.wait(list(self.running), timeout=left)
        rest = [t for t in self.running if not t.done()]
        if rest:
            log.warning("%d background task(s) still running %gs into the stop: cancelled", len(rest), timeout_s)
            await cancelled(self.running)


async def cancelled(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 2.0) -> None:
    """Cancel ``tasks`` and await their ends, for ``timeout_s`` at most; asked again while one runs (Python 3.11's
    ``wait_for`` can swallow a cancellation that lands as what it waits for completes)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    # looked at again each round: ``tasks`` may be a live set, a task ending may start another (a grace's abort)
    while (pending := {t for t in tasks if not t.done()}) and (left := end - loop.time()) > 0:
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=min(0.1, left))
    if pending:
        log.warning("still running %gs after they were cancelled: %s", timeout_s, ", ".join(map(repr, pending)))
