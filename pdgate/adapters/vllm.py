"""vLLM's prefill/decode disaggregation (NixlConnector), as its toy proxy drives it (facts and sources:
``docs/vllm.md``).

- Sequential legs: the prefill gets the client's body with ``kv_transfer_params`` asking for a remote decode,
  ``max_tokens`` 1 (``max_completion_tokens`` too where the client sent it), not streamed, without
  ``stream_options`` and ``min_tokens``; its answer's ``kv_transfer_params`` go verbatim into the decode's body
  (``decode_after``). None returned: the decode recomputes the prompt. Both legs carry the attempt's rid as
  ``X-Request-Id`` (the request path sets it), which NIXL correlates on before vLLM 0.13.
- Abort: vLLM aborts a request when its client's connection closes, and the request path closes a leg it ends.
  It is told by id too where it offers that: ``POST /inference/v1/abort_requests`` (vLLM 0.32 registers it on every
  ``vllm serve`` but answers 403 unless ``--enable-scale-out``; guarded by ``--api-key``), else ``POST
  /abort_requests`` (``--tokens-only``, ``VLLM_SERVER_DEV_MODE``); a path that answers 403 or 404 is not asked
  again until the engine was down.
  Its decode may be torn down while it waits for KV (vLLM keeps the blocks until the read ends): never deferred.
- A prefill's KV that no decode reads is freed by the engine itself: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (480 s in
  0.12-0.21) or the KV lease (30 s, 0.22+). A decode waiting for KV has no engine timeout: the request's
  deadline is what ends it.
- Probes: ``/health`` (200), ``/v1/models`` (served model, ``max_model_len``), ``/metrics``
  (``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, summed over engines; the latter is a prefill's
  compute queue), identity from ``/version`` and ``process_start_time_seconds`` (a restart changes it); the last
  two only inform: unanswered, the worker stays up with them unknown. vLLM lists no rids: reconciliation compares
  counts. All of these are open with ``--api-key`` (it guards ``/v1`` only).
- Routes: ``/v1/chat/completions`` and ``/v1/completions`` (``/generate`` is SGLang's: a 400 here).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import orjson

from pdgate.adapters import base
from pdgate.adapters.base import Held, Probe, Usage, _count, failed_probe, openai_usage, token_count, tokenize_body, unanswered
from pdgate.core.errors import InvalidField

if TYPE_CHECKING:
    from pdgate.adapters.upstream import Upstream
    from pdgate.core.config import WorkerSpec
    from pdgate.core.record import Attempt

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
              "remote_host": None, "remote_port": None}
ABORT_PATHS = ("/inference/v1/abort_requests", "/abort_requests")  # the first an engine does not answer 404 to
GAUGE = re.compile(rb"^vllm:(num_requests_running|num_requests_waiting)\{[^}]*\} ([0-9.eE+-]+)$", re.M)
STARTED = re.compile(rb"^process_start_time_seconds ([0-9.eE+]+)$", re.M)


class VLLM(base.OverHTTP):
    kind = "vllm"
    sequential = True
    prefill_answer_is_first_token = False  # the decode has yet to read the KV: a TTFT budget covers that wait
    done_event = b"data: [DONE]"
    error_event = b'data: {"error"'

    def __init__(self, upstream: Upstream) -> None:
        self.up = upstream
        self.no_abort: dict[str, int] = {}  # engine -> how many of ABORT_PATHS it refused (not asked until down)

    # ---- the legs ----------------------------------------------------------------------
    def legs(self, body: dict[str, Any], att: Attempt, prefill: WorkerSpec) -> tuple[bytes, bytes]:
        if "messages" not in body and "prompt" not in body:
            raise InvalidField("vLLM workers serve /v1/chat/completions and /v1/completions (not /generate)")
        p = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
        p.update(kv_transfer_params=PREFILL_KV, stream=False, max_tokens=1)
        if "max_completion_tokens" in body:
            p["max_completion_tokens"] = 1
        return orjson.dumps(p), orjson.dumps(body)

    def decode_after(self, decode: bytes, prefill_answer: bytes) -> bytes:
        try:
            answer = orjson.loads(prefill_answer)
        except orjson.JSONDecodeError:
            return decode
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            return decode  # nothing to read remotely: the decode computes the prompt itself
        return orjson.dumps({**orjson.loads(decode), "kv_transfer_params": params})

    def needs_prefill_answer(self, route: str, body: dict[str, Any]) -> bool:
        return False

    def merge(self, prefill_answer: bytes, decode_answer: bytes) -> bytes:
        return decode_answer

    def usage(self, answer: bytes) -> Usage:
        try:
            obj = orjson.loads(answer)
        except orjson.JSONDecodeError:
            return Usage()
        return openai_usage(obj.get("usage") if isinstance(obj, dict) else None)

    def output_tokens(self, route: str, body: dict[str, Any]) -> int | None:
        """As vLLM reads them: chat ``max_completion_tokens`` or ``max_tokens`` (neither: up to the context),
        completions ``max_tokens`` (default 16)."""
        if route == COMPLETIONS:
            return _count(body.get("max_tokens", 16))
        return _count(body.get("max_completion_tokens") or body.get("max_tokens"))

    def limit_output(self, route: str, body: dict[str, Any], n: int) -> None:
        body["max_tokens" if route == COMPLETIONS else "max_completion_tokens"] = n

    def defers_decode_abort(self, decode_fixes: list[str] | None) -> bool:
        return False  # vLLM keeps a torn-down decode's blocks until its KV read ends

    async def abort(self, url: str, rid: str) -> int:
        """Closing the leg aborted it; an engine that offers abort by id is told too (its external ids)."""
        body = orjson.dumps({"request_ids": [f"chatcmpl-{rid}", f"cmpl-{rid}-0", rid]})
        while (tried := self.no_abort.get(url, 0)) < len(ABORT_PATHS):
            status = await self.up.post_small(url, ABORT_PATHS[tried], body)
            if status not in (403, 404):
                return status
            self.no_abort[url] = tried + 1
        return 200

    # ---- probes ------------------------------------------------------------------------
    async def probe(self, url: str, role: str, timeout_s: float) -> Probe:
        """Up is ``/health`` 200 and ``/v1/models`` answered. ``/version`` and ``/metrics`` only inform (identity,
        counts): unanswered in time, the worker stays up with them unknown (``Probe.partial`` says why the counts
        are). Real vLLM's ``/metrics`` took 8 and 22 s on a loaded 2-core box while its ``/health`` answered within
        3 s; read as a failed check, that took a serving decode down and failed its requests over
        (docs/fidelity.md)."""
        path = "/health"
        try:
            status, _ = await self.up.get(url + path, timeout_s)
            if status != 200:
                return Probe(False, f"/health answered {status}")
            path = "/v1/models"
            status, models = await self.up.get_json(url + path, timeout_s)
            if status in (401, 403):
                return Probe(False, f"/v1/models answered {status}: the engine refuses the gateway's credentials "
                             "(worker_api_key must be its --api-key)")
        except OSError as exc:
            return failed_probe(exc, path, timeout_s)
        version: Any = None
        metrics, partial = b"", None
        try:
            _, version = await self.up.get_json(url + "/version", timeout_s)
        except OSError:  # this check's identity unknown: a restart is still found by the next one that reads it
            pass
        try:
            status, metrics = await self.up.get(url + "/metrics", timeout_s)
            metrics = metrics if status == 200 else b""
        except OSError as exc:
            metrics, partial = b"", unanswered(exc, "/metrics", timeout_s)
        p = self._probed(models, version, metrics, role)
        p.partial = partial
        return p

    def _probed(self, models: Any, version: Any, metrics: bytes, role: str) -> Probe:
        data = models.get("data") if isinstance(models, dict) else None
        served = tuple(str(m["id"]) for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)) \
            if isinstance(data, list) else ()
        counts = {"num_requests_running": 0, "num_requests_waiting": 0}
        seen = False
        for name, value in GAUGE.findall(metrics):
            counts[name.decode()] += int(float(value))
            seen = True
        started = STARTED.search(metrics)
        v = version.get("version") if isinstance(version, dict) else None
        ident = f"vllm {v} started {started.group(1).decode()}" if started and isinstance(v, str) else None
        p = Probe(True, identity=ident, models=served, queues=dict(counts) if seen else {})
        if seen:
            p.held = p.running = counts["num_requests_running"] + counts["num_requests_waiting"]
            if role == "prefill":  # a decode's waiting ones wait for KV (WAITING_FOR_REMOTE_KVS), not for compute
                p.waiting = counts["num_requests_waiting"]
        return p

    async def identify(self, spec: WorkerSpec, timeout_s: float) -> Probe | None:
        """``/health`` 200 and vLLM's ``/metrics`` gauges (open with ``--api-key``), asked without credentials.
        vLLM says nothing of a worker's role: the operator's word for it stands."""
        status, _ = await self.up.get(spec.url + "/health", timeout_s, auth=False)
        if status != 200:
            return None
        status, metrics = await self.up.get(spec.url + "/metrics", timeout_s, auth=False)
        if status != 200 or not GAUGE.search(metrics):
            return None
        _, version = await self.up.get_json(spec.url + "/version", timeout_s, auth=False)
        return self._probed({}, version, metrics, spec.role)

    async def held(self, url: str, timeout_s: float) -> list[Held] | None:
        return None  # vLLM lists no request ids: counts only

    def forget(self, url: str) -> None:
        self.no_abort.pop(url, None)  # whatever comes back up may offer it

    async def count_tokens(self, url: str, chat: dict[str, Any], timeout_s: float) -> int | None:
        got = await self.up.post_within(url, "/tokenize", tokenize_body(chat), timeout_s)
        return token_count(*got) if got is not None else None

