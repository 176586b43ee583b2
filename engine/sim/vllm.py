"""The sim speaking vLLM's prefill/decode protocol (``python -m engine.sim --protocol vllm``; the facts it follows:
``docs/vllm.md``).

- Prefill role: a request whose ``kv_transfer_params`` ask for a remote decode is computed (one forward at a
  time, as a prefill batch), answered with its one token and ``kv_transfer_params`` (``do_remote_prefill``,
  ``remote_engine_id``, ``remote_block_ids``, ``remote_host``/``remote_port``: this sim, ``remote_request_id``: the
  request's ``X-Request-Id``, ``tp_size``), and its KV kept until a decode reads it or
  its timeout expires: 30 s, as vLLM 0.22+'s KV lease (``kv_lease_duration``; seen on real vLLM 0.32: docs/fidelity.md;
  the decode's heartbeats that extend a lease while it waits are not modelled), ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``
  to set it (vLLM 0.12-0.21's name for it: 480 s there).
- Decode role: a request with ``do_remote_prefill`` waits for its KV (``WAITING_FOR_REMOTE_KVS``: counted waiting),
  reads it from the prefill named in its params (``POST /sim/vllm/kv_read``; gone: the prompt is computed here), then
  generates, streamed (one event per token) or whole. No timeout of its own while it waits, as vLLM has none.
- Either role: a client that closes its connection aborts its request (vLLM's ``with_cancellation``); a request
  without ``kv_transfer_params`` is served whole (aggregated). Abort by id as vLLM 0.32: ``POST
  /inference/v1/abort_requests {"request_ids"}`` (external ids ``chatcmpl-<X-Request-Id>``, ``cmpl-<id>-0``) answers
  403 ``PermissionDeniedError`` unless the server runs with ``--enable-scale-out`` (here: ``VLLM_SCALE_OUT=1``), and
  the legacy ``POST /abort_requests`` is there only with ``VLLM_SERVER_DEV_MODE=1`` (else 404); seen on real vLLM
  0.32 (docs/fidelity.md).
- Probes as vLLM's: ``/health`` (200, empty), ``/version``, ``/v1/models`` (``max_model_len``), ``/metrics``
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``process_start_time_seconds``). vLLM lists no
  request ids; the tests' ``/pdgate/v1/requests`` (running, waiting, KV kept) is the sim's, not vLLM's.
- Impolite as the SGLang sims: fault ``segment`` cuts and merges writes, idle keep-alive connections close after
  5 s (uvicorn's default, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); faults ``kv_wait_forever`` (a decode whose KV never
  comes), ``ignore_disconnect`` (an engine that does not notice its client left: only an abort by id, where it
  has one, ends the work; what reconciliation by counts is for), ``decode_stall`` (its tokens stop), ``slow_kv_read`` (each KV read takes
  up to that long, uniformly at random: real NIXL on a busy CPU, docs/fidelity.md), ``slow_metrics`` (``/metrics``
  that long late, ``/health`` at once: real vLLM's on a loaded box),
  ``http_500_rate``, ``slow_prefill``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
import uuid
from typing import Any

import orjson

from engine.sim.config import SimConfig
from engine.sim.server import DONE, SSE, Parsed, Segmenter, chunk, error, full_body, jsonr, send_json, usage_chunk
from engine.sim.worker import EngineError, SimRequest, make_request
from h1lite.client import Client
from h1lite.server import Request, Response, Router, Server, Stream
from pdgate.core import protocol as p

log = logging.getLogger("engine.sim.vllm")
VERSION = "0.13.0+pdgate.sim"
KV_READ = "/sim/vllm/kv_read"


class VllmSim:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.started = time.time()
        self.engine_id = uuid.uuid4().hex
        self.identity = f"vllm-sim-{self.engine_id[:12]}"
        self.timeout_s = float(os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "30"))  # 0.32's lease
        self.running: dict[str, SimRequest] = {}
        self.waiting: dict[str, SimRequest] = {}
        self.kv: dict[str, float] = {}  # prefill: the KV kept for a decode, by request id -> when it is freed
        self.expired = 0  # KV freed by the timeout, no decode having read it
        self.forward = asyncio.Lock()
        self.segment_rng = random.Random(cfg.faults.segment_seed)
        self.client = Client(connect_timeout_s=2.0)
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.sent: list[dict[str, Any]] = []
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self.client.close()

    async def _reap(self) -> None:
        """The prefill's KV timeout: what no decode read is freed (vLLM logs "Releasing expired KV blocks")."""
        while True:
            now = time.monotonic()
            for rid in [r for r, until in self.kv.items() if until <= now]:
                del self.kv[rid]
                self.expired += 1
                log.warning("Releasing expired KV blocks for request %s which were retrieved by 0 decode worker(s) "
                            "within %g seconds.", rid, self.timeout_s)
            await asyncio.sleep(0.1)

    # ---- generation ---------------------------------------------------------------------------
    def finished(self, req: SimRequest) -> dict[str, Any] | None:
        if req.script is not None and len(req.tokens) >= len(req.script.tokens):
            return {"type": "stop", "matched": None}
        if self.cfg.eos_after and req.script is None and len(req.tokens) >= self.cfg.eos_after:
            return {"type": "stop", "matched": None}
        text = "".join(req.tokens)
        for s in req.stop:
            if s and s in text:
                return {"type": "stop", "matched": s}
        return {"type": "length", "length": req.max_tokens} if len(req.tokens) >= req.max_tokens else None

    async def prefill(self, req: SimRequest) -> None:
        self.waiting[req.rid] = req
        try:
            async with self.forward:  # one forward at a time
                del self.waiting[req.rid]
                self.running[req.rid] = req
                await asyncio.sleep(self.cfg.timing.prefill_s(req.prompt_tokens) + self.cfg.faults.slow_prefill)
        finally:
            self.waiting.pop(req.rid, None)
            self.running.pop(req.rid, None)

    async def read_kv(self, params: dict[str, Any]) -> bool:
        """Read the KV the prefill kept (its host, port and request id from the params); False: it is gone."""
        host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(rid, str)):
            return False
        try:
            async with asyncio.timeout(5.0):
                status, _ = await self.client.fetch(f"http://{host}:{port}", "POST", KV_READ, orjson.dumps({"id": rid}))
        except (OSError, TimeoutError):
            return False
        return status == 200

    # ---- the HTTP surface ------------------------------------------------------------------------
    def handler(self, route: str) -> Any:
        async def handle(request: Request) -> Response | Stream:
            cfg = self.cfg
            try:
                body = orjson.loads(request.body)
                if not isinstance(body, dict):
                    raise EngineError(400, "body must be a JSON object")
                ps = Parsed(route, body, cfg)
                if cfg.faults.http_500_rate and random.random() < cfg.faults.http_500_rate:
                    raise EngineError(500, "fault http_500_rate: injected internal error")
            except orjson.JSONDecodeError as exc:
                return error(400, f"invalid JSON body: {exc}")
            except EngineError as exc:
                return error(exc.status, exc.message, exc.kind)
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            raw = body.get("kv_transfer_params")
            kv: dict[str, Any] = raw if isinstance(raw, dict) else {}
            req = make_request({"rid": rid}, ps.prompt, ps.max_tokens, ps.stop, ps.seed, ps.temperature, ps.script)
            model = str(body.get("model") or cfg.model)
            serve = self.serve_prefill(request, ps, req, model) if kv.get("do_remote_decode") else \
                self.serve_decode(request, ps, req, model, kv)
            work = asyncio.ensure_future(serve)
            self.tasks[rid] = work
            work.add_done_callback(lambda _: self.tasks.pop(rid, None))
            if cfg.faults.ignore_disconnect:  # the engine does not notice its client left: the work goes on
                return await asyncio.shield(work)
            return await work  # the client leaving cancels the handler, and with it the work (vLLM's abort)

        return handle

    async def serve_prefill(self, request: Request, ps: Parsed, req: SimRequest, model: str) -> Response | Stream:
        await self.prefill(req)
        req.tokens.append(req.next_word())
        self.kv[req.rid] = time.monotonic() + self.timeout_s
        answer = full_body(ps, req, req.tokens, {"type": "length", "length": 1}, model, "prefill")
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
            "remote_engine_id": self.engine_id, "remote_host": self.cfg.host, "remote_port": self.cfg.port,
            "remote_request_id": req.rid, "tp_size": 1}
        return await send_json(request, self, answer)  # type: ignore[arg-type]

    async def serve_decode(self, request: Request, ps: Parsed, req: SimRequest, model: str,
                           kv: dict[str, Any]) -> Response | Stream:
        if kv.get("do_remote_prefill"):
            self.waiting[req.rid] = req  # WAITING_FOR_REMOTE_KVS
            try:
                if self.cfg.faults.kv_wait_forever:
                    await asyncio.Event().wait()  # no timeout of its own: only its client leaving ends it
                if self.cfg.faults.slow_kv_read:  # transfers that stall at random, as NIXL on a busy CPU does
                    await asyncio.sleep(random.uniform(0.0, self.cfg.faults.slow_kv_read))
                if not await self.read_kv(kv):
                    await asyncio.sleep(self.cfg.timing.prefill_s(req.prompt_tokens))  # gone: computed here
            finally:
                self.waiting.pop(req.rid, None)
        else:
            await self.prefill(req)
        self.running[req.rid] = req
        try:
            if not ps.stream:
                while self.finished(req) is None:
                    await self.step(req)
                self.sent.append({"rid": req.rid, "tokens": len(req.tokens), "text": "".join(req.tokens)})
                return await send_json(request, self, full_body(ps, req, req.tokens, self.finished(req), model,  # type: ignore[arg-type]
                                                                "decode"))
            s = request.open_stream(200, SSE)
            out = Segmenter(self)  # type: ignore[arg-type]
            while (finish := self.finished(req)) is None:
                await self.step(req)
                finish = self.finished(req)
                await out.write(s, chunk(ps, req, req.tokens, req.tokens[-1], finish, model, "decode"))
            tail = usage_chunk(ps, req, len(req.tokens), model) if ps.include_usage else b""
            self.sent.append({"rid": req.rid, "tokens": len(req.tokens), "text": "".join(req.tokens)})
            await out.write(s, tail + DONE, last=True)
            return s
        finally:
            self.running.pop(req.rid, None)

    async def step(self, req: SimRequest) -> None:
        await asyncio.sleep(self.cfg.timing.decode_step_s(len(self.running), req.context))
        while self.cfg.faults.decode_stall:  # tokens stop; everything else still answers
            await asyncio.sleep(0.02)
        req.tokens.append(req.next_word())

    async def kv_read(self, request: Request) -> Response:
        rid = orjson.loads(request.body).get("id")
        if self.kv.pop(rid, None) is None:
            return jsonr({"error": f"no KV kept for {rid!r}"}, 404)
        return jsonr({"ok": True})

    async def abort_requests(self, request: Request) -> Response:
        if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
            return jsonr({"detail": "Not Found"}, 404)
        return self._abort(request)

    async def scale_out_abort(self, request: Request) -> Response:
        if os.environ.get("VLLM_SCALE_OUT") != "1":  # vLLM 0.32 without --enable-scale-out: registered, refused
            return jsonr({"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with "
                                    "--enable-scale-out to enable them.", "type": "PermissionDeniedError",
                                    "param": None, "code": 403}}, 403)
        return self._abort(request)

    def _abort(self, request: Request) -> Response:
        ids = orjson.loads(request.body).get("request_ids") or []
        for ext in ids:
            rid = str(ext).removeprefix("chatcmpl-").removeprefix("cmpl-").removesuffix("-0")
            task = self.tasks.get(rid)
            if task is not None:
                task.cancel()
            self.kv.pop(rid, None)
        return jsonr({})

    def metrics(self) -> str:
        labels = f'{{model_name="{self.cfg.model}",engine="0"}}'
        return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {float(len(self.running))}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {float(len(self.waiting))}\n"
                f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {self.started:.2f}\n"
                f"# TYPE vllm:nixl_num_kv_expired_reqs counter\nvllm:nixl_num_kv_expired_reqs_total{labels} "
                f"{float(self.expired)}\n")

    def held(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        out = [{"rid": r.rid, "queue": "running", "since_s": round(now - r.created, 3)} for r in self.running.values()]
        out += [{"rid": r.rid, "queue": "waiting", "since_s": round(now - r.created, 3)} for r in self.waiting.values()]
        out += [{"rid": rid, "queue": "kv_kept", "since_s": round(self.timeout_s - (until - now), 3)}
                for rid, until in self.kv.items()]
        return out


def build_server(sim: VllmSim) -> Server:
    r = Router()
    for route in ("/v1/chat/completions", "/v1/completions"):
        r.add("POST", route, sim.handler(route))

    async def health(_: Request) -> Response:
        return Response(b"", 200, content_type="text/plain")

    async def version(_: Request) -> Response:
        return jsonr({"version": VERSION})

    async def models(_: Request) -> Response:
        return jsonr({"object": "list", "data": [{"id": sim.cfg.model, "object": "model", "owned_by": "vllm",
                                                   "root": sim.cfg.model, "max_model_len": sim.cfg.max_context}]})

    async def metrics(_: Request) -> Response:
        if sim.cfg.faults.slow_metrics:
            await asyncio.sleep(sim.cfg.faults.slow_metrics)
        return Response(sim.metrics().encode(), content_type="text/plain; version=0.0.4")

    async def requests(_: Request) -> Response:
        return jsonr({"requests": sim.held(), "expired": sim.expired, "sent": sim.sent[-200:]})

    async def sent(_: Request) -> Response:
        return jsonr({"sent": sim.sent[-2000:]})

    async def faults(request: Request) -> Response:
        try:
            for name, value in orjson.loads(request.body).items():
                sim.cfg.faults.set(name, value)
        except (KeyError, ValueError, AttributeError) as exc:
            return jsonr({"error": str(exc)}, 400)
        return jsonr(sim.cfg.faults.values)

    for method, path, h in (("GET", "/health", health), ("GET", "/version", version), ("GET", "/v1/models", models),
                            ("GET", "/metrics", metrics), ("POST", KV_READ, sim.kv_read),
                            ("POST", "/abort_requests", sim.abort_requests),
                            ("POST", "/inference/v1/abort_requests", sim.scale_out_abort),
                            ("GET", p.EXT_REQUESTS_PATH, requests),
                            ("POST", p.EXT_FAULTS_PATH, faults), ("GET", "/pdgate/v1/sent", sent)):
        r.add(method, path, h)
    keepalive = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))
    return Server(r.dispatch, 256 * 1024 * 1024, keepalive_s=keepalive)
