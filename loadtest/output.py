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


def save(fig: Any, path: Path, dpi: int = 110) -> None:
    """Save a figure; an axis with nothing drawn says "no data" rather than showing an empty -0.04..0.04 range."""
    for ax in fig.axes:
        drawn = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2 or ln.get_linestyle() == "-"]
        if not drawn and not ax.patches and not ax.collections:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
            ax.set_ylim(0, 1)
    fig.savefig(path, dpi=dpi)


def write(out: dict[str, Any], path: str | Path, plot: Callable[[dict[str, Any], Path], None]) -> None:
    """The results as JSON at ``path`` and the plot beside it; says where both went (stderr)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=2))
    png = p.with_suffix(".png")
    plot(out, png)
    print(f"wrote {p}" + (f" and {png}" if png.exists() else ""), file=sys.stderr)


def verdict_exit(out: dict[str, Any]) -> None:
    raise SystemExit(0 if out["verdict"] == "PASS" else 1)


def up_model(gateway: str | None) -> str:
    """The model to ask for when none is given: what the ``pdgate up`` run from this directory serves (its up file
    says) when the load test drives that very gateway, else the sims' own."""
    from pdgate.planes.cli import started

    up = started()
    model = up.get("model") if up and up.get("front") == gateway else None
    return model if isinstance(model, str) and model else "sim-model"


def verdict_command(p: argparse.ArgumentParser, name: str, run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
                    report: Callable[[Any, dict[str, Any]], None], plot: Callable[[dict[str, Any], Path], None]) -> None:
    """The flags and the main of a load test that ends in a verdict: run, report, write, exit 0 on PASS."""
    p.add_argument("--model", help="the model to ask for (default: the one a `pdgate up` run from this directory "
                   "serves when the test drives it, else sim-model)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=f"runs/{name}.json")

    def main(a: argparse.Namespace) -> None:
        import uvloop
        from rich.console import Console

        if a.model is None:
            a.model = up_model(getattr(a, "gateway", None))
        out = uvloop.run(run(a))
        report(Console(), out)
        write(out, a.out, plot)
        verdict_exit(out)

    p.set_defaults(func=main)
