"""Cluster entries with ``engine = "sglang"`` -> ``sglang.launch_server`` command lines (through our worker).

A worker's command is ``python -m engine.sglang.worker <SGLang server args>``; its environment
carries ``CUDA_VISIBLE_DEVICES``, the kernel profile's knobs and the worker's own ``env``.
Known-bad kernel-profile combinations are refused unless ``allow_unsafe``.

The interpreter is this one (a GPU image with SGLang installed), or, for a profile with
``own_environment`` (``cpu``), SGLang's own virtual environment that ``engine/sglang/install.sh``
makes (``PDGATE_ENGINES_HOME``, default ``~/.cache/pdgate/engines``, ``sglang/``). A profile's ``[args]`` (``all``, and per role) come before the
worker's own ``args``. Without ``model``, a worker serves the tiny model (``engine.model``, built
with SGLang's environment on first use) as ``tiny-llama``.
"""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.home import default_model, ensure_model, home

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "config" / "kernels"
KEYS = {"name", "engine", "role", "port", "bootstrap_port", "args", "env", "model", "served_model_name", "tp", "dp",
        "gpus", "transfer_backend", "mem_fraction", "kernel_profile", "host"}


class UnsafeProfile(ValueError):
    pass


@dataclass(frozen=True)
class Profile:
    name: str
    env: dict[str, str]
    forbid: tuple[dict[str, Any], ...]
    args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # "all", "prefill", "decode"
    own_environment: bool = False  # SGLang runs from engine/sglang/install.sh's environment, not this one

    def args_for(self, role: str) -> list[str]:
        return [*self.args.get("all", ()), *self.args.get(role, ())]


INSTALL = "bash engine/sglang/install.sh"


def python(profile: Profile | None = None) -> str:
    """The interpreter: SGLang's own environment for a profile that runs there (one-line error naming the install
    command when it is not there), else this one (a GPU image with SGLang installed)."""
    if profile is None or not profile.own_environment:
        return sys.executable
    exe = home() / "sglang" / "bin" / "python"
    if not exe.exists():
        raise FileNotFoundError(f"real SGLang is not installed ({exe} missing): run `{INSTALL}`")
    return str(exe)


def load_profile(name: str) -> Profile:
    path = KERNELS / f"{name}.toml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in KERNELS.glob("*.toml")))
        raise ValueError(f"kernel profile {name!r} not found in {KERNELS} (known: {known})")
    data = tomllib.loads(path.read_text())
    args = {role: tuple(str(a) for a in v) for role, v in data.get("args", {}).items()}
    if set(args) - {"all", "prefill", "decode"}:
        raise ValueError(f"kernel profile {name!r}: [args] takes all, prefill, decode (got {sorted(args)})")
    meta = data.get("profile", {})
    return Profile(str(meta.get("name", name)), {k: str(v) for k, v in data.get("env", {}).items()},
                   tuple(data.get("forbid", [])), args, bool(meta.get("own_environment", False)))


def check_profile(profile: Profile | None, role: str, env: dict[str, str], allow_unsafe: bool, who: str) -> list[str]:
    """Known-bad knobs in the final environment: refused (or, with allow_unsafe, returned as warnings)."""
    if profile is None:
        return []
    bad = [f"{who}: {f['reason']}" for f in profile.forbid
           if role in f.get("roles", ["prefill", "decode"]) and env.get(f["env"]) == str(f["value"])]
    if bad and not allow_unsafe:
        raise UnsafeProfile("; ".join(bad) + " (pass --allow-unsafe-kernel-profile to run it anyway)")
    return bad


def command(w: dict[str, Any], exe: str | None = None, build_model: bool = True) -> list[str]:
    """SGLang server arguments for one cluster entry, behind our worker entrypoint."""
    unknown = set(w) - KEYS
    if unknown:
        raise ValueError(f"worker {w.get('name')}: unknown keys {sorted(unknown)}")
    role = w["role"]
    profile = load_profile(w["kernel_profile"]) if w.get("kernel_profile") else None
    exe = exe or python(profile)
    model = Path(w["model"]) if w.get("model") else default_model()
    if build_model and not w.get("model"):
        ensure_model(model, exe)
    cmd = [exe, "-m", "engine.sglang.worker", "--model-path", str(model), "--host", str(w.get("host", "127.0.0.1")),
           "--port", str(w["port"]), "--disaggregation-mode", role,
           "--disaggregation-transfer-backend", str(w.get("transfer_backend", "nixl")),
           "--tp-size", str(w.get("tp", 1)), "--dp-size", str(w.get("dp", 1)),
           "--enable-metrics"]  # /metrics: fix C's counter (queue counts: /v1/loads)
    if role == "prefill":
        cmd += ["--disaggregation-bootstrap-port", str(w.get("bootstrap_port", 8998))]
    if "served_model_name" in w or not w.get("model"):
        cmd += ["--served-model-name", str(w.get("served_model_name", "tiny-llama"))]
    if "mem_fraction" in w:
        cmd += ["--mem-fraction-static", str(w["mem_fraction"])]
    return cmd + (profile.args_for(role) if profile else []) + [str(a) for a in w.get("args", [])]


def environment(w: dict[str, Any], allow_unsafe: bool = False) -> tuple[dict[str, str], list[str]]:
    """The worker's extra environment (profile, GPUs, its own env), and warnings for allowed unsafe knobs."""
    profile = load_profile(w["kernel_profile"]) if w.get("kernel_profile") else None
    env: dict[str, str] = dict(profile.env) if profile else {}
    if "gpus" in w:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in w["gpus"])
    env.update({str(k): str(v) for k, v in w.get("env", {}).items()})
    if profile is not None:
        env["PDGATE_KERNEL_PROFILE"] = profile.name
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # our worker
    warnings = check_profile(profile, w["role"], env, allow_unsafe, str(w.get("name")))
    if warnings:
        env["PDGATE_KERNEL_PROFILE"] = f"{profile.name if profile else 'none'}+unsafe"
    return env, warnings


def plan(cluster_path: str | Path, allow_unsafe: bool = False) -> list[dict[str, Any]]:
    data = tomllib.loads(Path(cluster_path).read_text())
    out = []
    for w in data.get("worker", []):
        if w.get("engine", "sim") != "sglang":
            continue
        env, warnings = environment(w, allow_unsafe)
        out.append({"name": w["name"], "role": w["role"], "url": f"http://{w.get('host', '127.0.0.1')}:{w['port']}",
                    "env": env, "command": command(w, build_model=False), "warnings": warnings})
    return out
