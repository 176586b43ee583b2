"""The ``/v1/responses`` routes: a Responses request served through the unchanged request path as the engines'
chat completion (``pdgate.apis.responses`` translates), and the responses kept in the store per tenant
(``docs/responses.md``).

``POST /v1/responses``: ``previous_response_id`` read from the store (the tenant's own, else 404), the chat body
made, the request's life run by the pipeline (admission, deadlines, both legs, retries before the first byte,
aborts, outcome) with the stream translated per event (``ctx.front``); then, with ``store`` (the default), the
response and its conversation kept before the client gets its terminal event, so a continuation sent the moment
it arrives finds it. A stream the gateway ends (deadline, drain, abort, a failed leg) ends with
``response.failed`` naming why, also when it ends before its first token; what a client should retry later
(429 and 503 with Retry-After: a key's limits, a full queue, a shed) stays an HTTP status, which the SDKs retry.
``GET`` and ``DELETE /v1/responses/{id}``: the tenant's own stored responses only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from h1lite.server import Request, Response, Stream, json_response
from pdgate.apis import responses
from pdgate.core.config import Role
from pdgate.core.errors import NotFound, UpstreamError
from pdgate.core.validation import CHAT, parse_body
from pdgate.path.auth import Tenant
from pdgate.path.relay import SSE_HEADERS
from pdgate.pool.policies import session_key

if TYPE_CHECKING:
    from pdgate.core.config import ResponsesConfig
    from pdgate.core.record import Record
    from pdgate.path.proxy import Pipeline
    from pdgate.store.base import Store

log = logging.getLogger("pdgate.responses")


class ResponsesFront(responses.Events):
    """A Responses stream bound to its request's record (``Ctx.front``)."""

    __slots__ = ("headers", "rec")

    def __init__(self, body: dict[str, Any], dropped: list[str]) -> None:
        super().__init__(body, "", 0)
        self.rec: Record | None = None
        self.headers = responses.dropped_header(dropped)

    def start(self, rec: Record) -> None:
        self.rec = rec
        rid = responses.response_id(rec.id)
        self.resp["id"], self.resp["created_at"], self.base = rid, int(rec.created_wall), rec.id

    def session_for(self, rec: Record) -> str:
        """A round with no session of its own begins one: named by its response, which a continuation inherits."""
        return session_key(rec.tenant, responses.response_id(rec.id), {})  # type: ignore[return-value]


def tenant_name(request: Request) -> str:
    return request.state.name if isinstance(request.state, Tenant) else ""


class ResponsesRoute:
    def __init__(self, pipeline: Pipeline, store: Store, cfg: ResponsesConfig, clock: Callable[[], float]) -> None:
        self.pipeline, self.store, self.cfg, self.clock = pipeline, store, cfg, clock

    async def load(self, tenant: str, rid: Any, param: str | None) -> dict[str, Any]:
        """A stored response of ``tenant``'s; one unknown, expired or another tenant's is a 404, alike."""
        what = "Previous response" if param else "Response"
        if not isinstance(rid, str) or not responses.ID.fullmatch(rid):
            raise NotFound(f"{what} with id {str(rid)[:200]!r} not found.", param=param)
        blob = await self.store.get_response(tenant, rid, self.clock())
        if blob is None:
            raise NotFound(f"{what} with id '{rid}' not found.", param=param)
        got = orjson.loads(blob)
        assert isinstance(got, dict)
        return got

    async def create(self, request: Request) -> Response | Stream:
        body = parse_body(request.body)
        tenant = tenant_name(request)
        history: list[dict[str, Any]] = []
        session = None
        prev = body.get("previous_response_id")
        if prev is not None:
            stored = await self.load(tenant, prev, "previous_response_id")
            history, session = stored["messages"], stored.get("session")
        chat, turn = responses.to_chat(body, history)
        stream = chat.get("stream") is True
        dropped = responses.dropped_tools(body)
        front = ResponsesFront(body, dropped)
        life = self.pipeline.handle(request, CHAT, chat, responses.RESPONSES, front, session, asked=body)
        rec = front.rec
        assert rec is not None
        if dropped:
            rec.note(f"tools left out (the engines cannot act on them): {', '.join(dropped)[:500]}")
        rid = front.resp["id"]
        answer = await life
        if isinstance(answer, Stream):
            if front.final:  # its engine finished: kept, then its terminal event
                await self.keep(tenant, body, rec, front.resp, history + turn)
                if not answer.proto.closed:
                    answer.send(front.final)
            u = front.usage
            if u is not None:
                rec.prompt_tokens, rec.completion_tokens = u["input_tokens"], u["output_tokens"]
                rec.cached_tokens = u["input_tokens_details"]["cached_tokens"]
            return answer
        headers = {"x-request-id": rec.id, **front.headers}
        if answer.status == 200 and not stream:
            try:
                obj, _ = responses.answer(body, answer.body, rid, int(rec.created_wall))
            except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError, IndexError):
                log.warning("request %s: the engine's chat answer could not be read as one", rec.id)
                raise UpstreamError("the decode's answer is not a chat completion", role=Role.DECODE) from None
            await self.keep(tenant, body, rec, obj, history + turn)
            return json_response(obj, headers=headers)
        if stream and answer.status >= 400 and answer.status != 499 and "Retry-After" not in answer.headers:
            # ended before its first token: the Responses stream opens and fails with the reason
            err = orjson.loads(answer.body).get("error") or {}
            out = request.open_stream(200, {**SSE_HEADERS, **headers})
            out.send(front.open() + front._failed({"code": err.get("code"), "message": err.get("message")}))
            return out
        return answer

    async def keep(self, tenant: str, body: dict[str, Any], rec: Record, resp: dict[str, Any],
                   asked: list[dict[str, Any]]) -> None:
        """Keep a finished response and its conversation (``store``: true by default), if it fits the bound."""
        if body.get("store", True) is False or resp["status"] not in ("completed", "incomplete"):
            return
        session = rec.session
        blob = orjson.dumps({"response": resp, "messages": asked + responses.said(resp), "session": session})
        if len(blob) > self.cfg.max_response_bytes:
            log.warning("response %s not stored: %d bytes, beyond responses.max_response_bytes=%d", resp["id"],
                        len(blob), self.cfg.max_response_bytes)
            return
        await self.store.put_response(tenant, resp["id"], blob, self.clock(), self.cfg)

    async def get(self, request: Request) -> Response:
        stored = await self.load(tenant_name(request), request.match["id"], None)
        return json_response(stored["response"])

    async def delete(self, request: Request) -> Response:
        rid = request.match["id"]
        if not responses.ID.fullmatch(rid) or not await self.store.delete_response(tenant_name(request), rid):
            raise NotFound(f"Response with id {rid[:200]!r} not found.")
        return json_response({"id": rid, "object": "response", "deleted": True})
