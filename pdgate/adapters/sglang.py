"""SGLang's prefill/decode disaggregation (facts from SGLang 0.5.23: ``docs/architecture.md``, "SGLang PD").

- Both legs get the same path and body at once, with ``bootstrap_host`` / ``bootstrap_port`` (the prefill's
  bootstrap server) and ``bootstrap_room``, and the same ``rid``; the prefill answers after the KV transfer
  ended (Success: its answer; Failed: 500), the decode streams the tokens.
- Abort: ``POST /abort_request {"rid"}``, matched by prefix, always 200. Without the abort-during-transfer fix
  (A) a decode torn down while it receives KV can crash or leak (SMG defers it until the decode's first answer
  for the same reason), so its abort waits for the transfer's end there (``defers_decode_abort``).
- Probes: ``/health``; ``/server_info`` (served model, ``max_running_requests``, ``disaggregation_mode``; the
  sim and engine/sglang add an identity and the fixes in force, the latter at ``/pdgate/v1/info``);
  ``/v1/loads?include=disagg`` (queue counts). Only engines with the pdgate extension list their rids
  (``/pdgate/v1/requests``); plain SGLang is reconciled by counts.
- Usage: OpenAI's ``usage`` or ``/generate``'s ``meta_info``; ``return_logprob`` on ``/generate`` gets the
  prefill's input logprobs in front of the decode's, as SGLang's routers merge them.
- Output tokens, as SGLang reads them (``srt/entrypoints/openai/protocol.py``): ``/generate`` its
  ``sampling_params.max_new_tokens`` (default 128); completions ``max_tokens`` (default 16); chat
  ``max_completion_tokens or max_tokens`` (neither: up to the context length). Other fields of the same meaning
  are not read by the engine for that route, so they count for nothing here either.
- With ``--api-key``, SGLang leaves ``/health``, ``/ready`` and ``/metrics`` open (``srt/utils/auth.py``,
  ``decide_request_auth``): a registration is identified there, without the key, when ``/server_info`` wants it.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any

import orjson

from pdgate.adapters import base
from pdgate.adapters.base import Held, Probe, Usage, _count, failed_probe, openai_usage, token_count, tokenize_body, unanswered
from pdgate.core import protocol as wire

if TYPE_CHECKING:
    from pdgate.adapters.upstream import Upstream
    from pdgate.core.config import WorkerSpec
    from pdgate.core.record import Attempt

GENERATE, COMPLETIONS = "/generate", "/v1/completions"
DEFAULT_NEW_TOKENS = {GENERATE: 128, COMPLETIONS: 16}  # SamplingParams.max_new_tokens; CompletionRequest.max_tokens
# the queues a worker of each role holds our requests in (count-mode reconciliation)
HELD = {"prefill": ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs"),
        "decode": ("decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "num_running_reqs")}


class SGLang(base.OverHTTP):
    kind = "sglang"
    sequential = False
    prefill_answer_is_first_token = True  # its prefill answers once the KV transfer is over
    done_event = b"data: [DONE]"
    error_event = b'data: {"error"'

    def __init__(self, upstream: Upstream) -> None:
        self.up = upstream
        self.no_info: set[str] = set()  # workers that answered no /pdgate/v1/info (not asked again until down)

    # ---- the legs ----------------------------------------------------------------------
    def legs(self, body: dict[str, Any], att: Attempt, prefill: WorkerSpec) -> tuple[bytes, bytes]:
        room = att.drawn[wire.BOOTSTRAP_ROOM] = random.getrandbits(63)  # each attempt its own: the KV's meeting place
        payload = orjson.dumps({**body, wire.BOOTSTRAP_HOST: prefill.host, wire.BOOTSTRAP_PORT: prefill.bootstrap_port,
                                wire.BOOTSTRAP_ROOM: room, wire.RID: att.rid})
        return payload, payload

    def decode_after(self, decode: bytes, prefill_answer: bytes) -> bytes:
        return decode

    def needs_prefill_answer(self, route: str, body: dict[str, Any]) -> bool:
        return route == GENERATE and bool(body.get("return_logprob"))

    def merge(self, prefill_answer: bytes, decode_answer: bytes) -> bytes:
        """The decode's ``input_token_logprobs`` = the prefill's + the decode's."""
        try:
            p, d = orjson.loads(prefill_answer), orjson.loads(decode_answer)
            pm, dm = p["meta_info"], d["meta_info"]
            if "input_token_logprobs" in pm and "input_token_logprobs" in dm:
                dm["input_token_logprobs"] = pm["input_token_logprobs"] + dm["input_token_logprobs"]
            return orjson.dumps(d)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return decode_answer

    def usage(self, answer: bytes) -> Usage:
        try:
            obj = orjson.loads(answer)
        except orjson.JSONDecodeError:
            return Usage()
        return openai_usage((obj.get("usage") or obj.get("meta_info")) if isinstance(obj, dict) else None)

    def output_tokens(self, route: str, body: dict[str, Any]) -> int | None:
        if route == GENERATE:
            sp = body.get("sampling_params")
            v = sp.get("max_new_tokens", DEFAULT_NEW_TOKENS[route]) if isinstance(sp, dict) else DEFAULT_NEW_TOKENS[route]
        elif route == COMPLETIONS:
            v = body.get("max_tokens", DEFAULT_NEW_TOKENS[route])
        else:
            v = body.get("max_completion_tokens") or body.get("max_tokens")
        return _count(v)

    def limit_output(self, route: str, body: dict[str, Any], n: int) -> None:
        if route == GENERATE:
            sp = body.get("sampling_params")
            body["sampling_params"] = {**(sp if isinstance(sp, dict) else {}), "max_new_tokens": n}
        else:
            body["max_completion_tokens" if route != COMPLETIONS else "max_tokens"] = n

    def defers_decode_abort(self, decode_fixes: list[str] | None) -> bool:
        return "A" not in (decode_fixes or ())

    async def abort(self, url: str, rid: str) -> int:
        return await self.up.post_small(url, wire.ABORT_PATH, orjson.dumps({"rid": rid}))

    # ---- probes ------------------------------------------------------------------------
    async def probe(self, url: str, role: str, timeout_s: float) -> Probe:
        """Up is ``/health`` 200 and ``/server_info`` answered. ``/v1/loads`` only informs (the queue counts): unanswered
        in time, the worker stays up with them unknown (``Probe.partial``), as vLLM's ``/metrics``."""
        path = wire.HEALTH_PATH
        try:
            status, _ = await self.up.get(url + path, timeout_s)
            if status != 200:
                return Probe(False, f"/health answered {status}")
            path = wire.SERVER_INFO_PATH
            status, info = await self.up.get_json(url + path, timeout_s)
            if status in (401, 403):  # /health is open on SGLang with --api-key; the rest is not
                return Probe(False, f"/server_info answered {status}: the engine refuses the gateway's credentials "
                             "(worker_api_key must be its --api-key)")
        except OSError as exc:
            return failed_probe(exc, path, timeout_s)
        info = info if isinstance(info, dict) else {}
        if wire.IDENTITY_FIELD not in info and url not in self.no_info:
            info = {**info, **await self._ext_info(url, timeout_s)}
        loads: Any = None
        partial = None
        try:
            _, loads = await self.up.get_json(url + wire.LOADS_PATH + "?include=disagg", timeout_s)
        except OSError as exc:
            partial = unanswered(exc, wire.LOADS_PATH, timeout_s)
        p = self._probed(info, _queues(loads), role)
        p.partial = partial
        return p

    def _probed(self, info: dict[str, Any], queues: dict[str, Any], role: str) -> Probe:
        served = info.get("served_model_name") or info.get("model_path")
        cap = info.get("max_running_requests")  # SGLang's resolved server arg (the sim reports its own)
        ident = info.get(wire.IDENTITY_FIELD)
        version, profile = info.get("sglang_version"), info.get("kernel_profile")
        if isinstance(ident, str) and isinstance(version, str):  # engine/sglang's worker: what runs, said with it
            ident = f"sglang {version}" + (f" profile {profile}" if isinstance(profile, str) else "") + f" {ident}"
        p = Probe(True, identity=ident if isinstance(ident, str) else None, fixes=info.get(wire.FIXES_FIELD),
                  models=(served,) if isinstance(served, str) else (),
                  capacity=cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None,
                  queues=queues, lists_rids=info.get("pdgate_engine") is not None)
        if queues:
            p.held = sum(v for k in HELD[role] if isinstance(v := queues.get(k), int))
        w = queues.get("num_waiting_reqs")
        if role == "prefill" and isinstance(w, int):  # a decode's waiting ones wait for KV, not for compute
            p.waiting = w
        if "num_running_reqs" in queues:
            p.running = sum(v for k, v in queues.items() if k in ("num_running_reqs", "num_waiting_reqs")
                            and isinstance(v, int))
        return p

    async def _ext_info(self, url: str, timeout_s: float) -> dict[str, Any]:
        """Identity and fixes from ``/pdgate/v1/info`` (engine/sglang workers). A worker that answers anything but
        a JSON object there is not asked again until it has been down."""
        try:
            status, body = await self.up.get_json(url + wire.EXT_INFO_PATH, timeout_s)
        except OSError:  # not this check's verdict: /health and /server_info decide that
            return {}
        if status == 200 and isinstance(body, dict):
            return dict(body)
        self.no_info.add(url)
        return {}

    def forget(self, url: str) -> None:
        self.no_info.discard(url)  # whatever comes back up may be another engine

    async def count_tokens(self, url: str, chat: dict[str, Any], timeout_s: float) -> int | None:
        got = await self.up.post_within(url, "/tokenize", tokenize_body(chat), timeout_s)
        return token_count(*got) if got is not None else None

    async def identify(self, spec: WorkerSpec, timeout_s: float) -> Probe | None:
        """``/health`` 200, and ``/server_info`` naming the same disaggregation mode (a decode registered as a
        prefill, or anything else, is refused); when ``/server_info`` wants a key, SGLang's open ``/metrics``
        with gauges of this role. All asked without the gateway's credentials."""
        status, _ = await self.up.get(spec.url + wire.HEALTH_PATH, timeout_s, auth=False)
        if status != 200:
            return None
        status, info = await self.up.get_json(spec.url + wire.SERVER_INFO_PATH, timeout_s, auth=False)
        if status == 200:
            ok = isinstance(info, dict) and info.get("disaggregation_mode") == spec.role
            return self._probed(info, {}, spec.role) if ok else None
        if status in (401, 403):
            status, text = await self.up.get(spec.url + wire.METRICS_PATH, timeout_s, auth=False)
            gauge = re.compile(rb'^sglang[:_]num_running_reqs\{[^}]*engine_type="%b"' % spec.role.encode(), re.M)
            return Probe(True) if status == 200 and gauge.search(text) else None
        return None

    async def held(self, url: str, timeout_s: float) -> list[Held] | None:
        try:
            status, body = await self.up.get_json(url + wire.EXT_REQUESTS_PATH, timeout_s)
        except OSError:
            return None
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("requests"), list):
            return None
        out = []
        for r in body["requests"]:
            if isinstance(r, dict):
                age = r.get("age_s", r.get("since_s", 0.0))
                out.append(Held(str(r.get("rid", "")), r.get("queue"), float(age) if isinstance(age, (int, float)) else 0.0))
        return out


def _queues(loads: Any) -> dict[str, Any]:
    if not isinstance(loads, dict) or not loads.get("loads") or not isinstance(loads["loads"], list):
        return {}
    first = loads["loads"][0]
    if not isinstance(first, dict):
        return {}
    out = {k: first.get(k) for k in ("num_running_reqs", "num_waiting_reqs") if k in first}
    disagg = first.get("disaggregation")  # asked as ?include=disagg, answered under this name (managers/load_snapshot)
    out.update({k: v for k, v in disagg.items() if k.endswith("_queue_reqs")} if isinstance(disagg, dict) else {})
    return out
