"""The simulated scheduler: queues, PD handshake, KV transfer, decode batch, fixes A/B/C.

Prefill: bootstrap (waits for its decode partner to register the room) -> waiting ->
forward (timing model; one forward at a time, like one GPU) -> inflight (KV bytes going to
decode) -> answers after the transfer reached Success, or 500 on Failed.
Decode: prealloc (handshake with the prefill's bootstrap server; KV budget) -> transfer
(waits for the KV bytes and the first token) -> running (continuous batching).

Fixes (on by default; docs/architecture.md, "The engine-side fixes"): A an abort always releases a bootstrapping
or transferring request; B the bootstrap wait is bounded; C inflight-queue watchdog.

Without fix A, two hazards of SGLang are modelled: an abort that lands while a prefill is in its inflight
queue is lost (fault ``abort_race``); and a decode aborted while it waits for its KV transfer is torn down
mid-transfer and leaks (it stays in the transfer queue holding its KV, as SGLang "can crash or leak" there).
A prefill that fails or is aborted after its decode registered tells that decode (TCP backend), which then
fails the request itself, as SGLang's prefill syncs a Failed status to the decode.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from engine.sim import kv
from engine.sim.agent import Script
from engine.sim.cache import PrefixCache
from engine.sim.config import SimConfig
from engine.sim.text import Sampler, count_tokens
from h1lite.client import Client

log = logging.getLogger("engine.sim")
T = TypeVar("T")


class EngineError(Exception):
    """A request ends with an HTTP error (SGLang's error body)."""

    def __init__(self, status: int, message: str, kind: str = "InternalServerError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class Aborted(EngineError):
    def __init__(self, where: str) -> None:
        super().__init__(500, f"Request aborted in {where}", "AbortError")


@dataclass(eq=False)
class SimRequest:
    rid: str
    room: int | None
    prompt: str
    prompt_tokens: int
    max_tokens: int
    stop: list[str]
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    queue: str = "new"
    since: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    task: asyncio.Task[Any] | None = None  # the engine work (prefill or decode); an abort cancels it
    aborted_in: str | None = None  # the queue an abort that took effect found the request in
    lost_aborts: int = 0
    leaked: bool = False  # torn down mid-transfer without fix A: it never leaves its queue
    # decode output
    tokens: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    kv_header: asyncio.Future[dict[str, Any]] | None = None
    seed: int | None = None
    temperature: float = 1.0
    script: Script | None = None  # a scripted answer (a tool call, JSON): engine.sim.agent
    cached_tokens: int = 0  # of the prompt, found in the prefill's prefix cache
    _sampler: Sampler | None = None
    _step: int = 0

    @property
    def sampler(self) -> Sampler:
        if self._sampler is None:
            self._sampler = Sampler(self.prompt, self.seed, self.temperature)
        return self._sampler

    def next_word(self) -> str:
        if self.script is not None:
            i, self._step = self._step, self._step + 1
            return self.script.tokens[i] if i < len(self.script.tokens) else ""
        return self.sampler.next()

    @property
    def context(self) -> int:
        return self.prompt_tokens + len(self.tokens)


class Counters:
    """Monotonic counts exported as SGLang's counters."""

    def __init__(self) -> None:
        self.requests = 0
        self.aborted = 0
        self.bootstrap_failed = 0
        self.transfer_failed = 0
        self.inflight_timeouts = 0
        self.lost_aborts = 0
        self.leaked = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefill_forwards = 0  # prefills computed (work done, whether anyone received it or not)
        self.cached_tokens = 0  # prompt tokens found in the prefix cache (not computed)


class Engine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.identity = uuid.uuid4().hex
        self.started = time.time()
        self.reqs: dict[str, SimRequest] = {}
        self.counters = Counters()
        self.unfrozen = asyncio.Event()
        self.unfrozen.set()
        self.segment_rng = random.Random(int(cfg.faults.segment_seed))  # reseeded when the fault is set
        self._forward = asyncio.Lock()
        self.cache = PrefixCache(cfg.prefix_cache_tokens if cfg.role == "prefill" else 0)
        # prefill: room -> future of the decode's destination
        self._rooms: dict[int, asyncio.Future[dict[str, Any]]] = {}
        # decode
        self._kv_used = 0
        self._kv_freed = asyncio.Condition()
        self._running: list[SimRequest] = []
        self._by_room: dict[int, SimRequest] = {}  # decode: legs mint their own rid when none is sent
        self._wake = asyncio.Event()
        self._batch_task: asyncio.Task[None] | None = None
        self.receiver: Any = None  # kv.KVReceiver or nixl_kv.NixlReceiver
        self.sender: Any = kv.KVSender()
        self._routes: set[str] = set()  # bootstrap servers whose /route we already know (SGLang caches it)
        self._http: Client | None = None  # keep-alive connections to prefill bootstrap servers
        self._tasks: set[asyncio.Task[Any]] = set()
        self.seen: deque[dict[str, Any]] = deque(maxlen=64)  # the last generation requests' rid and traceparent
        # decode: what the last answers carried, by rid (tokens and text), for a test to judge a client's answer by
        self.sent: deque[dict[str, Any]] = deque(maxlen=1024)

    # ---- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        self._http = Client(connect_timeout_s=10)
        hooks = (self._deliver_kv, self.unfrozen.wait, lambda: bool(self.cfg.faults.ack_loss),
                 lambda: bool(self.cfg.faults.decode_crash))
        if self.cfg.transfer_backend == "nixl":
            from engine.sim import nixl_kv  # optional extra, imported only when asked for

            name = f"{self.cfg.role}-{self.identity}"
            if self.cfg.role == "decode":
                self.receiver = nixl_kv.NixlReceiver(name, self.cfg.kv_buffer_bytes, *hooks)
            else:
                self.sender = nixl_kv.NixlSender(name, self.cfg.kv_buffer_bytes)
        elif self.cfg.role == "decode":
            self.receiver = kv.KVReceiver(*hooks)
        if self.receiver is not None:
            await self.receiver.start(self.cfg.host)
            self._batch_task = asyncio.create_task(self._batch_loop())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._batch_task is not None:
            self._batch_task.cancel()
        if self.receiver is not None:
            await self.receiver.close()
        self.sender.close()
        if self._http is not None:
            self._http.close()

    # ---- bookkeeping -------------------------------------------------------------
    def enter(self, req: SimRequest, queue: str) -> None:
        if req.queue == "new":
            self.reqs[req.rid] = req
            self.counters.requests += 1
            self.counters.prompt_tokens += req.prompt_tokens
        req.queue = queue
        req.since = time.monotonic()

    def leave(self, req: SimRequest) -> None:
        if self.reqs.get(req.rid) is req:
            del self.reqs[req.rid]
        req.queue = "done"

    def queue_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.reqs.values():
            counts[r.queue] = counts.get(r.queue, 0) + 1
        return counts

    def track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort_later(self, rid: str) -> None:
        """A client left: SGLang notices at its next state wait, then aborts by rid."""
        async def later() -> None:
            await asyncio.sleep(self.cfg.disconnect_notice_s)
            self.abort(rid)

        self.track(asyncio.ensure_future(later()))

    def abort(self, rid: str, abort_all: bool = False) -> int:
        """SGLang's /abort_request: prefix match on rid; unknown rid is a no-op."""
        hit = [r for r in list(self.reqs.values()) if abort_all or r.rid.startswith(rid)]
        for r in hit:
            if r.queue == "accepting":  # not at the scheduler yet: the abort finds nothing to stop
                continue
            if r.aborted_in is None and r.task is not None and not r.task.done() and self._abort_applies(r):
                if self._leaks(r):
                    continue
                r.aborted_in = r.queue
                r.task.cancel()  # lands at the request's current wait, wherever it is
        return len(hit)

    def _leaks(self, req: SimRequest) -> bool:
        """Without fix A, a decode torn down while it waits for its KV leaks: it stays, holding its KV."""
        if not req.leaked and "A" not in self.cfg.fixes and self.cfg.role == "decode" and req.queue == "transfer":
            req.leaked = True
            self.counters.leaked += 1
            log.error("abort during the KV transfer (fix A off): rid=%s room=%s leaks", req.rid, req.room)
        return req.leaked

    async def _abortable(self, req: SimRequest, work: Awaitable[T]) -> T:
        """Run one request's engine work in this task; an abort's cancellation becomes ``Aborted``."""
        task = req.task = asyncio.current_task()
        assert task is not None
        try:
            return await work
        except asyncio.CancelledError:
            if req.aborted_in is None:
                raise  # shutdown, not an abort
            task.uncancel()
            self.counters.aborted += 1
            raise Aborted(req.aborted_in) from None

    def _abort_applies(self, req: SimRequest) -> bool:
        """Whether an abort takes effect; models the race that fix A closes."""
        if "A" in self.cfg.fixes or not self.cfg.faults.abort_race:
            return True
        if req.queue == "inflight" and req.lost_aborts == 0:
            req.lost_aborts += 1
            self.counters.lost_aborts += 1
            log.warning("fault abort_race: abort lost for rid=%s room=%s", req.rid, req.room)
            return False
        return True

    async def _accept_delay(self, req: SimRequest) -> None:
        """Fault slow_accept: the request reaches the scheduler late; an abort sent earlier finds nothing. It is
        listed meanwhile (queue ``accepting``): the engine holds it, aborts do not reach it yet."""
        if self.cfg.faults.slow_accept:
            self.enter(req, "accepting")
            await asyncio.sleep(self.cfg.faults.slow_accept)

    # ---- prefill -----------------------------------------------------------------
    def register_room(self, room: int, dest: dict[str, Any]) -> bool:
        fut = self._rooms.get(room)
        if fut is None:
            fut = self._rooms[room] = asyncio.get_running_loop().create_future()
        if fut.done():
            return False
        fut.set_result(dest)
        return True

    async def prefill(self, req: SimRequest) -> str:
        """Run one prefill; returns the first output token or raises EngineError."""
        return await self._abortable(req, self._prefill(req))

    async def _prefill(self, req: SimRequest) -> str:
        assert req.room is not None
        await self._accept_delay(req)
        self.enter(req, "bootstrap")
        room_fut = self._rooms.get(req.room)
        if room_fut is None:
            room_fut = self._rooms[req.room] = asyncio.get_running_loop().create_future()
        try:
            dest = await self._bootstrap(req, room_fut)
            self.enter(req, "waiting")
            async with self._forward:
                self.enter(req, "forward")
                keys = self.cache.keys(req.prompt) if self.cache.capacity_blocks else []
                # as SGLang: the cached prefix is not computed again, the last prompt token always is
                cached = min(self.cache.cached(keys), req.prompt_tokens - 1) if keys else 0
                delay = self.cfg.timing.prefill_s(req.prompt_tokens - cached) + self.cfg.faults.slow_prefill
                await asyncio.sleep(delay)
                self.cache.insert(keys)
                self.cache.account(req.prompt_tokens, cached)
                req.cached_tokens = cached
                self.counters.cached_tokens += cached
                self.counters.prefill_forwards += 1
            first = req.next_word()
            self.enter(req, "inflight")
            await self._transfer(req, dest, first)
            return first
        except BaseException as exc:  # aborted or failed after its decode registered: that decode is told
            if room_fut.done() and not room_fut.cancelled():
                self.track(asyncio.ensure_future(self.sender.fail(room_fut.result(), req.room, repr(exc))))
            raise
        finally:
            self._rooms.pop(req.room, None)
            self.leave(req)

    async def _bootstrap(self, req: SimRequest, room_fut: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
        timeout = self.cfg.bootstrap_timeout if "B" in self.cfg.fixes else None
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(room_fut)
        except TimeoutError:
            self.counters.bootstrap_failed += 1
            log.warning("bootstrap timeout rid=%s room=%s after %.1fs", req.rid, req.room, timeout)
            raise EngineError(500, f"bootstrap timed out after {timeout}s (room {req.room})") from None

    async def _transfer(self, req: SimRequest, dest: dict[str, Any], first: str) -> None:
        payload = kv.kv_payload(req.prompt_tokens * self.cfg.kv_bytes_per_token, req.room or 0)
        header = {"room": req.room, "rid": req.rid, "first_token": first, "cached_tokens": req.cached_tokens}
        send = asyncio.ensure_future(self.sender.send(dest, header, payload))
        watchdog = self.cfg.inflight_timeout if "C" in self.cfg.fixes else None
        try:
            async with asyncio.timeout(watchdog):
                await send
        except TimeoutError:
            self.counters.inflight_timeouts += 1
            log.error(
                "inflight watchdog: force-failing rid=%s room=%s age=%.1fs",
                req.rid, req.room, time.monotonic() - req.since,
            )
            raise EngineError(500, f"KV transfer timed out in inflight queue after {watchdog}s") from None
        except kv.TransferFailed as exc:
            self.counters.transfer_failed += 1
            raise EngineError(500, f"KV transfer failed: {exc}") from None
        finally:
            send.cancel()

    # ---- decode ------------------------------------------------------------------
    def _deliver_kv(self, header: dict[str, Any]) -> bool:
        req = self._by_room.get(header.get("room"))  # type: ignore[arg-type]
        if req is None or req.kv_header is None or req.kv_header.done() or req.leaked:
            return False
        if header.get("failed"):  # its prefill failed or was aborted: so does this request
            req.kv_header.set_exception(EngineError(500, f"KV transfer failed: the prefill reported {header['failed']}"))
        else:
            req.kv_header.set_result(header)
        return True

    async def decode(self, req: SimRequest) -> None:
        """Run decode until the request finishes; tokens appear on ``req.tokens``."""
        await self._abortable(req, self._decode(req))

    async def _decode(self, req: SimRequest) -> None:
        assert self.receiver is not None and self._http is not None
        await self._accept_delay(req)
        req.kv_header = asyncio.get_running_loop().create_future()
        if req.room in self._by_room:
            self.leave(req)
            raise EngineError(400, f"bootstrap_room {req.room} is already in use on this decode worker")
        self._by_room[req.room] = req  # type: ignore[index]
        self.enter(req, "prealloc")
        need = req.prompt_tokens + req.max_tokens
        allocated = False
        try:
            if not self.cfg.faults.bootstrap_loss:
                await self._handshake(req)
            await self._alloc(need)
            allocated = True
            self.enter(req, "transfer")
            try:
                async with asyncio.timeout(self.cfg.waiting_timeout):
                    header = await asyncio.shield(req.kv_header)
            except TimeoutError:
                raise EngineError(500, f"decode waited {self.cfg.waiting_timeout}s for KV; none came") from None
            if self.cfg.faults.slow_first_token:  # the prefill has answered; the decode's first token comes late
                await asyncio.sleep(self.cfg.faults.slow_first_token)
            req.next_word()  # the prefill computed the first token; skip it here
            req.tokens.append(header["first_token"])
            req.cached_tokens = int(header.get("cached_tokens") or 0)
            self.counters.generation_tokens += 1
            self._check_finish(req)
            req.progress.set()
            if req.finish is None:
                self.enter(req, "running")
                self._running.append(req)
                self._wake.set()
                await self._finished(req)
        finally:
            if req in self._running:
                self._running.remove(req)
            if allocated:
                await self._free(need)
            req.progress.set()
            self._by_room.pop(req.room, None)  # type: ignore[arg-type]
            await self.receiver.release(req.room)
            self.leave(req)

    async def _handshake(self, req: SimRequest) -> None:
        assert self._http is not None and self.receiver is not None
        base = f"http://{req.bootstrap_host}:{req.bootstrap_port}"
        try:
            dest = await self.receiver.destination(req.room, req.prompt_tokens * self.cfg.kv_bytes_per_token)
        except kv.TransferFailed as exc:
            raise EngineError(400, str(exc), "BadRequestError") from None
        body = orjson.dumps({"room": req.room, "rid": req.rid, "dest": dest})
        try:
            async with asyncio.timeout(10):
                if base not in self._routes:
                    status, _ = await self._http.fetch(base, "GET", "/route")
                    if status != 200:
                        raise ConnectionError(f"GET /route answered {status}")
                    self._routes.add(base)
                status, _ = await self._http.fetch(base, "POST", "/register_room", body)
                if status != 200:
                    raise ConnectionError(f"POST /register_room answered {status}")
        except (OSError, TimeoutError) as exc:
            self._routes.discard(base)
            self.counters.bootstrap_failed += 1
            raise EngineError(500, f"bootstrap handshake with {base} failed: {exc!r}") from None

    async def _alloc(self, need: int) -> None:
        async with self._kv_freed:
            await self._kv_freed.wait_for(lambda: self._kv_used + need <= self.cfg.kv_budget_tokens)
            self._kv_used += need

    async def _free(self, need: int) -> None:
        async with self._kv_freed:
            self._kv_used -= need
            self._kv_freed.notify_all()

    async def _finished(self, req: SimRequest) -> None:
        while req.finish is None:
            req.progress.clear()
            await req.progress.wait()

    def _check_finish(self, req: SimRequest) -> None:
        if req.script is not None and len(req.tokens) >= len(req.script.tokens):
            req.finish = {"type": "stop", "matched": None}
            return
        if self.cfg.eos_after and req.script is None and len(req.tokens) >= self.cfg.eos_after:
            req.finish = {"type": "stop", "matched": None}  # the model's own end (EOS)
            return
        text = "".join(req.tokens)
        for s in req.stop:
            if s and s in text:
                req.finish = {"type": "stop", "matched": s}
                return
        if len(req.tokens) >= req.max_tokens:
            req.finish = {"type": "length", "length": req.max_tokens}

    def _stalled(self, req: SimRequest) -> bool:
        return self.cfg.unsafe_kernel and req.context > self.cfg.stall_threshold

    async def _batch_loop(self) -> None:
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
            await self.unfrozen.wait()
            while self.cfg.faults.decode_stall:  # a gray failure: no step, while HTTP answers as usual
                await asyncio.sleep(0.01)
            batch = list(self._running)
            ctx = sum(r.context for r in batch)
            await asyncio.sleep(self.cfg.timing.decode_step_s(len(batch), ctx))
            await self.unfrozen.wait()
            for r in batch:
                if r.finish is not None or r.queue != "running" or self._stalled(r):
                    continue
                r.tokens.append(r.next_word())
                self.counters.generation_tokens += 1
                self._check_finish(r)
                r.progress.set()
            self._running = [r for r in self._running if r.finish is None]


def make_request(body: dict[str, Any], prompt: str, max_tokens: int, stop: list[str], seed: int | None = None,
                 temperature: float = 1.0, script: Script | None = None) -> SimRequest:
    room = body.get("bootstrap_room")
    port = body.get("bootstrap_port")
    return SimRequest(
        rid=str(body.get("rid") or uuid.uuid4().hex),
        room=int(room) if room is not None else None,
        prompt=prompt,
        prompt_tokens=count_tokens(prompt),
        max_tokens=max_tokens,
        stop=stop,
        bootstrap_host=body.get("bootstrap_host"),
        bootstrap_port=int(port) if port is not None else None,
        seed=seed,
        temperature=temperature,
        script=script,
    )
