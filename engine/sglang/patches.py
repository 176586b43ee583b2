"""The engine-side fixes A, B, C as patches on SGLang 0.5.23 classes (``docs/architecture.md``, "The engine-side fixes").

Each ``patch_*`` takes the class to patch, so the logic is tested against stand-ins that
mirror the upstream signatures (tests/engine/test_sglang_patches.py); ``engine.sglang.worker``
applies them to the real classes. ``TARGETS`` names what is patched, with the parameters
relied on; the worker and a compatibility test check them against the installed SGLang.

- C, inflight watchdog (``SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue``):
  first-seen time per request in the inflight queue; past ``SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT``
  the request's KV sender is failed, so SGLang's own Failed path (``handle_inflight_transfer_failure``)
  frees the KV and answers 500. The poll result is all-reduced with MIN across TP (and CP)
  ranks and Failed is 0, so a rank that fails a sender fails the request on every rank in
  the same poll round: ranks stay consistent even though each keeps its own clock.
- A, abort during transfer (``CommonKVSender.abort``): upstream returns early, concluding
  nothing, for a sender that does not own its room under deferred bootstrap — the abort is
  lost and the request stays in the queue. Patched, every abort concludes the sender Failed.
- B, bounded bootstrap (``CommonKVSender._check_bootstrap_timeout``): with deferred decode
  allocation upstream measures from ``_prefill_complete_time`` and waits without bound while it
  is unset. Patched, it falls back to ``init_time``, so SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
  always applies.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pdgate.sglang.patches")

SUPPORTED_VERSIONS = ("0.5.23",)
# fix -> (module, class, method, parameters relied on)
TARGETS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "C": ("sglang.srt.disaggregation.prefill", "SchedulerDisaggregationPrefillMixin",
          "process_disagg_prefill_inflight_queue", ("self", "rids_to_check")),
    "A": ("sglang.srt.disaggregation.common.conn", "CommonKVSender", "abort", ("self",)),
    "B": ("sglang.srt.disaggregation.common.conn", "CommonKVSender", "_check_bootstrap_timeout", ("self",)),
}
KVPOLL = ("sglang.srt.disaggregation.base.conn", "KVPoll")


def inflight_timeout() -> float:
    return float(os.environ.get("SGLANG_DSV4_PREFILL_INFLIGHT_TIMEOUT", "60"))


def fail_sender(sender: Any, failed: Any, reason: str) -> None:
    """Conclude a KV sender Failed the way its own abort does, also for a room it does not own."""
    mgr = getattr(sender, "kv_mgr", None)
    room = getattr(sender, "bootstrap_room", None)
    if mgr is not None and room is not None:
        if hasattr(mgr, "record_failure"):
            mgr.record_failure(room, reason)
        if getattr(sender, "_owns_bootstrap_room", True) and hasattr(mgr, "update_status"):
            mgr.update_status(room, failed)
    sender.conclude_state = failed


def patch_inflight_watchdog(mixin: type, failed: Any, timeout: Callable[[], float] = inflight_timeout,
                            clock: Callable[[], float] = time.monotonic,
                            on_force_fail: Callable[[Any, float], None] | None = None) -> None:
    original = mixin.process_disagg_prefill_inflight_queue  # type: ignore[attr-defined]

    @functools.wraps(original)
    def process_disagg_prefill_inflight_queue(self: Any, rids_to_check: Any = None) -> Any:
        now, limit = clock(), timeout()
        for req in self.disagg_prefill_inflight_queue:
            since = getattr(req, "_pdgate_inflight_since", None)
            if since is None:
                req._pdgate_inflight_since = now
            elif limit > 0 and now - since > limit and not getattr(req, "_pdgate_force_failed", False):
                req._pdgate_force_failed = True
                age = now - since
                log.error("inflight watchdog: force-failing rid=%s room=%s age=%.1fs", req.rid,
                          getattr(req, "bootstrap_room", None), age)
                fail_sender(req.disagg_kv_sender, failed, f"inflight watchdog: no transfer result after {age:.1f}s")
                if on_force_fail is not None:
                    on_force_fail(req, age)
        return original(self, rids_to_check)

    process_disagg_prefill_inflight_queue.__pdgate_fix__ = "C"  # type: ignore[attr-defined]
    mixin.process_disagg_prefill_inflight_queue = process_disagg_prefill_inflight_queue  # type: ignore[attr-defined]


def patch_abort_concludes(sender_cls: type, failed: Any) -> None:
    original = sender_cls.abort  # type: ignore[attr-defined]

    @functools.wraps(original)
    def abort(self: Any) -> None:
        original(self)
        if getattr(self, "conclude_state", None) != failed:  # upstream returned early: the abort was lost
            log.warning("abort for room %s would have been lost; concluding it Failed", getattr(self, "bootstrap_room", None))
            self.conclude_state = failed

    abort.__pdgate_fix__ = "A"  # type: ignore[attr-defined]
    sender_cls.abort = abort  # type: ignore[attr-defined]


def patch_bounded_bootstrap(sender_cls: type, failed: Any, clock: Callable[[], float] = time.time) -> None:
    original = sender_cls._check_bootstrap_timeout  # type: ignore[attr-defined]

    @functools.wraps(original)
    def _check_bootstrap_timeout(self: Any) -> Any:
        status = original(self)
        if status is not None:
            return status
        mgr = self.kv_mgr
        if getattr(mgr, "defer_decode_allocation", False) and getattr(self, "_prefill_complete_time", None) is None:
            elapsed = clock() - self.init_time
            if elapsed >= mgr.bootstrap_timeout:
                fail_sender(self, failed, f"Request {self.bootstrap_room} timed out after {elapsed:.1f}s in "
                                          "KVPoll.Bootstrapping (bounded by pdgate fix B)")
                return failed
        return None

    _check_bootstrap_timeout.__pdgate_fix__ = "B"  # type: ignore[attr-defined]
    sender_cls._check_bootstrap_timeout = _check_bootstrap_timeout  # type: ignore[attr-defined]
