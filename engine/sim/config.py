"""Configuration of one simulated worker: role, timing model, fixes and faults.

Faults and fixes may change at run time (``POST /pdgate/v1/faults``), so they live in
small mutable holders; everything else is fixed at start.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

FIXES = ("A", "B", "C")

# name -> parser of the value given on the CLI, in env (SIM_FAULT_<NAME>) or by the endpoint.
def _flag(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    return str(v).strip().lower() not in ("", "0", "false", "off", "no")


def _rate(v: Any) -> float:
    r = float(v)
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"rate must be within 0..1, got {r}")
    return r


def _seconds(v: Any) -> float:
    if isinstance(v, bool):
        return 0.0 if not v else 1.0
    s = float(v)
    if s < 0:
        raise ValueError(f"seconds must be >= 0, got {s}")
    return s


FAULTS: dict[str, Any] = {
    "decode_crash": _flag,
    "decode_freeze": _flag,
    "decode_stall": _flag,  # decode: tokens stop while /health and everything else still answer (a gray failure)
    "abort_race": _flag,
    "bootstrap_loss": _flag,
    "ack_loss": _flag,
    "http_500_rate": _rate,
    "queue_full_rate": _rate,  # this fraction of generation requests gets SGLang's 503 "The request queue is full"
    "slow_prefill": _seconds,
    "slow_accept": _seconds,
    "slow_first_token": _seconds,  # decode: the first token leaves this long after the KV (and the prefill's answer)
    # re-segment what the engine writes, as a real network and a loaded SGLang do: with this
    # probability a write is cut at random byte offsets (pieces a little apart, so they arrive in
    # separate reads) or held back and merged with the next one
    "segment": _rate,
    "segment_seed": int,
    "split_stall": _seconds,  # every write: its first half, this long a pause, then the rest (stuck mid-event)
    "done_stall": _seconds,  # decode: a stream's end (the last chunk) this long after its [DONE]
    "slow_kv_read": _seconds,  # --protocol vllm, decode: each KV read takes up to this long, uniformly (real NIXL on a busy CPU: 0.03-11.7 s)
    "kv_wait_forever": _flag,  # --protocol vllm, decode: its KV never comes (WAITING_FOR_REMOTE_KVS, no timeout)
    "ignore_disconnect": _flag,  # --protocol vllm: a client that leaves does not abort its request
    # the probes' informational answer this long late (--protocol vllm: /metrics; SGLang: /v1/loads) while /health
    # answers at once: real vLLM's /metrics took 8 and 22 s on a loaded 2-core box, its /health 1-3 s
    "slow_metrics": _seconds,
}


class Faults:
    """Fault switches, all off by default."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {name: parse(0) for name, parse in FAULTS.items()}

    def set(self, name: str, value: Any) -> None:
        if name not in FAULTS:
            raise KeyError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        self.values[name] = FAULTS[name](value)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)


def parse_fixes(text: str) -> set[str]:
    text = text.strip()
    if text.lower() in ("none", ""):
        return set()
    if text.lower() == "all":
        return set(FIXES)
    fixes = {f.strip().upper() for f in text.split(",") if f.strip()}
    unknown = fixes - set(FIXES)
    if unknown:
        raise ValueError(f"unknown fixes {sorted(unknown)}; known: A,B,C,none")
    return fixes


@dataclass(frozen=True)
class Timing:
    """Cost model in seconds. ``speed`` scales all of it; 0 makes compute free."""

    speed: float = 1.0
    prefill_base: float = 0.004
    prefill_per_token: float = 2e-6
    decode_step_base: float = 0.004
    decode_step_per_req: float = 0.0002
    decode_step_per_ktok: float = 0.00002

    def prefill_s(self, tokens: int) -> float:
        return self.speed * (self.prefill_base + self.prefill_per_token * tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.speed * (
            self.decode_step_base
            + self.decode_step_per_req * batch
            + self.decode_step_per_ktok * context_tokens / 1000
        )


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else float(raw)


@dataclass
class SimConfig:
    role: str
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 8998
    model: str = "sim-model"
    transfer_backend: str = "tcp"
    fixes: set[str] = field(default_factory=lambda: set(FIXES))
    faults: Faults = field(default_factory=Faults)
    timing: Timing = field(default_factory=Timing)
    max_context: int = 131072
    default_max_tokens: int = 128
    kv_bytes_per_token: int = 256
    kv_budget_tokens: int = 4_000_000
    kv_buffer_bytes: int = 64 * 1024 * 1024  # nixl: registered DRAM per worker
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    inflight_timeout: float = 60.0
    stall_threshold: int = 16384
    unsafe_kernel: bool = False
    disconnect_notice_s: float = 4.0
    extension: bool = True  # serve GET /pdgate/v1/requests (off: look like plain SGLang)
    prefix_cache_tokens: int = 1_000_000  # the prefill's prefix cache (0: off, as SGLang's --disable-radix-cache)
    eos_after: int = 0  # free text ends (finish_reason stop) after this many tokens, as a model's EOS; 0: never
    protocol: str = "sglang"  # the engine it speaks: sglang (its PD protocol) or vllm (engine/sim/vllm.py)
    max_running_requests: int = 1024  # reported in /server_info as SGLang does (gateways read it as a capacity)
    api_key: str | None = None  # SGLang's --api-key: every route but /health*, /ready*, /metrics wants it

    @classmethod
    def from_env(cls, **kw: Any) -> SimConfig:
        cfg = cls(**kw)
        cfg.bootstrap_timeout = _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)
        cfg.waiting_timeout = _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
        cfg.inflight_timeout = _env_float("SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT", 60.0)
        cfg.disconnect_notice_s = _env_float("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", 4.0)
        cfg.stall_threshold = int(_env_float("SIM_STALL_THRESHOLD_TOKENS", 16384))
        cfg.unsafe_kernel = os.environ.get("SGLANG_SM120_MMA_TARGET_CTAS", "") == "512"
        for name in FAULTS:
            raw = os.environ.get(f"SIM_FAULT_{name.upper()}")
            if raw is not None:
                cfg.faults.set(name, raw)
        return cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.sim", description=__doc__)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang",
                   help="the engine it speaks: SGLang's PD protocol, or vLLM's (NixlConnector, sequential legs)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--model", default="sim-model")
    p.add_argument("--transfer-backend", choices=("tcp", "nixl"), default="tcp")
    p.add_argument("--fixes", default="A,B,C", help="comma list of A,B,C, or 'none'")
    p.add_argument("--fault", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--speed", type=float, default=1.0, help="timing scale; 0 = free compute")
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--kv-bytes-per-token", type=int, default=256)
    p.add_argument("--kv-budget-tokens", type=int, default=4_000_000)
    p.add_argument("--kv-buffer-mb", type=int, default=64, help="nixl: registered DRAM buffer per worker")
    p.add_argument("--no-extension", action="store_true",
                   help="do not serve GET /pdgate/v1/requests nor the pdgate fields of /server_info (like plain SGLang)")
    p.add_argument("--prefix-cache-tokens", type=int, default=1_000_000,
                   help="the prefill's prefix cache, in tokens (0: off, as SGLang's --disable-radix-cache)")
    p.add_argument("--prefill-per-token-us", type=float, default=None,
                   help="prefill compute per uncached prompt token, microseconds (default 2)")
    p.add_argument("--max-running-requests", type=int, default=1024,
                   help="reported in /server_info as SGLang's resolved server arg (a gateway's capacity hint)")
    p.add_argument("--api-key", default=os.environ.get("SIM_API_KEY") or None,
                   help="as SGLang's --api-key: Authorization: Bearer <key> required (env SIM_API_KEY)")
    p.add_argument("--eos-after", type=int, default=0,
                   help="free text ends with EOS (finish_reason stop) after this many tokens, as a model's answer "
                        "does; 0 (default): it runs to max_tokens")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"--host {args.host}: the sim binds to loopback only")
    cfg = SimConfig.from_env(
        role=args.role,
        host=args.host,
        port=args.port,
        bootstrap_port=args.bootstrap_port,
        model=args.model,
        transfer_backend=args.transfer_backend,
        fixes=parse_fixes(args.fixes),
        timing=Timing(speed=args.speed) if args.prefill_per_token_us is None else
        Timing(speed=args.speed, prefill_per_token=args.prefill_per_token_us * 1e-6),
        max_context=args.max_context,
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_budget_tokens=args.kv_budget_tokens,
        kv_buffer_bytes=args.kv_buffer_mb * 1024 * 1024,
        extension=not args.no_extension,
        api_key=args.api_key,
        max_running_requests=args.max_running_requests,
        prefix_cache_tokens=args.prefix_cache_tokens,
        eos_after=args.eos_after,
        protocol=args.protocol,
    )
    for item in args.fault:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--fault {item!r}: expected NAME=VALUE")
        try:
            cfg.faults.set(name, value)
        except (KeyError, ValueError) as exc:
            raise SystemExit(f"--fault {item!r}: {exc}") from None
    return cfg
