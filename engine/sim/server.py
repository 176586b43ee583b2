"""HTTP surface of a sim worker, in SGLang 0.5.x shapes, plus the pdgate extension.

The prefill role also serves its bootstrap server (``--bootstrap-port``): ``/route``,
``/health``, ``/register_dp_rank``, ``/query_dp_ranks`` as SGLang's, and
``/register_room``, the sim's stand-in for SGLang's ZMQ handshake (decode tells prefill
where to send a room's KV).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import time
from collections.abc import Awaitable
from typing import Any

import orjson

from engine.sim import agent, metrics
from engine.sim.config import FIXES, SimConfig, parse_fixes
from engine.sim.text import chat_prompt, token_ids, token_logprob
from engine.sim.worker import Engine, EngineError, SimRequest, make_request
from h1lite.server import Handler, Request, Response, Router, Server, Stream, json_response
from pdgate.core import protocol as p

log = logging.getLogger("engine.sim.server")
UNSUPPORTED = ("best_of", "suffix", "echo", "logit_bias", "functions")
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_BODY = 256 * 1024 * 1024
SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def error(status: int, message: str, kind: str = "BadRequestError") -> Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return Response(orjson.dumps(body), status)


def jsonr(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status)


def text(body: str = "") -> Response:
    return Response(body.encode(), content_type="text/plain; charset=utf-8")


# ---- request parsing ---------------------------------------------------------------
class Parsed:
    def __init__(self, route: str, body: dict[str, Any], cfg: SimConfig) -> None:
        self.route = route
        self.body = body
        if body.get("n", 1) != 1:
            raise EngineError(400, "n > 1 is not supported", "BadRequestError")
        for key in UNSUPPORTED:
            if body.get(key) not in (None, False, ""):
                raise EngineError(400, f"parameter '{key}' is not supported", "BadRequestError")
        self.stream = bool(body.get("stream", False))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.return_logprob = bool(body.get("return_logprob") or body.get("logprobs"))
        # OpenAI's logprobs: chat says logprobs true and top_logprobs n; completions says logprobs n
        self.top_logprobs = 0
        self.logprobs = route != "/generate" and self.return_logprob
        top = body.get("top_logprobs") if route == "/v1/chat/completions" else body.get("logprobs")
        if top is not None and not isinstance(top, bool):
            if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise EngineError(400, f"top_logprobs must be an integer within [0, {MAX_TOP_LOGPROBS}], got {top!r}")
            self.top_logprobs = top
        seed = body.get("seed") if route != "/generate" else (body.get("sampling_params") or {}).get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise EngineError(400, f"seed must be an integer, got {seed!r}")
        self.seed = seed
        if route == "/generate":
            sp = body.get("sampling_params") or {}
            if "text" in body:
                prompt = body["text"]
            elif "input_ids" in body:
                prompt = " ".join(f"t{i}" for i in body["input_ids"])
            else:
                raise EngineError(400, "Either text or input_ids should be provided.")
            max_tokens, stop, temp = sp.get("max_new_tokens", cfg.default_max_tokens), sp.get("stop"), sp.get("temperature", 1.0)
        elif route == "/v1/chat/completions":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise EngineError(400, "messages must be a non-empty list")
            prompt = chat_prompt(msgs)
            max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                              cfg.default_max_tokens)
            stop, temp = body.get("stop"), body.get("temperature", 1.0)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise EngineError(400, "prompt must be a string")
            max_tokens, stop, temp = body.get("max_tokens", 16), body.get("stop"), body.get("temperature", 1.0)
        if not isinstance(prompt, str):
            raise EngineError(400, "text must be a string")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise EngineError(400, f"max_new_tokens must be a positive integer, got {max_tokens!r}")
        if not isinstance(temp, (int, float)) or not 0 <= temp <= 2:
            raise EngineError(400, f"temperature must be within [0, 2], got {temp!r}")
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.temperature = float(temp)
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if route != "/v1/chat/completions" and body.get("tools") not in (None, []):
            raise EngineError(400, "parameter 'tools' is supported on /v1/chat/completions only")
        try:
            self.script = agent.script_for(body, prompt, max_tokens) if route == "/v1/chat/completions" else None
        except agent.BadRequest as exc:
            raise EngineError(400, str(exc)) from None


# ---- how bytes leave: whole, or re-segmented (fault "segment") ----------------------------
class Segmenter:
    """Writes a response's bytes to a stream as the ``segment`` fault says: whole; or cut at random
    offsets into pieces written ~0-3 ms apart (so they reach the peer in separate reads); or held
    and merged into the next write. Seeded by ``segment_seed`` (a scenario replays exactly)."""

    def __init__(self, engine: Engine) -> None:
        self.faults = engine.cfg.faults
        self.rate = float(engine.cfg.faults.segment)
        self.rng = engine.segment_rng
        self.held = b""

    async def write(self, s: Stream, data: bytes, last: bool = False) -> None:
        data, self.held = self.held + data, b""
        rng = self.rng
        stall = float(self.faults.split_stall)
        if stall and len(data) > 1:  # fault split_stall: half of it, a pause, the rest (a peer stuck mid-event)
            s.send(data[:len(data) // 2])
            await s.drain()
            await asyncio.sleep(stall)
            data = data[len(data) // 2:]
        if not self.rate or rng.random() >= self.rate or not data:
            s.send(data)
            await s.drain()
            return
        if not last and rng.random() < 0.4:  # merge: goes out with the next write
            self.held = data
            return
        k = min(len(data) - 1, rng.randint(1, 3))
        cuts = sorted(rng.sample(range(1, len(data)), k)) if k > 0 else []
        start = 0
        for cut in [*cuts, len(data)]:
            s.send(data[start:cut])
            start = cut
            if cut < len(data):
                await s.drain()
                await asyncio.sleep(rng.choice((0.0, 0.001, 0.003)))
        await s.drain()


async def send_json(request: Request, engine: Engine, obj: Any) -> Response | Stream:
    """A JSON answer: whole, or (fault ``segment``) chunked and re-segmented."""
    if not engine.cfg.faults.segment:
        return jsonr(obj)
    s = request.open_stream(200, {"Content-Type": "application/json"})
    await Segmenter(engine).write(s, orjson.dumps(obj), last=True)
    return s


# ---- response shapes -----------------------------------------------------------------
def _finish(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason["type"]


def _meta(req: SimRequest, tokens: list[str], finish: dict[str, Any] | None, logprobs: bool, role: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": finish,
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": len(tokens),
        "cached_tokens": req.cached_tokens,
        "e2e_latency": round(time.monotonic() - req.created, 6),
    }
    if logprobs:
        inputs = [[token_logprob(str(t)), t, None] for t in token_ids(req.prompt)] if role == "prefill" else []
        meta["input_token_logprobs"] = inputs
        meta["output_token_logprobs"] = [[token_logprob(t), token_ids(t)[0] if token_ids(t) else 0, None] for t in tokens]
    return meta


def _usage(req: SimRequest, n: int) -> dict[str, Any]:
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": n, "total_tokens": req.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def _entry(token: str, lp: float) -> dict[str, Any]:
    return {"token": token, "logprob": lp, "bytes": list(token.encode())}


def _token_logprobs(ps: Parsed, req: SimRequest, start: int, tokens: list[str]) -> list[dict[str, Any]]:
    """OpenAI chat logprobs of ``tokens`` (output steps ``start``...): scripted tokens are certain."""
    out = []
    for i, t in enumerate(tokens, start):
        if req.script is not None:
            e = _entry(t, 0.0)
            e["top_logprobs"] = [_entry(t, 0.0)][:ps.top_logprobs]
        else:
            e = _entry(t, req.sampler.logprob(i, t))
            e["top_logprobs"] = [_entry(w, lp) for w, lp in req.sampler.top(i, ps.top_logprobs)]
        out.append(e)
    return out


def _completion_logprobs(ps: Parsed, req: SimRequest, start: int, tokens: list[str], offset: int) -> dict[str, Any]:
    entries = _token_logprobs(ps, req, start, tokens)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{x["token"]: x["logprob"] for x in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _finish_reason(req: SimRequest, finish: dict[str, Any] | None) -> str | None:
    if finish is not None and finish["type"] == "stop" and req.script is not None and req.script.call is not None:
        return "tool_calls"
    return _finish(finish)


def full_body(ps: Parsed, req: SimRequest, tokens: list[str], finish: dict[str, Any] | None, model: str, role: str) -> dict[str, Any]:
    text = "".join(tokens)
    if ps.route == "/generate":
        return {"text": text, "meta_info": _meta(req, tokens, finish, ps.return_logprob, role)}
    created = int(time.time())
    if ps.route == "/v1/chat/completions":
        call = req.script.call if req.script is not None else None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": text}}]}
        lps = {"content": _token_logprobs(ps, req, 0, tokens)} if ps.logprobs else None
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": lps,
                                  "finish_reason": _finish_reason(req, finish)}
        obj = "chat.completion"
    else:
        lps = _completion_logprobs(ps, req, 0, tokens, 0) if ps.logprobs else None
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": _finish(finish)}
        obj = "text_completion"
    return {"id": req.rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": _usage(req, len(tokens))}


def chunk(ps: Parsed, req: SimRequest, tokens: list[str], new: str, finish: dict[str, Any] | None, model: str, role: str) -> bytes:
    if ps.route == "/generate":
        obj: dict[str, Any] = {"text": "".join(tokens), "meta_info": _meta(req, tokens, finish, ps.return_logprob, role)}
    elif ps.route == "/v1/chat/completions":
        first = len(tokens) <= 1
        call = req.script.call if req.script is not None else None
        if call is None:
            delta: dict[str, Any] = {"role": "assistant", "content": new} if first else {"content": new}
        elif first:  # the first delta names the call, later ones carry pieces of its arguments
            delta = {"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": new}}]}
        else:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}
        lps = {"content": _token_logprobs(ps, req, len(tokens) - 1, [new])} if ps.logprobs else None
        obj = {"id": req.rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
               "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": _finish_reason(req, finish)}]}
    else:
        lps = _completion_logprobs(ps, req, len(tokens) - 1, [new], sum(map(len, tokens[:-1]))) if ps.logprobs else None
        obj = {"id": req.rid, "object": "text_completion", "created": int(time.time()), "model": model,
               "choices": [{"index": 0, "text": new, "logprobs": lps, "finish_reason": _finish(finish)}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage_chunk(ps: Parsed, req: SimRequest, n: int, model: str) -> bytes:
    obj = {"id": req.rid, "object": "chat.completion.chunk" if ps.route.endswith("chat/completions") else "text_completion",
           "created": int(time.time()), "model": model, "choices": [], "usage": _usage(req, n)}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


# ---- handlers ------------------------------------------------------------------------
def _read_json(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise EngineError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise EngineError(400, "body must be a JSON object")
    return body


def generate_handler(engine: Engine, route: str) -> Handler:
    async def handle(request: Request) -> Response | Stream:
        cfg = engine.cfg
        try:
            body = _read_json(request)
            ps = Parsed(route, body, cfg)
            if body.get(p.BOOTSTRAP_ROOM) is None:
                raise EngineError(400, f"{cfg.role} worker runs in PD mode: bootstrap_room is required")
            req = make_request(body, ps.prompt, ps.max_tokens, ps.stop, ps.seed, ps.temperature, ps.script)
            if req.bootstrap_port is None:
                req.bootstrap_port = cfg.bootstrap_port
            if req.prompt_tokens + ps.max_tokens > cfg.max_context:
                raise EngineError(400, f"The input ({req.prompt_tokens} tokens) plus max_new_tokens ({ps.max_tokens}) "
                                  f"is longer than the model's context length ({cfg.max_context} tokens).")
            if cfg.faults.http_500_rate and random.random() < cfg.faults.http_500_rate:
                raise EngineError(500, "fault http_500_rate: injected internal error")
            if cfg.faults.queue_full_rate and random.random() < cfg.faults.queue_full_rate:
                raise EngineError(503, "The request queue is full.")
        except EngineError as exc:
            return error(exc.status, exc.message, exc.kind)
        model = str(body.get("model") or cfg.model)
        engine.seen.append({"rid": req.rid, "traceparent": request.headers.get("traceparent"),
                            "max_tokens": ps.max_tokens})
        if cfg.role == "prefill":
            return await _prefill(request, engine, ps, req, model)
        return await _decode(request, engine, ps, req, model)

    return handle


def _detached(engine: Engine, work: Awaitable[Any]) -> asyncio.Task[Any]:
    """Run engine work apart from the HTTP handler: like SGLang, a client that leaves is
    noticed only at the next state wait (SGLANG_REQUEST_STATE_WAIT_TIMEOUT) and then
    aborted through the normal abort path, race and all."""
    task = asyncio.ensure_future(work)
    engine.track(task)
    return task


async def _await_or_abort(engine: Engine, req: SimRequest, task: asyncio.Task[Any]) -> Any:
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            engine.abort_later(req.rid)
        raise


async def _prefill(request: Request, engine: Engine, ps: Parsed, req: SimRequest, model: str) -> Response | Stream:
    task = _detached(engine, engine.prefill(req))
    try:
        first = await _await_or_abort(engine, req, task)
    except EngineError as exc:
        return error(exc.status, exc.message, exc.kind)
    finish = {"type": "length", "length": 1}
    if not ps.stream:
        return await send_json(request, engine, full_body(ps, req, [first], finish, model, "prefill"))
    s = request.open_stream(200, SSE)
    await Segmenter(engine).write(s, chunk(ps, req, [first], first, finish, model, "prefill") + DONE, last=True)
    return s


async def _decode(request: Request, engine: Engine, ps: Parsed, req: SimRequest, model: str) -> Response | Stream:
    task = _detached(engine, engine.decode(req))
    if not ps.stream:
        try:
            await _await_or_abort(engine, req, task)
        except EngineError as exc:
            return error(exc.status, exc.message, exc.kind)
        engine.sent.append({"rid": req.rid, "tokens": len(req.tokens), "text": "".join(req.tokens), "whole": True})
        return await send_json(request, engine, full_body(ps, req, req.tokens, req.finish, model, "decode"))
    try:
        s = request.open_stream(200, SSE)
        out = Segmenter(engine)
        sent = 0
        task.add_done_callback(lambda _: req.progress.set())
        while True:
            # cleared and read before the tokens: the writes below may wait, and tokens (or the end) that
            # come meanwhile set it again
            req.progress.clear()
            finished = task.done()
            events = []
            while sent < len(req.tokens):  # one event per token, as SGLang streams (stream_interval 1)
                sent += 1
                last = sent == len(req.tokens) and req.finish is not None
                events.append(chunk(ps, req, req.tokens[:sent], req.tokens[sent - 1], req.finish if last else None,
                                    model, "decode"))
            if events:
                await out.write(s, b"".join(events))
            if finished:
                break
            await req.progress.wait()
        exc = task.exception()
        engine.sent.append({"rid": req.rid, "tokens": sent, "text": "".join(req.tokens[:sent]), "whole": exc is None})
        tail = b""
        if isinstance(exc, EngineError):
            err = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}}
            tail = b"data: " + orjson.dumps(err) + b"\n\n"
        elif ps.include_usage:
            tail = usage_chunk(ps, req, len(req.tokens), model)
        await out.write(s, tail + DONE, last=True)
        if engine.cfg.faults.done_stall:  # fault done_stall: [DONE] is out, the response's end comes later
            await asyncio.sleep(engine.cfg.faults.done_stall)
        return s
    except (asyncio.CancelledError, ConnectionError):
        if not task.done():
            engine.abort_later(req.rid)
        raise


# ---- small endpoints ---------------------------------------------------------------
def _model_info(cfg: SimConfig) -> dict[str, Any]:
    return {"model_path": cfg.model, "tokenizer_path": cfg.model, "served_model_name": cfg.model,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "disaggregation_mode": cfg.role, "max_total_num_tokens": cfg.kv_budget_tokens, "has_image_understanding": False}


def _server_info(engine: Engine) -> dict[str, Any]:
    cfg = engine.cfg
    args = {"model_path": cfg.model, "served_model_name": cfg.model, "host": cfg.host, "port": cfg.port,
            "disaggregation_mode": cfg.role, "disaggregation_bootstrap_port": cfg.bootstrap_port,
            "disaggregation_transfer_backend": cfg.transfer_backend, "context_length": cfg.max_context,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "load_balance_method": "round_robin",
            "max_running_requests": cfg.max_running_requests}
    info = {**args, "version": "0.5.23-sim", "scheduler_info": {"max_total_num_tokens": cfg.kv_budget_tokens},
            "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}}]}
    if cfg.extension:
        info.update({"pdgate_engine": "sim", p.IDENTITY_FIELD: engine.identity, p.FIXES_FIELD: sorted(cfg.fixes),
                     "pdgate_faults": engine.cfg.faults.values, "started_at": engine.started})
    return info


def build_router(engine: Engine) -> Router:
    cfg = engine.cfg
    registry = metrics.make_registry(engine)

    async def health(_: Request) -> Response:
        return text()

    async def models(_: Request) -> Response:
        data = [{"id": cfg.model, "object": "model", "created": int(engine.started), "owned_by": "sglang",
                 "root": cfg.model, "parent": None, "max_model_len": cfg.max_context}]
        return jsonr({"object": "list", "data": data})

    async def server_info(_: Request) -> Response:
        return jsonr(_server_info(engine))

    async def model_info(_: Request) -> Response:
        return jsonr(_model_info(cfg))

    async def abort_request(request: Request) -> Response:
        try:
            body = _read_json(request)
        except EngineError:
            body = {}
        n = engine.abort(str(body.get("rid") or ""), bool(body.get("abort_all")))
        if n:
            log.info("abort rid=%s matched %d", body.get("rid"), n)
        return text()

    async def loads(request: Request) -> Response:
        if cfg.faults.slow_metrics:
            await asyncio.sleep(cfg.faults.slow_metrics)
        c = engine.queue_counts()
        load: dict[str, Any] = {"dp_rank": 0, "num_running_reqs": c.get("running", 0) + c.get("forward", 0),
                                "num_waiting_reqs": c.get("waiting", 0) + c.get("prealloc", 0) + c.get("transfer", 0)}
        if "disagg" in request.query.get("include", ""):  # answered as "disaggregation", as SGLang 0.5.23 does
            load["disaggregation"] = {"mode": cfg.role, "prefill_bootstrap_queue_reqs": c.get("bootstrap", 0),
                                      "prefill_inflight_queue_reqs": c.get("inflight", 0),
                                      "decode_prealloc_queue_reqs": c.get("prealloc", 0),
                                      "decode_transfer_queue_reqs": c.get("transfer", 0)}
        return jsonr({"timestamp": time.time(), "loads": [load]})

    async def metrics_handler(_: Request) -> Response:
        return Response(metrics.render(registry), content_type=metrics.CONTENT_TYPE)

    async def flush_cache(_: Request) -> Response:
        engine.cache.flush()
        return text("Cache flushed.\n")

    async def ext_requests(_: Request) -> Response:
        now = time.monotonic()
        reqs = [{"rid": r.rid, "bootstrap_room": r.room, "queue": r.queue, "since_s": round(now - r.since, 3),
                 "age_s": round(now - r.created, 3)} for r in engine.reqs.values()]
        return jsonr({"role": cfg.role, "requests": reqs})

    async def ext_faults(request: Request) -> Response:
        if request.method == "POST":
            try:
                body = _read_json(request)
                for name, value in body.items():
                    if name == "fixes":
                        cfg.fixes = parse_fixes(str(value))
                    else:
                        cfg.faults.set(name, value)
                        if name == "segment_seed":
                            engine.segment_rng.seed(int(cfg.faults.segment_seed))
            except (EngineError, KeyError, ValueError) as exc:
                return error(400, str(exc))
            if cfg.faults.decode_freeze:
                engine.unfrozen.clear()
            else:
                engine.unfrozen.set()
            log.warning("faults now %s fixes %s", cfg.faults.values, sorted(cfg.fixes))
        return jsonr({"faults": cfg.faults.values, "fixes": sorted(cfg.fixes), "known_fixes": FIXES})

    r = Router()
    for route in p.GENERATE_ROUTES:
        r.add("POST", route, generate_handler(engine, route))
    for path in ("/health", "/health_generate"):
        r.add("GET", path, health)
    r.add("GET", "/v1/models", models)

    async def tokenize(request: Request) -> Response:
        """vLLM's ``/tokenize``: ``messages`` (through the sim's chat template) or ``prompt``; the count and ids."""
        try:
            body = _read_json(request)
        except EngineError as exc:
            return error(exc.status, exc.message, exc.kind)
        msgs, prompt = body.get("messages"), body.get("prompt")
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs):
            prompt = chat_prompt(msgs)
        if not isinstance(prompt, str):
            return error(400, "either messages or prompt (a string) is required")
        ids = token_ids(prompt)
        return jsonr({"count": len(ids), "max_model_len": cfg.max_context, "tokens": ids})

    r.add("POST", "/tokenize", tokenize)
    for path in ("/server_info", "/get_server_info"):
        r.add("GET", path, server_info)
    for path in ("/model_info", "/get_model_info"):
        r.add("GET", path, model_info)
    r.add("POST", p.ABORT_PATH, abort_request)
    r.add("GET", p.LOADS_PATH, loads)
    r.add("GET", p.METRICS_PATH, metrics_handler)
    r.add("POST", "/flush_cache", flush_cache)
    async def ext_seen(_: Request) -> Response:
        return jsonr({"seen": list(engine.seen)})

    async def ext_sent(_: Request) -> Response:
        return jsonr({"sent": list(engine.sent)})

    if cfg.extension:
        r.add("GET", p.EXT_REQUESTS_PATH, ext_requests)
        r.add("GET", "/pdgate/v1/seen", ext_seen)  # the last requests' rid and trace context (tests read it)
        r.add("GET", "/pdgate/v1/sent", ext_sent)  # what the last answers carried (the oracle reads it)
    for method in ("GET", "POST"):
        r.add(method, p.EXT_FAULTS_PATH, ext_faults)
    return r


def authorized(request: Request, key: str) -> bool:
    """SGLang's ``decide_request_auth`` for NORMAL routes (srt/utils/auth.py): probes and metrics are open, the
    rest wants ``Authorization: Bearer <key>``, compared in constant time."""
    path = request.path
    if request.method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def build_server(engine: Engine) -> Server:
    router = build_router(engine)

    key = engine.cfg.api_key

    async def dispatch(request: Request) -> Response | Stream:
        if request.path != p.EXT_FAULTS_PATH:  # a frozen decode answers nothing (sockets stay open) but this
            await engine.unfrozen.wait()
        if key is not None and not authorized(request, key):
            return json_response({"error": "Unauthorized"}, 401)  # SGLang's answer, word for word
        return await router.dispatch(request)

    # SGLang's HTTP server is uvicorn with timeout_keep_alive = SGLANG_TIMEOUT_KEEP_ALIVE (5 s): idle keep-alive
    # connections close after it, and a client that reuses one late races that close
    return Server(dispatch, MAX_BODY, keepalive_s=float(os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", "5")))


# ---- bootstrap server (prefill) -------------------------------------------------------------
def build_bootstrap_server(engine: Engine) -> Server:
    async def route(_: Request) -> Response:
        return jsonr({"rank_ip": engine.cfg.host, "rank_port": engine.cfg.bootstrap_port, "engine_rank": 0})

    async def register_room(request: Request) -> Response:
        body = orjson.loads(request.body)
        ok = engine.register_room(int(body["room"]), body["dest"])
        return jsonr({"ok": ok}, status=200 if ok else 409)

    async def ok(_: Request) -> Response:
        return jsonr({"status": "ok", "dp_ranks": [0]})

    async def health(_: Request) -> Response:
        return text()

    r = Router()
    r.add("GET", "/route", route)
    r.add("GET", "/health", health)
    r.add("POST", "/register_room", register_room)
    r.add("POST", "/register_dp_rank", ok)
    r.add("GET", "/query_dp_ranks", ok)
    return Server(r.dispatch, 1 << 20)
