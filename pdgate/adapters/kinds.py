"""The engine kinds this gateway knows, and one adapter per kind (made on first use). A new engine kind: its
adapter class in ``KINDS``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdgate.adapters.base import Engine
from pdgate.adapters.sglang import SGLang
from pdgate.adapters.vllm import VLLM

if TYPE_CHECKING:
    from pdgate.adapters.upstream import Upstream

Factory = Callable[["Upstream"], Engine]
KINDS: dict[str, Factory] = {SGLang.kind: SGLang, VLLM.kind: VLLM}  # a new engine kind: its adapter class here


class Engines:
    """One adapter per kind, made on first use, sharing the gateway's transport to the engines."""

    def __init__(self, upstream: Upstream, extra: dict[str, Factory] | None = None) -> None:
        self.upstream = upstream
        self.kinds = {**KINDS, **(extra or {})}
        self.made: dict[str, Engine] = {}

    def __call__(self, name: str) -> Engine:
        eng = self.made.get(name)
        if eng is None:
            eng = self.kinds[name](self.upstream)
            members = [*Engine.__annotations__, *(n for n, v in vars(Engine).items() if callable(v) and n[0] != "_")]
            missing = [m for m in members if not hasattr(eng, m)]
            if missing:  # found when its workers are made, not as failed legs counted against them
                raise TypeError(f"engine kind {name!r}: its adapter lacks {', '.join(missing)} (adapters.base.Engine)")
            self.made[name] = eng
        return eng

