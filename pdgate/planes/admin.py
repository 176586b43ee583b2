"""The operator's endpoints: workers, requests, cluster. Served on the admin plane; a client key reads and aborts
its own requests through the front door's copies of the request endpoints (``mine``).

Every change an operator makes (register, remove, restart, abort) is audited: one line on the
``pdgate.audit`` logger with who (the admin key's name, or the client key's), what, on what and the
answer's status, and ``pdgate_admin_actions_total``. Keys are never logged, only their names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import orjson

from h1lite.server import Request, Response, Stream, json_response
from pdgate.adapters import Probe
from pdgate.core.config import (
    ConfigError,
    Role,
    WorkerSpec,
    host_allowed,
    parse_prefill_flag,
    validate_worker,
)
from pdgate.core.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    GatewayError,
    NotFound,
    Unauthorized,
    WorkerUnreachable,
)
from pdgate.core.record import LIVE, Record, phase_label
from pdgate.core.validation import parse_body
from pdgate.observe import traces
from pdgate.path.auth import Admin, Tenant
from pdgate.path.gateway import Gateway
from pdgate.path.scope import Cause, Reason
from pdgate.planes.control import Control
from pdgate.planes.peers import Data
from pdgate.pool.policies import session_key

audit_log = logging.getLogger("pdgate.audit")
PHASES = (*dict.fromkeys(phase_label(p) for p in LIVE), "prefill")  # what GET /v1/requests?phase= takes
Handler = Callable[[Control, Request], Awaitable[Response | Stream]]


class Registered(Response):
    """A registration's answer, with the id the worker got (the audit line names it)."""

    __slots__ = ("worker",)

    def __init__(self, body: bytes, status: int, worker: str) -> None:
        super().__init__(body, status)
        self.worker = worker


def actor(request: Request) -> str:
    st = request.state
    if isinstance(st, Admin):
        return st.name
    if isinstance(st, Tenant):
        return f"client:{st.name}"
    return "anonymous"


def audit(ctl: Control, request: Request, action: str, target: str, status: int, detail: str = "") -> None:
    who = actor(request)
    audit_log.info("audit actor=%s action=%s target=%s status=%d%s", who, action, target, status,
                   f" {detail}" if detail else "")
    ctl.gw.metrics.admin_actions.labels(who, action, str(status)).inc()


def audited(action: str, handler: Handler) -> Handler:
    """``handler`` with its outcome audited (also when it fails)."""

    async def run(ctl: Control, request: Request) -> Response | Stream:
        target = target_of(request)
        try:
            resp = await handler(ctl, request)
        except GatewayError as exc:
            audit(ctl, request, action, target, exc.status, f"error={exc.code}")
            raise
        status = resp.status if isinstance(resp, Response) else 200
        audit(ctl, request, action, f"{resp.worker}={target}" if isinstance(resp, Registered) else target, status)
        return resp

    return run


def target_of(request: Request) -> str:
    """What an action is about: the id in the path, else the URL a registration names (one bounded line)."""
    if "id" in request.match:
        return quote(request.match["id"], safe="")[:100]  # one token: nothing in it can forge the line
    try:
        url = parse_body(request.body).get("url")
    except BadRequest:
        return "-"
    return quote(url, safe=":/[]")[:100] if isinstance(url, str) else "-"


def tenant_of(request: Request) -> Tenant | None:
    """The client key of a front-door request for the request endpoints; None on the admin plane (sees all)."""
    st = request.state
    if isinstance(st, Admin):
        return None
    if isinstance(st, Tenant):
        return st
    # the front door without client keys: nobody can be told apart, so nobody reads requests here
    if "authorization" in request.headers:
        raise Forbidden("requests are read on the admin plane (no client keys are configured here)")
    raise Unauthorized("reading requests here needs a client key (Authorization: Bearer <key>); operators use "
                       "the admin plane")


def visible(rec: Record | None, tenant: Tenant | None) -> Record | None:
    """A record as a tenant may see it: its own, else as if absent (another's id is not confirmed either)."""
    if rec is None or tenant is None:
        return rec
    return rec if rec.tenant == tenant.name else None


# ---- workers ---------------------------------------------------------------------------------------
async def list_workers(ctl: Control, request: Request) -> Response:
    gw = ctl.gw
    now = gw.now()
    return json_response({"workers": [w.view(now) for w in gw.pool.by_id.values()]})


def registration(ctl: Control, body: dict[str, Any]) -> WorkerSpec:
    """The worker a ``POST /v1/workers`` body names (its URL in one canonical spelling), or a 400/409 saying why
    not. Registrations in progress count against the limit and the duplicate check."""
    gw = ctl.gw
    try:
        role, url, kind = body.get("role"), str(body.get("url", "")).rstrip("/"), body.get("engine", "sglang")
        if role == "prefill":
            bport = body.get("bootstrap_port")
            spec = parse_prefill_flag(url, None if bport is None else str(bport), kind)
        elif role == "decode":
            spec = validate_worker(WorkerSpec(url=url, role=Role.DECODE, engine=kind))
        else:
            raise ConfigError("role", role, "must be prefill or decode")
    except (ConfigError, ValueError, TypeError) as exc:
        raise BadRequest(str(exc)) from None
    if spec.engine not in gw.adapters.kinds:
        raise BadRequest(f"engine {spec.engine!r} is not a kind this gateway knows ({', '.join(sorted(gw.adapters.kinds))})",
                         param="engine")
    if not host_allowed(spec.host, ctl.worker_hosts):
        raise BadRequest(f"worker host {spec.host} is not allowed (gateway.allowed_worker_hosts: "
                         f"{', '.join(ctl.worker_hosts)})", param="url")
    if spec.url in ctl.own_urls():
        raise BadRequest(f"{spec.url} is this gateway itself", param="url")
    if len(gw.pool.by_id) + len(ctl.registering) >= gw.cfg.max_workers:
        raise Conflict(f"the gateway has its max_workers of {gw.cfg.max_workers} workers")
    for w in gw.pool.by_id.values():
        if w.url == spec.url and w.role == spec.role:
            raise Conflict(f"{spec.role} worker {spec.url} is already registered as {w.id}")
    if (spec.role, spec.url) in ctl.registering:
        raise Conflict(f"{spec.role} worker {spec.url} is being registered")
    return spec


async def probe(gw: Gateway, spec: WorkerSpec) -> Probe | None:
    """What ``spec`` says of itself if it answers as an engine of its kind and role (``Engine.identify``: asked
    without the engines' key), within the health check's bound."""
    timeout = gw.cfg.health.timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await gw.adapters(spec.engine).identify(spec, timeout)
    except Exception:  # refused, reset, timed out, garbage: all one answer
        return None


async def add_worker(ctl: Control, request: Request) -> Response:
    """Register a worker once it answers as one: a registration that fails leaves nothing behind, and every
    kind of failure reads the same, after the same time (no port scanner, no echo of what answered)."""
    gw = ctl.gw
    spec = registration(ctl, await read_json(request))
    started = time.monotonic()
    ctl.registering.add((spec.role, spec.url))
    try:
        same = await ctl.same_address(spec, gw.cfg.health.timeout_s)
        if same is not None:  # another spelling of a registered engine: one engine counted twice
            raise Conflict(f"{spec.url} reaches the same address as worker {same.id} ({same.url}); nothing was "
                           "registered")
        found = await probe(gw, spec)
    finally:
        ctl.registering.discard((spec.role, spec.url))
    twin = next((w for w in gw.pool.by_id.values() if found is not None and found.identity is not None
                 and w.identity == found.identity), None)
    if twin is not None:
        raise Conflict(f"{spec.url} answers as the engine registered as worker {twin.id} ({twin.url}: the same "
                       "identity); nothing was registered")
    if found is None:
        if not any(w.url == spec.url for w in gw.pool.by_id.values()):
            gw.upstream.client.drop(spec.url)
        timeout = gw.cfg.health.timeout_s
        await asyncio.sleep(max(0.0, timeout - (time.monotonic() - started)))  # as long as the slowest failure
        raise WorkerUnreachable(f"the {spec.role} worker at {spec.url} did not answer as an {spec.engine} "
                                f"{spec.role} worker within {timeout:g}s; nothing was registered")
    try:
        w = await ctl.register(spec)  # with a shared store: into its worker set, which names it, for every process
    except ValueError as exc:  # registered meanwhile by another call
        raise Conflict(str(exc)) from None
    if w is None:
        raise Conflict(f"{spec.role} worker {spec.url} is already registered")
    return Registered(orjson.dumps(w.view(gw.now())), 201, w.id)


async def remove_worker(ctl: Control, request: Request) -> Response:
    wid = request.match["id"]
    if wid not in ctl.gw.pool.by_id:
        raise NotFound(f"no worker {wid}")
    w = await ctl.remove(wid)
    return json_response({"removed": wid, "url": w.url})


async def restart_worker(ctl: Control, request: Request) -> Response:
    gw = ctl.gw
    wid = request.match["id"]
    w = gw.pool.by_id.get(wid)
    if w is None:
        raise NotFound(f"no worker {wid}")
    sup = ctl.supervisor
    if sup is None:
        raise NotFound("this gateway does not run its workers (start it with `pdgate up` to restart them from here)")
    child = await sup.restart_url(w.url)
    await gw.health.check(w)
    return json_response({"worker": w.view(gw.now()), "process": child})


async def cluster(ctl: Control, request: Request) -> Response:
    sup = ctl.supervisor
    if sup is None:
        raise NotFound("this gateway does not run its workers")
    return json_response({"processes": await sup.view()})


# ---- requests (the admin plane sees all; a client key, on the front door, its own) ----------------------
async def list_requests(ctl: Control, request: Request) -> Response:
    gw = ctl.gw
    tenant = tenant_of(request)
    q = request.query
    try:
        min_age = float(q["min_age_s"]) if "min_age_s" in q else None
    except ValueError:
        raise BadRequest(f"min_age_s must be a number, got {q['min_age_s']!r}") from None
    phase, worker = q.get("phase"), q.get("worker")
    if phase is not None and phase not in PHASES:
        raise BadRequest(f"phase must be one of {', '.join(PHASES)}, got {phase!r}", param="phase")
    if worker is not None and worker not in gw.pool.by_id:
        raise BadRequest(f"worker must be one of {', '.join(sorted(gw.pool.by_id)) or 'none'}, got {worker!r}",
                         param="worker")
    now = gw.now()
    recs = [r for r in gw.traces.query(now, phase, worker, min_age) if visible(r, tenant)]
    return Data({"requests": [traces.summary(r, now) for r in recs], "count": len(recs)})


async def get_request(ctl: Control, request: Request) -> Response:
    gw = ctl.gw
    tenant = tenant_of(request)
    rec = visible(gw.traces.get(request.match["id"], tenant.name if tenant else None), tenant)
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
        if w is None or not w.info.lists_rids:
            return
        held = await w.adapter.held(w.url, 1.0)
        if held is None:  # a trace must render whatever the engine does
            out[wid] = {"queue": "unknown"}
            return
        hit = next((h for h in held if h.rid == a.rid), None)
        out[wid] = {"rid": hit.rid, "queue": hit.queue, "since_s": hit.age_s} if hit else {"queue": None}

    await asyncio.gather(one(a.prefill), one(a.decode))
    return out


async def abort_request(ctl: Control, request: Request) -> Response:
    gw = ctl.gw
    asked = request.match["id"]
    tenant = tenant_of(request)
    rec = visible(gw.traces.get(asked, tenant.name if tenant else None), tenant)
    if rec is None:
        raise NotFound(f"no live request {asked}")
    ctx = gw.live.get(rec.id)
    if ctx is None:
        return json_response({"id": rec.id, "aborted": False, "reason": "already finished"}, 409)
    by = f"by its client ({tenant.name})" if tenant is not None else f"by an operator ({actor(request)})"
    won = ctx.cancel(Reason(Cause.OPERATOR, detail=by))
    return json_response({"id": rec.id, "aborted": won, **({} if won else {"reason": "already ending"})},
                         200 if won else 409)


# ---- sessions: an agent's rounds (the session key the routing policies use) ------------------------------
SESSIONS_LISTED = 50


async def list_sessions(ctl: Control, request: Request) -> Response:
    gw, tenant, now = ctl.gw, tenant_of(request), ctl.gw.now()
    out = []
    for key, recs in gw.traces.sessions(SESSIONS_LISTED if tenant is None else 10 * SESSIONS_LISTED):
        mine = [r for r in recs if visible(r, tenant)]
        if mine:
            last = mine[-1]
            out.append({"session": key, "rounds": len(mine), "tenant": last.tenant, "last_id": last.id,
                        "last_age_s": round(now - last.created, 3), "live": sum(1 for r in mine if r.live)})
    out = out[:SESSIONS_LISTED]
    return json_response({"sessions": out, "count": len(out)})


async def get_session(ctl: Control, request: Request) -> Response:
    """A session's rounds: ``key`` as the policies name it (an admin: ``tenant/name`` where keys are in use); a
    client key asks by its own name for it."""
    gw, tenant, asked = ctl.gw, tenant_of(request), request.match["key"]
    key = session_key(tenant.name, asked, {}) if tenant is not None else asked
    now = gw.now()
    rounds = [traces.session_round(r, now) for r in gw.traces.session(key or "") if visible(r, tenant)]
    if not rounds:
        raise NotFound(f"no live or recent request of session {asked[:200]!r}")
    return json_response({"session": key, "rounds": rounds, "count": len(rounds)})


async def read_json(request: Request) -> dict[str, Any]:
    ctype = request.headers.get("content-type", "")
    if not ctype.split(";", 1)[0].strip().lower() == "application/json":  # a form a web page can post is not JSON
        raise BadRequest("the body must be sent as Content-Type: application/json")
    return parse_body(request.body)
