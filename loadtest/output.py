"""What every load test writes: a JSON file and, where matplotlib is installed, a PNG beside it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
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


def verdict_command(p: argparse.ArgumentParser, name: str, run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
                    report: Callable[[Any, dict[str, Any]], None], plot: Callable[[dict[str, Any], Path], None]) -> None:
    """The flags and the main of a load test that ends in a verdict: run, report, write, exit 0 on PASS."""
    p.add_argument("--model", default="sim-model")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=f"runs/{name}.json")

    def main(a: argparse.Namespace) -> None:
        import uvloop
        from rich.console import Console

        out = uvloop.run(run(a))
        report(Console(), out)
        write(out, a.out, plot)
        verdict_exit(out)

    p.set_defaults(func=main)
