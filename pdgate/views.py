"""Terminal views for the CLI: live requests, one request's timeline, workers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

BAR = 30


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


NUMERIC = frozenset({"age s", "left s", "attempt", "chunks", "load", "restarts", "orphans", "drift"})
HEADERS = {"prefill": "pre", "decode": "dec", "deadline": "next", "age s": "age", "left s": "left"}
WHOLE = frozenset({"id", "url"})  # never wrapped: what `trace`, `abort` and curl take


def _table(title: str, cols: list[str], rows: Sequence[dict[str, Any]] = ()) -> Table:
    """A table that never cuts a value: the id and url columns keep their width, the others wrap (``fold``) when
    the terminal or pipe is narrow; none ends in an ellipsis. No vertical rules (80 columns hold a 37-character id
    and the rest). Compact by default: ``--wide`` adds the columns an operator needs less often."""
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for col in cols:
        if col in WHOLE:
            t.add_column(col, no_wrap=True, min_width=max((len(str(r.get(col, ""))) for r in rows), default=2))
        else:
            t.add_column(HEADERS.get(col, col), overflow="fold", justify="right" if col in NUMERIC else "left")
    return t


def ps_table(data: dict[str, Any], wide: bool = False) -> Table:
    reqs = data.get("requests", [])
    cols = ["id", "phase", "age s", "prefill", "decode", "deadline", "left s"]
    if wide:
        cols += ["attempt", "chunks", "model", "tenant"]
    t = _table(f"live requests: {data.get('count', 0)} (age, left: seconds)", cols, reqs)
    for r in reqs:
        d = r.get("deadline") or {}
        left = d.get("left_s")
        row: list[Any] = [r["id"], r["phase"], f"{r['age_s']:.2f}", _s(r["prefill"]), _s(r["decode"]), _s(d.get("next")),
                          Text(f"{left:.2f}", style="red" if left < 1 else "") if left is not None else Text("-")]
        if wide:
            row += [str(r["attempt"]), str(r.get("chunks", 0)), _s(r.get("model")), _s(r.get("tenant"))]
        t.add_row(*row)
    return t


def workers_table(data: dict[str, Any], wide: bool = False) -> Table:
    ws = data.get("workers", [])
    cols = ["id", "role", "url", "state", "load", "restarts", "engine queues"]
    if wide:
        cols += ["identity", "fixes", "orphans", "drift", "last error"]
    t = _table("workers", cols, ws)
    for w in ws:
        state = "degraded" if w["degraded"] else ("up" if w["healthy"] else "down")
        style = {"up": "green", "down": "red", "degraded": "yellow"}[state]
        if w["breaker"] != "closed":  # health and breaker in one column: what a worker may be sent
            state, style = f"{state}, breaker {w['breaker']}", "yellow"
        eng = w.get("engine") or {}
        queues = " ".join(f"{k.replace('_queue_reqs', '').replace('num_', '').replace('_reqs', '')}={v}"
                          for k, v in eng.items() if v)
        row: list[Any] = [w["id"], w["role"], w["url"], Text(state, style=style), str(w["load"]), str(w["restarts"]),
                          queues or "idle"]
        if wide:
            row += [w.get("identity") or "-", ",".join(w.get("fixes") or []) or "-", str(w.get("orphans", 0)),
                    str(w.get("drift", 0)), _s(w.get("last_error"))]
        t.add_row(*row)
    return t


def trace_view(t: dict[str, Any]) -> Group:
    head = Table.grid(padding=(0, 2))
    for i in range(6):
        if i == 1:  # the id is never cut (what `trace` and `abort` take)
            head.add_column(no_wrap=True, min_width=len(t["id"]))
        else:
            head.add_column(overflow="fold")
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
        phases.add_column(col, overflow="fold")
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
        at.add_column("event", overflow="fold")
        at.add_column("info", overflow="fold")
        for e in att["events"]:
            at.add_row(f"{e['t']:.4f}", e["event"], _s(e.get("info")) if "info" in e else "")
        parts.append(at)
    if t.get("engine"):
        eng = Table(title="engine view (pdgate extension)")
        for col in ("worker", "queue", "since s"):
            eng.add_column(col, overflow="fold")
        for wid, e in t["engine"].items():
            eng.add_row(wid, _s(e.get("queue")), _s(e.get("since_s")))
        parts.append(eng)
    return Group(*parts)
