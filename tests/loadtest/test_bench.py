"""bench against given targets: closed and open loop, streaming TPOT; the generator is its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.pdgate.harness import make_config, start_gateway
from tests.procs import ROOT, Procs


async def test_bench_targets_closed_and_open_loop(procs: Procs, gateways: list[Any], tmp_path: Path) -> None:
    p, d = procs.pair("--speed", "0")
    g = await start_gateway(make_config([p], [d]))
    gateways.append(g)
    import asyncio

    for extra, key in ((["--concurrency", "4", "--stream"], "s4"), (["--rate", "40"], "ns40rps")):
        out = tmp_path / f"{key}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest", "bench", "--target", g.url, *extra, "--duration", "2", "--out", str(out),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, stdout.decode()[-2000:]
        m = json.loads(out.read_text())["results"][key][g.url]
        assert m["ok"] > 0 and m["errors"] == 0
        if key == "s4":
            assert m["tpot_p50_ms"] is not None and m["ttft_p50_ms"] > 0
        else:  # open loop: about the asked rate, not what the server could do
            assert 25 <= m["rps"] <= 55, m


def test_bench_needs_a_target() -> None:
    r = subprocess.run([sys.executable, "-m", "loadtest", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "--target" in r.stderr


def test_compare_on_fake_workers_serves_every_target(tmp_path: Path) -> None:
    """The zero-cost fake workers speak enough SGLang for direct, pdgate, the real sglang-router, the floor (a bare
    relay on h1lite, ``--floor``) and pdgate with every feature knocked out (``--knockout all``)."""
    out = tmp_path / "fake.json"
    r = subprocess.run([sys.executable, "-m", "loadtest", "bench", "--compare", "--workers", "fake", "--workloads", "s64",
                        "ns16", "ns200rps", "--duration", "1", "--floor", "--knockout", "all", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["workers"] == "fake"
    for wl in ("s64", "ns16", "ns200rps"):
        for target in ("direct", "pdgate", "sglang-router", "h1lite-floor", "pdgate-knocked"):
            m = res["results"][wl][target]
            assert m["ok"] > 100 and m["errors"] == 0, (wl, target, m)
            # every process's CPU per request is counted, and the parts add up to the machine total
            parts = [m.get("target_cpu_us_per_req", 0.0), m["workers_cpu_us_per_req"], m["generator_cpu_us_per_req"]]
            assert m["workers_cpu_us_per_req"] > 0 and m["generator_cpu_us_per_req"] > 0, m
            assert abs(sum(parts) - m["machine_cpu_us_per_req"]) < 1, m
            assert (m["cpu_bound_rps"] > 0) if wl != "ns200rps" else ("cpu_bound_rps" not in m), m
    paced = res["results"]["ns200rps"]
    for target in ("direct", "pdgate", "sglang-router"):  # open loop: about the asked rate, whatever the target
        assert 120 <= paced[target]["rps"] <= 280, paced[target]
    assert paced["pdgate"]["p50_added_ms"] == round(paced["pdgate"]["p50_ms"] - paced["direct"]["p50_ms"], 3)
    # the knocked-out target ran with every knockout (a KNOCK lost on the way would measure plain pdgate)
    knocked = (Path(res["logs"]) / "pdgate-knocked.log").read_text()
    assert "knocked out: metrics,events,traces,lineage,watchdog,validation,usage,routing,finished" in knocked, knocked[-500:]


@pytest.mark.parametrize("args", [["bench", "--compare"], ["bench", "--overload"], ["agents", "--compare"]])
def test_a_comparison_without_sglang_router_says_what_is_missing(args: list[str], tmp_path: Path) -> None:
    """It used to fail with 'process exited (1) before ... answered', naming nothing."""
    hide = ("import sys, runpy; sys.modules['sglang_router'] = None; "  # as if it were not installed
            f"sys.argv = ['loadtest', *{args!r}, '--out', {str(tmp_path / 'x.json')!r}]; "
            "runpy.run_module('loadtest', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "sglang-router is not installed here" in out.stderr and "pip install sglang-router==0.3.2" in out.stderr
    assert not (tmp_path / "x.json").exists()


async def test_bench_reports_goodput_against_its_slo_and_json_on_stdout(procs: Procs, gateways: list[Any],
                                                                        tmp_path: Path) -> None:
    """Goodput is judged on the generator's clock against the SLO it was given: every request within a loose SLO,
    none within an impossible one; tokens counted from the answers (16 each); --json: stdout parses, the table
    goes to stderr."""
    import asyncio

    p, d = procs.pair("--speed", "0")
    g = await start_gateway(make_config([p], [d]))
    gateways.append(g)
    got = {}
    for name, slo in (("loose", ("60000", "60000")), ("impossible", ("0.001", "60000"))):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest", "bench", "--target", g.url, "--concurrency", "4", "--duration", "1.5",
            "--slo-ttft-ms", slo[0], "--slo-total-ms", slo[1], "--json", "--out", str(tmp_path / f"{name}.json"),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        got[name] = json.loads(stdout)["results"]["ns4"][g.url]
        assert "goodput" in stderr.decode() and "bench ns4" in stderr.decode()
    loose, impossible = got["loose"], got["impossible"]
    assert loose["ok"] > 0 and abs(loose["goodput_rps"] - loose["rps"]) <= 0.2 and loose["slo_met"] == 1.0
    assert abs(loose["tokens_s"] - 16 * loose["rps"]) <= 16 and loose["goodput_tokens_s"] == loose["tokens_s"]
    assert impossible["ok"] > 0 and impossible["goodput_rps"] == 0 and impossible["goodput_tokens_s"] == 0


def test_every_knockout_names_what_is_there_and_an_unknown_one_is_refused() -> None:
    """scripts/knockout_serve.py measures what a feature costs by replacing it: a target renamed since would be
    knocked out of nothing (setattr makes a new attribute), and the run would measure nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("knockout_serve", ROOT / "scripts" / "knockout_serve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    missing = [f"{name}: {owner.__name__}.{attr}" for name, knocks in mod.KNOCKS.items() for owner, attr, _ in knocks
               if not hasattr(owner, attr)]
    assert not missing and len(mod.KNOCKS) == 9, missing
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "knockout_serve.py"), "serve"], cwd=ROOT,
                       env={"KNOCK": "metrics,bogus", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown feature 'bogus'" in r.stderr, r.stderr[-500:]


def test_the_request_paths_cost_in_memory_is_measured_with_and_without_the_features() -> None:
    """benchmarks/path_cost.py drives the whole request path in memory: every request answered 200 (it asserts so),
    a cost per request; a knockout it does not know is refused, as knockout_serve.py refuses it."""
    for knock in ("", "all"):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "path_cost.py"), "--requests", "800",
                            "--repeats", "1", *(("--knock", knock) if knock else ())], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout)
        nine = ["metrics", "events", "traces", "lineage", "watchdog", "validation", "usage", "routing", "finished"]
        assert out["us_per_request"] > 0 and len(out["runs"]) == 1 and out["knocked"] == (nine if knock else []), out
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "path_cost.py"), "--knock", "metrics,bogus"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown feature 'bogus'" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize(("args", "said"), [(["--knockout", "metrics,bogus"], "unknown feature 'bogus'"),
                                            (["--workers", "vllm", "--knockout", "all"], "not --workers vllm")])
def test_a_knockout_the_bench_cannot_run_is_refused_before_anything_starts(args: list[str], said: str,
                                                                             tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "loadtest", "bench", "--compare", *args, "--out", str(tmp_path / "x.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
    assert not (tmp_path / "x.json").exists()
