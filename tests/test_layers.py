"""Dependency direction (docs/architecture.md, "Parts"): h1lite knows neither side; engine imports only pdgate's wire
constants; pdgate's own modules form layers without a circle."""

from __future__ import annotations

import ast
import graphlib
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
    assert {m for m in mods if m.split(".")[0] == "pdgate"} <= {"pdgate", "pdgate.core", "pdgate.core.protocol"}


# pdgate's layers are its folders, from the ground up (docs/architecture.md, "Parts"): a module imports only from its
# own folder (without a circle there) or from a folder below its own. A folder not listed fails the test: give it its
# place. The two modules at the top (``__init__``, ``__main__``) may import anything.
FOLDERS = ["core", "apis", "store", "observe", "adapters", "pool", "path", "planes"]
TOP = {"__init__", "__main__"}


def folder_of(module: str) -> str:
    return module if module in TOP else module.split(".")[0]


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


def upward(graph: dict[str, set[str]], folders: list[str]) -> list[str]:
    """The imports that run up a folder, or round a circle inside one."""
    place = {f: i for i, f in enumerate(folders)} | {m: len(folders) for m in TOP}
    up = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if place[folder_of(d)] > place[folder_of(m)]]
    same = {m: {d for d in deps if folder_of(d) == folder_of(m) and m not in TOP} for m, deps in graph.items()}
    try:
        tuple(graphlib.TopologicalSorter(same).static_order())
    except graphlib.CycleError as e:
        up.append("circle: " + " -> ".join(e.args[1]))
    return sorted(up)


def test_the_folders_are_the_layers() -> None:
    """Every module lives in a layer's folder (the top's two apart), and every folder is a layer."""
    graph = pdgate_imports()
    folders = {p.name for p in (ROOT / "pdgate").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FOLDERS), f"give these folders their place in FOLDERS: {sorted(folders ^ set(FOLDERS))}"
    assert {m for m in graph if "." not in m} <= TOP | folders, sorted(m for m in graph if "." not in m)


def test_pdgate_has_no_import_circle_and_every_module_imports_only_from_its_folder_or_below() -> None:
    graph = pdgate_imports()
    assert not upward(graph, FOLDERS), f"imports that run up (or round a circle): {upward(graph, FOLDERS)}"


def test_the_layer_check_finds_a_circle_and_an_upward_import() -> None:
    """The check above on a circle inside a folder and on an import that runs up a folder: it fails on both."""
    graph = {"core.record": set(), "path.attempt": {"core.record", "path.proxy"}, "path.proxy": {"path.attempt"}}
    assert upward(graph, ["core", "path"])[0].startswith("circle: ")
    assert upward({"core.record": {"path.gate"}, "path.gate": set()}, ["core", "path"]) == ["core.record -> path.gate"]
    assert upward({"core.record": set(), "path.gate": {"core.record"}}, ["core", "path"]) == []


# what only an engine adapter knows: SGLang's bootstrap room and host, vLLM's KV transfer parameters (a worker's
# bootstrap_port stays: the operator declares it with the worker, and /v1/workers shows it)
ENGINE_NAMES = re.compile(r"room|bootstrap_room|bootstrap_host|kv_transfer_params|kv_params")
REQUEST_PATH = ("core", "path", "pool", "observe")  # every module in these folders


def engine_ideas(text: str) -> list[str]:
    """The names in ``text``'s code (not its prose: a docstring's "a pair with room" is English) that are an
    engine adapter's."""
    toks = tokenize.generate_tokens(io.StringIO(text).readline)
    return [t.string for t in toks if t.type == tokenize.NAME and ENGINE_NAMES.fullmatch(t.string)]


def test_only_the_engine_adapter_names_sglang_on_the_request_path() -> None:
    """The request path, health and reconciliation reach engines through their adapter alone."""
    graph = pdgate_imports()
    # the wire constants themselves, and the configuration that takes a worker's default bootstrap port from them
    names = [m for m in graph if folder_of(m) in REQUEST_PATH and m not in ("core.protocol", "core.config") and "." in m]
    names.append("adapters.upstream")  # the transport: it carries what the adapters say, and knows none of it
    assert len(names) > 30, names
    for name in names:
        text = (ROOT / "pdgate" / f"{name.replace('.', '/')}.py").read_text()
        assert "core.protocol" not in graph[name], f"pdgate.{name} imports SGLang's wire constants"
        assert not re.search(r"bootstrap_room|abort_request|/server_info|/v1/loads|/pdgate/v1/", text), name
        assert not engine_ideas(text), (name, engine_ideas(text))


def test_the_engine_idea_check_finds_a_room() -> None:
    """The check above on the line the request path had before the adapters drew their own rooms."""
    assert engine_ideas("att = Attempt(n=n, rid=rid, room=random.getrandbits(63))\n") == ["room"]
    assert engine_ideas('"""a pair with room"""\nx = att.room\n') == ["room"]
    assert engine_ideas("ok = w.has_room(now)  # room left\n") == []
