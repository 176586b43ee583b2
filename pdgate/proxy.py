"""The request path: admit -> select pair -> dispatch both legs -> relay decode -> finalize.

One ``Ctx`` per client request goes through these steps. Deadlines are absolute and
watched by a ``Watchdog`` that cancels the handler when the next budget (TTFT, idle or
total) runs out; the handler turns that into ``deadline_exceeded``. Every failure path
aborts both legs on the engines (``/abort_request`` with the attempt's rid).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import orjson

from h1lite.client import Response as UpstreamResponse
from h1lite.server import ClientGone, Request, Response, Stream
from pdgate import deadlines, protocol, validation
from pdgate.errors import (
    Aborted,
    DeadlineExceeded,
    GatewayError,
    InvalidJSON,
    ModelNotFound,
    NoHealthyPair,
    UpstreamError,
    UpstreamStatus,
    WorkerLost,
    error_json,
    sse_error_event,
)
from pdgate.gateway import Gateway
from pdgate.policies import select_pair
from pdgate.record import Attempt, Phase, Record, phase_label
from pdgate.upstream import wrap
from pdgate.workers import Worker

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
ERROR_EVENT = b'data: {"error"'


class Bind:
    """An attempt bound to its two workers and to the task running its decode leg.

    The handler runs the decode leg itself (no task of its own); anything that ends the
    attempt early (its prefill failing before the first token, one of its workers lost)
    records why in ``failure`` and cancels that task while the leg runs, and the handler
    turns the cancellation back into that error."""

    __slots__ = ("att", "failure", "gw", "task")

    def __init__(self, gw: Gateway, att: Attempt) -> None:
        self.gw = gw
        self.att = att
        self.task: asyncio.Task[Any] | None = None  # the handler, while it runs the decode leg
        self.failure: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            if self.task is not None:
                self.task.cancel()

    def lose(self, reason: str) -> None:
        self.fail(WorkerLost(f"attempt {self.att.n} lost its worker: {reason}", role="",
                             worker=reason.split(" ", 1)[0]))

    def note(self, name: str, info: Any = None) -> None:
        self.att.event(self.gw.now(), name, info)

    def prefill_done(self, p_task: asyncio.Task[bytes]) -> None:
        exc = None if p_task.cancelled() else p_task.exception()
        if exc is not None and not self.att.first_token:
            self.fail(exc)


class Ctx:
    __slots__ = ("body", "gw", "merge_logprobs", "rec", "request", "resp", "route", "stream_error")

    def __init__(self, gw: Gateway, request: Request, rec: Record, route: str, body: dict[str, Any]) -> None:
        self.gw = gw
        self.request = request
        self.rec = rec
        self.route = route
        self.body = body
        self.resp: Stream | None = None
        self.stream_error: str | None = None
        self.merge_logprobs = route == validation.GENERATE and bool(body.get("return_logprob"))

    def start_stream(self) -> Stream:
        self.rec.bytes_sent = True
        self.resp = self.request.open_stream(200, {**SSE_HEADERS, "x-request-id": self.rec.id})
        return self.resp

    def first_token(self, now: float) -> None:
        rec = self.rec
        if rec.attempts:
            rec.attempts[-1].first_token = True
        if rec.first_token_at is None:
            rec.first_token_at = now
        if rec.phase in (Phase.PREFILL, Phase.TRANSFER):
            self.gw.move(rec, Phase.DECODE)


class Watchdog:
    """Cancels the handler task when the request's next deadline passes.

    One timer per request, armed at the earliest time any budget could run out and moved
    later, lazily, when it fires early; so tokens never touch the timer."""

    def __init__(self, gw: Gateway, rec: Record, task: asyncio.Task[Any]) -> None:
        self.gw, self.rec, self.task = gw, rec, task
        self.loop = asyncio.get_running_loop()
        self.expired: str | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.offset = self.loop.time() - gw.now()  # record clock -> loop clock

    def arm(self) -> None:
        self.handle = self.loop.call_at(self.rec.deadlines.earliest(self.rec.created) + self.offset, self._fire)

    def _fire(self) -> None:
        kind, when = self.rec.deadlines.due(self.rec.first_token_at, self.rec.last_token_at)
        if when > self.gw.now():
            self.handle = self.loop.call_at(when + self.offset, self._fire)
            return
        self.expired = kind
        self.task.cancel()

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


# ---- admit -------------------------------------------------------------------------------
def admit(gw: Gateway, request: Request, route: str) -> Ctx:
    raw = request.body
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidJSON("request body must be a JSON object")
    model, stream = validation.validate(route, body)
    known = gw.known_models()
    if model is not None and known and model not in known:
        raise ModelNotFound(f"model '{model}' is not served here; available: {', '.join(sorted(known))}")
    now = gw.now()
    dl = deadlines.resolve(now, request.headers, body.pop("timeout", None), gw.cfg.models.get(model or ""),
                           gw.cfg.deadlines)
    body.pop(protocol.RID, None)
    rec = Record(id=gw.new_id(), route=route, model=model, stream=stream, created=now, created_wall=time.time(),
                 deadlines=dl, client_request_id=request.headers.get("x-request-id"), body_bytes=len(raw))
    gw.traces.add(rec)
    return Ctx(gw, request, rec, route, body)


# ---- serve: the whole life of one request ---------------------------------------------------
async def serve(ctx: Ctx) -> Response | Stream:
    gw, rec = ctx.gw, ctx.rec
    task = asyncio.current_task()
    assert task is not None
    gw.tasks[rec.id] = task
    wd = Watchdog(gw, rec, task)
    wd.arm()
    try:
        body = await dispatch(ctx)
        if ctx.stream_error is not None:
            finalize(ctx, Phase.FAILED, ctx.stream_error, 502)
            assert ctx.resp is not None
            return ctx.resp
        finalize(ctx, Phase.COMPLETED, None, 200)
        if ctx.resp is not None:
            return ctx.resp
        return Response(body, headers={"x-request-id": rec.id})
    except asyncio.CancelledError:
        if wd.expired is not None and task.uncancel() == 0:
            err: GatewayError = deadline_error(rec, wd.expired)
            gw.metrics.deadlines.labels(wd.expired, phase_label(rec.phase)).inc()
            finalize(ctx, Phase.DEADLINE_EXCEEDED, err.message, err.status)
            return await respond_error(ctx, err)
        if rec.id in gw.operator_aborts and task.uncancel() == 0:
            err = Aborted("request aborted by an operator")
            finalize(ctx, Phase.ABORTED, err.message, err.status)
            return await respond_error(ctx, err)
        finalize(ctx, Phase.ABORTED, "client disconnected", 499)
        raise
    except ClientGone:
        finalize(ctx, Phase.ABORTED, "client disconnected", 499)
        return ctx.resp or Response(status=499)
    except GatewayError as exc:
        finalize(ctx, Phase.FAILED, exc.message, exc.status)
        return await respond_error(ctx, exc)
    finally:
        wd.disarm()
        gw.tasks.pop(rec.id, None)
        gw.operator_aborts.discard(rec.id)
        if rec.live:  # an unexpected exception: never leave a live record behind
            finalize(ctx, Phase.FAILED, "internal error", 500)


def deadline_error(rec: Record, budget: str) -> DeadlineExceeded:
    d = rec.deadlines
    seconds = {"total": d.total_s, "ttft": d.ttft_s, "idle": d.idle_s}[budget]
    a = rec.attempt
    where = f" (attempt {a.n} on prefill {a.prefill}, decode {a.decode})" if a else ""
    phase = phase_label(rec.phase)
    return DeadlineExceeded(f"{budget} deadline of {seconds:g}s exceeded in phase {phase}{where}", budget=budget, phase=phase)


def finalize(ctx: Ctx, outcome: Phase, reason: str | None, status: int) -> None:
    rec = ctx.rec
    if not rec.live:
        return
    rec.status = status
    gw = ctx.gw
    gw.move(rec, outcome, reason)
    gw.traces.finish(rec)
    now = gw.now()
    for a in rec.attempts:
        gw.recent.append((a.prefill, a.rid, now))
        gw.recent.append((a.decode, a.rid, now))


async def respond_error(ctx: Ctx, exc: GatewayError) -> Response | Stream:
    if ctx.resp is not None:  # headers already sent: an error event, then [DONE]
        try:
            await ctx.resp.write(sse_error_event(exc))
        except ClientGone:
            pass
        return ctx.resp
    return Response(error_json(exc), exc.status, headers={"x-request-id": ctx.rec.id})


# ---- dispatch with retries ----------------------------------------------------------------------
async def dispatch(ctx: Ctx) -> bytes:
    gw, rec = ctx.gw, ctx.rec
    avoid: set[int] = set()
    last: UpstreamError | None = None
    for n in range(1, gw.cfg.max_attempts + 1):
        now = gw.now()
        pair = select_pair(gw.pool.available("prefill", now), gw.pool.available("decode", now),
                           gw.prefill_policy, gw.decode_policy, frozenset(avoid))
        if pair is None:
            if last is not None:
                raise last
            raise NoHealthyPair("no healthy prefill+decode pair is available")
        pw, dw = pair
        att = Attempt(n=n, rid=f"{rec.id}.{n}", prefill=pw.id, decode=dw.id, room=random.getrandbits(63))
        rec.attempts.append(att)
        gw.move(rec, Phase.DISPATCHED)
        bind = Bind(gw, att)
        pw.bind(bind, now)
        dw.bind(bind, now)
        try:
            return await run_attempt(ctx, att, bind, pw, dw)
        except UpstreamError as exc:
            att.error = exc.message
            att.event(gw.now(), "error", exc.message)
            if rec.bytes_sent or not exc.retryable:
                raise
            gw.metrics.retries.labels(exc.reason).inc()
            avoid.update(id(w) for w in (pw, dw) if exc.worker in ("", w.id))
            last = exc
        finally:
            pw.unbind(bind)
            dw.unbind(bind)
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
    loop = asyncio.get_running_loop()
    att.event(gw.now(), "sent")
    p_task = loop.create_task(prefill_leg(ctx, att, pw, payload, bind))
    p_task.add_done_callback(bind.prefill_done)
    gw.move(rec, Phase.PREFILL)
    task = asyncio.current_task()
    assert task is not None
    ok = False
    try:
        if bind.failure is not None:  # a worker was lost between binding and here
            raise bind.failure
        bind.task = task
        try:
            body = await decode_leg(ctx, att, dw, payload)
        except asyncio.CancelledError:
            if bind.failure is not None and task.uncancel() == 0:  # only the bind's cancel: not the client, no deadline
                raise bind.failure from None
            raise
        finally:
            bind.task = None  # the leg is over: a later failure must not cancel the rest of the handler
        if ctx.merge_logprobs:
            body = merge_logprobs(await p_task, body)
        ok = True
        note_usage(rec, body, ctx.resp is None)
        return body
    finally:
        if not ok:
            p_task.cancel()
            names = {e[1] for e in att.events}
            gw.abort_leg(att, pw, "prefill_done" in names)
            gw.abort_leg(att, dw, "decode_headers" in names)
        elif not p_task.done():
            gw.spawn(prefill_tail(gw, att, pw, p_task))
        elif not p_task.cancelled() and p_task.exception() is not None:
            att.event(gw.now(), "prefill_error_after_first_token", str(p_task.exception()))


async def prefill_tail(gw: Gateway, att: Attempt, pw: Worker, p_task: asyncio.Task[bytes]) -> None:
    """Decode finished but the prefill has not answered: give it a grace period, then abort it."""
    done, _ = await asyncio.wait({p_task}, timeout=gw.cfg.prefill_grace_s)
    if not done:
        att.event(gw.now(), "prefill_orphaned", f"no prefill answer {gw.cfg.prefill_grace_s:g}s after decode finished")
        p_task.cancel()
        gw.abort_leg(att, pw, False)


async def prefill_leg(ctx: Ctx, att: Attempt, w: Worker, payload: bytes, bind: Bind) -> bytes:
    gw = ctx.gw
    try:
        status, body = await gw.up().post_read(w.url, ctx.route, payload)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        w.breaker.failure(gw.now())
        gw.kick(w)
        raise wrap(exc, "prefill", w.id) from None
    now = gw.now()
    att.event(now, "prefill_done", status)
    if status != 200:
        err = UpstreamStatus(f"prefill worker {w.id} answered {status}: {_detail(body)}", role="prefill", worker=w.id,
                             upstream_status=status, detail=_detail(body))
        if err.retryable:
            w.breaker.failure(now)
        raise err
    w.breaker.success()
    w.progress(now)
    w.unbind(bind)  # its part is done: it no longer holds this request (load, stall and restart checks)
    if ctx.resp is None:  # non-streaming: the prefill computed the first token
        ctx.first_token(now)
    return body


async def decode_leg(ctx: Ctx, att: Attempt, w: Worker, payload: bytes) -> bytes:
    gw, rec = ctx.gw, ctx.rec
    try:
        if not rec.stream:
            status, body = await gw.up().post_read(w.url, ctx.route, payload)
            now = gw.now()
            att.event(now, "decode_headers", status)
            if status != 200:
                raise decode_status(w, status, body, now)
            att.event(now, "decode_done")
            ctx.first_token(now)
            w.progress(now)
            w.breaker.success()
            return body
        async with gw.up().post(w.url, ctx.route, payload) as resp:
            att.event(gw.now(), "decode_headers", resp.status)
            if resp.status != 200:
                raise decode_status(w, resp.status, await resp.read(), gw.now())
            await relay_stream(ctx, att, w, resp)
            w.breaker.success()
            return b""
    except (asyncio.CancelledError, ClientGone, UpstreamError):
        raise
    except Exception as exc:
        w.breaker.failure(gw.now())
        gw.kick(w)
        raise wrap(exc, "decode", w.id) from None


def decode_status(w: Worker, status: int, body: bytes, now: float) -> UpstreamStatus:
    err = UpstreamStatus(f"decode worker {w.id} answered {status}: {_detail(body)}", role="decode", worker=w.id,
                         upstream_status=status, detail=_detail(body))
    if err.retryable:
        w.breaker.failure(now)
    return err


async def relay_stream(ctx: Ctx, att: Attempt, w: Worker, resp: UpstreamResponse) -> None:
    """Relay decode's SSE bytes as they come, without re-encoding; count events as tokens.

    The relay runs inside the upstream connection's ``data_received`` (``resp.pipe``): one
    client write per upstream read and no task switch per token. When the client's socket is
    full, reading from the decode pauses until it drains."""
    relay = Relay(ctx, att, w, resp)
    await resp.pipe(relay.feed)
    att.event(ctx.gw.now(), "decode_done", ctx.rec.chunks)
    if not relay.done:
        raise UpstreamError(f"decode worker {w.id} closed the stream before [DONE]", role="decode", worker=w.id)


class Relay:
    __slots__ = ("att", "ctx", "done", "upstream", "w")

    def __init__(self, ctx: Ctx, att: Attempt, w: Worker, upstream: UpstreamResponse) -> None:
        self.ctx, self.att, self.w, self.upstream = ctx, att, w, upstream
        self.done = False

    def feed(self, chunk: bytes) -> None:
        ctx, w = self.ctx, self.w
        rec = ctx.rec
        now = ctx.gw.now()
        out = ctx.resp
        if out is None:
            if chunk.startswith(ERROR_EVENT):  # failed before anything reached the client: retryable
                detail = _detail(chunk[6:].split(b"\n\n", 1)[0])
                raise UpstreamStatus(f"decode worker {w.id} failed: {detail}", role="decode", worker=w.id,
                                     upstream_status=500)
            self.att.event(now, "first_token")
            ctx.first_token(now)
            out = ctx.start_stream()
        elif ERROR_EVENT in chunk:
            ctx.stream_error = "decode reported an error mid-stream"
        rec.chunks += chunk.count(b"\n\n")
        rec.last_token_at = now
        w.last_progress = now
        w.degraded = False
        out.send(chunk)
        self.done = chunk.endswith(DONE)
        if out.blocked:  # back-pressure: stop reading the decode until the client takes more
            self.upstream.pause()
            out.on_writable(self.upstream.resume)


def _detail(body: bytes) -> Any:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:300].decode(errors="replace")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            return err.get("message", err)
        return obj.get("message", err if err is not None else obj)
    return obj


def note_usage(rec: Record, body: bytes, parse: bool) -> None:
    if not parse or not body:
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
