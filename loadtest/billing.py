"""``python -m loadtest billing``: the cached share of a Claude Code session's prompts with
``[messages] normalise_billing`` on and off (README "Clients", docs/messages.md).

For each setting, ``pdgate up`` on a 1P1D sim cluster (the sims' prefix cache on, answers ended as an EOS does),
and two sessions of ``--rounds`` rounds each:

- **claude**: the real Claude Code CLI (``claude -p``, the session resumed each round with ``--resume``), each
  round a Bash tool round trip; what it sends is what it sends (2.1.328 in ``-p`` mode: no ``cch`` nonce).
- **replay**: the Anthropic Messages requests of a session shaped as Claude Code's (its system blocks: the billing
  line first, then a long system prompt; the conversation resent and grown each round), with a fresh
  ``cch=<nonce>`` in the billing line of every request, as the Claude Code versions that send one do.

The cached share is judged from outside, from what the client was told: ``cache_read_input_tokens`` over
``input_tokens + cache_read_input_tokens`` (Claude Code's own per-round ``result.usage``; the replay's answers).
Results: a table on stderr, ``--json`` on stdout, and a PNG (``--plot``)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from loadtest.procs import ROOT, free_port, wait_http

CLAUDE = Path(os.environ.get("PDGATE_CLIENTS_DIR", Path.home() / ".cache/pdgate/clients")) / "node_modules/.bin/claude"
WORDS = ("request reply token cache prefill decode transfer worker gateway engine queue model agent tool result "
         "round context window budget deadline abort retry").split()


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Up:
    """``pdgate up`` with ``normalise_billing`` set, on a 1P1D sim cluster of its own; stopped by its PID."""

    def __init__(self, tmp: Path, normalise: bool) -> None:
        self.tmp = tmp
        self.port, self.admin_port = free_port(), free_port()
        cluster = tmp / "cluster.toml"
        args = '["--eos-after", "48"]'
        cluster.write_text(f'[cluster]\nlog_dir = "{tmp / "logs"}"\n'
                           f'[[worker]]\nname = "p0"\nrole = "prefill"\nport = {free_port()}\n'
                           f'bootstrap_port = {free_port()}\nargs = {args}\n'
                           f'[[worker]]\nname = "d0"\nrole = "decode"\nport = {free_port()}\nargs = {args}\n')
        config = tmp / "pdgate.toml"
        config.write_text(f"[messages]\nnormalise_billing = {'true' if normalise else 'false'}\n")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdgate", "up", "--cluster", str(cluster), "--config", str(config), "--port",
             str(self.port), "--admin-port", str(self.admin_port), "--admin-key-file", str(tmp / "admin.key")],
            cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(tmp / "up.log", "wb"), env={**os.environ,
                                                                                      "PYTHONPATH": str(ROOT)})
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/readiness", timeout=60, proc=self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def share(rows: list[dict[str, int]]) -> float:
    read = sum(r["cache_read_input_tokens"] for r in rows)
    total = read + sum(r["input_tokens"] for r in rows)
    return read / total if total else 0.0


def _json(line: str) -> dict[str, Any]:
    try:
        v = json.loads(line)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def claude_session(url: str, tmp: Path, rounds: int) -> list[dict[str, int]]:
    """Real Claude Code: ``rounds`` rounds of one session; each round's usage as Claude Code reports it."""
    work, home = tmp / "work", tmp / "home"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "none",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    sid = str(uuid.uuid4())
    out = []
    for i in range(rounds):
        (work / f"file-{i}.txt").write_text("x")
        cmd = [str(CLAUDE), "-p", f"round {i}: run `ls` with Bash", "--allowedTools", "Bash(ls:*)",
               "--output-format", "stream-json", "--verbose", *(("--session-id", sid) if i == 0 else ("--resume", sid))]
        run = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=180)
        if run.returncode != 0:
            raise RuntimeError(f"claude exited {run.returncode}: {run.stderr[-500:]}")
        results = [e for e in map(_json, run.stdout.splitlines()) if e.get("type") == "result"]
        if not results:
            raise RuntimeError(f"claude said no result: {run.stdout[-800:]}")
        u = results[-1]["usage"]
        out.append({"input_tokens": u["input_tokens"], "cache_read_input_tokens": u["cache_read_input_tokens"]})
        say(f"  claude round {i}: input {u['input_tokens']}, cache read {u['cache_read_input_tokens']}")
    return out


def replay_session(url: str, rounds: int, system_words: int) -> list[dict[str, int]]:
    """A session shaped as Claude Code's, a fresh billing nonce in every request; each answer's usage."""
    import urllib.request

    system = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(system_words))
    messages: list[dict[str, Any]] = []
    out = []
    for i in range(rounds):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"round {i}: " + " ".join(
            WORDS[(i + j) % len(WORDS)] for j in range(200))}]})
        body = {"model": "claude-opus-5-5", "max_tokens": 32, "stream": False, "messages": messages,
                "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.593; "
                            f"cc_entrypoint=cli; cch={secrets.token_hex(3)};"},
                           {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}
        req = urllib.request.Request(url + "/v1/messages", data=orjson.dumps(body), headers={
            "content-type": "application/json", "x-api-key": "none", "anthropic-version": "2023-06-01"})
        with urllib.request.urlopen(req, timeout=60) as r:
            msg = json.loads(r.read())
        u = msg["usage"]
        out.append({"input_tokens": u["input_tokens"], "cache_read_input_tokens": u["cache_read_input_tokens"]})
        messages.append({"role": "assistant", "content": msg["content"]})
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    load = os.getloadavg()
    results: dict[str, Any] = {"command": " ".join(sys.argv), "rounds": a.rounds, "replay_rounds": a.replay_rounds,
                               "system_words": a.system_words, "load_before": [round(x, 2) for x in load],
                               "cpus": os.cpu_count(), "settings": {}}
    for normalise in (True, False):  # the default first
        name = "on" if normalise else "off"
        with tempfile.TemporaryDirectory(prefix="pdgate-billing-") as d:
            say(f"normalise_billing = {name}: starting pdgate up")
            up = Up(Path(d), normalise)
            try:
                got: dict[str, Any] = {}
                if CLAUDE.exists() and a.rounds:
                    rows = claude_session(up.url, Path(d), a.rounds)
                    got["claude"] = {"rounds": rows, "cached_share": round(share(rows), 4),
                                     "after_first": round(share(rows[1:]), 4)}
                else:
                    say(f"  no Claude Code at {CLAUDE} (bash tests/clients/install.sh): its session skipped")
                rows = replay_session(up.url, a.replay_rounds, a.system_words)
                got["replay"] = {"rounds": rows, "cached_share": round(share(rows), 4),
                                 "after_first": round(share(rows[1:]), 4)}
                results["settings"][name] = got
            finally:
                up.stop()
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return results


def report(results: dict[str, Any]) -> None:
    say(f"{'session':<8} {'normalise_billing':>17} {'cached share':>13} {'after round 1':>14}")
    for name, got in results["settings"].items():
        for kind, r in got.items():
            say(f"{kind:<8} {name:>17} {r['cached_share']:>13.1%} {r['after_first']:>14.1%}")
    say(f"load average before {results['load_before']}, after {results['load_after']} ({results['cpus']} CPUs)")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, marker in (("on", "o"), ("off", "x")):
        for kind, style in (("claude", "-"), ("replay", "--")):
            r = results["settings"].get(name, {}).get(kind)
            if r is None:
                continue
            shares = [row["cache_read_input_tokens"] / max(1, row["cache_read_input_tokens"] + row["input_tokens"])
                      for row in r["rounds"]]
            ax.plot(range(1, len(shares) + 1), [100 * s for s in shares], style, marker=marker,
                    label=f"{kind}, normalise_billing {name}")
    ax.set_xlabel("round of the session")
    ax.set_ylabel("prompt tokens read from the prefix cache (%)")
    ax.set_title("Claude Code sessions through pdgate up (sims): cached share per round")
    ax.set_ylim(-5, 105)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("billing", help="cached share of Claude Code sessions with normalise_billing on and off")
    p.add_argument("--rounds", type=int, default=4, help="rounds of the real Claude Code session (0: none)")
    p.add_argument("--replay-rounds", type=int, default=8, help="rounds of the replayed session")
    p.add_argument("--system-words", type=int, default=3000, help="words of the replayed system prompt")
    p.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    p.add_argument("--plot", metavar="PNG", help="a plot of the cached share per round")

    def main(a: argparse.Namespace) -> None:
        t0 = time.monotonic()
        results = run(a)
        results["seconds"] = round(time.monotonic() - t0, 1)
        report(results)
        if a.plot:
            plot(results, a.plot)
        if a.json:
            print(json.dumps(results, indent=1))

    p.set_defaults(func=main)
