"""What pdgate's own request path costs a request, without sockets: CPU microseconds a request of the whole path
(admission, gate, lease, both legs, outcome, every observer on ``pdgate serve``'s defaults, the lineage record
included) driven in memory, in one process.

The closed loop's figure (``scripts/ab_hotpath.sh``, ``loadtest bench --compare``) is this plus h1lite's side of it
(parsing the client's request, writing its answer, both legs' sockets), and moves by 10-20% between runs on a shared
two-core machine; this one moves by a few percent, so a change to the request path is judged here first
(``python benchmarks/path_cost.py``, run alternately for two checkouts from their own directories), then in the
closed loop. ``--knock NAMES``: with those features knocked out (``scripts/knockout_serve.py``'s names, or ``all``).

The engines answer at once (one turn of the loop each, as a socket's answer comes in a later turn): an SGLang pair's
non-streaming answers, 16 completion tokens, as ``loadtest.fakeworker`` gives them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from h1lite.server import Request
from loadtest.procs import knockout_module
from pdgate.core.config import GatewayConfig, WorkerSpec, validate
from pdgate.path.gateway import Gateway
from pdgate.planes.cli import GC_THRESHOLDS
from pdgate.pool.lineage import RECORD_S

BODY = orjson.dumps({"model": "mem-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16})
DECODE = orjson.dumps({"id": "x", "object": "chat.completion", "model": "mem-model", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "tok " * 16}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}})
INFO = {"prefill": orjson.dumps({"served_model_name": "mem-model", "max_running_requests": 1024,
                                 "disaggregation_mode": "prefill"}),
        "decode": orjson.dumps({"served_model_name": "mem-model", "max_running_requests": 1024,
                                "disaggregation_mode": "decode"})}


class Transport:
    """The engines in memory: every call answered whole after one turn of the loop."""

    stale_retries = 0

    async def fetch(self, base: str, method: str, target: str, body: bytes = b"", content_type: bytes = b"",
                    headers: Any = None, limit: int | None = None) -> tuple[int, bytes]:
        await asyncio.sleep(0)
        role = "prefill" if base.startswith("http://prefill") else "decode"
        if method == "GET":
            return (200, INFO[role]) if target.startswith("/server_info") else (200, b"{}")
        return 200, (b"{}" if role == "prefill" else DECODE)

    async def request(self, *a: Any, **kw: Any) -> Any:
        raise NotImplementedError("streams are not measured here")

    def limit(self, base: str, max_open: int) -> None:
        pass

    def drop(self, base: str) -> None:
        pass

    def close(self) -> None:
        pass


class Proto:
    """What h1lite's ``Request`` uses of its connection."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.task, self.closed, self.paused, self.transport = loop, None, False, False, self

    def write(self, data: bytes) -> None:
        pass


async def run(n: int, conc: int, state_dir: str) -> float:
    cfg = validate(GatewayConfig(prefill=(WorkerSpec(url="http://prefill0.mem:1", role="prefill", bootstrap_port=8998),),
                                 decode=(WorkerSpec(url="http://decode0.mem:1", role="decode"),), state_dir=state_dir))
    gw = Gateway(cfg, transport=Transport())  # type: ignore[arg-type]
    await asyncio.gather(*(gw.health.check(w) for w in gw.pool.by_id.values()))
    loop = asyncio.get_running_loop()
    # the lineage as ``pdgate serve`` runs it (``Control.start`` and ``Control.record``): told of every attempt,
    # written every RECORD_S
    gw.lineage.start()
    assert gw.lineage.enabled
    gw.obs.lineage = gw.lineage

    async def record() -> None:
        while True:
            gw.lineage.record(gw.now(), {w.id: w.url for w in gw.pool.by_id.values()})
            await asyncio.sleep(RECORD_S)

    recorder = loop.create_task(record())
    handle = gw.pipeline.handle
    headers = {"content-type": "application/json", "host": "127.0.0.1"}

    async def client(k: int) -> None:
        for _ in range(k):
            proto = Proto(loop)
            req = Request(proto, "POST", "/v1/chat/completions", "", dict(headers), "1.1")  # type: ignore[arg-type]
            req.body = BODY
            proto.task = asyncio.current_task()  # type: ignore[assignment]
            resp = await handle(req, "/v1/chat/completions")
            assert resp.status == 200, resp.status  # type: ignore[union-attr]

    await asyncio.gather(*(client(100) for _ in range(conc)))  # warm-up
    gc.collect()
    gc.freeze()  # as ``pdgate serve`` after its start
    t0 = time.process_time()
    await asyncio.gather(*(client(n // conc) for _ in range(conc)))
    spent = time.process_time() - t0
    recorder.cancel()
    await gw.stop()
    gw.lineage.close()
    gc.unfreeze()
    return spent / (n // conc * conc) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="the median is reported, with every repeat")
    p.add_argument("--knock", default="", metavar="NAMES", help="features knocked out (scripts/knockout_serve.py)")
    a = p.parse_args(argv)
    knocked = list(knockout_module().apply(a.knock)) if a.knock else []  # its checks included
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    gc.set_threshold(*GC_THRESHOLDS)  # as ``pdgate serve``
    runs = []
    with tempfile.TemporaryDirectory() as state_dir:
        for _ in range(a.repeats):
            runs.append(round(asyncio.run(run(a.requests, a.concurrency, state_dir)), 2))
    runs_sorted = sorted(runs)
    print(json.dumps({"us_per_request": runs_sorted[len(runs) // 2], "runs": runs, "knocked": knocked,
                      "pdgate": str(Path(sys.modules["pdgate"].__file__ or "").parent)}))


if __name__ == "__main__":
    main()
