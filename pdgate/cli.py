"""``pdgate``: serve the gateway (more subcommands: up, ps, trace, workers, top, abort — see issue 4)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import uvloop

from pdgate import config
from pdgate.server import build_app, serve

log = logging.getLogger("pdgate")


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway in front of existing workers")
    p.add_argument("--config", help="TOML file (see config/pdgate.toml)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill worker and its bootstrap port (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)")
    p.add_argument("--policy", choices=config.POLICIES)
    p.add_argument("--max-attempts", type=int)
    p.add_argument("--log-level", default="INFO")


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
    app = build_app(cfg)
    runner = await serve(app, cfg.host, cfg.port)
    log.info("pdgate listening on http://%s:%d (%d prefill, %d decode workers)", cfg.host, cfg.port,
             len(cfg.prefill), len(cfg.decode))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdgate", description="PD-disaggregation gateway for SGLang")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = build_config(args)
    except config.ConfigError as exc:
        parser.exit(2, f"pdgate: {exc}\n")
    if args.cmd == "serve":
        uvloop.run(run_serve(cfg))


if __name__ == "__main__":
    main()
