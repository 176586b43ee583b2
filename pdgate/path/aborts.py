"""Aborting an attempt's legs on the engines, in the order its engine needs (``docs/architecture.md``,
"Aborts").

Both legs of an attempt that ended early are aborted by rid through the worker's adapter, in the background
(owned: ``scope.Tasks``); results go on the trace. An abort that reaches the engine before the leg's own
request is a no-op there (unknown rid) and the leg then runs orphaned, so a leg that had not answered yet is
aborted again after ``abort_repeat_s`` delays. A decode whose engine lacks the abort-during-transfer fix
(``Engine.defers_decode_abort``) is aborted once its transfer is over: its first answer (the stream kept open
for it), or its prefill's successful end (a prefill that failed or was aborted ended no transfer: the decode learns
of it from its engine and answers), or ``abort_defer_s``, whichever comes first; reconciliation stays behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdgate.adapters.upstream import Answer
from pdgate.core.config import GatewayConfig
from pdgate.path.scope import Tasks

if TYPE_CHECKING:
    from pdgate.core.record import Attempt
    from pdgate.path.observers import Observers
    from pdgate.pool.workers import Worker


class Answered(Exception):
    """The decode leg said something: its transfer is over."""


def _answered(data: bytes) -> None:
    raise Answered


class Aborts:
    def __init__(self, cfg: GatewayConfig, obs: Observers, tasks: Tasks, clock: Callable[[], float]) -> None:
        self.cfg, self.obs, self.tasks, self.clock = cfg, obs, tasks, clock

    def legs(self, att: Attempt, pw: Worker, dw: Worker, decode: Answer | None,
             prefill: asyncio.Task[bytes] | None) -> None:
        """Both legs of ``att``, which ended early. ``decode``: its decode's answer, still open (kept open until
        a deferred abort is sent); ``prefill``: its prefill leg, still running (the same)."""
        if not self.cfg.abort_legs:  # like today's routers: nothing is aborted (a switch for demonstrations)
            self._let_go(decode, prefill)
            return
        self.leg(att, pw, att.prefill_answered)
        if att.first_token or att.transferred or not dw.adapter.defers_decode_abort(dw.info.fixes):
            self._let_go(decode, prefill)
            self.leg(att, dw, att.decode_answered)
        else:
            self.tasks.spawn(self._deferred(att, dw, decode, prefill))

    def leg(self, att: Attempt, w: Worker, answered: bool) -> None:
        if self.cfg.abort_legs:
            self.tasks.spawn(self._repeated(att, w, () if answered else self.cfg.abort_repeat_s))

    @staticmethod
    def _let_go(decode: Answer | None, prefill: asyncio.Task[bytes] | None) -> None:
        if decode is not None:
            decode.release()
        if prefill is not None:
            prefill.cancel()

    async def _deferred(self, att: Attempt, dw: Worker, decode: Answer | None,
                        prefill: asyncio.Task[bytes] | None) -> None:
        wait_s = self.cfg.abort_defer_s
        att.event(self.clock(), "abort_deferred", f"decode {dw.id}: until its KV transfer is over (at most {wait_s:g}s)")
        ends: list[asyncio.Future[object]] = []
        if decode is not None:
            decode.resume()  # the relay may have paused it for a slow client
            ends.append(asyncio.ensure_future(decode.pipe(_answered)))
        if prefill is not None:
            ends.append(prefill)  # type: ignore[arg-type]
        try:
            loop = asyncio.get_running_loop()
            end_at = loop.time() + wait_s
            over = False
            waiting = set(ends)
            while waiting and not over and loop.time() < end_at:
                done, _ = await asyncio.wait(waiting, timeout=end_at - loop.time(), return_when=asyncio.FIRST_COMPLETED)
                waiting -= done
                # a prefill that failed or was aborted ended no transfer: the decode learns of it from its engine and
                # answers (aborted before that, an engine without the fix leaks it)
                over = any(f is not prefill or att.transferred for f in done)
            if not ends:
                await asyncio.sleep(wait_s)
            att.event(self.clock(), "abort_undeferred", "its transfer is over" if over else f"after {wait_s:g}s")
        finally:
            for f in ends:
                f.cancel()
            await asyncio.gather(*ends, return_exceptions=True)
            self._let_go(decode, None)
        await self._repeated(att, dw, self.cfg.abort_repeat_s)

    async def _repeated(self, att: Attempt, w: Worker, delays: tuple[float, ...]) -> None:
        await self._abort(att, w)
        for delay in delays:
            await asyncio.sleep(delay)
            await self._abort(att, w, "abort_repeat")

    async def _abort(self, att: Attempt, w: Worker, name: str = "abort_sent") -> None:
        att.event(self.clock(), name, w.role)
        att.aborting(w.role, "sent")
        try:
            status = await w.adapter.abort(w.url, att.rid)
            result = "ok" if status == 200 else f"http_{status}"
        except Exception as exc:  # any failure of the call (refused, reset, timeout) goes on the trace
            result = "error"
            att.event(self.clock(), "abort_error", f"{w.role}: {exc.__class__.__name__}")
        else:
            att.event(self.clock(), "abort_acked", f"{w.role}: {result}")
        att.aborting(w.role, result)
        self.obs.aborted(w.role, result)
