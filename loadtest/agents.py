"""``python -m loadtest agents``: multi-round agent sessions whose context grows every round.

Each session is a conversation: every round sends the whole history (streaming), then
appends the assistant's reply and a synthetic tool result of ``--growth`` tokens. Reports
per-round TTFT/e2e percentiles and which sessions stalled or failed in which round; JSON +
PNG. Exits 0 only if every session finished every round. Short benchmarks miss what this
catches: a decode that stalls once contexts grow long (the seed's kernel-knob regression).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from loadtest.output import pyplot, verdict_command

WORDS = "alpha beta gamma delta file line error value result test build log path query row column".split()


def tool_result(rng: random.Random, tokens: int) -> str:
    return "tool output: " + " ".join(rng.choice(WORDS) for _ in range(tokens))


async def turn(http: aiohttp.ClientSession, a: argparse.Namespace, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": a.model, "messages": messages, "max_tokens": a.max_tokens, "stream": True}
    headers = {"x-pdgate-timeout": str(a.deadline)} if a.deadline else {}
    t0 = time.monotonic()
    ttft = None
    text: list[str] = []
    try:
        async with asyncio.timeout(a.deadline + 5 if a.deadline else None):
            async with http.post(a.gateway + "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    return {"ok": False, "why": f"http {r.status}: {(await r.text())[:200]}", "e2e": time.monotonic() - t0}
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    obj = orjson.loads(line[6:])
                    if "error" in obj:
                        return {"ok": False, "why": obj["error"].get("message", "error event"), "ttft": ttft,
                                "e2e": time.monotonic() - t0}
                    for c in obj.get("choices", []):
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            ttft = ttft if ttft is not None else time.monotonic() - t0
                            text.append(piece)
    except TimeoutError:
        return {"ok": False, "why": "client deadline: stalled", "ttft": ttft, "e2e": time.monotonic() - t0}
    except (aiohttp.ClientError, OSError) as exc:
        return {"ok": False, "why": f"{exc.__class__.__name__}: {exc}", "e2e": time.monotonic() - t0}
    return {"ok": True, "ttft": ttft, "e2e": time.monotonic() - t0, "text": "".join(text)}


async def session(http: aiohttp.ClientSession, a: argparse.Namespace, sid: int, rounds: list[list[dict[str, Any]]],
                  failures: list[dict[str, Any]]) -> None:
    rng = random.Random(a.seed * 1000 + sid)
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {sid}."},
                                      {"role": "user", "content": "Fix the failing build."}]
    for rnd in range(a.rounds):
        res = await turn(http, a, messages)
        res["session"] = sid
        res["context_words"] = sum(len(str(m["content"]).split()) for m in messages)
        rounds[rnd].append(res)
        if not res["ok"]:
            failures.append({"session": sid, "round": rnd + 1, "why": res["why"], "context_words": res["context_words"]})
            return
        messages += [{"role": "assistant", "content": res.pop("text")}, {"role": "user", "content": tool_result(rng, a.growth)}]


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else None


async def run(a: argparse.Namespace) -> dict[str, Any]:
    rounds: list[list[dict[str, Any]]] = [[] for _ in range(a.rounds)]
    failures: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with Progress(console=Console(stderr=True)) as bar:
        job = bar.add_task("agent rounds", total=a.sessions * a.rounds)

        async def tick() -> None:
            while True:
                bar.update(job, completed=sum(len(r) for r in rounds) + sum(a.rounds - f["round"] for f in failures))
                await asyncio.sleep(0.5)

        ticker = asyncio.create_task(tick())
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            await asyncio.gather(*(session(http, a, s, rounds, failures) for s in range(a.sessions)))
        ticker.cancel()
    per_round = []
    for i, rs in enumerate(rounds):
        ok = [r for r in rs if r["ok"]]
        per_round.append({"round": i + 1, "requests": len(rs), "ok": len(ok),
                          "context_words_median": statistics.median(r["context_words"] for r in rs) if rs else None,
                          "ttft_p50_ms": pct([r.get("ttft") for r in ok], 0.5), "ttft_p95_ms": pct([r.get("ttft") for r in ok], 0.95),
                          "e2e_p50_ms": pct([r["e2e"] for r in ok], 0.5), "e2e_p95_ms": pct([r["e2e"] for r in ok], 0.95)})
    return {"gateway": a.gateway, "sessions": a.sessions, "rounds": a.rounds, "growth": a.growth, "deadline": a.deadline,
            "seconds": round(time.monotonic() - t0, 2), "per_round": per_round,
            "failures": sorted(failures, key=lambda f: (f["round"], f["session"])),
            "verdict": "PASS" if not failures else "FAIL"}


def report(console: Console, out: dict[str, Any]) -> None:
    t = Table(title=f"agents: {out['sessions']} sessions x {out['rounds']} rounds, +{out['growth']} tokens/round: "
                    f"{out['verdict']}")
    for col in ("round", "ok/sent", "context words", "ttft p50 ms", "ttft p95 ms", "e2e p50 ms", "e2e p95 ms"):
        t.add_column(col, justify="right")
    for r in out["per_round"]:
        t.add_row(str(r["round"]), f"{r['ok']}/{r['requests']}", str(r["context_words_median"]), str(r["ttft_p50_ms"]),
                  str(r["ttft_p95_ms"]), str(r["e2e_p50_ms"]), str(r["e2e_p95_ms"]))
    console.print(t)
    for f in out["failures"]:
        console.print(f"[red]session {f['session']} stopped in round {f['round']}[/] (context {f['context_words']} words): {f['why']}")


def plot(out: dict[str, Any], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    pr = out["per_round"]
    xs = [r["round"] for r in pr]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms", "e2e_p95_ms"):
        ax[0].plot(xs, [r[key] for r in pr], marker="o", label=key)
    ax[0].set_xlabel("round")
    ax[0].set_ylabel("ms")
    ax[0].set_title("latency by round")
    ax[0].legend(fontsize=7)
    ax[1].bar(xs, [r["requests"] - r["ok"] for r in pr], color="red")
    ax[1].set_xlabel("round")
    ax[1].set_title("sessions that stalled or failed")
    fig.suptitle(f"agents: {out['verdict']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("agents", help="multi-round agent sessions with growing context")
    p.add_argument("--gateway", required=True)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--growth", type=int, default=2000, help="tokens of tool output appended per round")
    p.add_argument("--deadline", type=float, default=120, help="per-request deadline, seconds (sent as x-pdgate-timeout)")
    p.add_argument("--max-tokens", type=int, default=32)
    verdict_command(p, "agents", run, report, plot)
