"""The two coding agents people run, unchanged, against ``pdgate up`` on its sims: Codex CLI over the Responses API
and Claude Code over Anthropic's Messages API, each with its default settings but the endpoint, non-interactive.
The sims answer a request that names a tool with a call of it (a `backticked` command as its argument), the agent
runs the tool, sends its result, and the sims answer with text: one tool round trip, then a final answer.

The CLIs come from npm (``tests/clients/install.sh``, run by the README's test command). Without them these tests
fail in CI and skip elsewhere, naming the install command. Judged from outside: the agent's exit status and its
own event stream (``codex exec --json``, ``claude --output-format stream-json``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Procs, free_port, wait_http
from tests.test_up import cluster_file, up_command

CLIENTS = Path(os.environ.get("PDGATE_CLIENTS_DIR", Path.home() / ".cache/pdgate/clients")) / "node_modules/.bin"
INSTALL = "bash tests/clients/install.sh"


def client(name: str) -> str:
    path = CLIENTS / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed in {CLIENTS}: the README's test command runs {INSTALL}")
        pytest.skip(f"{name} is not installed (run {INSTALL})")
    return str(path)


@pytest.fixture
def up(procs: Procs, tmp_path: Path) -> str:
    """``pdgate up`` with its default gateway config (the agents' model names are aliases of the sims' model) on a
    1P1D cluster whose sims end their answers as a model's EOS does and cut and merge their writes."""
    cluster_file(tmp_path, 1, 1, ("--eos-after", "48", "--fault", "segment=0.5", "--fault", "segment_seed=3"))
    port, admin_port = free_port(), free_port()
    proc = procs.spawn(up_command(tmp_path, port, admin_port), name="pdgate-up")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readiness", timeout=60, proc=proc.popen)
    return url


def events(out: str) -> list[dict[str, Any]]:
    got = []
    for line in out.splitlines():
        try:
            got.append(json.loads(line))
        except ValueError:
            continue
    return got


def test_codex_exec_runs_a_shell_command_and_answers(up: str, tmp_path: Path) -> None:
    """``codex exec`` with a custom provider (``wire_api = "responses"``) and its model names: gpt-5.5 sends the
    freeform ``apply_patch`` and the built-in ``tool_search``/``web_search``; an unknown name (its fallback
    metadata) sends a ``namespace``. Both list the files with ``exec_command`` and answer; exit 0."""
    codex = client("codex")
    work = tmp_path / "work"
    work.mkdir()
    (work / "marker-file.txt").write_text("x")
    provider = (f'model_providers.pdgate={{name="pdgate", base_url="{up}/v1", wire_api="responses", '
                'env_key="PDGATE_KEY"}')
    for model in ("gpt-5.5", "gpt-5.1-codex"):
        run = subprocess.run(
            [codex, "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
             "-c", "model_provider=pdgate", "-c", provider, "-m", model, "use exec_command to list the files: `ls`"],
            cwd=work, env={**os.environ, "HOME": str(tmp_path / "home"), "PDGATE_KEY": "none"},
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (model, run.stdout[-3000:], run.stderr[-3000:])
        items = [e["item"] for e in events(run.stdout) if e.get("type") == "item.completed"
                 and not e["item"].get("message", "").startswith("Model metadata for")]  # its warning for a new name
        kinds = [i["type"] for i in items]
        assert kinds == ["command_execution", "agent_message"], (model, items)
        assert items[0]["command"].endswith("ls") and items[0]["exit_code"] == 0
        assert "marker-file.txt" in items[0]["aggregated_output"], items[0]
        assert items[1]["text"], items[1]
        assert [e["type"] for e in events(run.stdout)][-1] == "turn.completed"


def test_claude_code_runs_bash_and_answers_with_its_default_model(up: str, tmp_path: Path) -> None:
    """``claude -p`` with ``ANTHROPIC_BASE_URL`` at pdgate and no model named (its default name, an alias here):
    the sims call Bash with ``ls``, Claude Code runs it, sends the tool_result, the answer ends the turn; exit 0."""
    claude = client("claude")
    work = tmp_path / "work"
    work.mkdir()
    (work / "marker-file.txt").write_text("x")
    env = {**os.environ, "HOME": str(tmp_path / "home"), "ANTHROPIC_BASE_URL": up, "ANTHROPIC_API_KEY": "none",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    run = subprocess.run([claude, "-p", "run `ls` with Bash", "--allowedTools", "Bash(ls:*)",
                          "--output-format", "stream-json", "--verbose"],
                         cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    evs = events(run.stdout)
    said = [e["message"] for e in evs if e.get("type") in ("assistant", "user")]
    use = said[0]["content"][0]
    assert use["type"] == "tool_use" and use["name"] == "Bash" and use["input"]["command"] == "ls", said[0]
    result = said[1]["content"][0]
    assert result["type"] == "tool_result" and not result.get("is_error"), result
    assert "marker-file.txt" in json.dumps(result["content"]), result
    assert said[2]["content"][0]["type"] == "text" and said[2]["content"][0]["text"]
    assert said[0]["model"].startswith("claude-"), "its default model name, served by the alias"
    final = next(e for e in evs if e.get("type") == "result")
    assert final["subtype"] == "success" and final["is_error"] is False, final
