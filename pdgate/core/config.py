"""Gateway configuration: frozen dataclasses, one validator, loading kept apart.

``config/pdgate.toml`` documents every key. Errors name the key, the value and the reason.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pdgate.core.protocol import DEFAULT_BOOTSTRAP_PORT

POLICIES = ("round_robin", "least_loaded", "power_of_two", "session", "cache_aware")
LOAD_POLICIES = POLICIES[:3]  # what a decode choice may use (session and cache_aware are prefill choices)
PRIORITIES = ("high", "normal", "low")  # a key's priority class (admission control orders its queue by it)
KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a tenant's name: a metric label, a log field
KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
RESERVED_NAMES = frozenset({"anonymous", "unknown", "local"})  # what the audit log and metrics say for no key


class ConfigError(ValueError):
    def __init__(self, key: str, value: Any, reason: str) -> None:
        super().__init__(f"config {key} = {value!r}: {reason}")
        self.key = key


class ConfigErrors(ConfigError):
    """Every error found in one config, all at once (one per line)."""

    def __init__(self, errors: list[ConfigError], where: str = "") -> None:
        self.errors = errors
        head = f"{where}: " if where else ""
        lines = [f"{head}{e}" for e in errors]
        ValueError.__init__(self, lines[0] if len(lines) == 1 else f"{len(lines)} errors:\n  " + "\n  ".join(lines))
        self.key = errors[0].key


class Errors:
    """Collects config errors: ``with errs:`` around each check keeps going after one fails."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def __enter__(self) -> Errors:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, ConfigErrors):
            self.found.extend(exc.errors)
            return True
        if isinstance(exc, ConfigError):
            self.found.append(exc)
            return True
        return False

    def raise_any(self, where: str = "") -> None:
        if self.found:
            raise ConfigErrors(self.found, where)


LOCAL_ADMIN_KEY = Path(".pdgate/admin.key")  # the admin key `pdgate up` makes when none is configured; the CLI reads it
UP_FILE = "up.json"  # beside it: where a running `pdgate up` listens (front, admin) and its pid


def did_you_mean(word: str, known: Any) -> str:
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(known))}"


@dataclass(frozen=True)
class Budgets:
    """A model's settings (``[models."name"]``): deadline budgets in seconds (None: inherit), and ``served_by``:
    the name is an alias, asked by clients, of that served model (the name may be a pattern: ``"claude-*"``)."""

    total_s: float | None = None
    ttft_s: float | None = None
    idle_s: float | None = None
    served_by: str | None = None


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
    drift_checks: int = 3  # count mode: consecutive excess readings before drift is acted on
    recent_rids: int = 2000  # ended rids remembered per gateway, for count mode's re-aborts


@dataclass(frozen=True)
class StoreConfig:
    """What several gateway processes share (``pdgate/store``; docs/scale-out.md): none (the
    embedded store of one process), or Redis."""

    url: str = ""  # redis://host:port/db, rediss://host:port/db or unix:/path; empty: one process, nothing shared
    username: str | None = None  # Redis ACL user
    password_file: str | None = None  # a file holding the password (or: password_env names a variable)
    password_env: str | None = None
    prefix: str = "pdgate:"  # every key's (several gateways on one Redis: one prefix each)
    timeout_s: float = 0.05  # every call's bound; past it, limits fall back to this process's share
    lease_s: float = 10.0  # an instance whose heartbeat is this old is gone (its rids are aborted by the others)
    heartbeat_s: float = 2.0


@dataclass(frozen=True)
class AdmissionConfig:
    """A gateway queue in front of the engines (docs/admission.md)."""

    enabled: bool = True
    capacity: int = 0  # live requests of ours per worker; 0: what the engine reports (max_running_requests), else no cap
    max_queue: int = 1024  # requests waiting for room; beyond: 503 queue_full (429 for a tenant over its share)
    shed: bool = True  # answer at once a request that cannot reach its first token within its TTFT budget
    window_s: float = 10.0  # a drain-rate estimate not renewed within this (nobody waited) is not used
    engine_backoff_s: float = 5.0  # after an engine's 429/503, it gets no more requests than it holds, this long
    learn: bool = True  # learn each worker's limit from what it serves in time (pdgate.core.limits); capacity set wins
    learn_initial: int = 4  # the learned limit before anything was answered (slow start: +1 an answer showing no queueing)
    learn_cap: int = 0  # the most a learned limit reaches (0: the engine's max_running_requests only)
    learn_tolerance: float = 2.0  # latency above this many times the worker's no-load latency: it queues
    learn_window_s: float = 10.0  # the no-load latency is the least seen within this window

    @property
    def learns(self) -> bool:
        """Whether each worker's limit is learned: admission on, learning on, and no capacity set by hand."""
        return self.enabled and self.learn and not self.capacity


@dataclass(frozen=True)
class KeyConfig:
    """A client key: its name is the tenant; the key itself is kept only as ``sha256:<hex>``."""

    name: str
    hash: str
    models: tuple[str, ...] = ()  # empty: every model served
    max_concurrent: int | None = None  # live requests at once
    requests_per_min: int | None = None
    tokens_per_min: int | None = None  # prompt + completion tokens
    max_total_s: float | None = None  # caps on the deadlines this key's requests may ask for
    max_ttft_s: float | None = None
    max_idle_s: float | None = None
    priority: str = "normal"  # high | normal | low
    weight: float = 1.0  # its share of the queue against other tenants of the same priority (weighted fair queuing)


@dataclass(frozen=True)
class RoutingConfig:
    """The request-aware policies (``pdgate.pool.policies``); thresholds as SGLang router's defaults."""

    session_header: str = "x-session-id"  # the session key; without it, OpenAI's "user" field
    max_sessions: int = 100_000  # sessions remembered (least recently used first out)
    cache_threshold: float = 0.3  # cache_aware: the matched share of the prompt that picks the worker holding it
    cache_min_chars: int = 1024  # cache_aware: ... or a matched prefix this long, whatever its share
    balance_abs: int = 64  # both: a worker this many requests above the least loaded ...
    balance_rel: float = 1.5  # ... and this many times it is out of balance: the least loaded gets the request
    block_chars: int = 256  # cache_aware: its prefix tree's granularity, in characters of prompt text
    max_blocks: int = 262_144  # cache_aware: blocks remembered per worker (x block_chars: 2^26 characters, the router's)


@dataclass(frozen=True)
class OtelConfig:
    """OpenTelemetry traces over OTLP/HTTP (pdgate/observe/otel.py; the otel extra)."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"  # an OTLP/HTTP collector's traces URL
    service_name: str = "pdgate"


@dataclass(frozen=True)
class MessagesConfig:
    """``/v1/messages`` (Anthropic's Messages API)."""

    # the per-request nonce (cch=...) in Claude Code's first system line is dropped, so that a session's rounds
    # share their prefix in the engines' caches (BENCHMARKS.md: the cached share with it on and off)
    normalise_billing: bool = True


@dataclass(frozen=True)
class ResponsesConfig:
    """Stored responses of ``/v1/responses`` (``store`` true, the default): what ``previous_response_id`` and
    ``GET /v1/responses/{id}`` read, per tenant, in the store (embedded: this process's memory; Redis: shared)."""

    ttl_s: float = 3600.0  # a stored response is forgotten this long after it was written
    max_stored: int = 10_000  # per tenant: beyond it the oldest goes first
    max_response_bytes: int = 4 * 1024 * 1024  # a response whose conversation is larger is not stored (logged)
    max_total_bytes: int = 256 * 1024 * 1024  # embedded store: all tenants' together (Redis: its own maxmemory)


@dataclass(frozen=True)
class AdminKey:
    name: str  # who did it, in the audit log
    hash: str


class Role(StrEnum):
    """A worker's part in a pair (a str: it compares, prints and serializes as its name)."""

    PREFILL = "prefill"
    DECODE = "decode"


ROLES = tuple(Role)


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    role: Role
    bootstrap_port: int | None = None
    engine: str = "sglang"  # its engine kind: the adapter the gateway talks to it through (pdgate.adapters)

    def __post_init__(self) -> None:
        """A role given as text is a ``Role`` from here on, however the spec was made (one that names no role stays
        as it came, for ``validate_worker`` to refuse)."""
        if type(self.role) is not Role and self.role in ROLES:
            object.__setattr__(self, "role", Role(self.role))

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
    prefill_policy: str | None = None  # default: policy
    decode_policy: str | None = None  # default: policy, or least_loaded when policy is session or cache_aware
    max_attempts: int = 3
    max_body_bytes: int = 32 * 1024 * 1024
    trace_ring: int = 2000
    prefill_grace_s: float = 1.0  # after decode finished, how long prefill may still take before it is aborted
    connect_timeout_s: float = 2.0
    abort_timeout_s: float = 2.0
    abort_repeat_s: tuple[float, ...] = (0.25, 1.0)  # re-abort a leg that had not answered yet, after these delays
    abort_defer_s: float = 5.0  # a decode whose engine lacks fix A is aborted once its KV transfer is over, or after this
    drain_s: float = 10.0  # on SIGTERM: stop accepting, let live requests finish this long, then answer and abort the rest
    keepalive_s: float = 75.0  # front door: idle keep-alive connections close after this
    head_timeout_s: float = 10.0  # front door: a request head must arrive within this (slowloris: 408, closed)
    body_timeout_s: float = 60.0  # front door: a request body must arrive within this
    upstream_idle_s: float = 4.0  # pooled engine connections idle longer are not reused (SGLang closes them at 5 s)
    upstream_max_conns: int = 0  # open connections per engine at least; 0: derived (its capacity + CONN_HEADROOM)
    upstream_max_idle: int = 256  # idle connections kept per engine
    max_upstream_body_bytes: int = 64 * 1024 * 1024  # a non-streaming leg's answer larger than this is a 502
    worker_api_key: str | None = None  # sent as Authorization: Bearer to the engines (SGLang's --api-key)
    instance_id: str | None = None
    # access control (docs/access-control.md): the admin plane is a listener of its own
    admin_host: str = "127.0.0.1"
    admin_port: int = 30002  # 0: any free port
    admin_socket: str | None = None  # a Unix socket path for the admin plane instead of admin_host:admin_port
    metrics_on_front: bool = False  # also serve /metrics on the front door (to client keys; keyless there, to anyone)
    keys: tuple[KeyConfig, ...] = ()  # client keys; none: the front door is open
    admin_keys: tuple[AdminKey, ...] = ()  # none: the admin plane is open (it must then stay on loopback)
    keys_file: str | None = None  # a TOML file with more [[keys]] and [[admin_keys]]
    admin_key_file: str | None = None  # a file holding one admin key in plain text (pdgate up writes one)
    # where each process records what it owns on the engines, so that its successor (a restart, a --workers process
    # started again) aborts what a killed one left pinned (pdgate.pool.lineage); empty: nothing recorded
    state_dir: str = ".pdgate"
    allowed_worker_hosts: tuple[str, ...] | None = None  # POST /v1/workers: hosts, IPs, CIDRs, "*"; default loopback + config hosts
    max_workers: int = 64
    access_log: bool = True  # one line per request on the pdgate.access logger, at info
    log_format: str = "text"  # the access log's lines: text (key=value) or json
    # Safety switch for demonstrations and tests: with false the gateway never calls
    # /abort_request (like today's routers) and leaves cleanup to the engines.
    abort_legs: bool = True
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    models: dict[str, Budgets] = field(default_factory=dict)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    otel: OtelConfig = field(default_factory=OtelConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    messages: MessagesConfig = field(default_factory=MessagesConfig)
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()


def policy_names(cfg: GatewayConfig) -> tuple[str, str]:
    """The prefill's and the decode's policy."""
    decode = cfg.decode_policy or (cfg.policy if cfg.policy in LOAD_POLICIES else "least_loaded")
    return cfg.prefill_policy or cfg.policy, decode


def _positive(key: str, value: Any, *, allow_zero: bool = False, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(key, value, f"must be a {'whole ' if integer else ''}number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, value, "must be > 0" if not allow_zero else "must be >= 0")


def validate(cfg: GatewayConfig) -> GatewayConfig:
    """Every check, every error at once (``ConfigErrors``)."""
    errs = Errors()
    with errs:
        if cfg.policy not in POLICIES:
            raise ConfigError("gateway.policy", cfg.policy, f"one of {', '.join(POLICIES)}")
    with errs:
        if cfg.prefill_policy is not None and cfg.prefill_policy not in POLICIES:
            raise ConfigError("gateway.prefill_policy", cfg.prefill_policy, f"one of {', '.join(POLICIES)}")
    with errs:
        if cfg.decode_policy is not None and cfg.decode_policy not in LOAD_POLICIES:
            raise ConfigError("gateway.decode_policy", cfg.decode_policy,
                              f"one of {', '.join(LOAD_POLICIES)} (a decode is chosen by load: the prefill holds the cache)")
    r = cfg.routing
    with errs:
        if not isinstance(r.session_header, str) or not re.fullmatch(r"[A-Za-z0-9-]{1,64}", r.session_header):
            raise ConfigError("routing.session_header", r.session_header, "must be a header name")
    for key in ("max_sessions", "balance_abs", "block_chars", "max_blocks", "cache_min_chars"):
        with errs:
            _positive(f"routing.{key}", getattr(r, key), integer=True, allow_zero=key == "balance_abs")
    with errs:
        _positive("routing.balance_rel", r.balance_rel)
    with errs:
        _positive("routing.cache_threshold", r.cache_threshold, allow_zero=True)
        if r.cache_threshold > 1:
            raise ConfigError("routing.cache_threshold", r.cache_threshold, "must be within 0..1")
    with errs:
        _positive("gateway.max_attempts", cfg.max_attempts, integer=True)  # a number first: "3" is named, not a traceback
        if not 1 <= cfg.max_attempts <= 9:
            raise ConfigError("gateway.max_attempts", cfg.max_attempts, "must be within 1..9")
    with errs:
        _positive("gateway.port", cfg.port, integer=True)
        if not 0 < cfg.port < 65536:
            raise ConfigError("gateway.port", cfg.port, "must be a TCP port")
    for key in ("max_body_bytes", "trace_ring", "upstream_max_conns", "upstream_max_idle", "max_upstream_body_bytes"):
        with errs:
            _positive(f"gateway.{key}", getattr(cfg, key), integer=True, allow_zero=key == "upstream_max_conns")
    for key in ("prefill_grace_s", "connect_timeout_s", "abort_timeout_s", "abort_defer_s", "keepalive_s",
                "head_timeout_s", "body_timeout_s", "upstream_idle_s"):
        with errs:
            _positive(f"gateway.{key}", getattr(cfg, key))
    with errs:
        _positive("gateway.drain_s", cfg.drain_s, allow_zero=True)
    with errs:
        if not isinstance(cfg.abort_repeat_s, tuple) or len(cfg.abort_repeat_s) > 5:
            raise ConfigError("gateway.abort_repeat_s", cfg.abort_repeat_s, "must be a list of at most 5 delays")
        for delay in cfg.abort_repeat_s:
            _positive("gateway.abort_repeat_s", delay)
    d = cfg.deadlines
    for f in dataclasses.fields(d):
        with errs:
            _positive(f"deadlines.{f.name}", getattr(d, f.name))
    for name in ("total", "ttft", "idle"):
        with errs:
            pair = (getattr(d, f"{name}_s"), getattr(d, f"max_{name}_s"))
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair):
                continue  # a value that is not a number is named above
            if getattr(d, f"{name}_s") > getattr(d, f"max_{name}_s"):
                raise ConfigError(f"deadlines.{name}_s", getattr(d, f"{name}_s"), f"exceeds deadlines.max_{name}_s")
    for model, b in cfg.models.items():
        if b.served_by is not None and (not isinstance(b.served_by, str) or not b.served_by
                                        or any(c in b.served_by for c in "*?[")):
            with errs:
                raise ConfigError(f"models.{model}.served_by", b.served_by, "must name one served model")
        for f in dataclasses.fields(b):
            v = getattr(b, f.name)
            if v is not None and f.name != "served_by":
                with errs:
                    _positive(f"models.{model}.{f.name}", v)
    for f in dataclasses.fields(cfg.health):
        with errs:
            _positive(f"health.{f.name}", getattr(cfg.health, f.name), integer=f.name == "failures")
    for f in dataclasses.fields(cfg.reconcile):
        if f.name != "enabled":
            with errs:
                _positive(f"reconcile.{f.name}", getattr(cfg.reconcile, f.name),
                          integer=f.name in ("drift_checks", "recent_rids"))
    a = cfg.admission
    for key, integer, zero in (("capacity", True, True), ("max_queue", True, False), ("window_s", False, False),
                               ("engine_backoff_s", False, True), ("learn_initial", True, False),
                               ("learn_cap", True, True), ("learn_tolerance", False, False),
                               ("learn_window_s", False, False)):
        with errs:
            _positive(f"admission.{key}", getattr(a, key), integer=integer, allow_zero=zero)
    for f in dataclasses.fields(cfg.responses):
        with errs:
            _positive(f"responses.{f.name}", getattr(cfg.responses, f.name), integer=f.name != "ttl_s")
    with errs:
        _positive("breaker.failures", cfg.breaker.failures, integer=True)
    with errs:
        _positive("breaker.cooldown_s", cfg.breaker.cooldown_s)
    for role in ROLES:
        for i, w in enumerate(getattr(cfg, role)):
            with errs:
                validate_worker(w, f"{role}[{i}]")
    _validate_access(cfg, errs)
    with errs:
        if cfg.instance_id is not None and not (isinstance(cfg.instance_id, str)
                                                and re.fullmatch(r"[0-9a-f]{1,16}", cfg.instance_id)):
            raise ConfigError("gateway.instance_id", cfg.instance_id, "must be 1-16 lower-case hex digits (it is in "
                              "every request id, which reconciliation reads back)")
    _validate_store(cfg.store, errs)
    with errs:
        if not isinstance(cfg.otel.service_name, str) or not cfg.otel.service_name:
            raise ConfigError("otel.service_name", cfg.otel.service_name, "must be a non-empty string")
    with errs:
        if not isinstance(cfg.otel.enabled, bool):
            raise ConfigError("otel.enabled", cfg.otel.enabled, "must be true or false")
    with errs:
        if not isinstance(cfg.otel.endpoint, str) or not cfg.otel.endpoint.startswith(("http://", "https://")):
            raise ConfigError("otel.endpoint", cfg.otel.endpoint, "must be an http:// or https:// URL")
    errs.raise_any()
    return cfg


def _validate_store(s: StoreConfig, errs: Errors) -> None:
    with errs:
        if not isinstance(s.url, str) or (s.url and not s.url.startswith(("redis://", "rediss://", "unix:"))):
            raise ConfigError("store.url", s.url, "must be redis://host:port/db, rediss://host:port/db or unix:/path "
                              "(empty: one process, nothing shared)")
    with errs:
        if not isinstance(s.prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{0,64}", s.prefix):
            raise ConfigError("store.prefix", s.prefix, "must be up to 64 of A-Z a-z 0-9 _ . : -")
    for key in ("timeout_s", "lease_s", "heartbeat_s"):
        with errs:
            _positive(f"store.{key}", getattr(s, key))
    with errs:
        if isinstance(s.lease_s, (int, float)) and isinstance(s.heartbeat_s, (int, float)) and s.lease_s < 2 * s.heartbeat_s:
            raise ConfigError("store.lease_s", s.lease_s, "must be at least twice store.heartbeat_s (a late heartbeat "
                              "must not make an instance gone)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _validate_access(cfg: GatewayConfig, errs: Errors) -> None:
    with errs:
        if cfg.admin_socket is None:
            _positive("gateway.admin_port", cfg.admin_port, integer=True, allow_zero=True)
            if not 0 <= cfg.admin_port < 65536:
                raise ConfigError("gateway.admin_port", cfg.admin_port, "must be a TCP port (0: any free one)")
            if cfg.admin_port == cfg.port and cfg.admin_port != 0:
                raise ConfigError("gateway.admin_port", cfg.admin_port, "must differ from gateway.port (the admin "
                                  "plane is a listener of its own)")
            if not cfg.admin_keys and not is_loopback(cfg.admin_host):
                raise ConfigError("gateway.admin_host", cfg.admin_host, "an admin plane beyond loopback needs an admin "
                                  "key (admin_keys, admin_key_file or keys_file)")
    with errs:
        _positive("gateway.max_workers", cfg.max_workers, integer=True)
    with errs:
        if cfg.log_format not in ("text", "json"):
            raise ConfigError("gateway.log_format", cfg.log_format, "one of text, json")
    names: set[tuple[str, str]] = set()
    hashes: set[str] = set()
    every: list[tuple[str, int, KeyConfig | AdminKey]] = [("keys", i, k) for i, k in enumerate(cfg.keys)]
    every += [("admin_keys", i, k) for i, k in enumerate(cfg.admin_keys)]
    for section, i, k in every:
        with errs:
            _check_key(section, i, k, names, hashes)
    for i, k in enumerate(cfg.keys):
        with errs:
            _check_limits(i, k)
    for entry in cfg.allowed_worker_hosts or ():
        with errs:
            if not isinstance(entry, str) or not entry or (entry != "*" and "/" in entry and _network(entry) is None):
                raise ConfigError("gateway.allowed_worker_hosts", entry, "a host name, an IP, a CIDR (10.0.0.0/8) or *")


def _check_key(section: str, i: int, k: KeyConfig | AdminKey, names: set[tuple[str, str]], hashes: set[str]) -> None:
    if not isinstance(k.name, str) or not KEY_NAME.match(k.name):
        raise ConfigError(f"{section}[{i}].name", k.name, "must be 1-64 of A-Z a-z 0-9 _ . - (it is a metric label)")
    if k.name in RESERVED_NAMES:
        raise ConfigError(f"{section}[{i}].name", k.name, f"is reserved ({', '.join(sorted(RESERVED_NAMES))} "
                          "name requests without a key in logs and metrics)")
    if not isinstance(k.hash, str) or not KEY_HASH.match(k.hash):
        raise ConfigError(f"{section}[{i}].hash", "<hidden>", "must be sha256:<64 hex digits> "
                          "(`pdgate keys new` makes a key and its hash)")
    if (section, k.name) in names or k.hash in hashes:
        raise ConfigError(f"{section}[{i}]", k.name, "a key name or hash appears twice (an admin key must not "
                          "also be a client key)")
    names.add((section, k.name))
    hashes.add(k.hash)


def _check_limits(i: int, k: KeyConfig) -> None:
    if k.priority not in PRIORITIES:
        raise ConfigError(f"keys[{i}].priority", k.priority, f"one of {', '.join(PRIORITIES)}")
    if not isinstance(k.models, tuple) or not all(isinstance(m, str) for m in k.models):
        raise ConfigError(f"keys[{i}].models", k.models, "must be a list of model names")
    for f in ("max_concurrent", "requests_per_min", "tokens_per_min"):
        if getattr(k, f) is not None:
            _positive(f"keys[{i}].{f}", getattr(k, f), integer=True)
    for f in ("max_total_s", "max_ttft_s", "max_idle_s"):
        if getattr(k, f) is not None:
            _positive(f"keys[{i}].{f}", getattr(k, f))
    if isinstance(k, KeyConfig):
        _positive(f"keys[{i}].weight", k.weight)


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def worker_hosts_allowed(cfg: GatewayConfig) -> tuple[str, ...]:
    """Where ``POST /v1/workers`` may point: the configured list, else loopback and the hosts of the workers
    in the config (the operator's own network, never anywhere a caller names)."""
    if cfg.allowed_worker_hosts is not None:
        return cfg.allowed_worker_hosts
    return ("127.0.0.0/8", "::1", "localhost", *sorted({w.host.strip("[]") for w in (*cfg.prefill, *cfg.decode)}))


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.strip("[]").lower()
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for entry in allowed:
        if entry == "*" or entry.lower() == host:
            return True
        net = _network(entry) if ip is not None else None  # an IP is a network of one address
        if net is not None and ip is not None and ip.version == net.version and ip in net:
            return True
    return False


ENGINE_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")


def validate_worker(w: WorkerSpec, key: str = "worker") -> WorkerSpec:
    if w.role not in ROLES:
        raise ConfigError(f"{key}.role", w.role, "must be prefill or decode")
    if not isinstance(w.engine, str) or not ENGINE_KIND.fullmatch(w.engine):
        raise ConfigError(f"{key}.engine", w.engine, "must be an engine kind's name (sglang, vllm)")
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
    if u.port == 0:
        raise ConfigError(f"{key}.url", w.url, "port 0 is not a worker's port")
    if (u.username is not None or u.password is not None or u.query or u.fragment or u.path not in ("", "/")
            or "?" in w.url or "#" in w.url or any(c.isspace() or not c.isprintable() for c in w.url)):
        raise ConfigError(f"{key}.url", w.url, "must be http://host:port only (no credentials, path or query)")
    host = u.hostname.lower()
    canonical = f"http://{'[' + host + ']' if ':' in host else host}:{u.port or 80}"
    if canonical != w.url:  # one engine, one spelling: the duplicate check compares these
        w = dataclasses.replace(w, url=canonical)
    if w.bootstrap_port is not None and not (isinstance(w.bootstrap_port, int) and 0 < w.bootstrap_port < 65536):
        raise ConfigError(f"{key}.bootstrap_port", w.bootstrap_port, "must be a TCP port")
    return w


def _build(cls: Any, data: Any, prefix: str, errs: Errors | None = None) -> Any:
    """``cls`` from a TOML table. Unknown keys are errors (with the nearest known one); with ``errs`` they are
    recorded there and the object is built from the known keys, so the rest can still be checked."""
    local = errs is None
    errs = errs or Errors()
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip("."), data, "must be a table")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    for key in data:
        if key not in names:
            with errs:
                # an entry of a key table may hold a secret where a hash belongs: never printed back
                shown = "<hidden>" if cls in (KeyConfig, AdminKey) else data[key]
                raise ConfigError(f"{prefix}{key}", shown, f"unknown key; {did_you_mean(key, names)}")
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        with errs:
            raise ConfigError(prefix.rstrip("."), "...", f"missing {', '.join(missing)}")
        errs.raise_any()  # nothing to build from: every error found so far, the nearest key names included
    if local:
        errs.raise_any()
    return cls(**{k: v for k, v in data.items() if k in names})


def from_mapping(data: dict[str, Any]) -> GatewayConfig:
    """Build a config from TOML-shaped data (see config/pdgate.toml)."""
    data = dict(data)
    errs = Errors()
    top: dict[str, Any] = {}
    with errs:
        top = dict(_table(data.pop("gateway", {}), "gateway"))
    for key in [k for k in top if k in SECTIONS]:  # `otel = ...` under [gateway] is not the [otel] section
        with errs:
            raise ConfigError(f"gateway.{key}", top.pop(key), f"belongs in its own section [{key}], not in [gateway]")
    sections: dict[str, Any] = {}
    for name, cls in (("deadlines", DeadlineConfig), ("health", HealthConfig), ("breaker", BreakerConfig),
                      ("reconcile", ReconcileConfig), ("admission", AdmissionConfig), ("routing", RoutingConfig),
                      ("otel", OtelConfig), ("store", StoreConfig), ("responses", ResponsesConfig),
                      ("messages", MessagesConfig)):
        raw = data.pop(name, {})
        sections[name] = cls()  # a section with errors is checked no further (its defaults stand in for it)
        with errs:
            sections[name] = _build(cls, raw, f"{name}.")
    models: dict[str, Budgets] = {}
    with errs:
        for m, v in _table(data.pop("models", {}), "models").items():
            with errs:
                models[m] = _build(Budgets, v, f"models.{m}.")
    sections["models"] = models
    for role in ROLES:
        items = data.pop(role, [])
        workers = []
        if not isinstance(items, list):
            with errs:
                raise ConfigError(role, "...", f"must be [[{role}]] entries (a list of tables), not one [{role}] table")
            items = []
        for i, w in enumerate(items):
            with errs:
                workers.append(_build(WorkerSpec, {**_table(w, f"{role}[{i}]"), "role": role}, f"{role}[{i}]."))
        sections[role] = tuple(workers)
    sections.update(_key_sections(data, "", errs))
    for key in list(data):
        with errs:
            raise ConfigError(key, "...", f"unknown section; {did_you_mean(key, SECTIONS)}")
    for key in ("allowed_worker_hosts",):
        if isinstance(top.get(key), list):
            top[key] = tuple(top[key])
    if "abort_repeat_s" in top:
        top["abort_repeat_s"] = tuple(top["abort_repeat_s"]) if isinstance(top["abort_repeat_s"], list) else top["abort_repeat_s"]
    cfg = GatewayConfig()
    with errs:
        cfg = _build(GatewayConfig, {**top, **sections}, "gateway.", errs)
    with errs:
        validate(cfg)
    errs.raise_any()
    return cfg


SECTIONS = ("gateway", "deadlines", "health", "breaker", "reconcile", "admission", "routing", "otel", "store", "responses",
            "messages", "models",
            "prefill", "decode", "keys", "admin_keys")


def _table(v: Any, key: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ConfigError(key, v, "must be a table")
    return v


def _key_sections(data: dict[str, Any], prefix: str, into: Errors | None = None) -> dict[str, Any]:
    """``[[keys]]`` and ``[[admin_keys]]`` tables (popped from ``data``), every error at once (``into``: recorded
    there, and the entries without errors returned, so the rest of the config is still checked with them)."""
    errs = into or Errors()
    tables: dict[str, list[dict[str, Any]]] = {}
    for name in ("keys", "admin_keys"):
        raw = data.pop(name, [])
        tables[name] = []
        if not isinstance(raw, list):
            with errs:
                raise ConfigError(f"{prefix}{name}", "<hidden>", f"must be a list of tables ([[{name}]] entries)")
            continue
        for i, k in enumerate(raw):
            if isinstance(k, dict):
                tables[name].append(dict(k))
            else:  # never printed back: it may be a key written where a table belongs
                with errs:
                    raise ConfigError(f"{prefix}{name}[{i}]", "<hidden>", "must be a table (name, hash, ...)")
    keys = []
    for i, k in enumerate(tables["keys"]):
        if isinstance(k.get("models"), list):
            k["models"] = tuple(k["models"])
        with errs:
            keys.append(_build(KeyConfig, k, f"{prefix}keys[{i}]."))
    admins = []
    for i, k in enumerate(tables["admin_keys"]):
        with errs:
            admins.append(_build(AdminKey, k, f"{prefix}admin_keys[{i}]."))
    if into is None:
        errs.raise_any()
    if len(keys) < len(tables["keys"]):  # one failed: the rest are not checked further (their indices would lie)
        keys = []
    if len(admins) < len(tables["admin_keys"]):
        admins = []
    return {"keys": tuple(keys), "admin_keys": tuple(admins)}


def with_key_files(cfg: GatewayConfig, base: Path = Path(".")) -> GatewayConfig:
    """Add the keys of ``keys_file`` and the admin key in ``admin_key_file`` (relative paths from ``base``)."""
    keys, admins = cfg.keys, cfg.admin_keys
    if cfg.keys_file:
        path = base / cfg.keys_file
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError("gateway.keys_file", str(path), f"cannot be read: {exc}") from None
        extra = _key_sections(data, f"{cfg.keys_file}: ")
        if data:
            raise ConfigError(f"{cfg.keys_file}: {next(iter(data))}", "...", "unknown section (keys, admin_keys)")
        keys, admins = keys + extra["keys"], admins + extra["admin_keys"]
    if cfg.admin_key_file:
        path = base / cfg.admin_key_file
        try:
            secret = path.read_text().strip()
        except OSError as exc:
            raise ConfigError("gateway.admin_key_file", str(path), f"cannot be read: {exc}") from None
        if not secret:
            raise ConfigError("gateway.admin_key_file", str(path), "is empty")
        admins = (*admins, AdminKey(name="admin", hash=hash_key(secret)))
    if (keys, admins) == (cfg.keys, cfg.admin_keys):
        return cfg
    return validate(dataclasses.replace(cfg, keys=keys, admin_keys=admins, keys_file=None, admin_key_file=None))


def hash_key(key: str) -> str:
    """How a key is stored: its SHA-256 (keys are random and long, so a fast hash is the right one; no salt
    is needed for secrets nobody chose)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def load(path: str | Path | None) -> GatewayConfig:
    if path is None:
        return validate(GatewayConfig())
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--config", str(path), f"cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:  # its message names the line and column
        raise ConfigError("--config", str(path), f"is not valid TOML: {exc}") from None
    try:
        cfg = from_mapping(data)
    except ConfigErrors as exc:  # every error, each line naming the file
        raise ConfigErrors(exc.errors, str(path)) from None
    except (TypeError, AttributeError) as exc:  # a shape no check foresaw
        raise ConfigError(str(path), "...", f"a section has the wrong shape: {exc}") from None
    try:
        return with_key_files(cfg, Path(path).parent)
    except ConfigErrors as exc:
        raise ConfigErrors(exc.errors, f"{path} (keys_file {cfg.keys_file})") from None


def parse_prefill_flag(url: str, port: str | None, engine: str = "sglang") -> WorkerSpec:
    try:
        bport = DEFAULT_BOOTSTRAP_PORT if port is None or port in ("", "none") else int(port)
    except ValueError:
        raise ConfigError("--prefill BOOTSTRAP_PORT", port, "must be a TCP port") from None
    return validate_worker(WorkerSpec(url=url.rstrip("/"), role=Role.PREFILL, bootstrap_port=bport, engine=engine),
                           "--prefill")


def override(cfg: GatewayConfig, **changes: Any) -> GatewayConfig:
    """Apply CLI flags (None means 'not given') on top of the loaded config."""
    given = {k: v for k, v in changes.items() if v is not None and v != ()}
    return validate(dataclasses.replace(cfg, **given))
