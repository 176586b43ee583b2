"""``pdgate up``: the supervisor's workers and the gateway in one command.

This is the one place where the gateway and ``engine`` meet (``docs/architecture.md``, "Parts").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from engine.supervisor import Cluster, Supervisor, load_cluster
from h1lite.server import unix_socket_live
from pdgate.core import config
from pdgate.path import auth
from pdgate.planes import multi
from pdgate.planes.server import build_app, serve

LOCAL_ADMIN_KEY, UP_FILE = config.LOCAL_ADMIN_KEY, config.UP_FILE
DEFAULT_CLUSTER = "config/cluster.sim.toml"
EXAMPLE_CLUSTER = Path(__file__).parent.parent / "examples" / "cluster.sim.toml"  # packaged: `pdgate up` works anywhere


def cluster_file(path: str) -> Path:
    """The cluster file to run: the one named, or, for the default name outside a checkout, the packaged example."""
    p = Path(path)
    if p.exists() or path != DEFAULT_CLUSTER:
        if not p.exists():
            raise config.ConfigError("--cluster", path, "no such file")
        return p
    log.info("no %s here: running the example cluster packaged with pdgate (%s)", DEFAULT_CLUSTER, EXAMPLE_CLUSTER)
    return EXAMPLE_CLUSTER


def check_ports(cfg: config.GatewayConfig, cluster: Cluster) -> None:
    """Before anything starts: every port this cluster needs is free, or one line says which is taken (a second
    `pdgate up` of the same cluster, most often) and how to choose another."""
    taken = []
    for w in cluster.workers:
        for what, port in (("port", w.port), ("bootstrap_port", w.bootstrap_port)):
            if port is not None and not multi.port_free("127.0.0.1", port):
                taken.append(f"worker {w.name} {what} {port}")
    if taken:
        raise config.ConfigError("--cluster", ", ".join(taken), "in use: is this cluster already up? Stop it, or "
                                 "move everything with --base-port N (the gateway on N, the workers from N+10)")
    if not multi.port_free(cfg.host, cfg.port):
        raise config.ConfigError("--port", cfg.port, "cannot listen there: in use (choose another with --port, or "
                                 "move everything with --base-port N)")
    if cfg.admin_socket is not None and unix_socket_live(cfg.admin_socket):
        raise config.ConfigError("--admin-socket", cfg.admin_socket, "another server listens there (choose another "
                                 "with --admin-socket)")
    if cfg.admin_socket is None and cfg.admin_port and not multi.port_free(cfg.admin_host, cfg.admin_port):
        raise config.ConfigError("--admin-port", cfg.admin_port, "cannot listen there: in use (choose another with "
                                 "--admin-port)")


def served_model(cluster: Cluster) -> str:
    """The model name a client asks for, from the cluster's first worker (shown in the ready message)."""
    w = cluster.workers[0]
    opts = w.options if isinstance(w.options, dict) else {}
    if w.engine == "vllm":
        return str(opts.get("served_model_name", "tiny-llama"))
    if w.engine == "sglang":
        return str(opts.get("served_model_name") or opts.get("model") or "tiny-llama")  # no model: the tiny one
    args = list(w.args)
    return args[args.index("--model") + 1] if "--model" in args[:-1] else "sim-model"


AGENT_MODELS = ("claude-*", "gpt-*", "codex-*")  # Claude Code's and Codex's default model names


def with_agent_aliases(cfg: config.GatewayConfig, model: str) -> config.GatewayConfig:
    """Claude Code and Codex run with their default model names: unless the config names aliases of its own, those
    names are served by the cluster's model (``[models."claude-*"] served_by``; said in the ready message)."""
    if any(b.served_by for b in cfg.models.values()):
        return cfg
    aliases = {p: config.Budgets(served_by=model) for p in AGENT_MODELS}
    return dataclasses.replace(cfg, models={**cfg.models, **aliases})


def write_up_file(directory: Path, front: str, admin: str, model: str | None = None) -> Path:
    """Where this ``pdgate up`` listens, beside the admin key it made (``pdgate.planes.cli.UP_FILE``): the operator
    commands and the load tests run from the same directory find it with no flag. Removed when it stops."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / UP_FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"front": front, "admin": admin, "pid": os.getpid(), "model": model}) + "\n")
    tmp.replace(path)
    return path


def per_instance(cluster: Cluster, port: int) -> Cluster:
    """Logs of this instance apart from any other's: ``<log_dir>/pdgate-<port>/<worker>.log``."""
    return dataclasses.replace(cluster, log_dir=cluster.log_dir / f"pdgate-{port}")

log = logging.getLogger("pdgate.up")


class Supervised:
    """The workers this process supervises, as the gateway asks for them (``control.WorkerSupervisor``: ``POST
    /v1/workers/{id}/restart``, ``GET /v1/cluster``)."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    async def restart_url(self, url: str) -> dict[str, Any]:
        name = next((c.spec.name for c in self.sup.children.values() if c.spec.url == url), None)
        if name is None:
            raise KeyError(f"no supervised worker at {url}")
        return (await self.sup.restart(name)).view()

    async def view(self) -> list[dict[str, Any]]:
        return [c.view() for c in self.sup.children.values()]


def gateway_config(base: config.GatewayConfig, sup: Supervisor, host: str | None, port: int | None,
                   admin: dict[str, Any] | None = None) -> config.GatewayConfig:
    prefill = tuple(config.WorkerSpec(url=c.spec.url, role=config.Role.PREFILL, bootstrap_port=c.spec.bootstrap_port,
                                      engine=c.spec.kind)
                    for c in sup.children.values() if c.spec.role == "prefill")
    decode = tuple(config.WorkerSpec(url=c.spec.url, role=config.Role.DECODE, engine=c.spec.kind)
                   for c in sup.children.values() if c.spec.role == "decode")
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


def serve_argv(cfg: config.GatewayConfig, config_path: str | None, key_file: Path | None, log_level: str,
               log_format: str | None) -> list[str]:
    """The ``pdgate serve`` flags of each gateway process of ``pdgate up --workers N``: the same config, the
    workers the supervisor started, the admin key made for them."""
    argv = ["serve", "--host", cfg.host, "--port", str(cfg.port), "--admin-host", cfg.admin_host,
            "--admin-port", str(cfg.admin_port), "--log-level", log_level]
    argv += ["--config", config_path] if config_path else []
    argv += ["--policy", cfg.policy, "--max-attempts", str(cfg.max_attempts)]  # as up was given them
    argv += ["--prefill-policy", cfg.prefill_policy] if cfg.prefill_policy else []
    argv += ["--decode-policy", cfg.decode_policy] if cfg.decode_policy else []
    argv += ["--admin-key-file", str(key_file)] if key_file else []
    argv += ["--log-format", log_format] if log_format else []
    for w in cfg.prefill:
        argv += ["--prefill", w.url, *([str(w.bootstrap_port)] if w.bootstrap_port is not None else [])]
    for w in cfg.decode:
        argv += ["--decode", w.url]
    for pattern, b in cfg.models.items():  # aliases up made (with_agent_aliases) reach every process
        if b.served_by:
            argv += ["--model-alias", f"{pattern}={b.served_by}"]
    return argv


async def run_up(cluster_path: str, config_path: str | None, host: str | None, port: int | None,
                 allow_unsafe_kernel_profile: bool = False, admin: dict[str, Any] | None = None,
                 admin_key_file: Path = LOCAL_ADMIN_KEY, workers: int = 1, log_level: str = "INFO",
                 base_port: int | None = None) -> None:
    cluster = load_cluster(cluster_file(cluster_path), allow_unsafe_kernel_profile, base_port)
    base = with_agent_aliases(config.load(config_path), served_model(cluster))
    planned = config.override(base, host=host, port=port, **(admin or {}))
    multi.check(planned, workers)
    check_ports(planned, cluster)
    cluster = per_instance(cluster, planned.port)
    sup = Supervisor(cluster, base.worker_api_key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    up_file: Path | None = None
    try:
        starting = asyncio.create_task(sup.start())
        await asyncio.wait({starting, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            starting.cancel()
            return
        await starting
        cfg, key_file = local_admin_key(gateway_config(base, sup, host, port, admin), admin_key_file)
        running = None
        if workers > 1:  # N gateway processes (pdgate.planes.multi); this one keeps the workers and restarts them
            group = multi.ProcessGroup(serve_argv(cfg, config_path, key_file, log_level,
                                                  (admin or {}).get("log_format")), workers, cfg.drain_s,
                                       supervised=Supervised(sup), store=cfg.store)
            running = asyncio.create_task(group.run(stop, check_ready=True))
            up = asyncio.create_task(group.up.wait())
            await asyncio.wait({running, up}, return_when=asyncio.FIRST_COMPLETED)
            if not group.up.is_set():  # run() ended: a process died before all were up
                up.cancel()
                raise config.ConfigError("--workers", workers, "the gateway processes did not start (see above)")
            admin_url = f"http://{cfg.admin_host}:{cfg.admin_port}"
        else:
            app = build_app(cfg, supervisor=Supervised(sup))
            runner = await serve(app, cfg.host, cfg.port)
            admin_url = app.admin_url
        url = f"http://{cfg.host}:{cfg.port}"
        up_file = write_up_file(admin_key_file.parent, url, admin_url, served_model(cluster))
        key_note = f"key in {key_file}, where the CLI finds it" if key_file else "admin key from your config"
        procs = f"; {workers} gateway processes" if workers > 1 else ""
        print(f"pdgate is up: {url}  ({len(cfg.prefill)} prefill + {len(cfg.decode)} decode workers{procs}; logs in "
              f"{cluster.log_dir}/)\n"
              f"  admin plane: {admin_url} ({key_note})\n"
              + (f"  dashboard: {admin_url}/dashboard\n" if admin_url.startswith("http") else "") +
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              + ("    -H 'Authorization: Bearer <a client key>' \\\n" if cfg.keys else "") +
              f"""    -d '{{"model":"{served_model(cluster)}","messages":[{{"role":"user","content":"say hi"}}],"""
              """"max_tokens":8}'\n"""
              + "".join(f"  model names {', '.join(sorted(a for a, b in cfg.models.items() if b.served_by == m))} "
                        f"are served by {m} (README \"Clients\": Claude Code, Codex)\n"
                        for m in sorted({b.served_by for b in cfg.models.values() if b.served_by})) +
              "  pdgate ps   pdgate workers   pdgate trace <x-request-id>   pdgate top\n"
              "Ctrl-C stops the gateway and every worker.", flush=True)
        if running is not None:
            await running
        else:
            await stop.wait()
    finally:
        if up_file is not None:
            up_file.unlink(missing_ok=True)
        if runner is not None:
            await runner.cleanup()
        await sup.stop()
        log.info("stopped the gateway and %d workers", len(sup.children))
