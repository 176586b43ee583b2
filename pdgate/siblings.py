"""The admin plane of a gateway run as several processes (``pdgate.multi``): whichever process the kernel
hands a call to answers for all of them.

An operator's call (and a client's own ``/v1/requests`` on the front door) is answered here by
asking every sibling through its private listener for the same plane (``127.0.0.1``, the same keys
and middleware: the caller's ``Authorization`` is forwarded, nothing is granted on the way),
marked ``x-pdgate-local: 1`` so the sibling answers for itself alone, and merging:

- ``GET /v1/requests``: every process's live requests, oldest first;
- ``GET /v1/requests/{id}`` and ``POST .../abort``: the process whose instance id is in the request
  id answers (``pdg-<instance>-...``); an id of another form (a client's ``x-request-id``) is
  looked for here, then in every sibling;
- ``GET /v1/workers``: this process's view of each worker, with ``load`` and ``capacity`` summed over the
  processes and ``processes`` (how many answered);
- ``POST /v1/workers`` and ``DELETE /v1/workers/{id}``: done by the group's leader (the live process of the lowest
  index; a call that came to another is handed to it), then by every other process with the id the worker got
  there (routing is the same in all of them, under the same ids); a process that could not follow is named in
  ``x-pdgate-siblings-failed``;
- ``GET /v1/dashboard``: counts summed, lists merged;
- ``GET /metrics``: counters and histograms summed by label set (what prometheus-client's multiprocess
  mode does), gauges too (live requests, queue depth and loads add up over processes; a worker's
  state gauge reads as the number of processes that see it so);
- ``GET /v1/lease``: this instance, with every sibling's in ``instances``.

A sibling that does not answer within ``ASK_S`` is left out and counted in ``processes``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from h1lite.client import Client
from h1lite.server import Request, Response, Stream, json_response
from pdgate.admin import Registered
from pdgate.errors import NoHealthyPair, NotFound, one_line
from pdgate.multi import Group
from pdgate.rid import Rid

log = logging.getLogger("pdgate.siblings")
LOCAL = "x-pdgate-local"
WORKER_ID = "x-pdgate-worker-id"  # on a registration a sibling forwards: the id the worker got there
ASK_S = 3.0
Handler = Callable[[Request], Awaitable[Response | Stream]]
Answer = tuple[str, int, bytes]  # (instance, status: 0 when it did not answer, body)


class Siblings:
    def __init__(self, instance: str, health_timeout_s: float, group: Group) -> None:
        self.instance, self.health_timeout_s, self.group = instance, health_timeout_s, group
        self.client = Client(connect_timeout_s=2.0, idle_s=4.0, max_open=16, max_idle=4, max_body=64 << 20)

    def others(self, plane: str) -> list[tuple[str, str]]:
        """(instance, private URL of ``plane``) of every live sibling."""
        return [(str(m["instance"]), str(m[plane])) for m in self.group.siblings() if m.get(plane)]

    async def ask(self, plane: str, request: Request, only: str | None = None,
                  extra: dict[str, str] | None = None, local: bool = True, timeout_s: float = ASK_S) -> list[Answer]:
        """The same call asked of every sibling (or the one of instance ``only``), for itself alone (``local``)
        or, not ``local``, as if it had come to it (it then asks its own siblings: the leader of a change)."""
        headers = {**({LOCAL: "1"} if local else {}), **(extra or {})}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        target = request.path + (f"?{request.query_string}" if request.query_string else "")
        ctype = request.headers.get("content-type", "application/json").encode("latin-1")

        async def one(inst: str, url: str) -> Answer:
            try:
                async with asyncio.timeout(timeout_s):
                    resp, body = await self.client.fetch_response(url, request.method, target, request.body, ctype,
                                                                  headers)
                return inst, resp.status, body
            except (OSError, TimeoutError) as exc:
                log.warning("sibling %s did not answer %s %s: %s", inst, request.method, request.path, exc)
                return inst, 0, b""

        return list(await asyncio.gather(*(one(i, u) for i, u in self.others(plane) if only in (None, i))))

    def close(self) -> None:
        self.client.close()


def _json(resp: Response | Stream) -> dict[str, Any]:
    assert isinstance(resp, Response)
    return dict(orjson.loads(resp.body))


def _answered(answers: list[Answer], shape: dict[str, type] | None = None) -> list[dict[str, Any]]:
    """The siblings' 200 answers that are JSON objects whose fields in ``shape`` have the types named there (a
    sibling answering anything else is left out, with a log line, rather than spoil the whole answer)."""
    out = []
    for inst, status, body in answers:
        if status != 200:
            continue
        try:
            got = orjson.loads(body)
        except orjson.JSONDecodeError:
            got = None
        if isinstance(got, dict) and all(isinstance(got.get(k), t) for k, t in (shape or {}).items()):
            out.append(got)
        else:
            log.warning("sibling %s answered something that is not its part of the answer: left out", inst)
    return out


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def _age(r: dict[str, Any], key: str = "age_s") -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _processes(answers: list[Answer]) -> dict[str, int]:
    return {"answered": 1 + sum(1 for _, s, _ in answers if s == 200), "of": 1 + len(answers)}


async def requests_list(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _json(await local(request))
    answers = await sib.ask(plane, request)
    reqs = list(mine["requests"])
    for other in _answered(answers, {"requests": list}):
        reqs.extend(_dicts(other["requests"]))
    reqs.sort(key=lambda r: -_age(r))
    return json_response({"requests": reqs, "count": len(reqs), "processes": _processes(answers)})


async def by_id(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    rid = Rid.parse(request.match.get("id", ""))
    inst = rid.instance if rid is not None else None
    if inst is not None and inst != sib.instance and any(i == inst for i, _ in sib.others(plane)):
        return _relayed((await sib.ask(plane, request, only=inst))[0])
    try:
        return await local(request)
    except NotFound:
        if inst == sib.instance:
            raise
        for answer in await sib.ask(plane, request):
            if answer[1] not in (0, 404):
                return _relayed(answer)
        raise


def _relayed(answer: Answer) -> Response:
    inst, status, body = answer
    if status == 0:
        raise SiblingUnavailable(f"the gateway process {inst} holding this request did not answer within "
                                 f"{ASK_S:g}s; ask again")
    return Response(body, status)


class SiblingUnavailable(NoHealthyPair):
    code = "gateway_process_unavailable"


async def workers_list(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _json(await local(request))
    answers = await sib.ask(plane, request)
    merge_workers(mine["workers"], _answered(answers, {"workers": list}))
    mine["processes"] = _processes(answers)
    return json_response(mine)


def merge_workers(workers: list[dict[str, Any]], others: list[dict[str, Any]]) -> None:
    by_id = {w["id"]: w for w in workers}
    for other in others:
        for w in _dicts(other.get("workers")):
            mine = by_id.get(w.get("id"))
            if mine is not None and mine.get("url") == w.get("url"):
                for k in ("load", "capacity"):
                    if isinstance(mine.get(k), int) and isinstance(w.get(k), int):
                        mine[k] += w[k]


async def broadcast(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    """A change of workers: made by the group's leader (the live process of the lowest index) first, then by
    every other process with the id it got there. One process names new workers, so two changes at once never
    give one id to two workers; a call that came to another process is handed to the leader."""
    timeout_s = max(ASK_S, 2 * sib.health_timeout_s + 2)  # a registration probes, then checks
    members = sib.group.members()
    leader = min(members, key=lambda m: int(m.get("index", 0)), default=None)
    if leader is not None and leader.get("pid") != os.getpid():
        handed = await sib.ask(plane, request, only=str(leader["instance"]), local=False, timeout_s=timeout_s + ASK_S)
        if handed:  # (none: the leader's record names no listener of this plane; this process leads then)
            return _relayed(handed[0])
    resp = await local(request)  # refused here (bad input, unknown worker): refused for all, nobody asked
    # a registration carries the id it got here: every process names the worker alike (a DELETE by id then
    # removes the same worker everywhere; a sibling that has that id for another worker refuses, and is named)
    wid = resp.worker if isinstance(resp, Registered) else None
    extra = {WORKER_ID: wid} if wid and request.method == "POST" else None
    failed = [inst for inst, status, _ in await sib.ask(plane, request, extra=extra, timeout_s=timeout_s)
              if not 200 <= status < 300]
    if failed:
        log.warning("%s %s: sibling(s) %s did not follow", request.method, request.path, ", ".join(failed))
        if isinstance(resp, Response):
            resp.headers["x-pdgate-siblings-failed"] = ",".join(failed)
    return resp


async def dashboard(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _json(await local(request))
    answers = await sib.ask(plane, request)
    others = _answered(answers, {"workers": list, "live": list, "live_count": int, "queue_depth": int,
                                 "by_phase": dict, "finished": dict, "recent_failures": list})
    merge_workers(mine["workers"], others)
    mine["instances"] = [mine["instance"], *(o.get("instance") for o in others)]
    for o in others:
        mine["live"].extend(_dicts(o["live"]))
        mine["live_count"] += o["live_count"]
        mine["queue_depth"] += o["queue_depth"]
        for key in ("by_phase", "finished"):
            for k, v in o[key].items():
                if isinstance(v, int):
                    mine[key][k] = mine[key].get(k, 0) + v
        mine["recent_failures"].extend(_dicts(o["recent_failures"]))
        oldest = o.get("oldest")
        if isinstance(oldest, dict) and (mine["oldest"] is None or _age(oldest) > _age(mine["oldest"])):
            mine["oldest"] = oldest
    mine["live"] = sorted(mine["live"], key=lambda r: -_age(r))[:200]
    mine["recent_failures"] = sorted(mine["recent_failures"], key=lambda r: _age(r, "ago_s"))[:50]
    mine["processes"] = _processes(answers)
    return json_response(mine)


async def metrics(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    resp = await local(request)
    assert isinstance(resp, Response)
    answers = await sib.ask(plane, request)
    texts = [resp.body.decode()] + [body.decode(errors="replace") for _, status, body in answers if status == 200]
    return Response(merge_metrics(texts), content_type=CONTENT_TYPE_LATEST)


def _families(text: str) -> list[Metric]:
    """One process's exposition parsed; one that does not parse is left out (with a log line)."""
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        log.warning("a sibling's /metrics does not parse (%s): left out", one_line(str(exc), 120))
        return []


class _Merged:
    """A collector of families already merged (prometheus-client renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_metrics(texts: list[str]) -> bytes:
    """Several processes' exposition merged: samples with the same name and labels summed, with prometheus-client's
    own parser and renderer."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for fam in _families(text):
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                sums[fam.name] = {}
            acc = sums[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                acc[key] = acc.get(key, 0.0) + s.value
    for name, fam in families.items():
        for (sample, labels), value in sums[name].items():
            fam.add_sample(sample, dict(labels), value)
    return generate_latest(_Merged(list(families.values())))


async def lease(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _json(await local(request))
    mine["instances"] = sorted({sib.instance, *(str(m["instance"]) for m in sib.group.members())})
    return json_response(mine)


Merge = Callable[[Siblings, str, Request, Handler], Awaitable[Response | Stream]]
MERGES: dict[tuple[str, str], Merge] = {
    ("GET", "/v1/requests"): requests_list,
    ("GET", "/v1/requests/{id}"): by_id,
    ("POST", "/v1/requests/{id}/abort"): by_id,
    ("GET", "/v1/workers"): workers_list,
    ("POST", "/v1/workers"): broadcast,
    ("DELETE", "/v1/workers/{id}"): broadcast,
    ("GET", "/v1/dashboard"): dashboard,
    ("GET", "/metrics"): metrics,
    ("GET", "/v1/lease"): lease,
}


def fanned(sib: Siblings | None, plane: str, method: str, path: str, handler: Handler) -> Handler:
    """``handler`` answering for every process of the group (when there is one and the route merges)."""
    merge = MERGES.get((method, path))
    if merge is None or sib is None:
        return handler

    async def run(request: Request) -> Response | Stream:
        if LOCAL in request.headers:
            return await handler(request)
        return await merge(sib, plane, request, handler)

    return run
