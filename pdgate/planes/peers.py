"""Any admin plane answers for every live gateway instance that shares the store (``pdgate.store``): the
processes of ``--workers N`` and the replicas on other hosts alike.

An operator's call (and a client's own ``/v1/requests`` on the front door) is answered here by asking every other
live instance — found in the store's registry, where each says how its planes are reached — for the same call
(the caller's ``Authorization`` is forwarded, nothing is granted on the way), marked ``x-pdgate-local: 1`` so it
answers for itself alone, and merging:

- ``GET /v1/requests``: every instance's live requests, oldest first;
- ``GET /v1/requests/{id}`` and ``POST .../abort``: the instance whose id is in the request id answers
  (``pdgate.core.rid``); an id of another form (a client's ``x-request-id``) is looked for here, then everywhere;
- ``GET /v1/dashboard``: counts summed, lists merged.

Workers need no merge: what every instance holds on a worker is the store's, and each process's view includes it
(``Worker.load``); changes to the worker set go through the store. Metrics: prometheus-client's multiprocess
files for the processes of one host (``pdgate.observe.metrics``); each host is scraped on its own.

An instance that does not answer within ``ASK_S`` is left out and counted in ``processes``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from h1lite.client import Client
from h1lite.server import Request, Response, Stream, json_response
from pdgate.core.errors import NoHealthyPair, NotFound
from pdgate.core.rid import Rid
from pdgate.store.base import Store

log = logging.getLogger("pdgate.peers")
LOCAL = "x-pdgate-local"
ASK_S = 3.0
Handler = Callable[[Request], Awaitable[Response | Stream]]
Answer = tuple[str, int, bytes]  # (instance, status: 0 when it did not answer, body)


class Peers:
    def __init__(self, store: Store, instance: str) -> None:
        self.store, self.instance = store, instance
        self.client = Client(connect_timeout_s=2.0, idle_s=4.0, max_open=16, max_idle=4, max_body=64 << 20)

    async def others(self, plane: str) -> list[tuple[str, str]]:
        """(instance, URL of its ``plane``) of every other live instance, from the store's registry."""
        live = await self.store.instances() or {}
        return [(i, str(info[plane])) for i, info in live.items() if i != self.instance and info.get(plane)]

    async def ask(self, plane: str, request: Request, only: str | None = None,
                  timeout_s: float = ASK_S) -> list[Answer]:
        """The same call asked of every other instance (or the one ``only``), for itself alone."""
        headers = {LOCAL: "1"}
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
                log.warning("gateway instance %s did not answer %s %s: %s", inst, request.method, request.path, exc)
                return inst, 0, b""

        return list(await asyncio.gather(*(one(i, u) for i, u in await self.others(plane) if only in (None, i))))

    def close(self) -> None:
        self.client.close()


class Data(Response):
    """A JSON answer that keeps the object it was made from: a merge reads this instance's part from it, as it is,
    and only the other instances' parts from their bytes."""

    __slots__ = ("obj",)

    def __init__(self, obj: dict[str, Any], status: int = 200) -> None:
        super().__init__(orjson.dumps(obj), status)
        self.obj = obj


def _mine(resp: Response | Stream) -> dict[str, Any]:
    if not isinstance(resp, Data):
        raise TypeError("a merged route's own handler answers with peers.Data")
    return resp.obj


def _answered(answers: list[Answer], shape: dict[str, type] | None = None) -> list[dict[str, Any]]:
    """The instances' 200 answers that are JSON objects whose fields in ``shape`` have the types named there (a
    instance answering anything else is left out, with a log line, rather than spoil the whole answer)."""
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
            log.warning("instance %s answered something that is not its part of the answer: left out", inst)
    return out


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def _age(r: dict[str, Any], key: str = "age_s") -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _processes(answers: list[Answer]) -> dict[str, int]:
    return {"answered": 1 + sum(1 for _, s, _ in answers if s == 200), "of": 1 + len(answers)}


async def requests_list(peers: Peers, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _mine(await local(request))
    answers = await peers.ask(plane, request)
    reqs = list(mine["requests"])
    for other in _answered(answers, {"requests": list}):
        reqs.extend(_dicts(other["requests"]))
    reqs.sort(key=lambda r: -_age(r))
    return json_response({"requests": reqs, "count": len(reqs), "processes": _processes(answers)})


async def by_id(peers: Peers, plane: str, request: Request, local: Handler) -> Response | Stream:
    rid = Rid.parse(request.match.get("id", ""))
    inst = rid.instance if rid is not None else None
    if inst is not None and inst != peers.instance and any(i == inst for i, _ in await peers.others(plane)):
        return _relayed((await peers.ask(plane, request, only=inst))[0])
    try:
        return await local(request)
    except NotFound:
        if inst == peers.instance:
            raise
        for answer in await peers.ask(plane, request):
            if answer[1] not in (0, 404):
                return _relayed(answer)
        raise


def _relayed(answer: Answer) -> Response:
    inst, status, body = answer
    if status == 0:
        raise PeerUnavailable(f"the gateway instance {inst} holding this request did not answer within "
                                 f"{ASK_S:g}s; ask again")
    return Response(body, status)


class PeerUnavailable(NoHealthyPair):
    code = "gateway_instance_unavailable"


async def dashboard(peers: Peers, plane: str, request: Request, local: Handler) -> Response | Stream:
    mine = _mine(await local(request))
    answers = await peers.ask(plane, request)
    others = _answered(answers, {"workers": list, "live": list, "live_count": int, "queue_depth": int,
                                 "by_phase": dict, "finished": dict, "recent_failures": list})
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


Merge = Callable[[Peers, str, Request, Handler], Awaitable[Response | Stream]]


def fanned(peers: Peers | None, plane: str, merge: Merge | None, handler: Handler) -> Handler:
    """``handler`` answering for every live instance sharing the store (when it is shared and the route merges)."""
    if merge is None or peers is None:
        return handler

    async def run(request: Request) -> Response | Stream:
        if LOCAL in request.headers:
            return await handler(request)
        return await merge(peers, plane, request, handler)

    return run
