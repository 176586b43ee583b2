"""The application: two planes, each a listener with its routes and its middleware chain; lifecycle.

- The **front door** (``host:port``): the OpenAI and SGLang routes, ``/v1/models``, ``/health``, ``/readiness``,
  and the request endpoints for a client key's own requests. With client keys
  configured, every request but the probes needs one (``Authorization: Bearer``): 401 without, and the key's
  limits apply (429). Operator paths answer 401 without credentials and 403 with any.
- The **admin plane** (``admin_host:admin_port`` or ``admin_socket``): workers, requests, cluster, metrics,
  behind the admin key when one is configured (401 without, 403 with any other key); it may be open only on
  loopback or a Unix socket (``config`` refuses the rest). Changes are audited (``admin.py``).

Middleware wraps each plane's dispatch (``chain``): authentication (client key -> tenant) and the tenant's
limits. Admission control is the request path's own first stage (``pdgate.path.admission``), not middleware: it
needs the parsed body and opens the request's record. A refused generation request gets its access-log line
from the HTTP server's error hook (``refused``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import resource
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily, Metric

from h1lite.errors import HTTPError
from h1lite.server import Request, Response, Router, Server, Stream, json_response
from pdgate.apis import anthropic
from pdgate.apis.responses import RESPONSES
from pdgate.core import validation
from pdgate.core.config import ConfigError, GatewayConfig, Role, is_loopback
from pdgate.core.errors import Forbidden, Unauthorized, one_line
from pdgate.observe import access_log
from pdgate.path.auth import Admin, Tenant, bearer
from pdgate.path.gateway import Gateway
from pdgate.planes import admin, dashboard, multi, peers
from pdgate.planes.control import Control, WorkerSupervisor, reachable_url

log = logging.getLogger("pdgate.server")


# ---- front ---------------------------------------------------------------------------------
async def models(ctl: Control, request: Request) -> Response:
    served = ctl.gw.pool.models()
    tenant = request.state
    if isinstance(tenant, Tenant) and tenant.models:
        served = served & tenant.models  # a key sees the models it may use
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdgate"} for m in sorted(served)]
    return json_response({"object": "list", "data": data})


async def liveness(ctl: Control, request: Request) -> Response:
    return json_response({"status": "ok"})


async def readiness(ctl: Control, request: Request) -> Response:
    gw = ctl.gw
    now = gw.now()
    ready = gw.pool.ready(now)
    body = {"ready": ready, "prefill_available": len(gw.pool.available(Role.PREFILL, now)),
            "decode_available": len(gw.pool.available(Role.DECODE, now))}
    return json_response(body, 200 if ready else 503)


async def metrics(ctl: Control, request: Request) -> Response:
    return Response(ctl.gw.metrics.render(), content_type=CONTENT_TYPE_LATEST)


async def operator_only(ctl: Control, request: Request) -> Response:
    """An operator path asked at the front door: never served here, whatever the key."""
    if "authorization" in request.headers:
        raise Forbidden(f"{request.path} is served on the admin plane only")
    raise Unauthorized(f"{request.path} is an operator endpoint: it is served on the admin plane only, with the "
                       "admin key")


# ---- middleware ------------------------------------------------------------------------------------
Dispatch = Callable[[Request], Awaitable[Response | Stream]]
Middleware = Callable[[Dispatch], Dispatch]
GENERATION = frozenset((validation.CHAT, validation.COMPLETIONS, validation.GENERATE))
PROBES = frozenset(("/health", "/readiness"))  # answered without a key (k8s probes)
LOCAL = Admin("local")


def chain(dispatch: Dispatch, *middleware: Middleware) -> Dispatch:
    """``dispatch`` wrapped by ``middleware``, the first outermost."""
    for mw in reversed(middleware):
        dispatch = mw(dispatch)
    return dispatch


def refused(app: App) -> Callable[[Request, HTTPError], None]:
    """The access log's line for a generation request refused before admission (no record to log it at its
    end): bad input, a missing key, a rate limit, a full queue (``pdgate.observe.access_log``); told by the HTTP server
    (``Server.on_error``), so a request that is not refused pays nothing for it."""
    fmt = app.cfg.log_format

    def log_refusal(request: Request, exc: HTTPError) -> None:
        if (request.path in GENERATION or request.path in (RESPONSES, anthropic.MESSAGES) or exc.status == 404) \
                and access_log.enabled():  # a generation request refused, or a path nobody serves
            tenant = request.state.name if isinstance(request.state, Tenant) else None
            access_log.emit(access_log.refused_fields(request.path, exc.status, exc.code, tenant,
                                                      time.monotonic() - request.started), fmt)

    return log_refusal


def error_shape(request: Request, exc: HTTPError) -> HTTPError:
    """Anthropic's clients read errors in Anthropic's shape: every refusal under ``/v1/messages`` (a missing key, an
    unknown path, a bad body, a body too large, an ``Expect`` refused, a bug) is rendered so (``anthropic.Error``)."""
    if request.path.startswith(anthropic.MESSAGES) and not isinstance(exc, anthropic.Error):
        return anthropic.Error(exc)
    return exc


def client_keys(app: App) -> Middleware:
    """Front door with client keys: the key names the tenant (``request.state``), its limits apply to generation."""
    keys, metrics, clock, store = app.gw.tenants, app.gw.metrics, app.gw.now, app.gw.store
    assert keys is not None
    operator = app.operator_paths

    def wrap(nxt: Dispatch) -> Dispatch:
        async def run(request: Request) -> Response | Stream:
            path = request.path
            if path in PROBES or path in operator or path.startswith("/v1/workers/"):
                return await nxt(request)  # probes are open; operator paths refuse any key themselves
            token = bearer(request.headers) or request.headers.get("x-api-key")  # Anthropic's clients: x-api-key
            tenant = keys.lookup(token) if token is not None else None
            if tenant is None:
                metrics.reject("unknown", "unauthenticated")
                raise Unauthorized("no API key given: send Authorization: Bearer <key> (or x-api-key: <key>)"
                                   if token is None else "invalid API key")  # the key itself is never echoed
            request.state = tenant  # a generation request's limits are taken with its pair (Gate.pair_for)
            if (path.startswith("/v1/requests") or path == anthropic.COUNT_TOKENS) and tenant.key.requests_per_min:
                # reading its requests, counting tokens: engine calls too, counted against the key's requests
                grant = await store.acquire(tenant.ask(hold=False), (), clock())
                if not grant.ok:
                    metrics.reject(tenant.name, grant.limit or "")
                    raise tenant.refused(grant.limit or "", grant.retry_after_s)
            return await nxt(request)

        return run

    return wrap


def from_a_browser(request: Request, admin_host: str) -> str | None:
    """Why a request to an open admin plane may come from a web page rather than an operator's tool (None: it
    does not look like it). Without a key, loopback alone does not keep out a page in the operator's browser:
    a cross-site form or fetch carries an Origin (or Sec-Fetch-Site), and DNS rebinding a foreign Host."""
    h = request.headers
    host = h.get("host", "localhost").lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if name.strip("[]") not in ("localhost", "127.0.0.1", "::1", admin_host.lower()):
        return f"Host {one_line(host, 60)!r} is not this admin plane's"
    if "origin" in h or h.get("sec-fetch-site", "none") not in ("none", "same-origin"):
        return "a request from a web page"
    return None


def admin_keys(app: App) -> Middleware:
    """Admin plane: the admin key when one is configured (401 without, 403 with any other); else open, to the
    operator's own tools only (``from_a_browser``)."""
    keys = app.gw.admins
    admin_host = app.cfg.admin_host

    def wrap(nxt: Dispatch) -> Dispatch:
        async def run(request: Request) -> Response | Stream:
            if request.path == dashboard.PAGE_PATH and request.method == "GET" and keys is not None:
                return await nxt(request)  # the page holds no data; its calls carry the key
            if keys is None:
                why = from_a_browser(request, admin_host)
                if why is not None:
                    admin.audit(app.control, request, "denied", one_line(f"{request.method}:{request.path}", 100), 403)
                    raise Forbidden(f"refused: {why} (an admin plane without an admin key answers local tools only)")
                request.state = LOCAL
                return await nxt(request)
            token = bearer(request.headers)
            who = keys.lookup(token) if token is not None else None
            if who is None:
                err: Unauthorized | Forbidden = (Unauthorized("the admin plane needs the admin key (Authorization: "
                                                              "Bearer <admin key>)") if token is None
                                                 else Forbidden("not an admin key"))
                admin.audit(app.control, request, "denied", one_line(f"{request.method}:{request.path}", 100),
                            err.status)
                raise err
            request.state = who
            return await nxt(request)

        return run

    return wrap


# ---- lifecycle -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Route:
    """A path of the planes, named once. Served on the admin plane; at the front door too where ``front`` (the
    request paths: a client key's own requests there), else refused there whatever the key (``operator_only``);
    audited as ``action``; answered for every instance sharing the store through ``merge`` (``peers``)."""

    method: str
    path: str
    handler: Callable[[Control, Request], Awaitable[Response | Stream]]
    front: bool = False
    action: str | None = None
    merge: peers.Merge | None = None
    front_if: Callable[[GatewayConfig], bool] | None = None  # at the front door too where this setting says so


ROUTES = (
    Route("GET", "/v1/models", models, front=True),
    Route("GET", "/health", liveness, front=True),
    Route("GET", "/readiness", readiness, front=True),
    Route("GET", "/metrics", metrics, front_if=lambda cfg: cfg.metrics_on_front),  # where SGLang's scrapers look
    Route("GET", "/v1/workers", admin.list_workers),
    Route("POST", "/v1/workers", admin.add_worker, action="worker.register"),
    Route("DELETE", "/v1/workers/{id}", admin.remove_worker, action="worker.remove"),
    Route("POST", "/v1/workers/{id}/restart", admin.restart_worker, action="worker.restart"),
    Route("GET", "/v1/cluster", admin.cluster),
    Route("GET", "/v1/requests", admin.list_requests, front=True, merge=peers.requests_list),
    Route("GET", "/v1/requests/{id}", admin.get_request, front=True, merge=peers.by_id),
    Route("POST", "/v1/requests/{id}/abort", admin.abort_request, front=True, action="request.abort",
          merge=peers.by_id),
    Route("GET", "/v1/sessions", admin.list_sessions, front=True),
    Route("GET", "/v1/sessions/{key}", admin.get_session, front=True),
    Route("GET", "/v1/dashboard", dashboard.snapshot, merge=peers.dashboard),
    Route("GET", dashboard.PAGE_PATH, dashboard.dashboard_page),
)


class App:
    """The gateway's two listeners with their routes and middleware, and its lifecycle."""

    def __init__(self, cfg: GatewayConfig, gateway: Gateway | None = None,
                 supervisor: WorkerSupervisor | None = None) -> None:
        group = multi.Group.from_env()  # one of several processes on one port (``pdgate serve --workers N``)
        if group is not None and gateway is None:  # an instance id of its own: rids stay unique
            cfg = dataclasses.replace(cfg, instance_id=(cfg.instance_id or "")[:8] + secrets.token_hex(4))
        self.cfg = cfg
        self.gw = gateway or Gateway(cfg)
        self.group = group
        self.control = ctl = Control(self.gw, supervisor or multi.RemoteSupervisor.of(group))
        ctl.own_urls = self.own_urls
        self.peers = peers.Peers(self.gw.store, self.gw.instance) if self.gw.store.shared else None
        self.router = front = Router()
        for route in GENERATION:
            front.add("POST", route, functools.partial(self.gw.pipeline.handle, route=route))
        front.add("POST", RESPONSES, self.gw.responses.create)
        front.add("GET", RESPONSES + "/{id}", self.gw.responses.get)
        front.add("DELETE", RESPONSES + "/{id}", self.gw.responses.delete)
        front.add("POST", anthropic.MESSAGES, self.gw.messages.create)
        front.add("POST", anthropic.COUNT_TOKENS, self.gw.messages.count_tokens)

        back = Router()
        self.operator_paths: set[str] = set()
        for r in ROUTES:
            h = functools.partial(admin.audited(r.action, r.handler) if r.action else r.handler, ctl)
            back.add(r.method, r.path, peers.fanned(self.peers, "admin", r.merge, h))
            if r.front or (r.front_if is not None and r.front_if(cfg)):
                front.add(r.method, r.path, peers.fanned(self.peers, "front", r.merge, h))
            else:
                front.add(r.method, r.path, functools.partial(operator_only, ctl))
                self.operator_paths.add(r.path)
        dispatch = chain(front.dispatch, client_keys(self)) if self.gw.tenants is not None else front.dispatch
        on_error = refused(self) if cfg.access_log else None
        self.server = Server(dispatch, cfg.max_body_bytes, cfg.keepalive_s, cfg.head_timeout_s, cfg.body_timeout_s,
                             on_error, error_shape)
        admin_dispatch = chain(back.dispatch, admin_keys(self))
        self.admin = Server(admin_dispatch, 1 << 20, cfg.keepalive_s, cfg.head_timeout_s, cfg.body_timeout_s)
        # a process of a group (its ports shared) is reached by the other instances here, on loopback, with each
        # plane's own keys and middleware
        self.private = {"front": Server(dispatch, cfg.max_body_bytes, cfg.keepalive_s, cfg.head_timeout_s,
                                        cfg.body_timeout_s, on_error, error_shape),
                        "admin": Server(admin_dispatch, 1 << 20, cfg.keepalive_s, cfg.head_timeout_s,
                                        cfg.body_timeout_s)} if group is not None else {}
        if self.gw.tenants is not None:
            self.gw.metrics.add_collector(self._tenant_gauges)
        if group is not None:  # any process's /metrics answers for the group's processes (multiprocess files)
            self.gw.metrics.share(group.dir / multi.METRICS_DIR)

    def _tenant_gauges(self) -> Iterator[Metric]:
        live = GaugeMetricFamily("pdgate_tenant_live_requests", "Live requests by tenant (client key name) holding "
                                 "one of its max_concurrent", labels=["tenant"])
        held: dict[str, int] = {}
        for ctx in self.gw.live.values():
            if ctx.holds and ctx.tenant is not None:
                held[ctx.tenant.name] = held.get(ctx.tenant.name, 0) + 1
        for t in sorted(self.gw.tenants.values() if self.gw.tenants else (), key=lambda t: t.name):
            live.add_metric([t.name], float(held.get(t.name, 0)))
        yield live

    async def listen(self, flag: str, where: object, starting: Awaitable[None]) -> None:
        """Start a listener; a port in use or an address we may not bind is one line naming the flag."""
        try:
            await starting
        except OSError as exc:
            raise ConfigError(flag, where, f"cannot listen there: {exc.strerror or exc} (choose another with {flag})") from None

    def own_urls(self) -> set[str]:
        """This gateway's own listeners, as worker URLs would spell them (never registered as a worker)."""
        ports = {self.server.port} | ({self.admin.port} if not self.cfg.admin_socket else set())
        return {f"http://{h}:{p}" for p in ports for h in ("127.0.0.1", "localhost", "[::1]", self.cfg.host)}

    @property
    def admin_url(self) -> str:
        """Where the admin plane listens: ``http://host:port`` or ``unix:/path``."""
        if self.cfg.admin_socket:
            return f"unix:{self.cfg.admin_socket}"
        return f"http://{self.cfg.admin_host}:{self.admin.port}"

    async def start(self, host: str, port: int) -> None:
        raise_fd_limit()
        await self.control.start()
        c = self.cfg
        shared = self.group is not None  # SO_REUSEPORT: the group's processes listen on the same ports
        try:
            if c.admin_socket:
                await self.listen("--admin-socket", c.admin_socket, self.admin.start_unix(c.admin_socket))
            else:
                await self.listen("--admin-port", c.admin_port, self.admin.start(c.admin_host, c.admin_port,
                                                                                 reuse_port=shared))
            await self.listen("--port", port, self.server.start(host, port, reuse_port=shared))
            for srv in self.private.values():
                await srv.start("127.0.0.1", 0)
        except ConfigError:
            await self.cleanup()  # what started before the refusal stops with it
            raise
        ctl = self.control
        ctl.reachable = {plane: f"http://127.0.0.1:{srv.port}" for plane, srv in self.private.items()} or {
            "front": reachable_url(host, self.server.port),
            **({"admin": reachable_url(c.admin_host, self.admin.port)} if not c.admin_socket else {})}
        ctl.run()
        warning = open_front_door(host, self.gw.tenants is not None)
        if warning:
            log.warning(warning)
        log.info("admin plane on %s (%s)", self.admin_url, "admin key required" if self.gw.admins else "open: loopback only")

    async def cleanup(self) -> None:
        """Drain: stop accepting, let live requests finish for ``drain_s``, then give each one still
        live its terminal answer (and abort its legs) before the connections close."""
        drain_s = self.cfg.drain_s
        ctl = self.control
        ctl.draining = True
        await self.server.close(drain_s, lambda: self.gw.drain(f"still live after drain_s={drain_s:g}s"))
        ours = self.admin.server is not None  # the socket file is ours to remove only if we listened on it
        await self.admin.close()
        for srv in self.private.values():
            await srv.close()
        if self.peers is not None:
            self.peers.close()
        if isinstance(ctl.supervisor, multi.RemoteSupervisor):
            ctl.supervisor.close()
        if self.cfg.admin_socket and ours:
            with contextlib.suppress(OSError):
                os.unlink(self.cfg.admin_socket)
        await ctl.stop()  # the store last: until it is closed this instance's rids are live there


def open_front_door(host: str, keys: bool) -> str | None:
    """The warning for a front door without client keys beyond loopback (it stays open: as before)."""
    if keys or is_loopback(host):
        return None
    return (f"the front door listens on {host or 'every address'} without client keys: anyone who reaches it may "
            "send requests (configure [[keys]]; docs/access-control.md)")


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


def build_app(cfg: GatewayConfig, gateway: Gateway | None = None, supervisor: WorkerSupervisor | None = None) -> App:
    return App(cfg, gateway, supervisor)


async def serve(app: App, host: str, port: int) -> App:
    """Start the gateway's background work and listen; ``await app.cleanup()`` stops both."""
    await app.start(host, port)
    return app
