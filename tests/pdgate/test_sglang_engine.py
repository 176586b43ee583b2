"""The SGLang adapter reads what real SGLang 0.5.23 answers (shapes recorded from the real pair of the SGLang real
tier, not from the sim): ``/v1/loads?include=disagg`` answers its PD queues under ``disaggregation`` (the sim said
``disagg``, and so did the adapter: against the real engine a prefill's held count read 0 whatever it held), and the
identity of an engine/sglang worker names its version and kernel profile."""

from __future__ import annotations

from typing import Any

from pdgate.adapters.sglang import SGLang, _queues

# GET /v1/loads?include=disagg on real SGLang 0.5.23 (CPU profile), the decode holding 4 requests waiting for KV
REAL_DECODE = {"timestamp": "2026-12-04T13:53:10+00:00", "version": "0.5.23", "loads": [{
    "timestamp": 1796391190.1, "dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 4,
    "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "max_total_num_tokens": 8192,
    "max_running_requests": 4096, "token_usage": 0.0, "disaggregation": {
        "mode": "decode", "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
        "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 4, "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}}]}


def prefill_loads(bootstrap: int, inflight: int) -> dict[str, Any]:
    d = REAL_DECODE["loads"][0]["disaggregation"]  # type: ignore[index]
    return {**REAL_DECODE, "loads": [{**REAL_DECODE["loads"][0], "num_waiting_reqs": 0,  # type: ignore[index]
                                      "disaggregation": {**d, "mode": "prefill", "decode_transfer_queue_reqs": 0,
                                                         "prefill_bootstrap_queue_reqs": bootstrap,
                                                         "prefill_inflight_queue_reqs": inflight}}]}


def test_a_real_prefills_pd_queues_are_read_as_what_it_holds() -> None:
    p = SGLang(None)._probed({}, _queues(prefill_loads(1, 2)), "prefill")  # type: ignore[arg-type]
    assert p.held == 3 and p.queues["prefill_inflight_queue_reqs"] == 2
    assert "kv_transfer_latency_ms" not in p.queues and "mode" not in p.queues  # counts only


def test_a_real_decodes_transfer_queue_is_read_as_what_it_holds() -> None:
    p = SGLang(None)._probed({}, _queues(REAL_DECODE), "decode")  # type: ignore[arg-type]
    assert p.held == 4 and p.queues["decode_transfer_queue_reqs"] == 4


def test_an_engine_sglang_worker_is_identified_with_its_version_and_profile() -> None:
    info = {"pdgate_identity": "4352-1796391185411100250", "pdgate_fixes": ["A", "B", "C"], "sglang_version": "0.5.23",
            "kernel_profile": "cpu"}
    p = SGLang(None)._probed(info, {}, "decode")  # type: ignore[arg-type]
    assert p.identity == "sglang 0.5.23 profile cpu 4352-1796391185411100250" and p.fixes == ["A", "B", "C"]
    assert SGLang(None)._probed({"pdgate_identity": "sim-1"}, {}, "decode").identity == "sim-1"  # type: ignore[arg-type]
