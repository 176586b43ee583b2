"""Terminal views for the CLI: live requests, one request's timeline, workers."""

from __future__ import annotations

import re
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from pdgate.core.rid import Rid

BAR = 30


CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _s(v: Any) -> Text:
    """A value as plain text: never read as rich markup (a model named "[/x]" or an IPv6 URL), control characters
    (a terminal's escape sequences) shown as "?"."""
    return Text(CONTROL.sub("?", "-" if v is None else str(v)))


NUMERIC = frozenset({"age s", "left s", "attempt", "chunks", "load", "limit", "restarts", "orphans", "drift",
                     "ttft ms", "cached", "prompt"})
HEADERS = {"prefill": "pre", "decode": "dec", "deadline": "next", "age s": "age", "left s": "left"}
WHOLE = frozenset({"id"})  # never wrapped: what `trace` and `abort` take


MIN_FOLD = 10  # a wrapping column narrower than this is hard to read: lay the rows out as records instead


def layout(title: str, cols: list[str], rows: list[list[Any]], width: int | None) -> Table | Group:
    """Rows that never lose a value. As a table when it fits ``width``: the id column keeps its width, numbers are
    never split, the others wrap (``fold``); none ends in an ellipsis; no vertical rules (80 columns hold a
    37-character id and the rest). Where even that does not fit (a long id or URL, --wide at 80 columns), one
    record per row: the id on its line, then every column as "name: value", wrapped between values."""
    cells = [[c if isinstance(c, Text) else Text(str(c)) for c in row] for row in rows]
    heads = [HEADERS.get(c, c) for c in cols]

    def need(i: int) -> int:
        longest = max((len(r[i].plain) for r in cells), default=0)
        if cols[i] in WHOLE or cols[i] in NUMERIC:
            return max(longest, len(heads[i]) if cols[i] in NUMERIC else 2)
        return min(max(longest, len(heads[i])), MIN_FOLD)

    if width is None or sum(need(i) + 2 for i in range(len(cols))) <= width:  # 2: the rule and padding
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
        for i, col in enumerate(cols):
            if col in WHOLE or col in NUMERIC:
                t.add_column(heads[i], no_wrap=True, min_width=need(i), justify="right" if col in NUMERIC else "left")
            else:
                t.add_column(heads[i], overflow="fold")
        for row in cells:
            t.add_row(*row)
        return t
    parts: list[Any] = [Text(title, style="bold")]
    for row in cells:
        parts.append(row[0])
        rest = Text("  ")
        for head, cell in zip(heads[1:], row[1:], strict=True):
            rest.append(f"{head}: ", style="dim")
            rest.append_text(cell)
            rest.append("  ")
        parts.append(rest)
    return Group(*parts)


def ps_table(data: dict[str, Any], wide: bool = False, width: int | None = None) -> Table | Group:
    reqs = data.get("requests", [])
    cols = ["id", "phase", "age s", "prefill", "decode", "deadline", "left s"]
    if wide:
        cols += ["attempt", "chunks", "model", "tenant"]
    rows = []
    for r in reqs:
        d = r.get("deadline") or {}
        left = d.get("left_s")
        row: list[Any] = [_s(r["id"]), _s(r["phase"]), f"{r['age_s']:.2f}", _s(r["prefill"]), _s(r["decode"]),
                          _s(d.get("next")),
                          Text(f"{left:.2f}", style="red" if left < 1 else "") if left is not None else Text("-")]
        if wide:
            row += [str(r["attempt"]), str(r.get("chunks", 0)), _s(r.get("model")), _s(r.get("tenant"))]
        rows.append(row)
    return layout(f"live requests: {data.get('count', 0)} (age, left: seconds)", cols, rows, width)


def workers_table(data: dict[str, Any], wide: bool = False, width: int | None = None) -> Table | Group:
    ws = data.get("workers", [])
    cols = ["id", "role", "url", "state", "load", "restarts", "engine queues"]
    if wide:
        cols += ["limit", "kind", "limit from", "identity", "fixes", "orphans", "drift", "gone rids aborted",
                 "last error"]
    rows = []
    for w in ws:
        state = "degraded" if w["degraded"] else ("up" if w["healthy"] else "down")
        style = {"up": "green", "down": "red", "degraded": "yellow"}[state]
        if w["breaker"] != "closed":  # health and breaker in one column: what a worker may be sent
            state, style = f"{state}, breaker {w['breaker']}", "yellow"
        eng = w.get("queues") or {}
        queues = " ".join(f"{k.replace('_queue_reqs', '').replace('num_', '').replace('_reqs', '')}={v}"
                          for k, v in eng.items() if v)
        cap, learned = w.get("capacity"), w.get("learned")
        src = "set" if w.get("configured") else learned_line(learned) if learned else "engine"
        role = w["role"] if w.get("kind") in (None, "sglang") else f"{w['role']}/{w['kind']}"  # another engine: said
        row: list[Any] = [_s(w["id"]), _s(role), _s(w["url"]), Text(state, style=style), str(w["load"]),
                          str(w["restarts"]), _s(queues or ("unknown" if w.get("counts_unknown") else "idle"))]
        if wide:
            row += ["-" if cap is None else str(cap), _s(w.get("kind") or "-"), _s(src), _s(w.get("identity") or "-"),
                    _s(",".join(str(f) for f in w.get("fixes") or []) or "-"),
                    str(w.get("orphans", 0)), str(w.get("drift", 0)),
                    _s(" ".join(f"{k}:{v}" for k, v in (w.get("reaped") or {}).items()) or "-"),
                    _s(w.get("last_error"))]
        rows.append(row)
    title = ("workers (limit from: set, engine, or learned as baseline/latency/target ms, the gateway's loop lag ms, "
             "its last moves and what moved it; gone "
             "rids aborted: a stopped gateway's requests this worker held)" if wide else "workers")
    return layout(title, cols, rows, width)


def learned_line(lv: dict[str, Any]) -> str:
    """A learned limit's inputs, the gateway's loop lag, its last moves and the signal that moved it last (the
    engine's latency, the engine's queue, or neither: held, the loop's lag explaining the latency), in one cell."""
    history = lv.get("history", [])
    moves = " ".join(str(h["limit"]) for h in history[-6:])
    if lv.get("baseline_ms") is None and not moves:
        return "learned, nothing measured yet"
    last = history[-1]["why"] if history else ""
    signals = (("engine latency", "engine latency"), ("engine queue clear", "grew: engine queue clear"),
               ("engine queue", "engine queue"), ("engine keeps up", "grew: engine keeps up"),
               ("no answer yet", "grew: no answer yet"))
    signal = next((name for prefix, name in signals if last.startswith(prefix)), "")
    return (f"{lv.get('baseline_ms')}/{lv.get('latency_ms')}/{lv.get('target_ms')}"
            + (f" q={lv['engine_waiting']}" if lv.get("engine_waiting") is not None else "")
            + (f" lag={lv['loop_lag_ms']}" if lv.get("loop_lag_ms") is not None else "")
            + (f"; {moves}" if moves else "") + (f" (last: {signal})" if signal else "")
            + ("; held: the loop's lag explains its latency" if lv.get("held") else ""))


def trace_view(t: dict[str, Any]) -> Group:
    head = Table.grid(padding=(0, 2))  # label, value: 80 columns hold the id whole
    head.add_column(no_wrap=True, style="dim")
    head.add_column(overflow="fold")
    head.add_row("request", _s(t["id"]))
    rid = Rid.parse(str(t["id"]))
    if rid is not None:  # who owns it: the gateway process (instance) that admitted it, and its place in order
        head.add_row("instance", _s(f"{rid.instance}  request #{rid.seq}"))
    head.add_row("route", _s(f"{t['route']}  model {t.get('model') or '-'}  stream {t['stream']}"))
    outcome = t.get("outcome") or t["phase"]
    head.add_row("outcome", Text(f"{_s(outcome).plain}  status {_s(t.get('status')).plain}",
                                 style="green" if t.get("outcome") == "completed" else "red" if t.get("outcome") else "yellow"))
    if t.get("reason"):
        head.add_row("reason", _s(t["reason"]))
    b = t["budgets_s"]
    tm = t["timings_s"]
    head.add_row("budgets", f"total {b['total']}s  ttft {b['ttft']}s  idle {b['idle']}s")
    secs = {k: "-" if tm.get(k) is None else f"{tm[k]}s" for k in ("ttft", "e2e", "tpot")}
    head.add_row("timings", f"ttft {secs['ttft']}  e2e {secs['e2e']}  tpot {secs['tpot']}")
    end = tm.get("e2e") or t["age_s"]
    phases = Table(title="phases", show_header=True)
    for col in ("phase", "start s", "took s", "timeline"):
        phases.add_column(col, overflow="fold")
    ph = t["phases"]
    for i, p in enumerate(ph):
        start = p["t"]
        stop = ph[i + 1]["t"] if i + 1 < len(ph) else None
        if stop is None:
            phases.add_row(_s(p["phase"]), f"{start:.4f}", "", "")
            continue
        a = int(start / end * BAR) if end else 0
        w = max(1, int((stop - start) / end * BAR)) if end else 1
        phases.add_row(_s(p["phase"]), f"{start:.4f}", f"{stop - start:.4f}", " " * a + "█" * w)
    parts: list[Any] = [head, phases]
    for att in t["attempts"]:  # its rid on a line of its own: text wraps between words, never inside the rid
        parts.append(_s(f"attempt {att['n']}: prefill {att['prefill']}, decode {att['decode']}, "
                        f"room {att['bootstrap_room']}"))
        parts.append(_s(f"  rid {att['rid']}" + (f"  error: {att['error']}" if att.get("error") else "")))
        at = Table()
        at.add_column("t s", justify="right")
        at.add_column("event", overflow="fold")
        at.add_column("info", overflow="fold")
        for e in att["events"]:
            at.add_row(f"{e['t']:.4f}", _s(e["event"]), _s(e.get("info")) if "info" in e else "")
        parts.append(at)
    if t.get("engine"):
        eng = Table(title="engine view (pdgate extension)")
        for col in ("worker", "queue", "since s"):
            eng.add_column(col, overflow="fold")
        for wid, e in t["engine"].items():
            eng.add_row(_s(wid), _s(e.get("queue")), _s(e.get("since_s")))
        parts.append(eng)
    return Group(*parts)


def session_table(data: dict[str, Any], width: int | None = None) -> Table | Group:
    """A session's rounds, oldest first: TTFT and cached tokens, the pair that served each, how it ended and why
    the policies chose as they did."""
    cols = ["id", "route", "ttft ms", "cached", "prompt", "prefill", "decode", "outcome", "routing"]
    rows = []
    for r in data.get("rounds", []):
        ttft = r.get("ttft_s")
        outcome = r.get("outcome") or r.get("phase")
        rows.append([_s(r["id"]), _s(str(r["route"]).removeprefix("/v1/")),
                     "-" if ttft is None else f"{ttft * 1000:.0f}", _s(r.get("cached_tokens")),
                     _s(r.get("prompt_tokens")), _s(r.get("prefill")), _s(r.get("decode")),
                     Text(str(outcome), style="green" if outcome == "completed" else "red" if r.get("outcome") else "yellow"),
                     _s("; ".join(r.get("routing") or []) or "-")])
    return layout(f"session {data.get('session')}: {data.get('count', 0)} rounds", cols, rows, width)
