"""Active health checks, restart detection and progress-based (gray failure) detection.

One task per worker, owned by the app. Each check: ``GET /health``, then ``/server_info``
(identity, served model, fixes; for engine/sglang workers identity and fixes come from
``/pdgate/v1/info``) and ``/v1/loads?include=disagg`` (engine queue counts).
- ``failures`` consecutive failed checks -> down: its live requests are failed or retried
  at once (not left to their deadlines).
- A new identity, or up again after down -> restarted: the same, and counted.
- Holding our requests with no progress for ``degraded_after_s`` -> degraded (no new
  requests; the affected traces get an event); it recovers on progress, or once none of
  our requests is left on it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdgate import protocol
from pdgate.errors import one_line
from pdgate.gateway import Gateway
from pdgate.upstream import LoopLate
from pdgate.workers import Breaker, State, Worker

log = logging.getLogger("pdgate.health")


async def check(gw: Gateway, w: Worker) -> None:
    cfg = gw.cfg.health
    info: Any = None
    ok = False
    started = gw.now()
    inconclusive = False
    try:
        status, _ = await gw.up().get(w.url + protocol.HEALTH_PATH, cfg.timeout_s)
        ok = status == 200
        if ok:
            status, info = await gw.up().get_json(w.url + protocol.SERVER_INFO_PATH, cfg.timeout_s)
            if status in (401, 403):  # /health is open on SGLang with --api-key; the rest is not
                ok = False
                w.last_error = (f"/server_info answered {status}: the engine refuses the gateway's credentials "
                                "(worker_api_key must be its --api-key)")
        if ok:
            if isinstance(info, dict) and protocol.IDENTITY_FIELD not in info and w.info_path is not False:
                info = {**info, **await ext_info(gw, w, cfg.timeout_s)}
            _, loads = await gw.up().get_json(w.url + protocol.LOADS_PATH + "?include=disagg", cfg.timeout_s)
            w.engine = _engine_counts(loads)
            held = sum(v for k, v in w.engine.items() if k in ("num_running_reqs", "num_waiting_reqs")
                       and isinstance(v, int))
            w.foreign = max(0, held - len(w.bound)) if "num_running_reqs" in w.engine else 0
        elif w.last_error is None or not w.last_error.startswith("/server_info"):
            w.last_error = f"/health answered {status}"
    except OSError as exc:  # a timeout's message is empty: say what it was
        detail = str(exc) or (f"no answer within {cfg.timeout_s:g}s" if isinstance(exc, TimeoutError) else "no detail")
        inconclusive = late_not_lost(w, started, exc)
        w.last_error = one_line(f"{exc.__class__.__name__}: {detail}" + (
            " (not counted against it, unless it keeps happening)" if inconclusive else ""))
    if ok:
        w.health_uncounted = 0
        on_up(gw, w, info if isinstance(info, dict) else {})
    elif inconclusive and w.health_uncounted < UNCOUNTED_FACTOR * cfg.failures:
        w.health_uncounted += 1  # forgiven, a few times in a row at most: a hung worker on a late loop goes down
    else:
        on_failed_check(gw, w)
    w.checked = True
    check_progress(gw, w)
    gw.gate.pump()  # its capacity, its backoff or its state may have changed


UNCOUNTED_FACTOR = 2  # timed-out checks in a row forgiven: this many times health.failures, then they count


def late_not_lost(w: Worker, started: float, exc: BaseException) -> bool:
    """Whether a timed-out check says nothing against the worker, and is not counted as a failure: this gateway's
    own loop ran behind (a saturated relay reads everything late, and its timers fire before the reads:
    ``LoopLate``), or the worker kept sending our requests' tokens while we waited for its answer."""
    if isinstance(exc, LoopLate):
        return True
    return isinstance(exc, TimeoutError) and w.last_progress >= started and w.busy_since is not None


async def ext_info(gw: Gateway, w: Worker, timeout_s: float) -> dict[str, Any]:
    """Identity and fixes from ``/pdgate/v1/info`` (engine/sglang workers). A worker that answers
    anything but a JSON object there is not asked again until it has been down."""
    try:
        status, body = await gw.up().get_json(w.url + protocol.EXT_INFO_PATH, timeout_s)
    except OSError:  # not this check's verdict: /health and /server_info decide that
        return {}
    w.info_path = status == 200 and isinstance(body, dict)
    return dict(body) if w.info_path else {}


def _engine_counts(loads: Any) -> dict[str, Any]:
    if not isinstance(loads, dict) or not loads.get("loads"):
        return {}
    first = loads["loads"][0]
    out = {k: first.get(k) for k in ("num_running_reqs", "num_waiting_reqs") if k in first}
    out.update(first.get("disagg") or {})
    return out


def on_up(gw: Gateway, w: Worker, info: dict[str, Any]) -> None:
    ident = info.get(protocol.IDENTITY_FIELD)
    restarted = None
    if w.identity is not None and ident is not None and ident != w.identity:
        restarted = "new identity"
    elif w.checked and w.state is State.DOWN and ident is None:
        restarted = "health down->up"
    if ident is not None:
        w.identity = ident
    w.fixes = info.get(protocol.FIXES_FIELD)
    served = info.get("served_model_name") or info.get("model_path")
    gw.pool.set_models(w, (served,) if isinstance(served, str) else ())
    w.has_extension = info.get("pdgate_engine") is not None
    cap = info.get("max_running_requests")  # SGLang's resolved server arg (the sim reports its own)
    w.engine_capacity = cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None
    w.health_failures, w.last_error = 0, None
    now = gw.now()
    if restarted:
        w.restarts += 1
        w.breaker.success()
        w.transition(State.RESTARTED, now, restarted)
    if not w.healthy:
        w.transition(State.UP if w.breaker.state is Breaker.CLOSED else State.BREAKER_OPEN, now, "health check passed")


def on_failed_check(gw: Gateway, w: Worker) -> None:
    w.health_failures += 1
    if w.health_failures >= gw.cfg.health.failures and w.state is not State.DOWN:
        w.info_path = None  # whatever comes back up may be another engine
        w.transition(State.DOWN, gw.now(), w.last_error or "health check failed")


def check_progress(gw: Gateway, w: Worker) -> None:
    now = gw.now()
    if w.degraded and w.busy_since is None:
        # the evidence (our stuck requests) is gone; it gets new requests again and, if still
        # stuck, is degraded again after degraded_after_s
        w.transition(State.UP, now, "no longer holds stuck requests")
        return
    stalled = w.stalled_for(now)
    if stalled >= gw.cfg.health.degraded_after_s and w.state in (State.UP, State.HALF_OPEN):
        w.transition(State.DEGRADED, now, f"holds {w.load} of our requests with no progress for {stalled:.1f}s")


async def run(gw: Gateway, w: Worker) -> None:
    kick = gw.kicks.setdefault(w.id, asyncio.Event())
    while w.id in gw.pool.by_id:
        kick.clear()
        try:
            await check(gw, w)
        except Exception:  # a health loop must survive anything a worker answers
            log.exception("health check of %s failed", w.id)
        try:
            await asyncio.wait_for(kick.wait(), gw.cfg.health.interval_s)
        except TimeoutError:
            pass
    gw.kicks.pop(w.id, None)
