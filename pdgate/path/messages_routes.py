"""The ``/v1/messages`` routes: an Anthropic Messages request served through the unchanged request path as the
engines' chat completion (``pdgate.apis.anthropic`` translates; ``docs/messages.md``).

``POST /v1/messages``: the chat body made, the request's life run by the pipeline (admission, deadlines, both
legs, retries before the first byte, aborts, outcome), the stream translated per event (``ctx.front``). Every
error leaves in Anthropic's shape: those raised here, in admission and in the HTTP layer (rendered by
``server.error_shape`` as ``anthropic.Error``), answers the path made in OpenAI's, and a stream the gateway ends, which ends with one ``event: error`` naming why, also when it
ends before its first token; what a client should retry later (429 and 503 with Retry-After) stays an HTTP status,
which the SDKs retry.

``POST /v1/messages/count_tokens``: the engine's tokenizer where it offers one (``Engine.count_tokens``), else an
estimate, said in ``x-pdgate-token-count: estimate``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from h1lite.server import Request, Response, Stream, json_response
from pdgate.apis import anthropic
from pdgate.apis.responses import dropped_header
from pdgate.core.config import Role
from pdgate.core.errors import UpstreamError
from pdgate.core.validation import CHAT, parse_body
from pdgate.path.auth import Tenant
from pdgate.path.relay import SSE_HEADERS

if TYPE_CHECKING:
    from pdgate.core.record import Record
    from pdgate.path.proxy import Pipeline
    from pdgate.pool.workers import Pool

log = logging.getLogger("pdgate.messages")
COUNT_TIMEOUT_S = 5.0


class MessagesFront(anthropic.Events):
    """A Messages stream bound to its request's record (``Ctx.front``)."""

    __slots__ = ("headers", "rec")

    def __init__(self, body: dict[str, Any], dropped: list[str]) -> None:
        super().__init__(body, "")
        self.rec: Record | None = None
        self.headers = dropped_header(dropped)

    def start(self, rec: Record) -> None:
        self.rec = rec
        self.msg["id"] = message_id(rec.id)

    def session_for(self, rec: Record) -> str | None:
        return None


def message_id(request_id: str) -> str:
    """A message's id: its request's (the trace of a request is found by either)."""
    return "msg_" + request_id


def parse(request: Request) -> dict[str, Any]:
    return parse_body(request.body)


class MessagesRoute:
    def __init__(self, pipeline: Pipeline, pool: Pool, normalise_billing: bool, clock: Callable[[], float]) -> None:
        self.pipeline, self.pool, self.normalise_billing, self.clock = pipeline, pool, normalise_billing, clock

    async def create(self, request: Request) -> Response | Stream:
        body = parse(request)
        chat, dropped = anthropic.to_chat(body, self.normalise_billing)
        stream = chat.get("stream") is True
        front = MessagesFront(body, dropped)
        life = self.pipeline.handle(request, CHAT, chat, anthropic.MESSAGES, front, asked=body)
        rec = front.rec
        assert rec is not None
        headers = {"x-request-id": rec.id, **front.headers}
        if dropped:
            rec.note(f"tools left out (the engines cannot act on them): {', '.join(dropped)[:500]}")
        answer = await life
        if isinstance(answer, Stream):
            u = front.usage
            if u is not None:
                rec.prompt_tokens = u["input_tokens"] + u["cache_read_input_tokens"]
                rec.completion_tokens, rec.cached_tokens = u["output_tokens"], u["cache_read_input_tokens"]
            return answer
        if answer.status == 200 and not stream:
            try:
                obj = anthropic.answer(body, answer.body, message_id(rec.id))
            except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError, IndexError):
                log.warning("request %s: the engine's chat answer could not be read as one", rec.id)
                raise UpstreamError("the decode's answer is not a chat completion", role=Role.DECODE) from None
            return json_response(obj, headers=headers)
        if answer.status < 400:
            return answer
        if stream and answer.status != 499 and "Retry-After" not in answer.headers:
            # ended before its first token: the stream opens and ends with an error event naming why
            out = request.open_stream(200, {**SSE_HEADERS, **headers})
            msg = orjson.loads(anthropic.from_openai(answer.status, answer.body))["error"]["message"]
            out.send(anthropic.error_event(answer.status, msg))
            return out
        return Response(anthropic.from_openai(answer.status, answer.body), answer.status,
                        headers={**answer.headers, **headers})

    async def count_tokens(self, request: Request) -> Response:
        body = parse(request)
        chat, _ = anthropic.to_chat(body, self.normalise_billing, counting=True)
        tenant = request.state if isinstance(request.state, Tenant) else None
        chat["model"] = self.pipeline.admission.model_for(chat["model"], tenant)
        now = self.clock()
        model = chat["model"]
        for w in self.pool.available(Role.PREFILL, now)[:2]:
            if w.info.models and model not in w.info.models:
                continue
            n = await w.adapter.count_tokens(w.url, chat, COUNT_TIMEOUT_S)
            if n is not None:
                return json_response({"input_tokens": n})
        # no engine that counts: about four bytes of JSON per token, said so
        size = len(orjson.dumps([chat["messages"], chat.get("tools")]))
        return json_response({"input_tokens": max(1, size // 4)}, headers={"x-pdgate-token-count": "estimate"})
