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
- ``POST /v1/workers`` and ``DELETE /v1/workers/{id}``: done here, then by every sibling (routing is the
  same in all of them); a sibling that could not follow is named in ``x-pdgate-siblings-failed``;
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
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from h1lite.client import Client
from h1lite.server import Request, Response, Stream, json_response
from pdgate.errors import NotFound
from pdgate.multi import Group

if TYPE_CHECKING:
    from pdgate.server import App

log = logging.getLogger("pdgate.siblings")
LOCAL = "x-pdgate-local"
ASK_S = 3.0
OWNER = re.compile(r"^pdg-([0-9a-f]{1,16})-")
Handler = Callable[[Request], Awaitable[Response | Stream]]
Answer = tuple[str, int, bytes]  # (instance, status: 0 when it did not answer, body)


class Siblings:
    def __init__(self, app: App, group: Group) -> None:
        self.app, self.group = app, group
        self.client = Client(connect_timeout_s=2.0, idle_s=4.0, max_open=16, max_idle=4, max_body=64 << 20)

    def others(self, plane: str) -> list[tuple[str, str]]:
        """(instance, private URL of ``plane``) of every live sibling."""
        return [(str(m["instance"]), str(m[plane])) for m in self.group.siblings() if m.get(plane)]

    async def ask(self, plane: str, request: Request, only: str | None = None) -> list[Answer]:
        headers = {LOCAL: "1"}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        target = request.path + (f"?{request.query_string}" if request.query_string else "")
        ctype = request.headers.get("content-type", "application/json").encode("latin-1")

        async def one(inst: str, url: str) -> Answer:
            try:
                async with asyncio.timeout(ASK_S):
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


def _answered(answers: list[Answer]) -> list[dict[str, Any]]:
    out = []
    for _, status, body in answers:
        if status == 200:
            try:
                out.append(dict(orjson.loads(body)))
            except (orjson.JSONDecodeError, TypeError, ValueError):
                continue
    return out


def _processes(answers: list[Answer]) -> dict[str, int]:
    return {"answered": 1 + sum(1 for _, s, _ in answers if s == 200), "of": 1 + len(answers)}


async def requests_list(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _json(await local(request))
    answers = await sib.ask(plane, request)
    reqs = list(mine["requests"])
    for other in _answered(answers):
        reqs.extend(other.get("requests", []))
    reqs.sort(key=lambda r: -float(r.get("age_s") or 0))
    return json_response({"requests": reqs, "count": len(reqs), "processes": _processes(answers)})


async def by_id(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    m = OWNER.match(request.match.get("id", ""))
    inst = m.group(1) if m else None
    if inst is not None and inst != sib.app.gw.instance and any(i == inst for i, _ in sib.others(plane)):
        return _relayed((await sib.ask(plane, request, only=inst))[0])
    try:
        return await local(request)
    except NotFound:
        if inst == sib.app.gw.instance:
            raise
        for answer in await sib.ask(plane, request):
            if answer[1] not in (0, 404):
                return _relayed(answer)
        raise


def _relayed(answer: Answer) -> Response:
    inst, status, body = answer
    if status == 0:
        raise NotFound(f"the gateway process {inst} holding this request did not answer")
    return Response(body, status)


async def workers_list(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _json(await local(request))
    answers = await sib.ask(plane, request)
    merge_workers(mine["workers"], _answered(answers))
    mine["processes"] = _processes(answers)
    return json_response(mine)


def merge_workers(workers: list[dict[str, Any]], others: list[dict[str, Any]]) -> None:
    by_id = {w["id"]: w for w in workers}
    for other in others:
        for w in other.get("workers", []):
            mine = by_id.get(w.get("id"))
            if mine is not None and mine.get("url") == w.get("url"):
                for k in ("load", "capacity"):
                    if isinstance(mine.get(k), int) and isinstance(w.get(k), int):
                        mine[k] += w[k]


async def broadcast(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    resp = await local(request)  # refused here (bad input, unknown worker): refused for all, nobody asked
    failed = [inst for inst, status, _ in await sib.ask(plane, request) if not 200 <= status < 300]
    if failed:
        log.warning("%s %s: sibling(s) %s did not follow", request.method, request.path, ", ".join(failed))
        if isinstance(resp, Response):
            resp.headers["x-pdgate-siblings-failed"] = ",".join(failed)
    return resp


async def dashboard(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _json(await local(request))
    answers = await sib.ask(plane, request)
    others = _answered(answers)
    merge_workers(mine["workers"], others)
    mine["instances"] = [mine["instance"], *(o.get("instance") for o in others)]
    for o in others:
        mine["live"].extend(o.get("live", []))
        mine["live_count"] += int(o.get("live_count", 0))
        mine["queue_depth"] += int(o.get("queue_depth", 0))
        for key in ("by_phase", "finished"):
            for k, v in (o.get(key) or {}).items():
                mine[key][k] = mine[key].get(k, 0) + v
        mine["recent_failures"].extend(o.get("recent_failures", []))
        oldest = o.get("oldest")
        if oldest and (mine["oldest"] is None or oldest.get("age_s", 0) > mine["oldest"].get("age_s", 0)):
            mine["oldest"] = oldest
    mine["live"] = sorted(mine["live"], key=lambda r: -float(r.get("age_s") or 0))[:200]
    mine["recent_failures"] = sorted(mine["recent_failures"], key=lambda r: float(r.get("ago_s") or 0))[:50]
    mine["processes"] = _processes(answers)
    return json_response(mine)


async def metrics(sib: Siblings, plane: str, request: Request, local: Handler) -> Response | Stream:
    resp = await local(request)
    assert isinstance(resp, Response)
    answers = await sib.ask(plane, request)
    texts = [resp.body.decode()] + [body.decode(errors="replace") for _, status, body in answers if status == 200]
    return Response(merge_metrics(texts), content_type=CONTENT_TYPE_LATEST)


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
        for fam in text_string_to_metric_families(text):
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
    mine["instances"] = sorted({sib.app.gw.instance, *(str(m["instance"]) for m in sib.group.members())})
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


def fanned(app: App, plane: str, method: str, path: str, handler: Handler) -> Handler:
    """``handler`` answering for every process of the group (when there is one and the route merges)."""
    merge = MERGES.get((method, path))
    if merge is None:
        return handler

    async def run(request: Request) -> Response | Stream:
        sib = app.siblings
        if sib is None or LOCAL in request.headers:
            return await handler(request)
        return await merge(sib, plane, request, handler)

    return run
