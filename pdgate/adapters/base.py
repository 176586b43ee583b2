"""The engine seam's types: the ``Engine`` Protocol an adapter implements and the values it answers with.

See ``pdgate.adapters`` for what an adapter decides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from pdgate.core.errors import LoopLate

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from pdgate.adapters.upstream import Answer, Upstream
    from pdgate.core.config import WorkerSpec
    from pdgate.core.record import Attempt


@dataclass(slots=True)
class Probe:
    """One health check's result, as a value (``health.py`` moves the worker's state from it)."""

    ok: bool
    error: str | None = None  # why not (None when ok)
    timed_out: bool = False  # no answer in time ...
    loop_late: bool = False  # ... noticed well after it was due: this gateway's loop ran behind
    identity: str | None = None  # changes each time the engine process starts (restart detection)
    fixes: list[str] | None = None  # engine-side fixes in force (the seed's A, B, C)
    models: tuple[str, ...] = ()
    capacity: int | None = None  # the most requests the engine runs at once, as it reports it
    held: int | None = None  # requests the engine holds in the queues of this worker's role
    running: int | None = None  # requests it runs or queues in all (ours and others')
    waiting: int | None = None  # requests queued for its compute in this role, not yet running (a learned limit's input)
    queues: dict[str, Any] = field(default_factory=dict)  # its queue counts, as it names them (shown)
    lists_rids: bool = False  # it answers ``held`` (exact reconciliation); else counts only
    partial: str | None = None  # up, but what informs (identity, counts) went unanswered: why (they read unknown)


@dataclass(frozen=True, slots=True)
class Held:
    """A request an engine holds, by the rid we gave it."""

    rid: str
    queue: str | None
    age_s: float


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None


def unanswered(exc: OSError, path: str, timeout_s: float) -> str:
    """What a probe's GET of ``path`` met, in a line (a timeout's own message is empty: say what it was)."""
    detail = str(exc) or (f"no answer within {timeout_s:g}s" if isinstance(exc, TimeoutError) else "no detail")
    return f"{exc.__class__.__name__}: {path}: {detail}"


def failed_probe(exc: OSError, path: str, timeout_s: float) -> Probe:
    """A check whose liveness GET failed: timed out (``loop_late``: noticed late, this gateway's loop ran behind),
    refused, reset."""
    return Probe(False, unanswered(exc, path, timeout_s), timed_out=isinstance(exc, TimeoutError),
                 loop_late=isinstance(exc, LoopLate))


def openai_usage(u: Any) -> Usage:
    """OpenAI's ``usage`` object as a ``Usage`` (``cached_tokens`` in ``prompt_tokens_details``, or beside it as
    SGLang's ``meta_info`` has it); what is not a count is None."""
    if not isinstance(u, dict):
        return Usage()
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else u.get("cached_tokens")
    return Usage(_count(u.get("prompt_tokens")), _count(u.get("completion_tokens")), _count(cached))


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


class Engine(Protocol):
    kind: str
    sequential: bool  # legs in sequence (the decode's body from the prefill's answer), else at once
    # the prefill's answer means the decode has what it needs (SGLang: it answers once the KV reached the decode),
    # so a whole answer's first token counts from there; else (vLLM: the decode has yet to read the KV) from the
    # decode's answer, and the TTFT budget covers the wait for the KV
    prefill_answer_is_first_token: bool
    done_event: bytes  # a stream's last event, as the engine writes it
    error_event: bytes  # how an error event begins

    def legs(self, body: dict[str, Any], att: Attempt, prefill: WorkerSpec) -> tuple[bytes, bytes]:
        """The prefill's and the decode's bodies (``sequential``: the decode's is a template for
        ``decode_after``)."""

    def decode_after(self, decode: bytes, prefill_answer: bytes) -> bytes:
        """A sequential engine's decode body, once the prefill has answered."""

    def call(self, url: str, route: str, body: bytes, headers: bytes) -> Awaitable[tuple[int, bytes]]:
        """One leg sent over the adapter's transport, its answer read whole: (status, body)."""

    def open(self, url: str, route: str, body: bytes, headers: bytes) -> Awaitable[Answer]:
        """One leg sent, done once its answer's head came (a stream; the caller releases it)."""

    def needs_prefill_answer(self, route: str, body: dict[str, Any]) -> bool:
        """Whether the decode's answer is merged with the prefill's (``merge``), which is then kept."""

    def merge(self, prefill_answer: bytes, decode_answer: bytes) -> bytes: ...

    def usage(self, answer: bytes) -> Usage: ...

    def output_tokens(self, route: str, body: dict[str, Any]) -> int | None:
        """The most tokens the engine generates for ``body``, read as the engine reads it (its fields for that
        route, its default when none is given; None: as many as its context allows)."""

    def limit_output(self, route: str, body: dict[str, Any], n: int) -> None:
        """Make the engine generate at most ``n`` tokens for ``body`` (in the field it reads)."""

    def defers_decode_abort(self, decode_fixes: list[str] | None) -> bool:
        """Whether a decode leg's abort waits for its transfer to end (its first answer, or the prefill's
        success), bounded by ``abort_defer_s``: tearing a decode down while it receives KV can crash or leak
        an engine without the fix."""

    async def abort(self, url: str, rid: str) -> int:
        """Abort ``rid`` on the engine at ``url``; the HTTP status."""

    async def probe(self, url: str, role: str, timeout_s: float) -> Probe:
        """The worker at ``url`` checked: healthy or not, and what it says of itself (``role``: the queues it
        holds our requests in)."""

    async def identify(self, spec: WorkerSpec, timeout_s: float) -> Probe | None:
        """What ``spec`` says of itself if it answers as an engine of its role, asked without credentials (a
        registration: the engine's key goes only to workers that were registered); None: it does not."""

    async def held(self, url: str, timeout_s: float) -> list[Held] | None:
        """The requests the engine holds, by rid (None: it does not say)."""

    def forget(self, url: str) -> None:
        """The worker at ``url`` was down or removed: what the adapter learned of it may no longer hold."""

    async def count_tokens(self, url: str, chat: dict[str, Any], timeout_s: float) -> int | None:
        """The prompt tokens of chat body ``chat`` as the engine's tokenizer and chat template count them (None: it
        does not say; ``/v1/messages/count_tokens``)."""


class OverHTTP:
    """Legs sent as POSTs over the pooled HTTP client (``Upstream``): SGLang's and vLLM's."""

    up: Upstream

    def call(self, url: str, route: str, body: bytes, headers: bytes) -> Awaitable[tuple[int, bytes]]:
        return self.up.post_read(url, route, body, headers)

    def open(self, url: str, route: str, body: bytes, headers: bytes) -> Awaitable[Answer]:
        return self.up.open(url, route, body, headers)


def tokenize_body(chat: dict[str, Any]) -> bytes:
    """``POST /tokenize`` for a chat body, as vLLM reads it (the messages through the chat template)."""
    return orjson.dumps({"model": chat.get("model"), "messages": chat.get("messages"),
                         **({"tools": chat["tools"]} if chat.get("tools") else {}), "add_generation_prompt": True})


def token_count(status: int, answer: bytes) -> int | None:
    """The count in ``/tokenize``'s answer (``count``, else the length of ``tokens``); None for anything else."""
    if status != 200:
        return None
    try:
        obj = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    n = obj.get("count")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    return len(obj["tokens"]) if isinstance(obj.get("tokens"), list) else None
