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

def apply(names: str) -> list[str]:
    """Knock out ``names`` (comma-separated, or ``all``); the names knocked out. An unknown name, or a target gone
    since (knocking out nothing would measure nothing), ends the process with a message."""
    chosen = list(KNOCKS) if names == "all" else [n for n in names.split(",") if n]
    for name in chosen:
        if name not in KNOCKS:
            sys.exit(f"KNOCK: unknown feature {name!r} (known: {', '.join(KNOCKS)})")
        for owner, attr, _ in KNOCKS[name]:
            if not hasattr(owner, attr):  # renamed since: knocking out nothing would measure nothing
                sys.exit(f"KNOCK={name}: {owner.__name__}.{attr} is gone; update scripts/knockout_serve.py")
    for name in chosen:
        for owner, attr, value in KNOCKS[name]:
            setattr(owner, attr, value)
    return chosen


if __name__ == "__main__":
    knocked = apply(os.environ.get("KNOCK", ""))
    print("knocked out:", ",".join(knocked) or "nothing", file=sys.stderr, flush=True)
    main(sys.argv[1:])
