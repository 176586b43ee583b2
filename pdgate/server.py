"""The aiohttp application: front routes (OpenAI + SGLang native), admin API, lifecycle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson
from aiohttp import web

from pdgate import health, proxy, reconcile, traces, validation
from pdgate.config import ConfigError, GatewayConfig, WorkerSpec, parse_prefill_flag, validate_worker
from pdgate.errors import BadRequest, GatewayError, NotFound, PayloadTooLarge, error_json
from pdgate.gateway import Gateway
from pdgate.record import Record

GATEWAY = web.AppKey("gateway", Gateway)
HEALTH_TASKS = web.AppKey("health_tasks", dict)
RECONCILER = web.AppKey("reconciler", reconcile.Reconciler)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Owner(Protocol):
    """The supervisor of the workers, when this gateway runs them (``pdgate up``)."""

    async def restart_url(self, url: str) -> dict[str, Any]: ...

    def view(self) -> list[dict[str, Any]]: ...


OWNER = web.AppKey("owner", Owner)


def jsonr(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def err(exc: GatewayError) -> web.Response:
    return web.Response(body=error_json(exc), status=exc.status, content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape, also aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return err(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return err(PayloadTooLarge(exc.text or "request body too large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        e = NotFound(f"{request.method} {request.path}: {exc.reason}") if exc.status == 404 else GatewayError(exc.reason)
        e.status = exc.status
        if exc.status == 405:
            e.type, e.code = "invalid_request_error", "method_not_allowed"
        return err(e)


def generate_route(route: str) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        gw = request.app[GATEWAY]
        ctx = await proxy.admit(gw, request, route)
        return await proxy.serve(ctx)

    return handle


# ---- front ---------------------------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdgate"} for m in sorted(gw.known_models())]
    return jsonr({"object": "list", "data": data})


async def liveness(request: web.Request) -> web.Response:
    return jsonr({"status": "ok"})


async def readiness(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    now = gw.now()
    ready = gw.pool.ready(now)
    body = {"ready": ready, "prefill_available": len(gw.pool.available("prefill", now)),
            "decode_available": len(gw.pool.available("decode", now))}
    return jsonr(body, 200 if ready else 503)


async def lease(request: web.Request) -> web.Response:
    return jsonr(reconcile.lease(request.app[GATEWAY]))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[GATEWAY].metrics.render(), content_type="text/plain", charset="utf-8")


# ---- admin: workers ------------------------------------------------------------------------------
async def list_workers(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    now = gw.now()
    return jsonr({"workers": [w.view(now) for w in gw.pool.by_id.values()]})


async def add_worker(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = await _json(request)
    try:
        role, url = body.get("role"), str(body.get("url", "")).rstrip("/")
        if role == "prefill":
            spec = parse_prefill_flag(url, body.get("bootstrap_port"))
        else:
            spec = validate_worker(WorkerSpec(url=url, role=str(role)))
        w = gw.pool.add(spec)
    except (ConfigError, ValueError, TypeError) as exc:
        raise BadRequest(str(exc)) from None
    start_health(request.app, w.id)
    await health.check(gw, w)
    return jsonr(w.view(gw.now()), 201)


async def remove_worker(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    wid = request.match_info["id"]
    if wid not in gw.pool.by_id:
        raise NotFound(f"no worker {wid}")
    w = gw.pool.remove(wid)
    task = request.app[HEALTH_TASKS].pop(wid, None)
    if task is not None:
        task.cancel()
    return jsonr({"removed": wid, "url": w.url})


async def restart_worker(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    wid = request.match_info["id"]
    w = gw.pool.by_id.get(wid)
    if w is None:
        raise NotFound(f"no worker {wid}")
    owner = request.app.get(OWNER)
    if owner is None:
        raise NotFound("this gateway does not run its workers (start it with `pdgate up` to restart them from here)")
    child = await owner.restart_url(w.url)
    await health.check(gw, w)
    return jsonr({"worker": w.view(gw.now()), "process": child})


async def cluster(request: web.Request) -> web.Response:
    owner = request.app.get(OWNER)
    if owner is None:
        raise NotFound("this gateway does not run its workers")
    return jsonr({"processes": owner.view()})


# ---- admin: requests -------------------------------------------------------------------------------
async def list_requests(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    q = request.query
    try:
        min_age = float(q["min_age_s"]) if "min_age_s" in q else None
    except ValueError:
        raise BadRequest(f"min_age_s must be a number, got {q['min_age_s']!r}") from None
    now = gw.now()
    recs = gw.traces.query(now, q.get("phase"), q.get("worker"), min_age)
    return jsonr({"requests": [traces.summary(r, now) for r in recs], "count": len(recs)})


async def get_request(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    rec = gw.traces.get(request.match_info["id"])
    if rec is None:
        raise NotFound(f"no live or recent request {request.match_info['id']}")
    engine = await engine_view(gw, rec) if rec.live else None
    return jsonr(traces.full(rec, gw.now(), engine))


async def engine_view(gw: Gateway, rec: Record) -> dict[str, Any]:
    """Where the engines hold this request (bootstrap / inflight / transfer / running), if they say."""
    a = rec.attempt
    if a is None:
        return {}
    out: dict[str, Any] = {}

    async def one(wid: str) -> None:
        w = gw.pool.by_id.get(wid)
        if w is None or not w.has_extension:
            return
        try:
            _, body = await gw.up().get_json(w.url + "/pdgate/v1/requests", 1.0)
        except Exception:  # a trace must render whatever the engine does
            out[wid] = {"queue": "unknown"}
            return
        hits = [r for r in (body or {}).get("requests", []) if r.get("rid") == a.rid]
        out[wid] = hits[0] if hits else {"queue": None}

    await asyncio.gather(one(a.prefill), one(a.decode))
    return out


async def abort_request(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    rid = request.match_info["id"]
    task = gw.tasks.get(rid)
    if task is None:
        if gw.traces.get(rid) is not None:
            return jsonr({"id": rid, "aborted": False, "reason": "already finished"}, 409)
        raise NotFound(f"no live request {rid}")
    gw.operator_aborts.add(rid)
    task.cancel()
    return jsonr({"id": rid, "aborted": True})


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


# ---- lifecycle -------------------------------------------------------------------------------------
def start_health(app: web.Application, wid: str) -> None:
    gw = app[GATEWAY]
    app[HEALTH_TASKS][wid] = asyncio.get_running_loop().create_task(health.run(gw, gw.pool.by_id[wid]))


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    await gw.start()
    await asyncio.gather(*(health.check(gw, w) for w in gw.pool.by_id.values()))
    for wid in list(gw.pool.by_id):
        start_health(app, wid)
    rec_task = asyncio.get_running_loop().create_task(app[RECONCILER].run()) if gw.cfg.reconcile.enabled else None
    yield
    if rec_task is not None:
        rec_task.cancel()
    for t in app[HEALTH_TASKS].values():
        t.cancel()
    await gw.stop()


def build_app(cfg: GatewayConfig, gateway: Gateway | None = None, owner: Owner | None = None) -> web.Application:
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[openai_errors])
    app[GATEWAY] = gateway or Gateway(cfg)
    if owner is not None:
        app[OWNER] = owner
    app[HEALTH_TASKS] = {}
    app[RECONCILER] = reconcile.Reconciler(app[GATEWAY])
    app.cleanup_ctx.append(lifecycle)
    for route in (validation.CHAT, validation.COMPLETIONS, validation.GENERATE):
        app.router.add_post(route, generate_route(route))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", liveness)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/lease", lease)
    app.router.add_get("/v1/workers", list_workers)
    app.router.add_post("/v1/workers", add_worker)
    app.router.add_delete("/v1/workers/{id}", remove_worker)
    app.router.add_post("/v1/workers/{id}/restart", restart_worker)
    app.router.add_get("/v1/cluster", cluster)
    app.router.add_get("/v1/requests", list_requests)
    app.router.add_get("/v1/requests/{id}", get_request)
    app.router.add_post("/v1/requests/{id}/abort", abort_request)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True, backlog=1024).start()
    return runner


