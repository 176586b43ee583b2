"""Where the real engines' environments and the tiny model live, and the model built there on first use. Stdlib only:
the planners (imported by the gateway) read it; ``engine.model`` itself needs an engine's torch."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def home() -> Path:
    """Where the real engines' environments and the model live (``PDGATE_ENGINES_HOME``, default
    ``~/.cache/pdgate/engines``)."""
    return Path(os.environ.get("PDGATE_ENGINES_HOME") or Path.home() / ".cache" / "pdgate" / "engines")


def default_model() -> Path:
    return home() / "models" / "tiny-llama"


def ensure_model(path: Path, exe: str) -> Path:
    """The tiny model, built with an engine's interpreter ``exe`` the first time (``engine.model``; seconds)."""
    if not (path / "pdgate-model.json").exists():
        subprocess.run([exe, "-m", "engine.model", "--out", str(path)], check=True,
                       cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL)
    return path
