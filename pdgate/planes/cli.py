"""``pdgate``: serve, up, the operator commands (ps, trace, workers, top, abort) and ``keys``.

The operator commands talk to the admin plane: ``--admin URL`` (or ``PDGATE_ADMIN_URL``; ``unix:/path`` for a
Unix socket; default http://127.0.0.1:30002) with ``--admin-key`` (or ``PDGATE_ADMIN_KEY``, or the file named
by ``PDGATE_ADMIN_KEY_FILE``, or ``.pdgate/admin.key`` where ``pdgate up`` writes one).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import http.client
import json
import logging
import os
import signal
import socket
import sys
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import uvloop
from rich.console import Console, Group
from rich.live import Live

from pdgate.core import config
from pdgate.path import auth
from pdgate.planes import multi, views
from pdgate.planes.server import build_app, serve

log = logging.getLogger("pdgate")
DEFAULT_ADMIN = "http://127.0.0.1:30002"
LOCAL_ADMIN_KEY, UP_FILE = config.LOCAL_ADMIN_KEY, config.UP_FILE


class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help says its default (when it has one worth saying)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS) or action.default == []:
            return action.help
        return super()._get_help_string(action)


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file (see config/pdgate.toml; flags override it)")
    p.add_argument("--host", help="the front door's address (config default 127.0.0.1)")
    p.add_argument("--port", type=int, help="the front door's port (config default 30001)")
    p.add_argument("--admin-host", help="the admin plane's address (config default 127.0.0.1)")
    p.add_argument("--admin-port", type=int, help="the admin plane's port (config default 30002; 0: any free one)")
    p.add_argument("--admin-socket", help="serve the admin plane on this Unix socket instead")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--log-format", choices=("text", "json"), help="the access log's lines (config default text)")


def _workers_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=multi.default_workers(), metavar="N",
                   help="gateway processes sharing the port (SO_REUSEPORT), under a supervisor that restarts "
                   "one that dies; one process relays on one core. They share limits, sessions and the worker "
                   "set through the store: [store] url, or a redis-server the supervisor runs")


def started(directory: Path | None = None) -> dict[str, Any] | None:
    """What a running ``pdgate up`` wrote of itself (``UP_FILE``: its front door, admin plane and pid) in
    ``directory`` (default: beside the admin key it made, ``.pdgate/``, or ``PDGATE_ADMIN_KEY_FILE``'s); None when
    there is none or its process is gone."""
    if directory is None:
        key_file = os.environ.get("PDGATE_ADMIN_KEY_FILE")
        directory = Path(key_file).parent if key_file else LOCAL_ADMIN_KEY.parent
    try:
        got = json.loads((directory / UP_FILE).read_text())
        os.kill(int(got["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return got if isinstance(got.get("admin"), str) and isinstance(got.get("front"), str) else None


def admin_default() -> tuple[str, str]:
    """The admin plane the operator commands talk to without ``--admin``, and where that came from."""
    if os.environ.get("PDGATE_ADMIN_URL"):
        return os.environ["PDGATE_ADMIN_URL"], "PDGATE_ADMIN_URL"
    up = started()
    if up is not None:
        return up["admin"], f"written by pdgate up (pid {up['pid']}) in {LOCAL_ADMIN_KEY.parent / UP_FILE}"
    return DEFAULT_ADMIN, "the default"


def _routing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=config.POLICIES, help="worker choice for both roles (default least_loaded; "
                   "session and cache_aware choose the prefill, the decode then goes by least_loaded)")
    p.add_argument("--prefill-policy", choices=config.POLICIES, help="the prefill's choice (default: --policy)")
    p.add_argument("--decode-policy", choices=config.LOAD_POLICIES, help="the decode's choice (default: --policy)")
    p.add_argument("--max-attempts", type=int, help="attempts per request, 1..9 (config default 3)")


def routing_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {"policy": args.policy, "prefill_policy": args.prefill_policy, "decode_policy": args.decode_policy,
            "max_attempts": args.max_attempts}


def _admin_flags(p: argparse.ArgumentParser) -> None:
    url, source = admin_default()
    p.add_argument("--admin", dest="admin", default=url,
                   help="the admin plane: http://host:port or unix:/path (env PDGATE_ADMIN_URL; else where a "
                   f"`pdgate up` run from this directory listens; now: {url}, {source})")
    p.set_defaults(admin_source=source)
    p.add_argument("--admin-key", help="the admin key (env PDGATE_ADMIN_KEY, PDGATE_ADMIN_KEY_FILE, or "
                   f"{LOCAL_ADMIN_KEY} as `pdgate up` writes it)")
    p.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdgate", description="PD-disaggregation gateway for SGLang and vLLM: "
                                     "OpenAI and Anthropic APIs in front, prefill and decode pools behind",
                                     formatter_class=HELP)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", help="run the gateway in front of existing workers", formatter_class=HELP)
    _add_gateway_flags(p)
    p.add_argument("--store", metavar="URL", help="the store gateway processes share (redis://, rediss:// or "
                   "unix:/path; config [store] url, env PDGATE_STORE_URL); none: this process alone")
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill worker and its bootstrap port (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)")
    _routing_flags(p)
    p.add_argument("--model-alias", action="append", default=[], metavar="PATTERN=MODEL",
                   help='client model names served by a served model, e.g. "claude-*=my-model" (repeatable; config '
                   '[models."claude-*"] served_by)')
    _workers_flag(p)
    p.add_argument("--admin-key-file", help="a file holding the admin key (in plain text), beside the config's keys")
    p = sub.add_parser("up", help="start the workers of a cluster file and the gateway in front of them",
                       formatter_class=HELP)
    _add_gateway_flags(p)
    _routing_flags(p)
    p.add_argument("--base-port", type=int, metavar="N",
                   help="move everything at once: the gateway on N, its admin plane on N+1, the cluster's workers "
                   "from N+10 (each: port, then bootstrap port)")
    p.add_argument("--cluster", default="config/cluster.sim.toml",
                   help="the cluster file (outside a checkout, the default is the example packaged with pdgate); "
                   "worker logs go to <its log_dir>/pdgate-<port>/")
    p.add_argument("--admin-key-file", default=str(LOCAL_ADMIN_KEY),
                   help="without an admin key in the config, the one made for the admin plane is kept here")
    _workers_flag(p)
    p.add_argument("--allow-unsafe-kernel-profile", action="store_true",
                   help="run engine=sglang workers even with a known-bad kernel knob (see config/kernels)")
    for name, helptext in (("ps", "live requests"), ("workers", "workers: health, breaker, load, engine queues"),
                           ("top", "live refresh of ps and workers"), ("trace", "one request's timeline"),
                           ("abort", "abort one live request")):
        p = sub.add_parser(name, help=helptext, formatter_class=HELP)
        _admin_flags(p)
        if name == "abort":
            p.add_argument("id", help="the request's id (x-request-id), an attempt's rid, or the client's x-request-id")
        if name == "trace":
            p.add_argument("id", nargs="?", help="the request's id (x-request-id), its response's id (resp_...), an "
                           "attempt's rid, or the client's x-request-id")
            p.add_argument("--session", metavar="KEY", help="instead: a session's rounds (its x-session-id or user, "
                           "as tenant/name where client keys are in use; a Responses chain: its first resp_ id)")
        if name in ("ps", "workers", "top"):
            p.add_argument("--wide", action="store_true", help="more columns (the default view fits 80 columns)")
        if name == "ps":
            p.add_argument("--phase", help="only requests in this phase (queued, dispatched, prefill, decode, ...)")
            p.add_argument("--worker", help="only requests on this worker id")
            p.add_argument("--min-age", type=float, help="only requests at least this many seconds old")
        if name == "top":
            p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
            p.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: until Ctrl-C)")
    p = sub.add_parser("keys", help="make a client or admin key (the key is printed once; the file keeps its hash)",
                       formatter_class=HELP)
    ks = p.add_subparsers(dest="keys_cmd", required=True)
    k = ks.add_parser("new", help="make a key and add its [[keys]] (or [[admin_keys]]) entry to a keys file",
                      formatter_class=HELP)
    k.add_argument("--json", action="store_true", help="print the key and its entry as one JSON object")
    k.add_argument("name", help="the tenant's (or operator's) name: metrics, logs and traces show it")
    k.add_argument("--file", default="keys.toml", help="the keys file (gateway.keys_file) to append to")
    k.add_argument("--admin", action="store_true", help="an admin key instead of a client key")
    k.add_argument("--models", help="comma list of the models this key may use (default: all)")
    for flag in ("max-concurrent", "requests-per-min", "tokens-per-min"):
        k.add_argument(f"--{flag}", type=int)
    for flag in ("max-total-s", "max-ttft-s", "max-idle-s"):
        k.add_argument(f"--{flag}", type=float)
    k.add_argument("--priority", choices=config.PRIORITIES, help="its queue class (config default normal)")
    h = ks.add_parser("hash", help="print the stored form (sha256:...) of a key read from stdin", formatter_class=HELP)
    h.add_argument("--json", action="store_true", help="print {\"hash\": ...}")
    return parser


def build_config(args: argparse.Namespace) -> config.GatewayConfig:
    cfg = config.load(args.config)
    prefill = []
    for item in args.prefill:
        if len(item) > 2:
            raise config.ConfigError("--prefill", item, "takes URL and an optional BOOTSTRAP_PORT")
        prefill.append(config.parse_prefill_flag(item[0], item[1] if len(item) > 1 else None))
    decode = [config.validate_worker(config.WorkerSpec(url=u.rstrip("/"), role=config.Role.DECODE), "--decode") for u in args.decode]
    if args.admin_key_file:
        cfg = config.with_key_files(dataclasses.replace(cfg, admin_key_file=args.admin_key_file))
    aliases = {}
    for item in getattr(args, "model_alias", []):
        pattern, sep, model = item.partition("=")
        if not sep or not pattern or not model:
            raise config.ConfigError("--model-alias", item, "must be PATTERN=MODEL")
        aliases[pattern] = dataclasses.replace(cfg.models.get(pattern, config.Budgets()), served_by=model)
    if aliases:
        cfg = config.validate(dataclasses.replace(cfg, models={**cfg.models, **aliases}))
    store = getattr(args, "store", None) or os.environ.get(multi.ENV_STORE)
    if store:
        cfg = config.validate(dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, url=store)))
    return config.override(cfg, host=args.host, port=args.port, prefill=tuple(prefill) or None,
                           decode=tuple(decode) or None, **routing_flags(args), **admin_flags(args))


def admin_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {"admin_host": args.admin_host, "admin_port": args.admin_port, "admin_socket": args.admin_socket,
            "log_format": args.log_format}


async def run_serve(cfg: config.GatewayConfig) -> None:
    runner = await serve(build_app(cfg), cfg.host, cfg.port)
    log.info("pdgate listening on http://%s:%d (%d prefill, %d decode workers%s)", cfg.host, cfg.port,
             len(cfg.prefill), len(cfg.decode), f"; process {runner.group.index}" if runner.group else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = loop.create_task(multi.orphaned(runner.group, stop)) if runner.group is not None else None
    gc.freeze()  # what start-up made lives as long as the process: the collector stops walking it
    # and runs less often: a full pass walks every live stream's objects (a pause of tens of ms at thousands of
    # streams, in the middle of their tokens); the request path's garbage is mostly freed by refcounts
    gc.set_threshold(*GC_THRESHOLDS)
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await runner.cleanup()


GC_THRESHOLDS = (10_000, 20, 50)  # CPython's default: (700, 10, 10)


def serve_group(args: argparse.Namespace, argv: list[str]) -> None:
    """``pdgate serve --workers N`` (N > 1): the supervisor of N gateway processes (``pdgate.planes.multi``)."""
    cfg = build_config(args)  # a bad config is refused once, here, not N times
    multi.check(cfg, args.workers, ports=True)
    log.info("pdgate: %d gateway processes on http://%s:%d", args.workers, cfg.host, cfg.port)
    if multi.run(argv, args.workers, cfg):
        raise SystemExit(1)


class UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the admin plane's ``admin_socket``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


class AdminClient:
    """The admin plane, as the CLI reaches it."""

    def __init__(self, url: str, key: str | None, source: str = "--admin") -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.source = source  # where the URL came from (said when it cannot be reached)

    def _connection(self) -> http.client.HTTPConnection:
        if self.url.startswith("unix:"):
            return UnixConnection(self.url[5:], 10)
        u = urlsplit(self.url)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(f"pdgate: the admin URL must be http://host:port or unix:/path, not {self.url!r}")
        return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=10)

    def call(self, path: str, method: str = "GET") -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        conn = self._connection()
        try:
            conn.request(method, path, body=b"" if method == "POST" else None, headers=headers)
            r = conn.getresponse()
            raw = r.read()
        except OSError as exc:
            raise SystemExit(f"pdgate: cannot reach the admin plane at {self.url} ({self.source}): {exc}. Name "
                             "it with --admin URL or PDGATE_ADMIN_URL (a `pdgate up` run from this directory is "
                             "found by itself)") from None
        finally:
            conn.close()
        try:
            return r.status, json.loads(raw or b"null")
        except ValueError:
            return r.status, raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        status, body = self.call(path)
        if status != 200:
            msg = (body or {}).get("error", {}).get("message", body) if isinstance(body, dict) else body
            hint = " (give the admin key: --admin-key or PDGATE_ADMIN_KEY)" if status in (401, 403) else ""
            raise SystemExit(f"pdgate: {path}: {status} {msg}{hint}")
        return body


def admin_key(flag: str | None) -> str | None:
    if flag:
        return flag
    if os.environ.get("PDGATE_ADMIN_KEY"):
        return os.environ["PDGATE_ADMIN_KEY"]
    path = Path(os.environ["PDGATE_ADMIN_KEY_FILE"]) if os.environ.get("PDGATE_ADMIN_KEY_FILE") else LOCAL_ADMIN_KEY
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def operator_command(args: argparse.Namespace) -> None:
    console = Console()
    gw = AdminClient(args.admin, admin_key(args.admin_key),
                     args.admin_source if args.admin == admin_default()[0] else "--admin")
    if args.cmd == "ps":
        q = "&".join(f"{k}={v}" for k, v in (("phase", args.phase), ("worker", args.worker), ("min_age_s", args.min_age))
                     if v is not None)
        data = gw.get("/v1/requests" + (f"?{q}" if q else ""))
        print(json.dumps(data)) if args.json else console.print(views.ps_table(data, args.wide, console.width))
    elif args.cmd == "workers":
        data = gw.get("/v1/workers")
        print(json.dumps(data)) if args.json else console.print(views.workers_table(data, args.wide, console.width))
    elif args.cmd == "trace" and args.session is not None:
        data = gw.get("/v1/sessions/" + quote(args.session, safe=""))
        print(json.dumps(data)) if args.json else console.print(views.session_table(data, console.width))
    elif args.cmd == "trace":
        if not args.id:
            raise SystemExit("pdgate trace: give a request's id, or --session KEY")
        data = gw.get(f"/v1/requests/{args.id}")
        print(json.dumps(data)) if args.json else console.print(views.trace_view(data))
    elif args.cmd == "abort":
        status, body = gw.call(f"/v1/requests/{args.id}/abort", "POST")
        print(json.dumps(body)) if args.json else console.print_json(data=body)
        if status != 200:
            raise SystemExit(1)
    elif args.cmd == "top":
        def frame() -> Group:
            return Group(views.ps_table(gw.get("/v1/requests"), args.wide, console.width),
                         views.workers_table(gw.get("/v1/workers"), args.wide, console.width))

        n = 0
        if args.json:  # one JSON object per refresh, one per line (for a pipe)
            try:
                while True:
                    print(json.dumps({"requests": gw.get("/v1/requests"), "workers": gw.get("/v1/workers")}),
                          flush=True)
                    n += 1
                    if args.iterations and n >= args.iterations:
                        return
                    time.sleep(args.interval)
            except KeyboardInterrupt:
                return
        with Live(frame(), console=console, refresh_per_second=4) as live:
            try:
                while args.iterations == 0 or n < args.iterations:
                    time.sleep(args.interval)
                    live.update(frame())
                    n += 1
            except KeyboardInterrupt:
                pass


def keys_command(args: argparse.Namespace) -> None:
    if args.keys_cmd == "hash":
        digest = config.hash_key(sys.stdin.readline().strip())
        print(json.dumps({"hash": digest}) if args.json else digest)
        return
    key = auth.new_key()
    entry: dict[str, Any] = {"name": args.name, "hash": config.hash_key(key)}
    if not args.admin:
        if args.models:
            entry["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
        for name in ("max_concurrent", "requests_per_min", "tokens_per_min", "max_total_s", "max_ttft_s", "max_idle_s",
                     "priority"):
            if getattr(args, name) is not None:
                entry[name] = getattr(args, name)
    table = "admin_keys" if args.admin else "keys"
    path = Path(args.file)
    # the file with the new entry, checked as the gateway will read it, before anything is written
    try:
        with open(path, "rb") as existing:
            probe = tomllib.load(existing)
    except FileNotFoundError:
        probe = {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise config.ConfigError("--file", str(path), f"cannot be read: {exc}") from None
    probe[table] = [*probe.get(table, []), entry]
    config.from_mapping(probe)
    lines = [f"\n[[{table}]]"] + [f"{k} = {json.dumps(v)}" for k, v in entry.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(json.dumps({"key": key, "table": table, "entry": entry, "file": str(path)}) if args.json else key)
    print(f"pdgate: {'admin' if args.admin else 'client'} key '{args.name}' added to {path} (only its hash is kept "
          "there; this is the one time the key is shown)", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "keys":
        try:
            keys_command(args)
        except config.ConfigError as exc:
            parser.exit(2, f"pdgate: {exc}\n")
        return
    if args.cmd not in ("serve", "up"):
        operator_command(args)
        return
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "serve" and args.workers > 1 and multi.Group.from_env() is None:
            serve_group(args, sys.argv[1:] if argv is None else argv)
        elif args.cmd == "serve":
            cfg = build_config(args)
            multi.check(cfg, args.workers)
            uvloop.run(run_serve(cfg))
        else:
            from pdgate.planes.up import run_up  # the one place the gateway meets engine/

            port, flags = args.port, {**admin_flags(args), **routing_flags(args)}
            if args.base_port is not None:
                if not 1 <= args.base_port <= 65535 - 100:
                    raise config.ConfigError("--base-port", args.base_port, "must leave room for 100 ports below 65536")
                port = port or args.base_port
                if flags["admin_port"] is None and flags["admin_socket"] is None:
                    flags["admin_port"] = args.base_port + 1
            uvloop.run(run_up(args.cluster, args.config, args.host, port, args.allow_unsafe_kernel_profile,
                              flags, Path(args.admin_key_file), args.workers, args.log_level, args.base_port))
    except (config.ConfigError, ValueError) as exc:
        parser.exit(2, f"pdgate: {exc}\n")


if __name__ == "__main__":
    main()
