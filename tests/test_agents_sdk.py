"""The real OpenAI Agents SDK (openai-agents), in its default mode, through ``pdgate up``: a tool-calling agent for
five turns (``Runner.run``, ``Runner.run_streamed``, ``previous_response_id``, ``store=False``), in a process of its
own (``tests/agents_sdk_client.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT, Procs, free_port, wait_http
from tests.test_up import cluster_file, up_command


def test_the_agents_sdk_runs_a_tool_calling_agent_through_pdgate_up(procs: Procs, tmp_path: Path) -> None:
    cluster_file(tmp_path, 1, 1, ("--eos-after", "24", "--fault", "segment=0.7", "--fault", "segment_seed=5"))
    port, admin_port = free_port(), free_port()
    up = procs.spawn(up_command(tmp_path, port, admin_port), name="pdgate-up")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readiness", timeout=60, proc=up.popen)
    run = subprocess.run([sys.executable, "-m", "tests.agents_sdk_client", url], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    turns = seen["turns"]
    assert [t["mode"] for t in turns] == ["run", "run_streamed", "previous_response_id",
                                          "run_streamed+previous_response_id", "store=False"]
    for t in turns:  # each turn: the model asked for the tool, the SDK ran it, sent its output, the model answered
        assert t["items"] == ["tool_call_item", "tool_call_output_item", "message_output_item"], t
        assert isinstance(t["final"], str) and t["final"], t
        assert t["id"].startswith("resp_pdg-"), t
    assert turns[1]["raw_events"] > 10, "run_streamed got the Responses events as they came"
    assert len(seen["calls"]) == 5 and all(c["tool"] == "read_file" and c["path"] for c in seen["calls"])
    assert seen["unstored_found"] == "NotFoundError"
