"""Deadline resolution at admission: header > body ``timeout`` (total only) > model > global.

Every value is capped by the configured maximum. Invalid values are a 400, never a silent
default. The result holds absolute times on the caller's clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from pdgate.core.config import Budgets, DeadlineConfig
from pdgate.core.errors import InvalidDeadline
from pdgate.core.record import Deadlines

HEADERS = {"total": "x-pdgate-timeout", "ttft": "x-pdgate-ttft-timeout", "idle": "x-pdgate-idle-timeout"}
HEADER_NAMES = tuple(HEADERS.values())


def _parse(value: Any, source: str) -> float:
    if isinstance(value, bool):
        raise InvalidDeadline(f"{source} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidDeadline(f"{source} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidDeadline(f"{source} must be a positive number of seconds, got {value!r}")
    return seconds


@functools.lru_cache(maxsize=1024)  # one DeadlineConfig per key with caps
def _defaults(cfg: DeadlineConfig) -> tuple[float, float, float]:
    return (min(cfg.total_s, cfg.max_total_s), min(cfg.ttft_s, cfg.max_ttft_s), min(cfg.idle_s, cfg.max_idle_s))


def resolve(
    now: float,
    headers: Mapping[str, str],
    body_timeout: Any,
    model: Budgets | None,
    cfg: DeadlineConfig,
) -> Deadlines:
    if body_timeout is None and model is None and not any(h in headers for h in HEADER_NAMES):
        total, ttft, idle = _defaults(cfg)  # the common case: nothing asked, the configured budgets
        return Deadlines(total_s=total, ttft_s=ttft, idle_s=idle, total_at=now + total, ttft_at=now + ttft)
    budgets: dict[str, float] = {}
    for name, header in HEADERS.items():
        raw = headers.get(header)
        if raw is not None:
            value = _parse(raw.strip(), f"header {header}")
        elif name == "total" and body_timeout is not None:
            value = _parse(body_timeout, "body field 'timeout'")
        elif model is not None and getattr(model, f"{name}_s") is not None:
            value = float(getattr(model, f"{name}_s"))
        else:
            value = float(getattr(cfg, f"{name}_s"))
        budgets[name] = min(value, float(getattr(cfg, f"max_{name}_s")))
    return Deadlines(
        total_s=budgets["total"],
        ttft_s=budgets["ttft"],
        idle_s=budgets["idle"],
        total_at=now + budgets["total"],
        ttft_at=now + budgets["ttft"],
    )
