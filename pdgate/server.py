"""The application: front routes (OpenAI + SGLang native), admin API, lifecycle (on ``h1lite.server``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from typing import Any, Protocol

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from h1lite.server import Request, Response, Router, Server, Stream, json_response
from pdgate import health, proxy, reconcile, traces, validation
from pdgate.config import ConfigError, GatewayConfig, WorkerSpec, parse_prefill_flag, validate_worker
from pdgate.errors import BadRequest, NotFound
from pdgate.gateway import Gateway
from pdgate.record import Record
from pdgate.scope import Cause, Reason

log = logging.getLogger("pdgate.server")


class Owner(Protocol):
    """The supervisor of the workers, when this gateway runs them (``pdgate up``)."""

    async def restart_url(self, url: str) -> dict[str, Any]: ...

    def view(self) -> list[dict[str, Any]]: ...


# ---- front ---------------------------------------------------------------------------------
async def models(app: App, request: Request) -> Response:
    gw = app.gw
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdgate"} for m in sorted(gw.known_models())]
    return json_response({"object": "list", "data": data})


async def liveness(app: App, request: Request) -> Response:
    return json_response({"status": "ok"})


async def readiness(app: App, request: Request) -> Response:
    gw = app.gw
    now = gw.now()
    ready = gw.pool.ready(now)
    body = {"ready": ready, "prefill_available": len(gw.pool.available("prefill", now)),
            "decode_available": len(gw.pool.available("decode", now))}
    return json_response(body, 200 if ready else 503)


async def lease(app: App, request: Request) -> Response:
    return json_response(reconcile.lease(app.gw))


async def metrics(app: App, request: Request) -> Response:
    return Response(app.gw.metrics.render(), content_type=CONTENT_TYPE_LATEST)


# ---- admin: workers ------------------------------------------------------------------------------
async def list_workers(app: App, request: Request) -> Response:
    gw = app.gw
    now = gw.now()
    return json_response({"workers": [w.view(now) for w in gw.pool.by_id.values()]})


async def add_worker(app: App, request: Request) -> Response:
    gw = app.gw
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
    app.start_health(w.id)
    await health.check(gw, w)
    return json_response(w.view(gw.now()), 201)


async def remove_worker(app: App, request: Request) -> Response:
    gw = app.gw
    wid = request.match["id"]
    if wid not in gw.pool.by_id:
        raise NotFound(f"no worker {wid}")
    w = gw.pool.remove(wid, gw.now())
    task = app.health_tasks.pop(wid, None)
    if task is not None:
        task.cancel()
    return json_response({"removed": wid, "url": w.url})


async def restart_worker(app: App, request: Request) -> Response:
    gw = app.gw
    wid = request.match["id"]
    w = gw.pool.by_id.get(wid)
    if w is None:
        raise NotFound(f"no worker {wid}")
    owner = app.owner
    if owner is None:
        raise NotFound("this gateway does not run its workers (start it with `pdgate up` to restart them from here)")
    child = await owner.restart_url(w.url)
    await health.check(gw, w)
    return json_response({"worker": w.view(gw.now()), "process": child})


async def cluster(app: App, request: Request) -> Response:
    owner = app.owner
    if owner is None:
        raise NotFound("this gateway does not run its workers")
    return json_response({"processes": owner.view()})


# ---- admin: requests -------------------------------------------------------------------------------
async def list_requests(app: App, request: Request) -> Response:
    gw = app.gw
    q = request.query
    try:
        min_age = float(q["min_age_s"]) if "min_age_s" in q else None
    except ValueError:
        raise BadRequest(f"min_age_s must be a number, got {q['min_age_s']!r}") from None
    now = gw.now()
    recs = gw.traces.query(now, q.get("phase"), q.get("worker"), min_age)
    return json_response({"requests": [traces.summary(r, now) for r in recs], "count": len(recs)})


async def get_request(app: App, request: Request) -> Response:
    gw = app.gw
    rec = gw.traces.get(request.match["id"])
    if rec is None:
        raise NotFound(f"no live or recent request {request.match['id']}")
    engine = await engine_view(gw, rec) if rec.live else None
    return json_response(traces.full(rec, gw.now(), engine))


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


async def abort_request(app: App, request: Request) -> Response:
    gw = app.gw
    asked = request.match["id"]
    rec = gw.traces.get(asked)
    if rec is None:
        raise NotFound(f"no live request {asked}")
    ctx = gw.live.get(rec.id)
    if ctx is None:
        return json_response({"id": rec.id, "aborted": False, "reason": "already finished"}, 409)
    won = ctx.cancel(Reason(Cause.OPERATOR))
    return json_response({"id": rec.id, "aborted": won, **({} if won else {"reason": "already ending"})},
                         200 if won else 409)


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


# ---- lifecycle -------------------------------------------------------------------------------------
ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", models),
    ("GET", "/health", liveness),
    ("GET", "/readiness", readiness),
    ("GET", "/metrics", metrics),
    ("GET", "/v1/lease", lease),
    ("GET", "/v1/workers", list_workers),
    ("POST", "/v1/workers", add_worker),
    ("DELETE", "/v1/workers/{id}", remove_worker),
    ("POST", "/v1/workers/{id}/restart", restart_worker),
    ("GET", "/v1/cluster", cluster),
    ("GET", "/v1/requests", list_requests),
    ("GET", "/v1/requests/{id}", get_request),
    ("POST", "/v1/requests/{id}/abort", abort_request),
]


class App:
    """The gateway with its routes, background tasks and (under ``pdgate up``) the owner of its workers."""

    def __init__(self, cfg: GatewayConfig, gateway: Gateway | None = None, owner: Owner | None = None) -> None:
        self.cfg = cfg
        self.gw = gateway or Gateway(cfg)
        self.owner = owner
        self.health_tasks: dict[str, asyncio.Task[None]] = {}
        self.reconciler = reconcile.Reconciler(self.gw)
        self.rec_task: asyncio.Task[None] | None = None
        self.router = Router()
        for route in (validation.CHAT, validation.COMPLETIONS, validation.GENERATE):
            self.router.add("POST", route, functools.partial(self.generate, route))
        for method, path, handler in ROUTES:
            self.router.add(method, path, functools.partial(handler, self))
        self.server = Server(self.router.dispatch, cfg.max_body_bytes, cfg.keepalive_s, cfg.head_timeout_s,
                             cfg.body_timeout_s)

    async def generate(self, route: str, request: Request) -> Response | Stream:
        return await proxy.handle(self.gw, request, route)

    def start_health(self, wid: str) -> None:
        self.health_tasks[wid] = asyncio.get_running_loop().create_task(health.run(self.gw, self.gw.pool.by_id[wid]))

    async def start(self, host: str, port: int) -> None:
        raise_fd_limit()
        gw = self.gw
        await gw.start()
        await asyncio.gather(*(health.check(gw, w) for w in gw.pool.by_id.values()))
        for wid in list(gw.pool.by_id):
            self.start_health(wid)
        if gw.cfg.reconcile.enabled:
            self.rec_task = asyncio.get_running_loop().create_task(self.reconciler.run())
        await self.server.start(host, port)

    async def cleanup(self) -> None:
        """Drain: stop accepting, let live requests finish for ``drain_s``, then give each one still
        live its terminal answer (and abort its legs) before the connections close."""
        drain_s = self.cfg.drain_s
        await self.server.close(drain_s, lambda: self.gw.drain(f"still live after drain_s={drain_s:g}s"))
        if self.rec_task is not None:
            self.rec_task.cancel()
        for t in self.health_tasks.values():
            t.cancel()
        await self.gw.stop()


def raise_fd_limit() -> None:
    """Every client connection and every engine connection is an fd: the soft limit (often 1024) goes up to
    the hard one, as uvicorn's and nginx's operators are told to do by hand."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open files limit raised from %d to %d", soft, hard)
        except (ValueError, OSError) as exc:
            log.warning("open files limit stays %d (hard %d): %s", soft, hard, exc)


def build_app(cfg: GatewayConfig, gateway: Gateway | None = None, owner: Owner | None = None) -> App:
    return App(cfg, gateway, owner)


async def serve(app: App, host: str, port: int) -> App:
    """Start the gateway's background work and listen; ``await app.cleanup()`` stops both."""
    await app.start(host, port)
    return app
