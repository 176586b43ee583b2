"""``python -m engine.sim --role prefill|decode --port N ...``: one simulated SGLang PD worker."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop
from aiohttp import web

from engine.sim.config import SimConfig, build_parser, config_from_args
from engine.sim.server import build_app, build_bootstrap_app
from engine.sim.worker import Engine

log = logging.getLogger("engine.sim")


async def serve(cfg: SimConfig) -> None:
    engine = Engine(cfg)
    await engine.start()
    runners = []
    apps = [(build_app(engine), cfg.port)]
    if cfg.role == "prefill":
        apps.append((build_bootstrap_app(engine), cfg.bootstrap_port))
    for app, port in apps:
        runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, cfg.host, port, reuse_address=True).start()
        runners.append(runner)
    log.info("sim %s worker ready on http://%s:%d (bootstrap %s) fixes=%s faults=%s identity=%s",
             cfg.role, cfg.host, cfg.port, cfg.bootstrap_port if cfg.role == "prefill" else "-",
             ",".join(sorted(cfg.fixes)) or "none",
             {k: v for k, v in cfg.faults.values.items() if v}, engine.identity)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()
    await engine.close()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(config_from_args(args)))


if __name__ == "__main__":
    main()
