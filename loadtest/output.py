"""What every load test writes: a JSON file and, where matplotlib is installed, a PNG beside it."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def pyplot(path: Path) -> Any:
    """matplotlib.pyplot on the Agg backend, or None (saying so) without the loadtest extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed (pip install -e '.[loadtest]'): no {path}", file=sys.stderr)
        return None
    return plt


def write(out: dict[str, Any], path: str | Path, plot: Callable[[dict[str, Any], Path], None]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=2))
    plot(out, p.with_suffix(".png"))


def verdict_exit(out: dict[str, Any]) -> None:
    raise SystemExit(0 if out["verdict"] == "PASS" else 1)
