"""Gateway configuration: frozen dataclasses, one validator, loading kept apart.

``config/pdgate.toml`` documents every key. Errors name the key, the value and the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pdgate.protocol import DEFAULT_BOOTSTRAP_PORT

POLICIES = ("round_robin", "least_loaded", "power_of_two")


class ConfigError(ValueError):
    def __init__(self, key: str, value: Any, reason: str) -> None:
        super().__init__(f"config {key} = {value!r}: {reason}")
        self.key = key


@dataclass(frozen=True)
class Budgets:
    """Deadline budgets in seconds; None means 'inherit'."""

    total_s: float | None = None
    ttft_s: float | None = None
    idle_s: float | None = None


@dataclass(frozen=True)
class DeadlineConfig:
    total_s: float = 600.0
    ttft_s: float = 120.0
    idle_s: float = 60.0
    max_total_s: float = 3600.0
    max_ttft_s: float = 600.0
    max_idle_s: float = 600.0


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 2.0
    timeout_s: float = 2.0
    failures: int = 2  # consecutive failed checks before a worker is down
    degraded_after_s: float = 30.0  # holding our requests with no progress this long -> degraded


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 5
    cooldown_s: float = 10.0


@dataclass(frozen=True)
class ReconcileConfig:
    enabled: bool = True
    interval_s: float = 5.0
    grace_s: float = 5.0  # an engine-held rid must be at least this old before it can be an orphan
    lease_s: float = 30.0  # a rid of another gateway instance is an orphan once that instance is unseen this long
    drift_checks: int = 3  # count mode: consecutive excess readings before drift is acted on
    recent_rids: int = 2000  # ended rids remembered per gateway, for count mode's re-aborts


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    role: str
    bootstrap_port: int | None = None

    @functools.cached_property
    def host(self) -> str:
        rest = self.url.split("://", 1)[-1]
        hostport = rest.split("/", 1)[0]
        if hostport.startswith("["):
            return hostport[: hostport.index("]") + 1]
        return hostport.rsplit(":", 1)[0]


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 30001
    policy: str = "least_loaded"
    max_attempts: int = 3
    max_body_bytes: int = 32 * 1024 * 1024
    trace_ring: int = 2000
    prefill_grace_s: float = 1.0  # after decode finished, how long prefill may still take before it is aborted
    connect_timeout_s: float = 2.0
    abort_timeout_s: float = 2.0
    abort_repeat_s: tuple[float, ...] = (0.25, 1.0)  # re-abort a leg that had not answered yet, after these delays
    drain_s: float = 10.0  # on SIGTERM: stop accepting, let live requests finish this long, then answer and abort the rest
    keepalive_s: float = 75.0  # front door: idle keep-alive connections close after this
    head_timeout_s: float = 10.0  # front door: a request head must arrive within this (slowloris: 408, closed)
    body_timeout_s: float = 60.0  # front door: a request body must arrive within this
    upstream_idle_s: float = 4.0  # pooled engine connections idle longer are not reused (SGLang closes them at 5 s)
    upstream_max_conns: int = 1024  # open connections per engine; a request beyond waits (connect timeout)
    upstream_max_idle: int = 256  # idle connections kept per engine
    max_upstream_body_bytes: int = 64 * 1024 * 1024  # a non-streaming leg's answer larger than this is a 502
    worker_api_key: str | None = None  # sent as Authorization: Bearer to the engines (SGLang's --api-key)
    instance_id: str | None = None
    # Safety switch for demonstrations and tests: with false the gateway never calls
    # /abort_request (like today's routers) and leaves cleanup to the engines.
    abort_legs: bool = True
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    models: dict[str, Budgets] = field(default_factory=dict)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    peers: tuple[str, ...] = ()  # URLs of other gateways in front of the same workers (their leases are read)
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()


def _positive(key: str, value: Any, *, allow_zero: bool = False, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(key, value, f"must be a {'whole ' if integer else ''}number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, value, "must be > 0" if not allow_zero else "must be >= 0")


def validate(cfg: GatewayConfig) -> GatewayConfig:
    if cfg.policy not in POLICIES:
        raise ConfigError("gateway.policy", cfg.policy, f"one of {', '.join(POLICIES)}")
    if not 1 <= cfg.max_attempts <= 9:
        raise ConfigError("gateway.max_attempts", cfg.max_attempts, "must be within 1..9")
    if not 0 < cfg.port < 65536:
        raise ConfigError("gateway.port", cfg.port, "must be a TCP port")
    for key in ("max_body_bytes", "trace_ring", "upstream_max_conns", "upstream_max_idle", "max_upstream_body_bytes"):
        _positive(f"gateway.{key}", getattr(cfg, key), integer=True)
    for key in ("prefill_grace_s", "connect_timeout_s", "abort_timeout_s", "keepalive_s", "head_timeout_s",
                "body_timeout_s", "upstream_idle_s"):
        _positive(f"gateway.{key}", getattr(cfg, key))
    _positive("gateway.drain_s", cfg.drain_s, allow_zero=True)
    if not isinstance(cfg.abort_repeat_s, tuple) or len(cfg.abort_repeat_s) > 5:
        raise ConfigError("gateway.abort_repeat_s", cfg.abort_repeat_s, "must be a list of at most 5 delays")
    for delay in cfg.abort_repeat_s:
        _positive("gateway.abort_repeat_s", delay)
    d = cfg.deadlines
    for f in dataclasses.fields(d):
        _positive(f"deadlines.{f.name}", getattr(d, f.name))
    for name in ("total", "ttft", "idle"):
        if getattr(d, f"{name}_s") > getattr(d, f"max_{name}_s"):
            raise ConfigError(f"deadlines.{name}_s", getattr(d, f"{name}_s"), f"exceeds deadlines.max_{name}_s")
    for model, b in cfg.models.items():
        for f in dataclasses.fields(b):
            v = getattr(b, f.name)
            if v is not None:
                _positive(f"models.{model}.{f.name}", v)
    for f in dataclasses.fields(cfg.health):
        _positive(f"health.{f.name}", getattr(cfg.health, f.name), integer=f.name == "failures")
    for f in dataclasses.fields(cfg.reconcile):
        if f.name != "enabled":
            _positive(f"reconcile.{f.name}", getattr(cfg.reconcile, f.name), integer=f.name in ("drift_checks", "recent_rids"))
    _positive("breaker.failures", cfg.breaker.failures, integer=True)
    _positive("breaker.cooldown_s", cfg.breaker.cooldown_s)
    for role in ("prefill", "decode"):
        for i, w in enumerate(getattr(cfg, role)):
            validate_worker(w, f"{role}[{i}]")
    return cfg


def validate_worker(w: WorkerSpec, key: str = "worker") -> WorkerSpec:
    if w.role not in ("prefill", "decode"):
        raise ConfigError(f"{key}.role", w.role, "must be prefill or decode")
    if w.url.startswith("https://"):
        raise ConfigError(f"{key}.url", w.url, "https:// workers are not supported (engines are reached over plain "
                          "HTTP on a trusted network); use http://")
    if not w.url.startswith("http://"):
        raise ConfigError(f"{key}.url", w.url, "must start with http://")
    try:
        u = urlsplit(w.url)
        u.port  # noqa: B018 - parsing it is the check (a port out of range raises)
    except ValueError as exc:
        raise ConfigError(f"{key}.url", w.url, f"not a URL: {exc}") from None
    if not u.hostname:
        raise ConfigError(f"{key}.url", w.url, "must be http://host:port")
    if w.bootstrap_port is not None and not (isinstance(w.bootstrap_port, int) and 0 < w.bootstrap_port < 65536):
        raise ConfigError(f"{key}.bootstrap_port", w.bootstrap_port, "must be a TCP port")
    return w


def _build(cls: Any, data: dict[str, Any], prefix: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}", data[key], f"unknown key (known: {', '.join(sorted(names))})")
    return cls(**data)


def from_mapping(data: dict[str, Any]) -> GatewayConfig:
    """Build a config from TOML-shaped data (see config/pdgate.toml)."""
    data = dict(data)
    top = dict(data.pop("gateway", {}))
    sections: dict[str, Any] = {
        "deadlines": _build(DeadlineConfig, data.pop("deadlines", {}), "deadlines."),
        "health": _build(HealthConfig, data.pop("health", {}), "health."),
        "breaker": _build(BreakerConfig, data.pop("breaker", {}), "breaker."),
        "reconcile": _build(ReconcileConfig, data.pop("reconcile", {}), "reconcile."),
        "models": {m: _build(Budgets, v, f"models.{m}.") for m, v in data.pop("models", {}).items()},
    }
    for role in ("prefill", "decode"):
        items = data.pop(role, [])
        sections[role] = tuple(_build(WorkerSpec, {**w, "role": role}, f"{role}.") for w in items)
    if data:
        key = next(iter(data))
        raise ConfigError(key, data[key], "unknown section")
    if "peers" in top:
        top["peers"] = tuple(top["peers"])
    if "abort_repeat_s" in top:
        top["abort_repeat_s"] = tuple(top["abort_repeat_s"]) if isinstance(top["abort_repeat_s"], list) else top["abort_repeat_s"]
    return validate(_build(GatewayConfig, {**top, **sections}, "gateway."))


def load(path: str | Path | None) -> GatewayConfig:
    if path is None:
        return validate(GatewayConfig())
    with open(path, "rb") as f:
        return from_mapping(tomllib.load(f))


def parse_prefill_flag(url: str, port: str | None) -> WorkerSpec:
    bport = DEFAULT_BOOTSTRAP_PORT if port is None or port in ("", "none") else int(port)
    return validate_worker(WorkerSpec(url=url.rstrip("/"), role="prefill", bootstrap_port=bport), "--prefill")


def override(cfg: GatewayConfig, **changes: Any) -> GatewayConfig:
    """Apply CLI flags (None means 'not given') on top of the loaded config."""
    given = {k: v for k, v in changes.items() if v is not None and v != ()}
    return validate(dataclasses.replace(cfg, **given))
