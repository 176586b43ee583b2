"""``pdgate serve`` with features knocked out, for measurement only.

BENCHMARKS.md run AF, "Where pdgate's cost above the floor goes": ``KNOCK=metrics,traces,...`` replaces each named feature's per-request work with nothing, so a closed loop run against
it (``KNOCK=... scripts/ab_hotpath.sh DIR PORT``) shows what that work costs. A knocked-out gateway is not a gateway to
serve anyone: no metrics, no traces, no deadlines, no validation, as named.

Names: metrics (transition observer and histograms), events (attempt events), traces (the trace store), lineage (the
successor's record), watchdog (the deadline timer), validation (body checks), usage (token counts from the answer),
routing (the policies: first prefill, first decode), finished (``Observers.finished``: recent rids, traces, access log);
``KNOCK=all``: every one. ``loadtest bench --compare --knockout NAMES`` runs it beside the peers.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pdgate.adapters import base, sglang
from pdgate.core import record, validation
from pdgate.observe import metrics, traces
from pdgate.path import observers, scope
from pdgate.planes.cli import main
from pdgate.pool import lineage, routing


def noop(*_: Any, **__: Any) -> None:
    return None


def first_pair(self: routing.Routing, avoid: Any, view: Any, now: float, limited: bool = True) -> Any:
    return self.pool.prefill[0], self.pool.decode[0]


KNOCKS: dict[str, list[tuple[Any, str, Any]]] = {
    "metrics": [(metrics.Metrics, "on_transition", noop), (metrics.Hist, "observe", noop)],
    "events": [(record.Attempt, "event", noop)],
    "traces": [(traces.Traces, "add", noop), (traces.Traces, "finish", noop)],
    "lineage": [(lineage.Lineage, "began", noop), (lineage.Lineage, "ended", noop)],
    "watchdog": [(scope.Watchdog, "arm", noop), (scope.Watchdog, "rearm", noop), (scope.Watchdog, "disarm", noop)],
    "validation": [(validation, "check_depth", noop),
                   (validation, "validate", lambda route, body: (body.get("model"), bool(body.get("stream"))))],
    "usage": [(sglang.SGLang, "usage", lambda self, answer: base.Usage())],
    "routing": [(routing.Routing, "pick", first_pair)],
    "finished": [(observers.Observers, "finished", noop)],
}

if __name__ == "__main__":
    names = os.environ.get("KNOCK", "")
    for name in KNOCKS if names == "all" else filter(None, names.split(",")):
        if name not in KNOCKS:
            sys.exit(f"KNOCK: unknown feature {name!r} (known: {', '.join(KNOCKS)})")
        for owner, attr, value in KNOCKS[name]:
            if not hasattr(owner, attr):  # renamed since: knocking out nothing would measure nothing
                sys.exit(f"KNOCK={name}: {owner.__name__}.{attr} is gone; update scripts/knockout_serve.py")
            setattr(owner, attr, value)
    main(sys.argv[1:])
