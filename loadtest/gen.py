"""Load generator, run as its own process: closed loop (N connections) or open loop (R req/s).

Modes: ``gateway`` sends one request per op to a gateway; ``direct`` plays the router
itself and sends both PD legs (with bootstrap fields) straight to a prefill and a decode
worker, which is what "direct to the engines" means for PD; ``direct-vllm`` does as vLLM's toy proxy
does for a vLLM pair (the prefill with ``kv_transfer_params`` and one token, then the decode with its answer's
params). Prints one JSON object.

Goodput: the requests (and their completion tokens) that met the SLO, a first token within ``--slo-ttft-ms``
and the whole answer within ``--slo-total-ms`` of its start (an open loop: of its scheduled arrival), per second,
beside raw throughput. Tokens are counted from the answer: a stream's data events less ``[DONE]``, a whole answer's
``usage.completion_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import time
from typing import Any

import aiohttp
import orjson
import uvloop


def body(stream: bool, max_tokens: int, model: str = "sim-model") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "say hi"}], "max_tokens": max_tokens,
            "stream": stream}


TPOT: list[float] = []  # per request: (last chunk - first chunk) / (events - 1), streaming only


USAGE = b'"completion_tokens":'


async def one_gateway(s: aiohttp.ClientSession, url: str, data: bytes, stream: bool,
                      headers: dict[str, str] | None = None) -> tuple[bool, float, int]:
    """Whether it answered 200, its time to first token, and its completion tokens."""
    t0 = time.perf_counter()
    ttft = 0.0
    tokens = 0
    async with s.post(url, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
        if stream:
            events, last = 0, 0.0
            async for chunk in r.content.iter_any():
                last = time.perf_counter() - t0
                if not ttft:
                    ttft = last
                events += chunk.count(b"\n\n")
            if events > 2:  # the last event is [DONE]
                TPOT.append((last - ttft) / (events - 2))
            tokens = max(0, events - 1)
        else:
            answer = await r.read()
            ttft = time.perf_counter() - t0
            i = answer.find(USAGE)
            if i >= 0:
                digits = answer[i + len(USAGE):i + len(USAGE) + 12].lstrip(b" ")
                n = len(digits) - len(digits.lstrip(b"0123456789"))
                tokens = int(digits[:n] or b"0")
        return r.status == 200, ttft, tokens


async def one_direct(s: aiohttp.ClientSession, a: argparse.Namespace, b: dict[str, Any],
                     stream: bool) -> tuple[bool, float, int]:
    room = random.getrandbits(63)
    data = orjson.dumps({**b, "bootstrap_host": "127.0.0.1", "bootstrap_port": a.bootstrap_port, "bootstrap_room": room})

    async def prefill() -> bool:
        async with s.post(a.prefill + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status == 200

    p = asyncio.ensure_future(prefill())
    ok, ttft, tokens = await one_gateway(s, a.decode + "/v1/chat/completions", data, stream)
    return (await p) and ok, ttft, tokens


VLLM_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def one_direct_vllm(s: aiohttp.ClientSession, a: argparse.Namespace, b: dict[str, Any],
                          stream: bool) -> tuple[bool, float, int]:
    """vLLM's toy proxy: the prefill (one token, not streamed, asking for a remote decode), then the decode with the
    prefill answer's ``kv_transfer_params``; the time to first token counts from the prefill's start."""
    rid = f"gen-{random.getrandbits(64):016x}"
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    t0 = time.perf_counter()
    async with s.post(a.prefill + "/v1/chat/completions", headers=headers, data=orjson.dumps(
            {**b, "max_tokens": 1, "stream": False, "kv_transfer_params": VLLM_PREFILL})) as r:
        answer = await r.read()
        if r.status != 200:
            return False, 0.0, 0
    params = orjson.loads(answer).get("kv_transfer_params")
    took = time.perf_counter() - t0
    ok, ttft, tokens = await one_gateway(s, a.decode + "/v1/chat/completions", orjson.dumps(
        {**b, "kv_transfer_params": params}), stream, headers)
    return ok, took + ttft, tokens


async def run(a: argparse.Namespace) -> dict[str, Any]:
    b = body(a.stream, a.max_tokens, a.model)
    data = orjson.dumps(b)
    lat: list[float] = []
    ttfts: list[float] = []
    errors = good = tokens_all = tokens_good = 0
    slo_ttft, slo_total = a.slo_ttft_ms / 1000, a.slo_total_ms / 1000
    end = time.perf_counter() + a.duration
    warm_end = time.perf_counter() + a.warmup
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def op(t0: float) -> None:
            nonlocal errors, good, tokens_all, tokens_good
            sent = time.perf_counter()
            try:
                if a.mode == "direct":
                    ok, ttft, n = await one_direct(s, a, b, a.stream)
                elif a.mode == "direct-vllm":
                    ok, ttft, n = await one_direct_vllm(s, a, b, a.stream)
                else:
                    ok, ttft, n = await one_gateway(s, a.url + "/v1/chat/completions", data, a.stream)
            except (aiohttp.ClientError, TimeoutError, ValueError):  # ValueError: an answer that is not JSON
                ok, ttft, n = False, 0.0, 0
            if t0 < warm_end:
                return
            if ok:
                took = time.perf_counter() - t0
                lat.append(took)
                ttfts.append(ttft)
                tokens_all += n
                if ttft + (sent - t0) <= slo_ttft and took <= slo_total:  # from its arrival, as the client sees it
                    good += 1
                    tokens_good += n
            else:
                errors += 1

        async def closed_loop() -> None:
            while (now := time.perf_counter()) < end:
                await op(now)

        async def open_loop() -> None:
            """Poisson arrivals at --rate; latency counts from the scheduled arrival time."""
            rng = random.Random(1)
            pending: set[asyncio.Task[None]] = set()
            t = time.perf_counter()
            while t < end:
                t += rng.expovariate(a.rate)
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
                task = asyncio.ensure_future(op(t))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.wait(pending, timeout=60)

        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t_start = time.perf_counter()
        if a.rate:
            await open_loop()
        else:
            await asyncio.gather(*(closed_loop() for _ in range(a.concurrency)))
        wall = time.perf_counter() - t_start - a.warmup
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
    lat.sort()
    ttfts.sort()

    def pct(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3) if xs else 0.0

    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"ok": len(lat), "errors": errors, "seconds": round(wall, 3), "rps": round(len(lat) / wall, 1),
            "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "ttft_p50_ms": pct(ttfts, 0.5),
            "ttft_p99_ms": pct(ttfts, 0.99), "tpot_p50_ms": pct(sorted(TPOT), 0.5), "tpot_p99_ms": pct(sorted(TPOT), 0.99),
            "tokens_s": round(tokens_all / wall, 1), "goodput_rps": round(good / wall, 1),
            "goodput_tokens_s": round(tokens_good / wall, 1), "slo_met": round(good / max(len(lat) + errors, 1), 4),
            "slo_ttft_ms": a.slo_ttft_ms, "slo_total_ms": a.slo_total_ms,
            "generator_cpu_s": round(cpu, 3),
            "generator_cpu_share": round(cpu / (wall + a.warmup), 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.gen")
    p.add_argument("--mode", choices=("gateway", "direct", "direct-vllm"), default="gateway")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--url", default="")
    p.add_argument("--prefill", default="")
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--decode", default="")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop: connections")
    p.add_argument("--rate", type=float, default=0, help="open loop: requests/s (Poisson); overrides --concurrency")
    p.add_argument("--duration", type=float, default=10)
    p.add_argument("--warmup", type=float, default=1)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=500, help="goodput: the first token within this")
    p.add_argument("--slo-total-ms", type=float, default=2000, help="goodput: the whole answer within this")
    a = p.parse_args(argv)
    a.duration += a.warmup
    out = uvloop.run(run(a))
    sys.stdout.write(orjson.dumps(out).decode() + "\n")


if __name__ == "__main__":
    main()
