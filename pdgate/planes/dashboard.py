"""The live dashboard on the admin plane: ``GET /dashboard`` (one HTML page, plain JS, no build step) and the
snapshot it polls, ``GET /v1/dashboard``: workers and their state, live requests by phase with ages and
deadlines left, the oldest live request, recent failures and deadline expiries. A request's waterfall (phases,
attempts, legs, events, the engines' queue) is drawn from ``GET /v1/requests/{id}``.

The page holds no data and is served without a key; its calls carry the admin key the operator types into its
box (kept in the tab's sessionStorage only; never in a URL, which a browser's history would keep).
"""

from __future__ import annotations

import functools
from importlib import resources

from h1lite.server import Request, Response
from pdgate.core.record import Phase, phase_label
from pdgate.observe import traces
from pdgate.planes.control import Control
from pdgate.planes.peers import Data

RECENT = 30  # recent failures and expiries shown
SESSIONS, SESSION_ROUNDS = 8, 12  # sessions shown (the most recently active), and each one's last rounds
PAGE_PATH = "/dashboard"


@functools.cache
def page() -> bytes:
    return resources.files("pdgate.planes").joinpath("dashboard.html").read_bytes()


async def dashboard_page(ctl: Control, request: Request) -> Response:
    return Response(page(), content_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-store", "Content-Security-Policy":
                             "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                             "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
                             "frame-ancestors 'none'", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
                             "X-Content-Type-Options": "nosniff"})


async def snapshot(ctl: Control, request: Request) -> Response:
    gw = ctl.gw
    now = gw.now()
    live = sorted(gw.traces.live.values(), key=lambda r: r.created)
    by_phase: dict[str, int] = {}
    for r in live:
        label = phase_label(r.phase)
        by_phase[label] = by_phase.get(label, 0) + 1
    recent = []
    for r in reversed(gw.traces.finished.values()):
        if r.phase is not Phase.COMPLETED:
            recent.append({**traces.summary(r, now), "status": r.status, "reason": r.reason, "cause": r.cause,
                           "ended_phase": phase_label(r.ended_phase) if r.ended_phase else None,
                           "ago_s": round(now - (r.finished_at or now), 3)})
            if len(recent) >= RECENT:
                break
    finished = gw.metrics.finished
    return Data({
        "instance": gw.instance,
        "workers": [w.view(now) for w in gw.pool.by_id.values()],
        "live": [traces.summary(r, now) for r in live[:200]],
        "live_count": len(live),
        "by_phase": by_phase,
        "oldest": traces.summary(live[0], now) if live else None,
        "queue_depth": gw.gate.queue.n,
        "recent_failures": recent,
        "sessions": [{"session": key, "rounds": [traces.session_round(r, now) for r in recs[-SESSION_ROUNDS:]],
                      "first": max(0, len(recs) - SESSION_ROUNDS)}
                     for key, recs in gw.traces.sessions(SESSIONS)],
        "finished": {outcome: sum(n for (_, o), n in finished.items() if o == outcome)
                     for outcome in sorted({o for _, o in finished})},
    })
