"""``python -m engine.sim --role prefill|decode --port N ...``: one simulated SGLang PD worker."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop

from engine.sim.config import SimConfig, build_parser, config_from_args
from engine.sim.server import build_bootstrap_server, build_server
from engine.sim.worker import Engine

log = logging.getLogger("engine.sim")


async def until_stopped() -> None:
    """Until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_vllm(cfg: SimConfig) -> None:
    from engine.sim.vllm import VllmSim
    from engine.sim.vllm import build_server as build_vllm

    sim = VllmSim(cfg)
    await sim.start()
    server = build_vllm(sim)
    await server.start(cfg.host, cfg.port)
    log.info("sim %s worker (vllm protocol) ready on http://%s:%d faults=%s identity=%s", cfg.role, cfg.host, cfg.port,
             {k: v for k, v in cfg.faults.values.items() if v}, sim.identity)
    await until_stopped()
    await server.close()
    await sim.close()


async def serve(cfg: SimConfig) -> None:
    if cfg.protocol == "vllm":
        await serve_vllm(cfg)
        return
    engine = Engine(cfg)
    await engine.start()
    servers = [(build_server(engine), cfg.port)]
    if cfg.role == "prefill":
        servers.append((build_bootstrap_server(engine), cfg.bootstrap_port))
    for server, port in servers:  # h1lite cancels a handler whose client leaves, as aiohttp's handler_cancellation
        await server.start(cfg.host, port)
    log.info("sim %s worker ready on http://%s:%d (bootstrap %s) fixes=%s faults=%s identity=%s",
             cfg.role, cfg.host, cfg.port, cfg.bootstrap_port if cfg.role == "prefill" else "-",
             ",".join(sorted(cfg.fixes)) or "none",
             {k: v for k, v in cfg.faults.values.items() if v}, engine.identity)
    await until_stopped()
    for server, _ in servers:
        await server.close()
    await engine.close()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(config_from_args(args)))


if __name__ == "__main__":
    main()
