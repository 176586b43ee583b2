"""Terminal views for the CLI: live requests, one request's timeline, workers."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

BAR = 40


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


def ps_table(data: dict[str, Any]) -> Table:
    t = Table(title=f"live requests: {data.get('count', 0)}")
    widest = max((len(r["id"]) for r in data.get("requests", [])), default=2)
    for col in ("id", "phase", "age s", "attempt", "prefill", "decode", "deadline", "left s", "chunks"):
        if col == "id":  # what `trace` and `abort` take: never cut, the other columns give way
            t.add_column(col, no_wrap=True, min_width=widest)
            continue
        t.add_column(col, justify="right" if col in ("age s", "left s", "attempt", "chunks") else "left")
    for r in data.get("requests", []):
        d = r.get("deadline") or {}
        left = d.get("left_s")
        t.add_row(r["id"], r["phase"], f"{r['age_s']:.2f}", str(r["attempt"]), _s(r["prefill"]), _s(r["decode"]),
                  _s(d.get("next")), Text(f"{left:.2f}", style="red" if left is not None and left < 1 else "") if left is not None
                  else Text("-"), str(r.get("chunks", 0)))
    return t


def workers_table(data: dict[str, Any]) -> Table:
    t = Table(title="workers")
    for col in ("id", "role", "url", "health", "breaker", "load", "restarts", "identity", "fixes", "orphans", "drift",
                "engine queues"):
        t.add_column(col)
    for w in data.get("workers", []):
        state = "degraded" if w["degraded"] else ("up" if w["healthy"] else "down")
        style = {"up": "green", "down": "red", "degraded": "yellow"}[state]
        eng = w.get("engine") or {}
        queues = " ".join(f"{k.replace('_queue_reqs', '').replace('num_', '')}={v}" for k, v in eng.items() if v)
        t.add_row(w["id"], w["role"], w["url"], Text(state, style=style), w["breaker"], str(w["load"]), str(w["restarts"]),
                  (w.get("identity") or "-")[:8], ",".join(w.get("fixes") or []) or "-", str(w.get("orphans", 0)),
                  str(w.get("drift", 0)), queues or "idle")
    return t


def trace_view(t: dict[str, Any]) -> Group:
    head = Table.grid(padding=(0, 2))
    for i in range(6):
        if i == 1:  # the id is never cut (what `trace` and `abort` take)
            head.add_column(no_wrap=True, min_width=len(t["id"]))
        else:
            head.add_column()
    head.add_row("request", t["id"], "route", t["route"], "model", _s(t.get("model")))
    head.add_row("outcome", Text(_s(t.get("outcome") or t["phase"]),
                                 style="green" if t.get("outcome") == "completed" else "red" if t.get("outcome") else "yellow"),
                 "status", _s(t.get("status")), "stream", str(t["stream"]))
    if t.get("reason"):
        head.add_row("reason", t["reason"])
    b = t["budgets_s"]
    tm = t["timings_s"]
    head.add_row("budgets", f"total {b['total']}s  ttft {b['ttft']}s  idle {b['idle']}s", "ttft", _s(tm.get("ttft")),
                 "e2e", _s(tm.get("e2e")))
    end = tm.get("e2e") or t["age_s"]
    phases = Table(title="phases", show_header=True)
    for col in ("phase", "start s", "took s", "timeline"):
        phases.add_column(col)
    ph = t["phases"]
    for i, p in enumerate(ph):
        start = p["t"]
        stop = ph[i + 1]["t"] if i + 1 < len(ph) else None
        if stop is None:
            phases.add_row(p["phase"], f"{start:.4f}", "", "")
            continue
        a = int(start / end * BAR) if end else 0
        w = max(1, int((stop - start) / end * BAR)) if end else 1
        phases.add_row(p["phase"], f"{start:.4f}", f"{stop - start:.4f}", " " * a + "█" * w)
    parts: list[Any] = [head, phases]
    for att in t["attempts"]:
        at = Table(title=f"attempt {att['n']}: prefill {att['prefill']}, decode {att['decode']}, rid {att['rid']}, "
                         f"room {att['bootstrap_room']}" + (f"  error: {att['error']}" if att.get("error") else ""))
        at.add_column("t s", justify="right")
        at.add_column("event")
        at.add_column("info")
        for e in att["events"]:
            at.add_row(f"{e['t']:.4f}", e["event"], _s(e.get("info")) if "info" in e else "")
        parts.append(at)
    if t.get("engine"):
        eng = Table(title="engine view (pdgate extension)")
        eng.add_column("worker")
        eng.add_column("queue")
        eng.add_column("since s")
        for wid, e in t["engine"].items():
            eng.add_row(wid, _s(e.get("queue")), _s(e.get("since_s")))
        parts.append(eng)
    return Group(*parts)
