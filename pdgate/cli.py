"""``pdgate``: serve, up, and the operator commands (ps, trace, workers, top, abort)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import uvloop
from rich.console import Console, Group
from rich.live import Live

from pdgate import config, views
from pdgate.server import build_app, serve

log = logging.getLogger("pdgate")
DEFAULT_GATEWAY = "http://127.0.0.1:30001"


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file (see config/pdgate.toml)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--log-level", default="INFO")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdgate", description="PD-disaggregation gateway for SGLang")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", help="run the gateway in front of existing workers")
    _add_gateway_flags(p)
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill worker and its bootstrap port (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)")
    p.add_argument("--policy", choices=config.POLICIES)
    p.add_argument("--max-attempts", type=int)
    p = sub.add_parser("up", help="start the workers of a cluster file and the gateway in front of them")
    _add_gateway_flags(p)
    p.add_argument("--cluster", default="config/cluster.sim.toml")
    p.add_argument("--allow-unsafe-kernel-profile", action="store_true",
                   help="run engine=sglang workers even with a known-bad kernel knob (see config/kernels)")
    for name, helptext in (("ps", "live requests"), ("workers", "workers: health, breaker, load, engine queues"),
                           ("top", "live refresh of ps and workers"), ("trace", "one request's timeline"),
                           ("abort", "abort one live request")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--gateway", default=DEFAULT_GATEWAY)
        p.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
        if name in ("trace", "abort"):
            p.add_argument("id")
        if name == "ps":
            p.add_argument("--phase")
            p.add_argument("--worker")
            p.add_argument("--min-age", type=float)
        if name == "top":
            p.add_argument("--interval", type=float, default=1.0)
            p.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: until Ctrl-C)")
    return parser


def build_config(args: argparse.Namespace) -> config.GatewayConfig:
    cfg = config.load(args.config)
    prefill = []
    for item in args.prefill:
        if len(item) > 2:
            raise config.ConfigError("--prefill", item, "takes URL and an optional BOOTSTRAP_PORT")
        prefill.append(config.parse_prefill_flag(item[0], item[1] if len(item) > 1 else None))
    decode = [config.validate_worker(config.WorkerSpec(url=u.rstrip("/"), role="decode"), "--decode") for u in args.decode]
    return config.override(cfg, host=args.host, port=args.port, policy=args.policy, max_attempts=args.max_attempts,
                           prefill=tuple(prefill) or None, decode=tuple(decode) or None)


async def run_serve(cfg: config.GatewayConfig) -> None:
    runner = await serve(build_app(cfg), cfg.host, cfg.port)
    log.info("pdgate listening on http://%s:%d (%d prefill, %d decode workers)", cfg.host, cfg.port,
             len(cfg.prefill), len(cfg.decode))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def call(gateway: str, path: str, method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(gateway.rstrip("/") + path, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except OSError as exc:
        raise SystemExit(f"pdgate: cannot reach the gateway at {gateway}: {exc}") from None


def _get(gateway: str, path: str) -> Any:
    status, body = call(gateway, path)
    if status != 200:
        msg = (body or {}).get("error", {}).get("message", body) if isinstance(body, dict) else body
        raise SystemExit(f"pdgate: {path}: {status} {msg}")
    return body


def operator_command(args: argparse.Namespace) -> None:
    console = Console()
    gw = args.gateway
    if args.cmd == "ps":
        q = "&".join(f"{k}={v}" for k, v in (("phase", args.phase), ("worker", args.worker), ("min_age_s", args.min_age))
                     if v is not None)
        data = _get(gw, "/v1/requests" + (f"?{q}" if q else ""))
        console.print_json(data=data) if args.json else console.print(views.ps_table(data))
    elif args.cmd == "workers":
        data = _get(gw, "/v1/workers")
        console.print_json(data=data) if args.json else console.print(views.workers_table(data))
    elif args.cmd == "trace":
        data = _get(gw, f"/v1/requests/{args.id}")
        console.print_json(data=data) if args.json else console.print(views.trace_view(data))
    elif args.cmd == "abort":
        status, body = call(gw, f"/v1/requests/{args.id}/abort", "POST")
        console.print_json(data=body)
        if status != 200:
            raise SystemExit(1)
    elif args.cmd == "top":
        def frame() -> Group:
            return Group(views.ps_table(_get(gw, "/v1/requests")), views.workers_table(_get(gw, "/v1/workers")))

        n = 0
        with Live(frame(), console=console, refresh_per_second=4) as live:
            try:
                while args.iterations == 0 or n < args.iterations:
                    time.sleep(args.interval)
                    live.update(frame())
                    n += 1
            except KeyboardInterrupt:
                pass


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd not in ("serve", "up"):
        operator_command(args)
        return
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "serve":
            uvloop.run(run_serve(build_config(args)))
        else:
            from pdgate.up import run_up  # the one place the gateway meets engine/

            uvloop.run(run_up(args.cluster, args.config, args.host, args.port, args.allow_unsafe_kernel_profile))
    except (config.ConfigError, ValueError) as exc:
        parser.exit(2, f"pdgate: {exc}\n")


if __name__ == "__main__":
    main()
