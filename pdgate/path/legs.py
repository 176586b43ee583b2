"""The legs: one attempt's prefill and decode, run over the transport (``upstream.Transport``) as the pair's engine
adapter says (``pdgate.adapters``: the bodies, at once or in sequence, the merge of the two answers), the decode's
stream relayed to the client (``pdgate.path.relay``) (``docs/architecture.md``, "One request's way").

Its prefill failing before the first token, or one of its workers lost, cancels the attempt's scope
(``gate.Lease.scope``: ``Cause.LEG_FAILED`` / ``Cause.WORKER_LOST``), and the request may go on with another pair.
Whatever ends an attempt early, both legs are aborted on the engines (``pdgate.path.aborts``). A leg that is done gives
its worker back to the lease at once (``Lease.prefill_answered``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from h1lite.server import ClientGone
from pdgate.adapters.upstream import Answer, wrap
from pdgate.core.config import GatewayConfig
from pdgate.core.errors import UpstreamError, UpstreamStatus, detail_of
from pdgate.core.record import Attempt, Phase, first_token
from pdgate.path.aborts import Aborts
from pdgate.path.gate import Gate, Lease
from pdgate.path.observers import Observers
from pdgate.path.relay import relay_stream
from pdgate.path.scope import Cancelled, Tasks

if TYPE_CHECKING:
    from pdgate.path.context import Ctx
    from pdgate.pool.workers import Worker


# what a leg passes on as it is (anything else its call raises is the worker's failure: counted, wrapped): a relayed
# stream ends so with the client gone, or an error the relay or the leg's status already judged
RELAYED = (asyncio.CancelledError, ClientGone, UpstreamError)
CALLED = (asyncio.CancelledError,)


class Flight:
    """An attempt's legs in flight: the prefill's task while it runs, then its outcome alone (a stream lasts
    minutes: the task object and its coroutine are let go); the decode's answer, kept open for a deferred abort."""

    __slots__ = ("decode_resp", "lease", "prefill", "prefill_body", "prefill_exc")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.prefill: asyncio.Task[bytes] | None = None
        self.prefill_body = b""
        self.prefill_exc: BaseException | None = None
        self.decode_resp: Answer | None = None

    def prefill_done(self, p_task: asyncio.Task[bytes]) -> None:
        """The prefill task ended (its done callback; also called at the attempt's end if the task is done but
        the callback has not run yet: the second call is a no-op)."""
        if self.prefill is not p_task:
            return
        self.prefill = None
        exc = asyncio.CancelledError() if p_task.cancelled() else p_task.exception()
        self.prefill_exc = exc
        if exc is None:
            self.prefill_body = p_task.result()
        elif not isinstance(exc, asyncio.CancelledError) and not self.lease.att.first_token:
            self.lease.fail(exc)

    async def prefill_answer(self) -> bytes:
        """The prefill's answer, waited for if it has not come yet."""
        task = self.prefill
        if task is not None:
            return await task
        if self.prefill_exc is not None:
            raise self.prefill_exc
        return self.prefill_body


class Legs:
    """Runs an attempt's two legs (made once; one ``fly`` per attempt: its legs in flight)."""

    def __init__(self, cfg: GatewayConfig, gate: Gate, obs: Observers, aborts: Aborts, tasks: Tasks,
                 kick: Callable[[Worker], None], clock: Callable[[], float]) -> None:
        self.cfg, self.gate, self.obs = cfg, gate, obs
        self.aborts, self.tasks, self.kick, self.clock = aborts, tasks, kick, clock
        # prefills outliving their decode, in their grace: its timer, the attempt, the prefill's worker
        self.graces: dict[asyncio.Task[bytes], tuple[asyncio.TimerHandle, Attempt, Worker]] = {}

    async def fly(self, ctx: Ctx, lease: Lease) -> bytes:
        """One attempt's two legs; what they carry and their order are the engine's."""
        att, (pw, dw) = lease.att, lease.pair
        legs = Flight(lease)
        eng = pw.adapter
        merge = eng.needs_prefill_answer(ctx.route, ctx.body)
        keep = merge or eng.sequential  # the prefill's answer is needed after it came
        p_body, d_body = eng.legs(ctx.body, att, pw.spec)
        att.event(self.clock(), "sent")
        p_task = legs.prefill = ctx.loop.create_task(self.leg(ctx, lease, pw, [p_body], keep))
        p_task.add_done_callback(legs.prefill_done)
        del p_task, p_body  # the legs hold it while it runs
        self.obs.move(ctx.rec, Phase.PREFILL, self.clock())
        sending = [d_body]  # the decode leg takes it from here: nobody holds the body once it is sent
        del d_body
        ok = False
        try:
            try:
                with lease.scope:  # a worker lost between binding and here: raises at once
                    if eng.sequential:  # the decode's body is made from the prefill's answer
                        sending[0] = eng.decode_after(sending[0], await legs.prefill_answer())
                    body = await self.leg(ctx, lease, dw, sending, legs=legs)
            except Cancelled as c:
                assert isinstance(c.reason.error, UpstreamError)
                raise c.reason.error from None
            if merge:
                body = eng.merge(await legs.prefill_answer(), body)
            ok = True
            if body and ctx.resp is None:
                usage = eng.usage(body)
                rec = ctx.rec
                rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = usage.prompt, usage.completion, usage.cached
            return body
        finally:
            task: asyncio.Task[bytes] | None = legs.prefill
            if task is not None and task.done():
                legs.prefill_done(task)  # its callback may not have run yet
                task = None
            lease.tail = task  # a prefill that outlives the attempt keeps its rid recorded until it ends
            if not ok:
                self.aborts.legs(att, pw, dw, legs.decode_resp, task)
            elif task is not None:  # decode finished, the prefill has not answered: a grace period, then its abort
                timer = ctx.loop.call_later(self.cfg.prefill_grace_s, self.prefill_orphaned, att, pw, task)
                self.graces[task] = (timer, att, pw)
                task.add_done_callback(self._grace_over)
                self.tasks.adopt(task)
            elif legs.prefill_exc is not None and not isinstance(legs.prefill_exc, asyncio.CancelledError):
                att.event(self.clock(), "prefill_error_after_first_token", str(legs.prefill_exc))

    def _grace_over(self, task: asyncio.Task[bytes]) -> None:
        hit = self.graces.pop(task, None)
        if hit is not None:
            hit[0].cancel()

    def prefill_orphaned(self, att: Attempt, pw: Worker, p_task: asyncio.Task[bytes], why: str = "") -> None:
        """Decode finished ``prefill_grace_s`` ago and the prefill has not answered: it is aborted."""
        self.graces.pop(p_task, None)
        if not p_task.done():
            att.event(self.clock(), "prefill_orphaned", why or f"no prefill answer {self.cfg.prefill_grace_s:g}s "
                      "after decode finished")
            p_task.cancel()
            self.aborts.leg(att, pw, False)

    def end_graces(self) -> None:
        """The gateway stops: a prefill still in its grace is aborted now. A stop neither waits out a grace nor
        cancels the prefill at its bound without the abort that frees the engine."""
        for task, (timer, att, pw) in list(self.graces.items()):
            timer.cancel()
            self.prefill_orphaned(att, pw, task, "no prefill answer when the gateway stopped")

    async def leg(self, ctx: Ctx, lease: Lease, w: Worker, sending: list[bytes], keep: bool = True,
                  legs: Flight | None = None) -> bytes:
        """One leg (``legs``: the decode's, which keeps its answer open for a deferred abort). Its body is taken out
        of ``sending`` as it is sent (a stream that lasts minutes does not hold it: orjson's output keeps a 4 KiB
        buffer whatever its length); its answer is read whole, or, a streaming decode's, relayed to the client."""
        att, rec, decode = lease.att, ctx.rec, legs is not None
        streamed = decode and rec.stream
        passed = RELAYED if streamed else CALLED
        payload = sending.pop()
        try:
            if not streamed:
                status, body = await w.adapter.call(w.url, ctx.route, payload, lease.headers)
            else:
                resp = await w.adapter.open(w.url, ctx.route, payload, lease.headers)
                del payload
                kept = False
                try:
                    att.decode_answered = True
                    att.event(self.clock(), "decode_headers", resp.status)
                    if resp.status != 200:
                        raise self.leg_status(w, resp.status, await resp.read(), self.clock())
                    await relay_stream(ctx, att, w, resp, self.clock, self.obs.transitions)
                    w.success(self.clock())
                    return b""
                except BaseException:
                    if not resp.complete and not att.first_token:  # still open: a deferred abort may wait on it
                        assert legs is not None
                        legs.decode_resp, kept = resp, True
                    raise
                finally:
                    if not kept:
                        resp.release()
        except passed:
            raise
        except Exception as exc:
            raise self.leg_failed(w, exc) from None
        now = self.clock()
        if decode:
            att.decode_answered = True
        else:
            att.prefill_answered = True
        att.event(now, "decode_headers" if decode else "prefill_done", status)
        if status != 200:
            raise self.leg_status(w, status, body, now)
        w.success(now)
        w.progress(now)
        if decode:
            att.event(now, "decode_done")
        else:
            att.transferred = True
            lease.prefill_answered(w, now)  # its part is done: its slot may go to a queued request
        # a whole answer's first token: the decode's answer, or the prefill's where the engine says it is (the
        # prefill computed it)
        if not rec.stream and (decode or w.adapter.prefill_answer_is_first_token) \
                and first_token(rec, now, self.obs.transitions):
            ctx.watchdog.rearm()
        return body if keep else b""  # a prefill's kept (in the task) for the life of the request only if needed

    def leg_failed(self, w: Worker, exc: Exception) -> UpstreamError:
        """A leg's call failed (connect, reset, a broken or too large answer): its breaker counts it, and its
        health is checked at once."""
        err = wrap(exc, w.role, w.id)
        w.failure(self.clock(), err.message)
        self.kick(w)
        return err

    def leg_status(self, w: Worker, status: int, body: bytes, now: float) -> UpstreamStatus:
        detail = detail_of(body)
        backoff_s = self.cfg.admission.engine_backoff_s
        if status in (429, 503) and backoff_s:  # the engine says it is full: no more than it holds, for a while
            self.gate.cut(w, now + backoff_s)
        err = UpstreamStatus(f"{w.role} worker {w.id} answered {status}: {detail}", role=w.role, worker=w.id,
                             upstream_status=status, detail=detail)
        if err.retryable:
            w.failure(now, err.message)
        return err
