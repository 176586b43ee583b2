"""Every PNG a load test writes: each panel has axis labels (with units where there are any) and a legend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import pytest

from loadtest import affinity, agents, bench, overload, storm, streams

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROW = {"rps": 10.0, "target_cpu_us_per_req": 5.0, "machine_cpu_us_per_req": 9.0, "workers_cpu_us_per_req": 3.0,
       "generator_cpu_us_per_req": 1.0, "p50_added_ms": 0.5, "p99_added_ms": 1.5}


def stream_row(n: int, target: bool, added: float) -> dict[str, Any]:
    row: dict[str, Any] = {"streams": n, "events_per_s_offered": 10.0 * n, "machine_cpu_us_per_event": 90.0,
                           "delay_p50_ms": 0.1 + added, "delay_p99_ms": 0.3 + added, "delay_p999_ms": 1.0 + added,
                           "added_p50_ms": added / 2, "added_p99_ms": added, "added_p999_ms": added * 2}
    if target:
        row.update({"target_cpu_us_per_event": 40.0, "kb_per_stream": 12.0})
    return row


STREAMS = {"tokens_per_s": 10.0, "streams": [250, 500], "headline_streams": 500, "limit_ms": 10.0,
           "results": {name: {str(n): stream_row(n, name != "direct", 0.0 if name == "direct" else n / 50)
                              for n in (250, 500)} for name in ("direct", "pdgate", "sglang-router")}}
CASES: dict[str, tuple[Any, Any]] = {
    "streams": (streams.plot, STREAMS),
    "storm": (storm.plot, {"prefill_metrics": ["http://p0/metrics"], "samples": [{"t": 0, "http://p0/metrics": 1},
                                                                                 {"t": 1, "http://p0/metrics": 0}],
                           "marks": [{"t": 0.5, "event": "storm"}], "watchdog_line": 2.0, "verdict": "PASS"}),
    "agents": (agents.plot, {"per_round": [{"round": 1, "requests": 2, "ok": 1, "ttft_p50_ms": 1, "ttft_p95_ms": 2,
                                            "e2e_p50_ms": 3, "e2e_p95_ms": 4}], "verdict": "FAIL"}),
    "bench": (bench.plot, {"ns16": {"direct": ROW, "pdgate": ROW}, "ns200rps": {"direct": ROW, "pdgate": ROW}}),
    "overload": (overload.plot, {"results": {"1x": {"pdgate": {"goodput_x_capacity": 1.0, "terminal_within_deadline": 1.0,
                                                               "wasted_prefills": 0}}},
                                 "capacity_rps": 4.0, "ttft_s": 1.5, "total_s": 2.5}),
    "speed_change": (overload.plot_change, {"phase_s": 2.0, "capacity_rps": 4.9, "speed_change": {
        "pdgate-learned": {"goodput_per_s": [4, 5, 2, 2, 5, 5], "limit": [[0.0, 2], [2.5, 1], [4.5, 2]]},
        "pdgate-no-admission": {"goodput_per_s": [2, 2, 0, 0, 2, 2], "limit": [[0.0, 1024]]}}}),
    "affinity": (affinity.plot, {"targets": {"round_robin": {"per_round": [{"round": 1, "ttft_p50_ms": 1, "ttft_p99_ms": 2}],
                                                             "prefill_tokens_computed": 1000, "cache_hit_rate": 0.5}},
                                 "sessions": 1, "rounds": 1, "prefills": 2, "ratios": {}}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_panel_has_axis_labels_and_a_legend(name: str, tmp_path: Path) -> None:
    plot, data = CASES[name]
    plt.close("all")
    plot(data, tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").stat().st_size > 5000
    figs = [plt.figure(n) for n in plt.get_fignums()]
    assert len(figs) == 1
    if name in ("bench", "streams"):
        assert len(figs[0].axes) == 4, "every panel is drawn"
    for ax in figs[0].axes:
        title = ax.get_title() or "?"
        assert ax.get_xlabel(), f"{name}: panel {title!r} has no x label"
        assert ax.get_ylabel(), f"{name}: panel {title!r} has no y label"
        legend = ax.get_legend()
        assert legend is not None and legend.get_texts(), f"{name}: panel {title!r} has no legend"
    plt.close("all")


def test_a_plot_with_no_data_says_so(tmp_path: Path) -> None:
    from loadtest.output import pyplot, save

    plt = pyplot(tmp_path / "x.png")
    fig, (empty, full) = plt.subplots(1, 2)
    empty.axvline(1.0, linestyle="--")  # a marker line is not data
    full.plot([0, 1, 2], [1, 2, 3])
    save(fig, tmp_path / "x.png")
    assert [t.get_text() for t in empty.texts] == ["no data"] and empty.get_ylim() == (0, 1)
    assert not full.texts
