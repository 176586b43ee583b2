"""``python -m engine.sglang.worker <sglang server args>``: SGLang with pdgate's fixes applied.

Imports sglang (the optional extra), refuses versions and targets it does not know (unless
``--pdgate-force``), applies fixes A, B, C (``PDGATE_FIXES``, default all), logs which are
active and serves them at ``GET /pdgate/v1/info``, then runs SGLang's HTTP server.

The patches are applied at import: SGLang spawns its scheduler processes, and a spawned
child re-imports this main module, so every process gets them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
import time
from typing import Any

from engine.sglang import cpu
from engine.sglang.patches import (
    KVPOLL,
    SUPPORTED_VERSIONS,
    TARGETS,
    patch_abort_concludes,
    patch_bounded_bootstrap,
    patch_inflight_watchdog,
)

log = logging.getLogger("pdgate.sglang.worker")
FORCE = "--pdgate-force"
CHECK = "--pdgate-check"  # apply, import SGLang's server, print what is on, exit: the install's check


class Incompatible(RuntimeError):
    pass


def check(fixes: list[str], force: bool) -> dict[str, Any]:
    """Resolve the patch targets in the installed SGLang; name whatever does not match."""
    problems = []
    version = importlib.metadata.version("sglang")
    if version not in SUPPORTED_VERSIONS:
        problems.append(f"sglang {version} is not a known version ({', '.join(SUPPORTED_VERSIONS)})")
    resolved: dict[str, Any] = {}
    for fix in fixes:
        module, cls, method, params = TARGETS[fix]
        try:
            target = getattr(importlib.import_module(module), cls)
            have = tuple(inspect.signature(getattr(target, method)).parameters)
        except (ImportError, AttributeError) as exc:
            problems.append(f"fix {fix}: {module}.{cls}.{method} not found ({exc})")
            continue
        if have[: len(params)] != params:
            problems.append(f"fix {fix}: {cls}.{method}{have} does not start with {params}")
            continue
        resolved[fix] = target
    kvpoll = getattr(importlib.import_module(KVPOLL[0]), KVPOLL[1])
    if kvpoll.Failed != 0:
        problems.append("KVPoll.Failed is not 0: the all-reduce (MIN) consistency argument of fix C does not hold")
    if problems and not force:
        raise Incompatible("; ".join(problems) + f" (pass {FORCE} to patch anyway)")
    for p in problems:
        log.warning("forced past: %s", p)
    return {"version": version, "targets": resolved, "failed": kvpoll.Failed}


def profile() -> str | None:
    """The kernel profile this worker was planned with (``PDGATE_KERNEL_PROFILE``; ``+unsafe`` when allowed past)."""
    return os.environ.get("PDGATE_KERNEL_PROFILE")


def apply(fixes: list[str], force: bool) -> dict[str, Any]:
    on_cpu = (profile() or "").split("+")[0] == cpu.NAME
    stood_in = cpu.install_stand_ins() if on_cpu else []  # before anything imports sglang
    found = check(fixes, force)
    if on_cpu:
        try:
            forced = cpu.apply(force)
        except cpu.Refused as exc:
            raise Incompatible(f"{exc} (pass {FORCE} to patch anyway)") from None
        for p in forced:
            log.warning("forced past: %s", p)
    failed = found["failed"]
    counter = _counter()
    for fix, target in found["targets"].items():
        if fix == "C":
            patch_inflight_watchdog(target, failed, on_force_fail=lambda req, age: counter and counter.inc())
        elif fix == "A":
            patch_abort_concludes(target, failed)
        elif fix == "B":
            patch_bounded_bootstrap(target, failed)
    info = {"pdgate_fixes": sorted(found["targets"]), "sglang_version": found["version"],
            "pdgate_identity": f"{os.getpid()}-{time.time_ns()}",  # new on every start: restarts are seen
            "kernel_profile": profile(), "pid": os.getpid(),
            **({"cpu_profile": {"stand_ins": stood_in, "host_page_indices": True}} if on_cpu else {})}
    log.warning("pdgate fixes active: %s (sglang %s, kernel profile %s)", ",".join(info["pdgate_fixes"]) or "none",
                found["version"], info["kernel_profile"])
    return info


def _counter() -> Any:
    try:
        from prometheus_client import Counter

        return Counter("sglang:num_prefill_inflight_timeout_reqs", "Requests force-failed by the inflight watchdog (fix C)")
    except (ImportError, ValueError):
        return None


def _fixes() -> list[str]:
    raw = os.environ.get("PDGATE_FIXES", "A,B,C")
    return [] if raw.lower() == "none" else [f.strip().upper() for f in raw.split(",") if f.strip()]


INFO: dict[str, Any] = {}
if __name__ in ("__main__", "__mp_main__"):  # the worker, or one of SGLang's spawned processes
    INFO = apply(_fixes(), FORCE in sys.argv or os.environ.get("PDGATE_FORCE") == "1")


def main() -> None:
    from fastapi.responses import JSONResponse
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.server_args import prepare_server_args

    if CHECK in sys.argv:
        print(json.dumps(INFO))
        return
    app.add_api_route("/pdgate/v1/info", lambda: JSONResponse(INFO), methods=["GET"])
    os.environ["PDGATE_FORCE"] = "1" if FORCE in sys.argv else os.environ.get("PDGATE_FORCE", "0")
    run_server(prepare_server_args([a for a in sys.argv[1:] if a not in (FORCE, CHECK)]))


if __name__ == "__main__":
    main()
