"""``python -m loadtest agents``: multi-round agent sessions whose context grows every round.

Each session is a conversation: every round sends the whole history (streaming, with the session's
``x-session-id``). With ``--tools`` (the default) rounds alternate as an agent's do: the user's request
gets a tool call (the sim's rule, engine/sim/agent.py), whose result of ``--growth`` tokens goes back as a
``tool`` message; the next round's answer is text, and a short user message follows. Without tools each
round appends the reply and a tool output of ``--growth`` tokens as a user message. Reports per-round
TTFT/e2e percentiles and which sessions stalled or failed in which round; JSON + PNG. Exits 0 only if
every session finished every round. Short benchmarks miss what this catches: a decode that stalls once
contexts grow long (the seed's kernel-knob regression).

``--api responses`` drives the same sessions over ``/v1/responses`` as the OpenAI Agents SDK does: each round
sends only what is new (the tool's output, or the user's next message) with ``previous_response_id``, and the
gateway's stored conversation supplies the rest; its events are read as the SDK reads them.

``--compare`` runs the same sessions against pdgate's policies and sglang-router's cache_aware on one set
of sims with a prefix cache (loadtest/affinity.py).
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

from loadtest.output import pyplot, save, up_model, verdict_command

WORDS = "alpha beta gamma delta file line error value result test build log path query row column".split()


def tool_result(rng: random.Random, tokens: int) -> str:
    return "tool output: " + " ".join(rng.choice(WORDS) for _ in range(tokens))


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file of the repository",
                                          "parameters": {"type": "object", "required": ["path"], "properties": {
                                              "path": {"type": "string"}, "lines": {"type": "integer"}}}}}]


async def turn(http: aiohttp.ClientSession, a: argparse.Namespace, messages: list[dict[str, Any]],
               sid: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"model": a.model, "messages": messages, "max_tokens": a.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if getattr(a, "tools", False):
        body["tools"] = TOOLS
    headers = {"x-pdgate-timeout": str(a.deadline)} if a.deadline else {}
    if sid:
        headers["x-session-id"] = sid
    t0 = time.monotonic()
    ttft = None
    text: list[str] = []
    call: dict[str, str] = {}
    usage: dict[str, Any] = {}
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
                    usage = obj.get("usage") or usage
                    for c in obj.get("choices", []):
                        delta = c.get("delta") or {}
                        piece = delta.get("content")
                        for tc in delta.get("tool_calls") or ():
                            fn = tc.get("function") or {}
                            call["id"] = call.get("id", "") + (tc.get("id") or "")
                            call["name"] = call.get("name", "") + (fn.get("name") or "")
                            piece = fn.get("arguments") or piece or " "
                            call["arguments"] = call.get("arguments", "") + (fn.get("arguments") or "")
                        if piece:
                            ttft = ttft if ttft is not None else time.monotonic() - t0
                            text.append(piece)
    except TimeoutError:
        return {"ok": False, "why": "client deadline: stalled", "ttft": ttft, "e2e": time.monotonic() - t0}
    except (aiohttp.ClientError, OSError) as exc:
        return {"ok": False, "why": f"{exc.__class__.__name__}: {exc}", "e2e": time.monotonic() - t0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ok": True, "ttft": ttft, "e2e": time.monotonic() - t0, "text": "".join(text), "call": call or None,
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached}


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


async def turn_responses(http: aiohttp.ClientSession, a: argparse.Namespace, new: list[dict[str, Any]],
                         prev: str | None, instructions: str, sid: str) -> dict[str, Any]:
    """One round over /v1/responses: only ``new`` input items, the rest by ``previous_response_id``."""
    body: dict[str, Any] = {"model": a.model, "input": new, "instructions": instructions,
                            "max_output_tokens": a.max_tokens, "stream": True}
    if prev:
        body["previous_response_id"] = prev
    if getattr(a, "tools", False):
        body["tools"] = RESPONSES_TOOLS
    headers = {"x-pdgate-timeout": str(a.deadline)} if a.deadline else {}
    if sid:
        headers["x-session-id"] = sid
    t0 = time.monotonic()
    ttft = None
    text: list[str] = []
    call: dict[str, str] = {}
    final: dict[str, Any] | None = None
    try:
        async with asyncio.timeout(a.deadline + 5 if a.deadline else None):
            async with http.post(a.gateway + "/v1/responses", json=body, headers=headers) as r:
                if r.status != 200:
                    return {"ok": False, "why": f"http {r.status}: {(await r.text())[:200]}", "e2e": time.monotonic() - t0}
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    ev = orjson.loads(line[6:])
                    kind = ev.get("type")
                    if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        if kind == "response.output_text.delta":
                            text.append(ev["delta"])
                    elif kind == "response.output_item.added" and ev["item"]["type"] == "function_call":
                        call = {"id": ev["item"]["call_id"], "name": ev["item"]["name"]}
                    elif kind == "response.failed":
                        err = ev["response"].get("error") or {}
                        return {"ok": False, "why": err.get("message", "response.failed"), "ttft": ttft,
                                "e2e": time.monotonic() - t0}
                    elif kind in ("response.completed", "response.incomplete"):
                        final = ev["response"]
    except TimeoutError:
        return {"ok": False, "why": "client deadline: stalled", "ttft": ttft, "e2e": time.monotonic() - t0}
    except (aiohttp.ClientError, OSError) as exc:
        return {"ok": False, "why": f"{exc.__class__.__name__}: {exc}", "e2e": time.monotonic() - t0}
    if final is None:
        return {"ok": False, "why": "the stream ended without a terminal event", "ttft": ttft, "e2e": time.monotonic() - t0}
    usage = final.get("usage") or {}
    return {"ok": True, "ttft": ttft, "e2e": time.monotonic() - t0, "text": "".join(text), "call": call or None,
            "response_id": final["id"], "prompt_tokens": usage.get("input_tokens"),
            "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens")}


async def session_responses(http: aiohttp.ClientSession, a: argparse.Namespace, sid: int,
                            rounds: list[list[dict[str, Any]]], failures: list[dict[str, Any]]) -> None:
    """``session``'s rounds over /v1/responses, continued by ``previous_response_id``."""
    rng = random.Random(a.seed * 1000 + sid)
    context = f" The repository: {tool_result(rng, a.system_tokens)}" if a.system_tokens else ""
    instructions = f"You are agent {sid}.{context}"
    new: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing build."}]
    prev: str | None = None
    words = len(instructions.split())
    for rnd in range(a.rounds):
        if rnd and a.think_ms:
            await asyncio.sleep(rng.uniform(0, 2 * a.think_ms) / 1000)
        words += sum(len(str(m.get("content") or m.get("output") or "").split()) for m in new)
        res = await turn_responses(http, a, new, prev, instructions, f"agent-{a.seed}-{sid}")
        res["session"] = sid
        res["context_words"] = words
        rounds[rnd].append(res)
        if not res["ok"]:
            failures.append({"session": sid, "round": rnd + 1, "why": res["why"], "context_words": words})
            return
        prev, call, text = res.pop("response_id"), res.pop("call"), res.pop("text")
        words += len(text.split())
        res["tool_call"] = call is not None
        if call is not None:
            new = [{"type": "function_call_output", "call_id": call["id"], "output": tool_result(rng, a.growth)}]
        elif getattr(a, "tools", False):
            new = [{"role": "user", "content": "Go on: next file."}]
        else:
            new = [{"role": "user", "content": tool_result(rng, a.growth)}]


async def session(http: aiohttp.ClientSession, a: argparse.Namespace, sid: int, rounds: list[list[dict[str, Any]]],
                  failures: list[dict[str, Any]]) -> None:
    if getattr(a, "api", "chat") == "responses":
        await session_responses(http, a, sid, rounds, failures)
        return
    rng = random.Random(a.seed * 1000 + sid)
    context = f" The repository: {tool_result(rng, a.system_tokens)}" if a.system_tokens else ""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {sid}.{context}"},
                                      {"role": "user", "content": "Fix the failing build."}]
    for rnd in range(a.rounds):
        if rnd and a.think_ms:  # the tool runs, the agent thinks: sessions drift apart as real ones do
            await asyncio.sleep(rng.uniform(0, 2 * a.think_ms) / 1000)
        res = await turn(http, a, messages, f"agent-{a.seed}-{sid}")
        res["session"] = sid
        res["context_words"] = sum(len(str(m.get("content") or "").split()) for m in messages)
        rounds[rnd].append(res)
        if not res["ok"]:
            failures.append({"session": sid, "round": rnd + 1, "why": res["why"], "context_words": res["context_words"]})
            return
        call = res.pop("call")
        text = res.pop("text")
        res["tool_call"] = call is not None
        if call is not None:  # the model asked for a tool: its result goes back
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                             {"id": call.get("id", ""), "type": "function",
                              "function": {"name": call.get("name", ""), "arguments": call.get("arguments", "")}}]},
                         {"role": "tool", "tool_call_id": call.get("id", ""), "content": tool_result(rng, a.growth)}]
        elif getattr(a, "tools", False):  # the model answered: the user asks for the next step
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on: next file."}]
        else:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": tool_result(rng, a.growth)}]


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
        prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
        cached = sum(r.get("cached_tokens") or 0 for r in ok)
        per_round.append({"round": i + 1, "requests": len(rs), "ok": len(ok), "tool_calls": sum(1 for r in ok if r.get("tool_call")),
                          "prompt_tokens": prompt, "cached_tokens": cached,
                          "context_words_median": statistics.median(r["context_words"] for r in rs) if rs else None,
                          "ttft_p50_ms": pct([r.get("ttft") for r in ok], 0.5), "ttft_p95_ms": pct([r.get("ttft") for r in ok], 0.95),
                          "ttft_p99_ms": pct([r.get("ttft") for r in ok], 0.99),
                          "e2e_p50_ms": pct([r["e2e"] for r in ok], 0.5), "e2e_p95_ms": pct([r["e2e"] for r in ok], 0.95)})
    ttfts = [r.get("ttft") for rs in rounds for r in rs if r["ok"]]
    return {"gateway": a.gateway, "api": getattr(a, "api", "chat"), "sessions": a.sessions, "rounds": a.rounds,
            "growth": a.growth, "deadline": a.deadline,
            "tools": bool(getattr(a, "tools", False)), "seconds": round(time.monotonic() - t0, 2),
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99), "per_round": per_round,
            "failures": sorted(failures, key=lambda f: (f["round"], f["session"])),
            "verdict": "PASS" if not failures else "FAIL"}


def report(console: Console, out: dict[str, Any]) -> None:
    t = Table(title=f"agents over {out.get('api', 'chat')}: {out['sessions']} sessions x {out['rounds']} rounds, "
                    f"+{out['growth']} tokens/round: {out['verdict']}")
    for col in ("round", "ok/sent", "context words", "cached %", "ttft p50 ms", "ttft p95 ms", "e2e p50 ms",
                "e2e p95 ms"):
        t.add_column(col, justify="right")
    for r in out["per_round"]:
        share = f"{100 * r['cached_tokens'] / r['prompt_tokens']:.0f}" if r["prompt_tokens"] else "-"
        t.add_row(str(r["round"]), f"{r['ok']}/{r['requests']}", str(r["context_words_median"]), share,
                  str(r["ttft_p50_ms"]), str(r["ttft_p95_ms"]), str(r["e2e_p50_ms"]), str(r["e2e_p95_ms"]))
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
    ax[0].set_ylabel("latency (ms)")
    ax[0].set_title("latency by round")
    ax[0].legend(fontsize=7)
    ax[1].bar(xs, [r["requests"] - r["ok"] for r in pr], color="red", label="stalled or failed")
    ax[1].set_xlabel("round")
    ax[1].set_ylabel("sessions")
    ax[1].set_title("sessions that stalled or failed")
    ax[1].legend(fontsize=7)
    fig.suptitle(f"agents: {out['verdict']}")
    fig.tight_layout()
    save(fig, path)


def add_parser(sub: Any) -> None:
    from loadtest import affinity

    p = sub.add_parser("agents", help="multi-round agent sessions with growing context")
    p.add_argument("--gateway", help="the gateway to drive (not with --compare, which starts its own)")
    p.add_argument("--tools", action=argparse.BooleanOptionalAction, default=True,
                   help="rounds alternate tool call / answer as an agent's do (default on)")
    p.add_argument("--api", choices=("chat", "responses"), default="chat",
                   help="chat: every round resends the history to /v1/chat/completions; responses: /v1/responses with "
                   "previous_response_id, only what is new sent (as the OpenAI Agents SDK does)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--growth", type=int, default=2000, help="tokens of tool output appended per round")
    p.add_argument("--deadline", type=float, default=120, help="per-request deadline, seconds (sent as x-pdgate-timeout)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=0,
                   help="tokens of the session's own context in its system message (a coding agent's repository files)")
    p.add_argument("--think-ms", type=float, default=100,
                   help="mean pause between a session's rounds (uniform in 0..2x), ms: tools take time to run")
    affinity.add_flags(p)
    verdict_command(p, "agents", run, report, plot)
    single = p.get_default("func")

    def main(a: argparse.Namespace) -> None:
        if a.model is None:  # --compare starts sims of its own: theirs
            a.model = up_model(None if a.compare else a.gateway)
        if a.compare:
            affinity.main(a)
        elif not a.gateway:
            p.error("--gateway is required (or --compare)")
        else:
            single(a)

    p.set_defaults(func=main)
