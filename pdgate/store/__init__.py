"""The store: what several gateway processes must agree on (``docs/architecture.md``, "The store").

``store.kinds.make(cfg)`` makes the embedded store for one process (no ``[store] url``), or Redis (imported only
then); ``store.base`` holds the Protocol and its values.
"""

from __future__ import annotations

from pdgate.store.base import Beat, Grant, Store, TenantAsk

__all__ = ["Beat", "Grant", "Store", "TenantAsk"]
