"""Live records and a bounded ring of finished ones; their JSON shape for the API and CLI."""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from pdgate.core.record import Phase, Record, phase_label
from pdgate.core.rid import Rid


class Traces:
    def __init__(self, ring_size: int) -> None:
        self.live: dict[str, Record] = {}
        self.finished: OrderedDict[str, Record] = OrderedDict()
        self._ring = ring_size
        # a client's own x-request-id -> our id (live and ring only): per tenant (one tenant's ids never shadow
        # another's), and the latest of any tenant for the admin plane
        self.by_client: dict[tuple[str, str], str] = {}
        self.by_client_any: dict[str, str] = {}

    def add(self, rec: Record) -> None:
        self.live[rec.id] = rec
        cid = rec.client_request_id
        if cid is not None:
            self.by_client[(rec.tenant or "", cid)] = rec.id
            self.by_client_any[cid] = rec.id

    def finish(self, rec: Record) -> None:
        self.live.pop(rec.id, None)
        self.finished[rec.id] = rec
        while len(self.finished) > self._ring:
            _, old = self.finished.popitem(last=False)
            cid = old.client_request_id
            if cid is not None:
                key = (old.tenant or "", cid)
                if self.by_client.get(key) == old.id:
                    del self.by_client[key]
                if self.by_client_any.get(cid) == old.id:
                    del self.by_client_any[cid]

    def _one(self, rid: str) -> Record | None:
        return self.live.get(rid) or self.finished.get(rid)

    def get(self, ident: str, tenant: str | None = None) -> Record | None:
        """A live or recent record by our request id, by its response's id (``resp_<id>``: /v1/responses), by one
        of its attempts' rids (``<id>.<n>``: the OpenAI SDK's chat ``response.id``), or by the client's own
        ``x-request-id`` (its latest request; ``tenant``: among that tenant's requests, None: among everyone's)."""
        rec = self._one(ident) or (self._one(ident[5:]) if ident.startswith("resp_") else None)
        if rec is None:
            rid = Rid.parse(ident)
            if rid is not None and rid.attempt:
                rec = self._one(str(rid.request))
                if rec is not None and not any(a.rid == ident for a in rec.attempts):
                    rec = None
        if rec is None:
            ours = self.by_client_any.get(ident) if tenant is None else self.by_client.get((tenant, ident))
            rec = self._one(ours) if ours is not None else None
        return rec

    def session(self, key: str) -> list[Record]:
        """A session's rounds among the live and recent records, oldest first (bounded as the ring is)."""
        return sorted((r for r in (*self.finished.values(), *self.live.values()) if r.session == key),
                      key=lambda r: r.created)

    def sessions(self, limit: int) -> list[tuple[str, list[Record]]]:
        """The sessions of the live and recent records, the most recently active first, at most ``limit``."""
        by: dict[str, list[Record]] = {}
        for r in sorted((*self.finished.values(), *self.live.values()), key=lambda r: r.created):
            if r.session is not None:
                by.setdefault(r.session, []).append(r)
        return sorted(by.items(), key=lambda kv: kv[1][-1].created, reverse=True)[:limit]

    def live_phases(self) -> dict[Phase, int]:
        """Live requests by phase, counted at scrape time (nothing per request)."""
        return Counter(r.phase for r in self.live.values())

    def oldest_age(self, now: float) -> float:
        return max((now - r.created for r in self.live.values()), default=0.0)

    def query(self, now: float, phase: str | None = None, worker: str | None = None,
              min_age_s: float | None = None) -> list[Record]:
        out = []
        for r in self.live.values():
            if phase is not None and r.phase.value != phase and phase_label(r.phase) != phase:
                continue
            a = r.attempt
            if worker is not None and (a is None or worker not in (a.prefill, a.decode)):
                continue
            if min_age_s is not None and now - r.created < min_age_s:
                continue
            out.append(r)
        return out


def _rel(t: float | None, base: float) -> float | None:
    return None if t is None else round(t - base, 6)


def summary(rec: Record, now: float) -> dict[str, Any]:
    a = rec.attempt
    kind, due = rec.due()
    return {
        "id": rec.id, "route": rec.route, "model": rec.model, "stream": rec.stream,
        "phase": phase_label(rec.phase), "age_s": round(now - rec.created, 3),
        "attempt": len(rec.attempts), "prefill": a.prefill if a else None, "decode": a.decode if a else None,
        "rid": a.rid if a else None, "chunks": rec.chunks,
        "deadline": {"next": kind, "left_s": round(due - now, 3)} if rec.live else None,
        "outcome": rec.outcome.value if rec.outcome else None,
        "tenant": rec.tenant,
    }


def full(rec: Record, now: float, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    base = rec.created
    d = rec.deadlines
    out = summary(rec, now)
    out.update({
        "client_request_id": rec.client_request_id,
        "created_at": rec.created_wall,
        "status": rec.status,
        "reason": rec.reason,
        "cause": rec.cause,
        "notes": rec.notes or [],
        "ended_phase": phase_label(rec.ended_phase) if rec.ended_phase else None,
        "budgets_s": {"total": d.total_s, "ttft": d.ttft_s, "idle": d.idle_s},
        "phases": [{"t": _rel(t, base), "phase": "prefill+transfer" if p == "prefill" else p} for t, p in rec.history],
        "timings_s": {
            "ttft": _rel(rec.first_token_at, base),
            "last_token": _rel(rec.last_token_at, base),
            "e2e": _rel(rec.finished_at, base),
            "tpot": (round((rec.last_token_at - rec.first_token_at) / max(rec.chunks - 1, 1), 6)
                     if rec.first_token_at is not None and rec.last_token_at is not None and rec.chunks > 1 else None),
        },
        "tokens": {"prompt": rec.prompt_tokens, "cached": rec.cached_tokens, "completion": rec.completion_tokens,
                   "chunks": rec.chunks},
        "attempts": [
            {"n": a.n, "rid": a.rid, "prefill": a.prefill, "decode": a.decode, **a.drawn,
             "error": a.error, "events": [{"t": _rel(t, base), "event": name, **({"info": info} if info is not None else {})}
                                          for t, name, info in a.events]}
            for a in rec.attempts
        ],
    })
    if engine:
        out["engine"] = engine
    return out


def session_round(rec: Record, now: float) -> dict[str, Any]:
    """One round of a session: where it went, how fast its first token came, what the prefill's cache held, how it
    ended, and why the policies chose its workers."""
    a = rec.attempt
    notes = [str(info) for att in rec.attempts for _, name, info in att.events if name == "routing"]
    return {
        "id": rec.id, "response_id": "resp_" + rec.id if rec.route == "/v1/responses" else None, "route": rec.route,
        "created_at": rec.created_wall, "age_s": round(now - rec.created, 3),
        "ttft_s": _rel(rec.first_token_at, rec.created), "e2e_s": _rel(rec.finished_at, rec.created),
        "prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens, "completion_tokens": rec.completion_tokens,
        "prefill": a.prefill if a else None, "decode": a.decode if a else None, "attempts": len(rec.attempts),
        "phase": phase_label(rec.phase), "outcome": rec.outcome.value if rec.outcome else None, "status": rec.status,
        "routing": notes, "tenant": rec.tenant,
    }
