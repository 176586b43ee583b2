"""``pdgate up``: the supervisor's workers and the gateway in one command.

This is the one place where the gateway and ``engine`` meet (DESIGN.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from typing import Any

from engine.supervisor import Supervisor, load_cluster
from pdgate import config
from pdgate.server import build_app, serve

log = logging.getLogger("pdgate.up")


class SupervisorOwner:
    """Lets the gateway restart the workers it runs (``POST /v1/workers/{id}/restart``)."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    async def restart_url(self, url: str) -> dict[str, Any]:
        name = next((c.spec.name for c in self.sup.children.values() if c.spec.url == url), None)
        if name is None:
            raise KeyError(f"no supervised worker at {url}")
        return (await self.sup.restart(name)).view()

    def view(self) -> list[dict[str, Any]]:
        return [c.view() for c in self.sup.children.values()]


def gateway_config(base: config.GatewayConfig, sup: Supervisor, host: str | None, port: int | None) -> config.GatewayConfig:
    prefill = tuple(config.WorkerSpec(url=c.spec.url, role="prefill", bootstrap_port=c.spec.bootstrap_port)
                    for c in sup.children.values() if c.spec.role == "prefill")
    decode = tuple(config.WorkerSpec(url=c.spec.url, role="decode") for c in sup.children.values() if c.spec.role == "decode")
    return config.override(dataclasses.replace(base, prefill=prefill, decode=decode), host=host, port=port)


async def run_up(cluster_path: str, config_path: str | None, host: str | None, port: int | None,
                 allow_unsafe_kernel_profile: bool = False) -> None:
    cluster = load_cluster(cluster_path, allow_unsafe_kernel_profile)
    sup = Supervisor(cluster)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    try:
        starting = asyncio.create_task(sup.start())
        await asyncio.wait({starting, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            starting.cancel()
            return
        await starting
        cfg = gateway_config(config.load(config_path), sup, host, port)
        runner = await serve(build_app(cfg, owner=SupervisorOwner(sup)), cfg.host, cfg.port)
        url = f"http://{cfg.host}:{cfg.port}"
        print(f"pdgate is up: {url}  ({len(cfg.prefill)} prefill + {len(cfg.decode)} decode workers; logs in "
              f"{cluster.log_dir}/)\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              """    -d '{"model":"sim-model","messages":[{"role":"user","content":"say hi"}],"max_tokens":8}'\n"""
              f"  pdgate ps   pdgate workers   pdgate trace <x-request-id>   pdgate top\n"
              "Ctrl-C stops the gateway and every worker.", flush=True)
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await sup.stop()
        log.info("stopped the gateway and %d workers", len(sup.children))
