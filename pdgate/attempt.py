"""Attempts: pick a pair, run both legs with the same rid, retry on another pair before the first byte.

Each attempt runs in a cancel scope of its own (``Bind.scope``) inside the request's: its
prefill failing before the first token, or one of its workers lost, cancels the attempt
(``Cause.LEG_FAILED`` / ``Cause.WORKER_LOST``) and the request may go on with another pair.
Whatever ends an attempt early, both legs are aborted on the engines.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

import orjson

from h1lite.client import header_lines
from h1lite.server import ClientGone
from pdgate import protocol, validation
from pdgate.errors import NoHealthyPair, UpstreamError, UpstreamStatus, WorkerLost, detail_of
from pdgate.record import Attempt, Phase
from pdgate.relay import relay_stream
from pdgate.scope import Cancelled, Cause, Reason, Scope
from pdgate.upstream import wrap

if TYPE_CHECKING:
    from pdgate.gateway import Gateway
    from pdgate.proxy import Ctx
    from pdgate.workers import Worker


class Bind:
    """An attempt bound to its two workers, with the cancel scope of its decode leg."""

    __slots__ = ("att", "gw", "prefill", "prefill_body", "prefill_exc", "scope", "span")

    def __init__(self, gw: Gateway, att: Attempt, span: Any = None) -> None:
        self.gw = gw
        self.att = att
        self.scope = Scope()
        self.span = span  # its OpenTelemetry span (None without otel)
        # the prefill leg's task while it runs; once done, its outcome alone (a stream lasts minutes: the task
        # object and its coroutine are let go)
        self.prefill: asyncio.Task[bytes] | None = None
        self.prefill_body = b""
        self.prefill_exc: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        self.scope.cancel(Reason(Cause.LEG_FAILED, error=exc))

    def lose(self, worker: str, role: str, cause: str) -> None:
        err = WorkerLost(f"attempt {self.att.n} lost its {role} worker {worker}: {cause}", role=role, worker=worker,
                         cause=cause)
        self.scope.cancel(Reason(Cause.WORKER_LOST, error=err))

    def note(self, name: str, info: Any = None) -> None:
        self.att.event(self.gw.now(), name, info)

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


async def dispatch(ctx: Ctx) -> bytes:
    gw, rec = ctx.gw, ctx.rec
    avoid: set[int] = set()
    last: UpstreamError | None = None
    for n in range(1, gw.cfg.max_attempts + 1):
        try:
            pw, dw = await gw.gate.acquire(ctx, frozenset(avoid), retry=n > 1)  # at once, or after the queue
        except NoHealthyPair:
            if last is not None:
                raise last from None
            raise
        now = gw.now()
        rec.dispatched_at = now
        att = Attempt(n=n, rid=f"{rec.id}.{n}", prefill=pw.id, decode=dw.id, room=random.getrandbits(63))
        rec.attempts.append(att)
        gw.move(rec, Phase.DISPATCHED)
        bind = Bind(gw, att, gw.otel_safely(gw.otel.attempt, ctx.span, rec, att, now)
                    if ctx.span is not None and gw.otel else None)
        pw.bind(bind, now)
        dw.bind(bind, now)
        view = ctx.view
        retrying = False
        ok = False
        try:
            gw.prefill_policy.dispatched(pw.id, view)
            gw.decode_policy.dispatched(dw.id, view)
            if view.notes:  # why the policy chose as it did (a session that moved, loads out of balance)
                for note in view.notes:
                    att.event(now, "routing", note)
                view.notes = None
            body = await run_attempt(ctx, att, bind, pw, dw)
            ok = True
            return body
        except UpstreamError as exc:
            att.error = exc.message
            att.event(gw.now(), "error", exc.message)
            if rec.bytes_sent or not exc.retryable:
                raise
            gw.metrics.retries.labels(exc.reason).inc()
            avoid.update(id(w) for w in (pw, dw) if exc.worker in ("", w.id))
            last = exc
            retrying = n < gw.cfg.max_attempts
        finally:
            pw.unbind(bind)
            dw.unbind(bind)
            gw.gate.free(counted=True, pump=not retrying)  # a retry takes its own slot before the queue does
            gw.prefill_policy.completed(pw.id, view, ok)
            gw.decode_policy.completed(dw.id, view, ok)
            if bind.span is not None and gw.otel is not None:
                gw.otel_safely(gw.otel.end_attempt, bind.span, rec, att, gw.now())
    assert last is not None
    raise last


async def run_attempt(ctx: Ctx, att: Attempt, bind: Bind, pw: Worker, dw: Worker) -> bytes:
    gw, rec = ctx.gw, ctx.rec
    payload = orjson.dumps({
        **ctx.body,
        protocol.BOOTSTRAP_HOST: pw.spec.host,
        protocol.BOOTSTRAP_PORT: pw.spec.bootstrap_port,
        protocol.BOOTSTRAP_ROOM: att.room,
        protocol.RID: att.rid,
    })
    att.event(gw.now(), "sent")
    headers = leg_headers(ctx, att, bind)
    p_task = bind.prefill = asyncio.get_running_loop().create_task(prefill_leg(ctx, att, pw, payload, bind, headers))
    p_task.add_done_callback(bind.prefill_done)
    del p_task  # bind holds it while it runs
    gw.move(rec, Phase.PREFILL)
    sending = [payload]  # the decode leg takes it from here: nobody holds the body once it is sent
    del payload
    ok = False
    try:
        try:
            with bind.scope:  # a worker lost between binding and here: raises at once
                body = await decode_leg(ctx, att, dw, sending, headers)
        except Cancelled as c:
            assert isinstance(c.reason.error, UpstreamError)
            raise c.reason.error from None
        if ctx.merge_logprobs:
            body = merge_logprobs(await bind.prefill_answer(), body)
        ok = True
        note_usage(ctx, body)
        return body
    finally:
        task: asyncio.Task[bytes] | None = bind.prefill
        if task is not None and task.done():
            bind.prefill_done(task)  # its callback may not have run yet
            task = None
        if not ok:
            if task is not None:
                task.cancel()
            names = {e[1] for e in att.events}
            gw.abort_leg(att, pw, "prefill_done" in names)
            gw.abort_leg(att, dw, "decode_headers" in names)
        elif task is not None:
            gw.spawn(prefill_tail(gw, att, pw, task))
        elif bind.prefill_exc is not None and not isinstance(bind.prefill_exc, asyncio.CancelledError):
            att.event(gw.now(), "prefill_error_after_first_token", str(bind.prefill_exc))


async def prefill_tail(gw: Gateway, att: Attempt, pw: Worker, p_task: asyncio.Task[bytes]) -> None:
    """Decode finished but the prefill has not answered: give it a grace period, then abort it."""
    done, _ = await asyncio.wait({p_task}, timeout=gw.cfg.prefill_grace_s)
    if not done:
        att.event(gw.now(), "prefill_orphaned", f"no prefill answer {gw.cfg.prefill_grace_s:g}s after decode finished")
        p_task.cancel()
        gw.abort_leg(att, pw, False)


def leg_headers(ctx: Ctx, att: Attempt, bind: Bind) -> bytes:
    """What both legs carry besides the body, as encoded header lines: the attempt's rid as x-request-id (the
    engines' logs name it), and W3C trace context: the attempt span's with OpenTelemetry on (an engine's spans
    join the trace under it), else the client's, passed through."""
    out = b"x-request-id: %b\r\n" % att.rid.encode()
    h = ctx.request.headers
    if bind.span is not None and ctx.gw.otel is not None:
        out += header_lines(ctx.gw.otel_safely(ctx.gw.otel.traceparent, bind.span) or {})
    elif "traceparent" in h:
        out += header_lines({k: h[k] for k in ("traceparent", "tracestate") if k in h})
    return out


async def prefill_leg(ctx: Ctx, att: Attempt, w: Worker, payload: bytes, bind: Bind, headers: bytes) -> bytes:
    gw = ctx.gw
    try:
        status, body = await gw.up().post_read(w.url, ctx.route, payload, headers)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise leg_failed(gw, w, exc) from None
    now = gw.now()
    att.event(now, "prefill_done", status)
    if status != 200:
        raise leg_status(gw, w, status, body, now)
    w.success(now)
    w.progress(now)
    w.unbind(bind)  # its part is done: it no longer holds this request (load, stall and restart checks)
    gw.gate.free(counted=False)  # its slot may go to a queued request
    if not ctx.rec.stream:  # non-streaming: the prefill computed the first token; a stream's is decode's first event
        ctx.first_token(now)
    return body if ctx.merge_logprobs else b""  # kept (in the task) for the life of the request only if needed


async def decode_leg(ctx: Ctx, att: Attempt, w: Worker, sending: list[bytes], headers: bytes) -> bytes:
    """The decode leg; ``sending`` holds the request body, taken out as it is sent (a stream that lasts minutes
    does not hold it: orjson's output keeps a 4 KiB buffer whatever its length)."""
    gw, rec = ctx.gw, ctx.rec
    payload = sending.pop()
    try:
        if not rec.stream:
            status, body = await gw.up().post_read(w.url, ctx.route, payload, headers)
            now = gw.now()
            att.event(now, "decode_headers", status)
            if status != 200:
                raise leg_status(gw, w, status, body, now)
            att.event(now, "decode_done")
            ctx.first_token(now)
            w.progress(now)
            w.success(now)
            return body
        async with gw.up().post(w.url, ctx.route, payload, headers) as resp:
            del payload
            att.event(gw.now(), "decode_headers", resp.status)
            if resp.status != 200:
                raise leg_status(gw, w, resp.status, await resp.read(), gw.now())
            await relay_stream(ctx, att, w, resp)
            w.success(gw.now())
            return b""
    except (asyncio.CancelledError, ClientGone, UpstreamError):
        raise
    except Exception as exc:
        raise leg_failed(gw, w, exc) from None


def leg_failed(gw: Gateway, w: Worker, exc: Exception) -> UpstreamError:
    """A leg's call failed (connect, reset, a broken or too large answer): its breaker counts it, and its
    health is checked at once."""
    err = wrap(exc, w.role, w.id)
    w.failure(gw.now(), err.message)
    gw.kick(w)
    return err


def leg_status(gw: Gateway, w: Worker, status: int, body: bytes, now: float) -> UpstreamStatus:
    detail = detail_of(body)
    backoff_s = gw.cfg.admission.engine_backoff_s
    if status in (429, 503) and backoff_s:  # the engine says it is full: no more than it holds, for a while
        gw.gate.cut(w, now + backoff_s)
    err = UpstreamStatus(f"{w.role} worker {w.id} answered {status}: {detail}", role=w.role, worker=w.id,
                         upstream_status=status, detail=detail)
    if err.retryable:
        w.failure(now, err.message)
    return err


def note_usage(ctx: Ctx, body: bytes) -> None:
    rec = ctx.rec
    if ctx.resp is not None or not body:
        return
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return
    usage = obj.get("usage") or obj.get("meta_info") or {}
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")


def merge_logprobs(prefill_body: bytes, decode_body: bytes) -> bytes:
    """As SGLang's routers do: decode's input_token_logprobs = prefill's + decode's."""
    try:
        p, d = orjson.loads(prefill_body), orjson.loads(decode_body)
        pm, dm = p["meta_info"], d["meta_info"]
        if "input_token_logprobs" in pm and "input_token_logprobs" in dm:
            dm["input_token_logprobs"] = pm["input_token_logprobs"] + dm["input_token_logprobs"]
        return orjson.dumps(d)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return decode_body


def wants_logprobs(route: str, body: dict[str, Any]) -> bool:
    return route == validation.GENERATE and bool(body.get("return_logprob"))
