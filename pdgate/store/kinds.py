"""The store a gateway process uses: the embedded one for one process (no ``[store] url``), or Redis."""

from __future__ import annotations

from pdgate.core.config import StoreConfig
from pdgate.store.base import Store
from pdgate.store.embedded import EmbeddedStore


def make(cfg: StoreConfig) -> Store:
    if not cfg.url:
        return EmbeddedStore(cfg.lease_s)
    from pdgate.store.redis import RedisStore  # the redis client is needed only then

    return RedisStore(cfg)
