"""Dependency direction (DESIGN.md): h1lite knows neither side; engine imports only pdgate's wire constants."""

from __future__ import annotations

import subprocess
import sys
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
