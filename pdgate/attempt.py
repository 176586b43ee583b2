"""Attempts: pick a pair, run both legs with the same rid, retry on another pair before the first byte
(``docs/architecture.md``, "One request's way").

Each attempt runs in a cancel scope of its own (``Bind.scope``) inside the request's: its prefill failing before
the first token, or one of its workers lost, cancels the attempt (``Cause.LEG_FAILED`` / ``Cause.WORKER_LOST``)
and the request may go on with another pair. What the legs carry, and whether they run at once or one after
the other, is the pair's engine adapter's (``pdgate.engines``). Whatever ends an attempt early, both legs are
aborted on the engines (``pdgate.aborts``).
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from h1lite.client import ClientResponse, header_lines
from h1lite.server import ClientGone
from pdgate.aborts import Aborts
from pdgate.admission import Gate
from pdgate.config import GatewayConfig
from pdgate.errors import NoHealthyPair, UpstreamError, UpstreamStatus, WorkerLost, detail_of
from pdgate.observe import Observers
from pdgate.record import Attempt, Phase, first_token
from pdgate.relay import relay_stream
from pdgate.rid import attempt_rid
from pdgate.routing import Routing
from pdgate.scope import Cancelled, Cause, Reason, Scope, Tasks
from pdgate.upstream import Upstream, wrap

if TYPE_CHECKING:
    from pdgate.context import Ctx
    from pdgate.workers import Worker


class Bind:
    """An attempt bound to its two workers, with the cancel scope of its decode leg."""

    __slots__ = ("att", "clock", "decode_resp", "prefill", "prefill_body", "prefill_exc", "scope", "slots", "span")

    def __init__(self, att: Attempt, span: Any, clock: Callable[[], float], task: asyncio.Task[Any] | None = None) -> None:
        self.att = att
        self.clock = clock
        self.scope = Scope(task)
        self.span = span  # its OpenTelemetry span (None without otel)
        # the prefill leg's task while it runs; once done, its outcome alone (a stream lasts minutes: the task
        # object and its coroutine are let go)
        self.prefill: asyncio.Task[bytes] | None = None
        self.prefill_body = b""
        self.prefill_exc: BaseException | None = None
        self.decode_resp: ClientResponse | None = None  # the decode's answer, kept open for a deferred abort
        self.slots = [att.prefill, att.decode]  # the store's slots it holds on its workers

    def fail(self, exc: BaseException) -> None:
        self.scope.cancel(Reason(Cause.LEG_FAILED, error=exc))

    def lose(self, worker: str, role: str, cause: str) -> None:
        err = WorkerLost(f"attempt {self.att.n} lost its {role} worker {worker}: {cause}", role=role, worker=worker,
                         cause=cause)
        self.scope.cancel(Reason(Cause.WORKER_LOST, error=err))

    def note(self, name: str, info: Any = None) -> None:
        self.att.event(self.clock(), name, info)

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
        elif not isinstance(exc, asyncio.CancelledError) and not self.att.first_token:
            self.fail(exc)

    async def prefill_answer(self) -> bytes:
        """The prefill's answer, waited for if it has not come yet."""
        task = self.prefill
        if task is not None:
            return await task
        if self.prefill_exc is not None:
            raise self.prefill_exc
        return self.prefill_body


class Attempts:
    def __init__(self, cfg: GatewayConfig, gate: Gate, routing: Routing, up: Upstream, obs: Observers,
                 aborts: Aborts, tasks: Tasks, kick: Callable[[Worker], None], clock: Callable[[], float]) -> None:
        self.cfg, self.gate, self.routing, self.up, self.obs = cfg, gate, routing, up, obs
        self.aborts, self.tasks, self.kick, self.clock = aborts, tasks, kick, clock

    async def dispatch(self, ctx: Ctx) -> bytes:
        rec, clock, obs, routing = ctx.rec, self.clock, self.obs, self.routing
        avoid: set[int] = set()
        last: UpstreamError | None = None
        for n in range(1, self.cfg.max_attempts + 1):
            rid = attempt_rid(rec.id, n)
            try:  # at once, or after the queue
                pw, dw = await self.gate.pair_for(ctx, frozenset(avoid), retry=n > 1, rid=rid)
            except NoHealthyPair:
                if last is not None:
                    raise last from None
                raise
            now = clock()
            rec.dispatched_at = now
            att = Attempt(n=n, rid=rid, prefill=pw.id, decode=dw.id, room=random.getrandbits(63))
            rec.attempts.append(att)
            obs.move(rec, Phase.DISPATCHED, now)
            bind = Bind(att, obs.attempt_started(ctx, att, now), clock, ctx.scope.task)
            pw.bind(bind, now)
            dw.bind(bind, now)
            view = ctx.view
            retrying = False
            ok = False
            try:
                routing.dispatched(pw, dw, view)
                if view.notes:  # why the policy chose as it did (a session that moved, loads out of balance)
                    for note in view.notes:
                        att.event(now, "routing", note)
                    view.notes = None
                body = await self.run(ctx, att, bind, pw, dw)
                ok = True
                return body
            except UpstreamError as exc:
                att.error = exc.message
                att.event(clock(), "error", exc.message)
                if rec.bytes_sent or not exc.retryable:
                    raise
                obs.retried(exc.reason)
                avoid.update(id(w) for w in (pw, dw) if exc.worker in ("", w.id))
                last = exc
                retrying = n < self.cfg.max_attempts
            finally:
                pw.unbind(bind)
                dw.unbind(bind)
                tail = bind.prefill  # a prefill that has not answered yet: its rid stays recorded until it has
                self.gate.give_back(tuple(bind.slots), "" if tail is not None else rid)
                if tail is not None:
                    tail.add_done_callback(functools.partial(self.rid_over, rid))
                self.gate.free(counted=True, pump=not retrying)  # a retry takes its own slot before the queue does
                routing.completed(pw, dw, view, ok)
                obs.attempt_ended(rec, att, bind.span, clock())
        assert last is not None
        raise last

    async def run(self, ctx: Ctx, att: Attempt, bind: Bind, pw: Worker, dw: Worker) -> bytes:
        """One attempt's two legs; what they carry and their order are the engine's."""
        eng = pw.engine
        merge = eng.needs_prefill_answer(ctx.route, ctx.body)
        keep = merge or eng.sequential  # the prefill's answer is needed after it came
        p_body, d_body = eng.legs(ctx.body, att, pw.spec)
        att.event(self.clock(), "sent")
        headers = self.leg_headers(ctx, att, bind)
        p_task = bind.prefill = ctx.loop.create_task(
            self.prefill_leg(ctx, att, pw, p_body, bind, headers, keep))
        p_task.add_done_callback(bind.prefill_done)
        del p_task, p_body  # bind holds it while it runs
        self.obs.move(ctx.rec, Phase.PREFILL, self.clock())
        sending = [d_body]  # the decode leg takes it from here: nobody holds the body once it is sent
        del d_body
        ok = False
        try:
            try:
                with bind.scope:  # a worker lost between binding and here: raises at once
                    if eng.sequential:  # the decode's body is made from the prefill's answer
                        sending[0] = eng.decode_after(sending[0], await bind.prefill_answer())
                    body = await self.decode_leg(ctx, att, dw, sending, headers, bind)
            except Cancelled as c:
                assert isinstance(c.reason.error, UpstreamError)
                raise c.reason.error from None
            if merge:
                body = eng.merge(await bind.prefill_answer(), body)
            ok = True
            if body and ctx.resp is None:
                usage = eng.usage(body)
                rec = ctx.rec
                rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = usage.prompt, usage.completion, usage.cached
            return body
        finally:
            task: asyncio.Task[bytes] | None = bind.prefill
            if task is not None and task.done():
                bind.prefill_done(task)  # its callback may not have run yet
                task = None
            if not ok:
                self.aborts.legs(att, pw, dw, bind.decode_resp, task)
            elif task is not None:  # decode finished, the prefill has not answered: a grace period, then its abort
                timer = ctx.loop.call_later(self.cfg.prefill_grace_s, self.prefill_orphaned, att, pw, task)
                task.add_done_callback(lambda _: timer.cancel())
                self.tasks.adopt(task)
            elif bind.prefill_exc is not None and not isinstance(bind.prefill_exc, asyncio.CancelledError):
                att.event(self.clock(), "prefill_error_after_first_token", str(bind.prefill_exc))

    def rid_over(self, rid: str, _: asyncio.Task[bytes]) -> None:
        """Its last leg ended: the store no longer lists the rid for the survivors, should this instance die."""
        self.gate.give_back((), rid)

    def prefill_orphaned(self, att: Attempt, pw: Worker, p_task: asyncio.Task[bytes]) -> None:
        """Decode finished ``prefill_grace_s`` ago and the prefill has not answered: it is aborted."""
        if not p_task.done():
            att.event(self.clock(), "prefill_orphaned", f"no prefill answer {self.cfg.prefill_grace_s:g}s after "
                      "decode finished")
            p_task.cancel()
            self.aborts.leg(att, pw, False)

    def leg_headers(self, ctx: Ctx, att: Attempt, bind: Bind) -> bytes:
        """What both legs carry besides the body, as encoded header lines: the attempt's rid as x-request-id (the
        engines' logs name it), and W3C trace context: the attempt span's with OpenTelemetry on (an engine's spans
        join the trace under it), else the client's, passed through."""
        out = b"x-request-id: %b\r\n" % att.rid.encode()
        h = ctx.request.headers
        if bind.span is not None:
            out += header_lines(self.obs.traceparent(bind.span))
        elif "traceparent" in h:
            out += header_lines({k: h[k] for k in ("traceparent", "tracestate") if k in h})
        return out

    async def prefill_leg(self, ctx: Ctx, att: Attempt, w: Worker, payload: bytes, bind: Bind, headers: bytes,
                          keep: bool) -> bytes:
        try:
            status, body = await self.up.post_read(w.url, ctx.route, payload, headers)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self.leg_failed(w, exc) from None
        now = self.clock()
        att.prefill_answered = True
        att.event(now, "prefill_done", status)
        if status != 200:
            raise self.leg_status(w, status, body, now)
        att.transferred = True
        w.success(now)
        w.progress(now)
        w.unbind(bind)  # its part is done: it no longer holds this request (load, stall and restart checks)
        bind.slots.remove(w.id)
        self.gate.give_back((w.id,))
        self.gate.free(counted=False)  # its slot may go to a queued request
        rec = ctx.rec
        self.gate.prefill_answered(w, rec, now)
        if not rec.stream and w.engine.prefill_answer_is_first_token and first_token(rec, now, self.obs.transitions):
            ctx.watchdog.rearm()  # non-streaming: the prefill computed the first token
        return body if keep else b""  # kept (in the task) for the life of the request only if needed

    async def decode_leg(self, ctx: Ctx, att: Attempt, w: Worker, sending: list[bytes], headers: bytes,
                         bind: Bind) -> bytes:
        """The decode leg; ``sending`` holds the request body, taken out as it is sent (a stream that lasts minutes
        does not hold it: orjson's output keeps a 4 KiB buffer whatever its length)."""
        rec = ctx.rec
        payload = sending.pop()
        try:
            if not rec.stream:
                status, body = await self.up.post_read(w.url, ctx.route, payload, headers)
                now = self.clock()
                att.decode_answered = True
                att.event(now, "decode_headers", status)
                if status != 200:
                    raise self.leg_status(w, status, body, now)
                att.event(now, "decode_done")
                if first_token(rec, now, self.obs.transitions):
                    ctx.watchdog.rearm()
                w.progress(now)
                w.success(now)
                return body
            resp = await self.up.open(w.url, ctx.route, payload, headers)
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
                    bind.decode_resp, kept = resp, True
                raise
            finally:
                if not kept:
                    resp.release()
        except (asyncio.CancelledError, ClientGone, UpstreamError):
            raise
        except Exception as exc:
            raise self.leg_failed(w, exc) from None

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
