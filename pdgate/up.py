"""``pdgate up``: the supervisor's workers and the gateway in one command.

This is the one place where the gateway and ``engine`` meet (DESIGN.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from pathlib import Path
from typing import Any

from engine.supervisor import Supervisor, load_cluster
from pdgate import auth, config
from pdgate.server import build_app, serve

LOCAL_ADMIN_KEY = Path(".pdgate/admin.key")  # the CLI looks here too (pdgate.cli)

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


def gateway_config(base: config.GatewayConfig, sup: Supervisor, host: str | None, port: int | None,
                   admin: dict[str, Any] | None = None) -> config.GatewayConfig:
    prefill = tuple(config.WorkerSpec(url=c.spec.url, role="prefill", bootstrap_port=c.spec.bootstrap_port)
                    for c in sup.children.values() if c.spec.role == "prefill")
    decode = tuple(config.WorkerSpec(url=c.spec.url, role="decode") for c in sup.children.values() if c.spec.role == "decode")
    return config.override(dataclasses.replace(base, prefill=prefill, decode=decode), host=host, port=port,
                           **(admin or {}))


def local_admin_key(cfg: config.GatewayConfig, path: Path = LOCAL_ADMIN_KEY) -> tuple[config.GatewayConfig, Path | None]:
    """With no admin key configured, the admin plane gets one made here (kept in ``path``, mode 0600, reused by
    later runs): only who can read this directory can change routing."""
    if cfg.admin_keys:
        return cfg, None
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(auth.new_key() + "\n")
    return config.with_key_files(dataclasses.replace(cfg, admin_key_file=str(path))), path


async def run_up(cluster_path: str, config_path: str | None, host: str | None, port: int | None,
                 allow_unsafe_kernel_profile: bool = False, admin: dict[str, Any] | None = None,
                 admin_key_file: Path = LOCAL_ADMIN_KEY) -> None:
    base = config.load(config_path)
    cluster = load_cluster(cluster_path, allow_unsafe_kernel_profile)
    sup = Supervisor(cluster, base.worker_api_key)
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
        cfg, key_file = local_admin_key(gateway_config(base, sup, host, port, admin), admin_key_file)
        app = build_app(cfg, owner=SupervisorOwner(sup))
        runner = await serve(app, cfg.host, cfg.port)
        url = f"http://{cfg.host}:{cfg.port}"
        key_note = f"key in {key_file}, where the CLI finds it" if key_file else "admin key from your config"
        print(f"pdgate is up: {url}  ({len(cfg.prefill)} prefill + {len(cfg.decode)} decode workers; logs in "
              f"{cluster.log_dir}/)\n"
              f"  admin plane: {app.admin_url} ({key_note})\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              + ("    -H 'Authorization: Bearer <a client key>' \\\n" if cfg.keys else "") +
              """    -d '{"model":"sim-model","messages":[{"role":"user","content":"say hi"}],"max_tokens":8}'\n"""
              "  pdgate ps   pdgate workers   pdgate trace <x-request-id>   pdgate top\n"
              "Ctrl-C stops the gateway and every worker.", flush=True)
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await sup.stop()
        log.info("stopped the gateway and %d workers", len(sup.children))
