"""Dependency direction (docs/architecture.md, "Parts"): h1lite knows neither side; engine imports only pdgate's wire
constants; pdgate's own modules form layers without a circle."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def loaded_after(imports: str) -> set[str]:
    code = f"import sys; {imports}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_h1lite_imports_neither_pdgate_nor_engine() -> None:
    mods = loaded_after("import h1lite.server, h1lite.client, h1lite.errors")
    assert not {m for m in mods if m.split(".")[0] in ("pdgate", "engine")}


@pytest.mark.parametrize("module", ["engine.sim.server", "engine.sim.worker", "engine.sim.__main__", "engine.supervisor"])
def test_engine_imports_only_pdgate_protocol(module: str) -> None:
    mods = loaded_after(f"import {module}")
    assert {m for m in mods if m.split(".")[0] == "pdgate"} <= {"pdgate", "pdgate.protocol"}


# pdgate's modules from the ground up: each imports only modules before it (docs/architecture.md, "Parts"). A module
# not listed fails the test: give it its place. The request path runs context -> relay -> aborts -> admission ->
# attempt -> outcome -> proxy; the gateway assembles it; the planes (control, admin, server) sit on top.
LAYERS = """
errors protocol record rid scope queueing limits views config validation policies responses anthropic store.base auth store.embedded store.redis
store.kinds store deadlines metrics access_log otel traces
upstream lineage engines.base engines engines.sglang engines.vllm engines.kinds workers routing
context observe relay aborts admission gate legs attempt outcome proxy responses_api messages_api
health reconcile gateway multi control dashboard admin peers server up cli __main__ __init__
""".split()


def pdgate_imports() -> dict[str, set[str]]:
    """Every pdgate module -> the pdgate modules it imports (TYPE_CHECKING imports and imports inside functions
    count: an import is an arrow whatever runs it)."""
    pkg = ROOT / "pdgate"
    names = {".".join(p.relative_to(pkg).with_suffix("").parts) for p in pkg.rglob("*.py")}
    names = {n.removesuffix(".__init__") if n != "__init__" else n for n in names}
    out: dict[str, set[str]] = {}
    for p in pkg.rglob("*.py"):
        rel = ".".join(p.relative_to(pkg).with_suffix("").parts)
        mod = rel.removesuffix(".__init__") if rel != "__init__" else rel
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pdgate":
                base = node.module.removeprefix("pdgate").lstrip(".") or "__init__"
                for a in node.names:
                    full = f"{base}.{a.name}" if base != "__init__" else a.name
                    deps.add(full if full in names else base)
            elif isinstance(node, ast.Import):
                deps |= {a.name.removeprefix("pdgate.") for a in node.names if a.name.startswith("pdgate.")}
        out[mod] = deps - {mod}
    return out


def upward(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """The imports that do not run down ``layers``: every circle has at least one."""
    place = {m: i for i, m in enumerate(layers)}
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if place[d] >= place[m])


def test_pdgate_has_no_import_circle_and_every_module_imports_only_below_itself() -> None:
    graph = pdgate_imports()
    assert set(graph) == set(LAYERS), f"give these modules their place in LAYERS: {sorted(set(graph) ^ set(LAYERS))}"
    assert not upward(graph, LAYERS), f"imports that run up (or round a circle): {upward(graph, LAYERS)}"


def test_the_layer_check_finds_a_circle() -> None:
    """The check above on a circle (proxy -> attempt -> proxy): it fails there, whatever order is given."""
    graph = {"record": set(), "attempt": {"record", "proxy"}, "proxy": {"attempt"}}
    assert upward(graph, ["record", "attempt", "proxy"]) == ["attempt -> proxy"]
    assert upward(graph, ["record", "proxy", "attempt"]) == ["proxy -> attempt"]


# what only an engine adapter knows: SGLang's bootstrap room and host, vLLM's KV transfer parameters (a worker's
# bootstrap_port stays: the operator declares it with the worker, and /v1/workers shows it)
ENGINE_NAMES = re.compile(r"room|bootstrap_room|bootstrap_host|kv_transfer_params|kv_params")
REQUEST_PATH = ("context", "relay", "aborts", "admission", "gate", "legs", "attempt", "outcome", "proxy", "health",
                "reconcile", "routing", "observe", "upstream", "workers", "record", "traces", "otel")


def engine_ideas(text: str) -> list[str]:
    """The names in ``text``'s code (not its prose: a docstring's "a pair with room" is English) that are an
    engine adapter's."""
    toks = tokenize.generate_tokens(io.StringIO(text).readline)
    return [t.string for t in toks if t.type == tokenize.NAME and ENGINE_NAMES.fullmatch(t.string)]


def test_only_the_engine_adapter_names_sglang_on_the_request_path() -> None:
    """The request path, health and reconciliation reach engines through their adapter alone."""
    for name in REQUEST_PATH:
        text = (ROOT / "pdgate" / f"{name}.py").read_text()
        assert "protocol" not in pdgate_imports()[name], f"pdgate.{name} imports SGLang's wire constants"
        assert not re.search(r"bootstrap_room|abort_request|/server_info|/v1/loads|/pdgate/v1/", text), name
        assert not engine_ideas(text), (name, engine_ideas(text))


def test_the_engine_idea_check_finds_a_room() -> None:
    """The check above on the line the request path had before the adapters drew their own rooms."""
    assert engine_ideas("att = Attempt(n=n, rid=rid, room=random.getrandbits(63))\n") == ["room"]
    assert engine_ideas('"""a pair with room"""\nx = att.room\n') == ["room"]
    assert engine_ideas("ok = w.has_room(now)  # room left\n") == []
