"""The oracle: generated scenarios against the real gateway and real sim processes, every request checked
against the promise (issue 12).

A scenario is a handful of requests (route x stream x budgets, idle sometimes shorter than the time to the
first token) x client behaviour (reads all, leaves before the first token or mid-stream, reads slowly) x
faults switched at random moments (every sim fault, SIGKILL and SIGSTOP of a worker) x the sims'
re-segmentation of every response (cut at random offsets, merged), sometimes a drain or an operator abort
at the very moment a deadline expires. ``check_record`` / ``check_client`` name the invariant a request broke, and ``run`` adds the
scenario's seed; the same seed replays the sims' segmentation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from hypothesis import strategies as st

from pdgate.config import AdmissionConfig, DeadlineConfig, HealthConfig, ReconcileConfig
from pdgate.record import Phase, Record
from pdgate.scope import Cause, Reason
from tests.engine.simclient import engine_requests, set_faults
from tests.pdgate.harness import Running, make_config, start_gateway
from tests.pdgate.sse import Seen, call
from tests.procs import Procs, Sim, wait_http

TOL = 0.35  # seconds a terminal answer may come after the budget that applies (timers, a loaded 2-core CI)
TOTAL, TTFT, IDLE = 4.0, 3.0, 2.0  # the gateway's defaults in the oracle: every scenario ends within seconds
DECODE_ARGS = ("--speed", "8")  # ~30 ms a token: streams last long enough for faults to land in them
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
SIM_FAULTS = ("slow_prefill", "decode_freeze", "decode_stall", "http_500_rate", "slow_first_token", "decode_crash", "abort_race",
              "ack_loss", "bootstrap_loss", "slow_accept")
OFF = {"slow_prefill": 0, "decode_freeze": False, "decode_stall": False, "http_500_rate": 0, "slow_first_token": 0, "decode_crash": False,
       "abort_race": False, "ack_loss": False, "bootstrap_loss": False, "slow_accept": 0}


@dataclass(frozen=True)
class Req:
    route: str
    stream: bool
    max_tokens: int
    total: float | None
    ttft: float | None
    idle: float | None
    client: str  # "reads" | "leaves_before_first" | "leaves_mid" | "slow_reader"
    leave_after: int
    start: float


@dataclass(frozen=True)
class Fault:
    at: float
    worker: int  # index into the scenario's sims, or ALL_DECODES
    kind: str  # a sim fault, or "sigkill" / "sigstop"
    value: float
    lasts: float


@dataclass(frozen=True)
class Scenario:
    seed: int
    segment: float
    reqs: tuple[Req, ...]
    faults: tuple[Fault, ...]
    drain: float | None  # seconds after the start, or None
    drain_s: float
    at_deadline: str | None  # "drain" | "abort": fired by a timer at the first request's due time
    capacity: int = 0  # admission control's capacity per worker (0: the engines' 1024, nothing queues)


budget = st.one_of(st.none(), st.floats(0.1, 3.0).map(lambda x: round(x, 2)), st.sampled_from((0.2, 0.5, 1.0)))


@st.composite
def requests(draw: st.DrawFn) -> Req:
    stream = draw(st.booleans())
    client = draw(st.sampled_from(("reads", "reads", "leaves_before_first", "leaves_mid", "slow_reader")))
    return Req(route=draw(st.sampled_from(ROUTES)), stream=stream, max_tokens=draw(st.integers(1, 24)),
               total=draw(budget), ttft=draw(budget), idle=draw(budget) if stream else None, client=client,
               leave_after=draw(st.integers(1, 6)), start=draw(st.floats(0, 0.3)))


ALL_DECODES = 4
DECODE_SIDE = ("decode_freeze", "decode_stall", "slow_first_token", "decode_crash", "ack_loss", "bootstrap_loss")
PREFILL_SIDE = ("slow_prefill",)


@st.composite
def faults(draw: st.DrawFn) -> Fault:
    # stalls of a decode mid-stream (the faults behind most stuck requests) are drawn more often
    kind = draw(st.sampled_from((*SIM_FAULTS, "decode_stall", "decode_stall", "decode_freeze", "sigkill", "sigstop")))
    worker = draw(st.sampled_from((2, 3, ALL_DECODES)) if kind in DECODE_SIDE else st.integers(0, 1) if kind in PREFILL_SIDE
                  else st.integers(0, 3))
    return Fault(at=draw(st.floats(0, 0.8)), worker=worker, kind=kind,
                 value=draw(st.sampled_from((0.3, 0.8, 1.5))), lasts=draw(st.floats(0.2, 2.0)))


@st.composite
def free_scenarios(draw: st.DrawFn) -> Scenario:
    drain = draw(st.one_of(st.none(), st.none(), st.none(), st.floats(0.2, 1.5)))
    return Scenario(seed=draw(st.integers(0, 2**31)), segment=draw(st.sampled_from((0.0, 0.5, 1.0))),
                    reqs=tuple(draw(st.lists(requests(), min_size=1, max_size=4))),
                    faults=tuple(draw(st.lists(faults(), max_size=2))), drain=drain,
                    drain_s=draw(st.sampled_from((0.0, 0.3))),
                    at_deadline=draw(st.sampled_from((None, None, None, "drain", "abort"))),
                    capacity=draw(st.sampled_from((0, 0, 1))))  # 1: requests wait in the gateway's queue


@st.composite
def stalled_streams(draw: st.DrawFn) -> Scenario:
    """The shape behind most stuck requests, drawn often on purpose: streams under way when every decode
    stops making tokens (a gray failure: /health still answers) or answers its first token late."""
    reqs = tuple(Req(route=draw(st.sampled_from(ROUTES)), stream=True, max_tokens=draw(st.integers(12, 40)),
                     total=draw(budget), ttft=draw(budget), idle=draw(st.sampled_from((0.2, 0.4, 0.8))),
                     client="reads", leave_after=1, start=draw(st.floats(0, 0.1)))
                 for _ in range(draw(st.integers(1, 3))))
    kind = draw(st.sampled_from(("decode_stall", "decode_stall", "slow_first_token")))
    fault = Fault(at=draw(st.floats(0.05, 0.4)), worker=ALL_DECODES, kind=kind,
                  value=draw(st.sampled_from((0.5, 1.0, 1.5))), lasts=draw(st.floats(0.8, 2.5)))
    return Scenario(seed=draw(st.integers(0, 2**31)), segment=draw(st.sampled_from((0.0, 0.5, 1.0))), reqs=reqs,
                    faults=(fault,), drain=None, drain_s=0.0, at_deadline=None)


@st.composite
def drained_under_load(draw: st.DrawFn) -> Scenario:
    """A drain while requests are still far from done (every decode stalled): past drain_s each must have its
    answer, not run on to its own deadline."""
    reqs = tuple(Req(route=draw(st.sampled_from(ROUTES)), stream=draw(st.booleans()), max_tokens=draw(st.integers(8, 30)),
                     total=None, ttft=None, idle=None, client="reads", leave_after=1, start=0.0)
                 for _ in range(draw(st.integers(1, 3))))
    fault = Fault(at=draw(st.floats(0.0, 0.2)), worker=ALL_DECODES, kind="decode_stall", value=1.0,
                  lasts=draw(st.floats(2.0, 3.0)))
    return Scenario(seed=draw(st.integers(0, 2**31)), segment=draw(st.sampled_from((0.0, 0.5, 1.0))), reqs=reqs,
                    faults=(fault,), drain=draw(st.floats(0.3, 0.8)), drain_s=draw(st.sampled_from((0.0, 0.3))),
                    at_deadline=None)


scenarios = lambda: st.one_of(free_scenarios(), stalled_streams(), drained_under_load())  # noqa: E731


@dataclass
class Cluster:
    """Two prefill and two decode sims that live across scenarios; a killed one is started again."""

    procs: Procs
    sims: list[Sim] = field(default_factory=list)

    def start(self) -> None:
        for role, extra in (("prefill", ()), ("prefill", ()), ("decode", DECODE_ARGS), ("decode", DECODE_ARGS)):
            self.sims.append(self.procs.sim(role, *extra))

    def revive(self) -> None:
        for i, s in enumerate(self.sims):
            assert s.proc.popen is not None
            if s.proc.popen.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)
                continue
            extra = DECODE_ARGS if s.role == "decode" else ()
            self.sims[i] = self.procs.sim(s.role, *extra, port=s.port, bootstrap_port=s.bootstrap_port, wait=False)
            wait_http(f"{self.sims[i].url}/health", proc=self.sims[i].proc.popen)


def headers(r: Req) -> dict[str, str]:
    out = {}
    for name, v in (("x-pdgate-timeout", r.total), ("x-pdgate-ttft-timeout", r.ttft), ("x-pdgate-idle-timeout", r.idle)):
        if v is not None:
            out[name] = str(v)
    return out


def body(r: Req) -> dict[str, Any]:
    if r.route == "/generate":
        return {"text": "tell me a story", "sampling_params": {"max_new_tokens": r.max_tokens}, "stream": r.stream}
    if r.route == "/v1/completions":
        return {"model": "sim-model", "prompt": "tell me a story", "max_tokens": r.max_tokens, "stream": r.stream}
    return {"model": "sim-model", "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": r.max_tokens, "stream": r.stream}


async def client(http: aiohttp.ClientSession, url: str, r: Req) -> Seen:
    await asyncio.sleep(r.start)
    if r.client == "leaves_before_first" or (r.client == "leaves_mid" and not r.stream):  # gives up after a while
        try:
            return await asyncio.wait_for(call(http, url + r.route, body(r), headers(r)), 0.05 + r.leave_after * 0.05)
        except TimeoutError:
            return Seen(error="left")
    return await call(http, url + r.route, body(r), headers(r), leave_after=r.leave_after if r.client == "leaves_mid" else None,
                      read_delay=0.05 if r.client == "slow_reader" else 0.0)


async def inject(http: aiohttp.ClientSession, cl: Cluster, f: Fault) -> None:
    await asyncio.sleep(f.at)
    if f.worker == ALL_DECODES:
        await asyncio.gather(*(inject(http, cl, dataclasses.replace(f, at=0, worker=i)) for i in (2, 3)))
        return
    s = cl.sims[f.worker]
    if f.kind == "sigkill":
        os.kill(s.proc.pid, signal.SIGKILL)
        return
    if f.kind == "sigstop":
        os.kill(s.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(f.lasts)
        os.kill(s.proc.pid, signal.SIGCONT)
        return
    value: Any = {"http_500_rate": 0.5}.get(f.kind, f.value)
    if f.kind in ("decode_freeze", "decode_stall", "decode_crash", "abort_race", "ack_loss", "bootstrap_loss"):
        value = True
    try:
        await set_faults(http, s, **{f.kind: value})
        await asyncio.sleep(f.lasts)
        await set_faults(http, s, **{f.kind: OFF[f.kind]})
    except aiohttp.ClientError:
        pass  # killed meanwhile


async def at_deadline(g: Running, what: str) -> None:
    """Fire a drain or an operator abort by a timer set to the first live request's due time: the same loop
    iteration as its deadline, two causes at once (first reason wins)."""
    gw = g.gw
    loop = asyncio.get_running_loop()
    for _ in range(100):
        if gw.live:
            break
        await asyncio.sleep(0.01)
    if not gw.live:
        return
    ctx = next(iter(gw.live.values()))
    when = ctx.rec.due()[1] + (loop.time() - gw.now())
    if what == "drain":
        loop.call_at(when, gw.drain, "oracle: at a deadline")
    else:
        loop.call_at(when, ctx.cancel, Reason(Cause.OPERATOR))


async def run(cl: Cluster, sc: Scenario) -> list[str]:
    """One scenario; returns the broken invariants (empty: the promise held)."""
    cl.revive()
    cfg = make_config(cl.sims[:2], cl.sims[2:], drain_s=sc.drain_s, prefill_grace_s=0.5, abort_timeout_s=0.5,
                      deadlines=DeadlineConfig(total_s=TOTAL, ttft_s=TTFT, idle_s=IDLE),
                      health=HealthConfig(interval_s=0.3, timeout_s=0.3, failures=2, degraded_after_s=30),
                      reconcile=ReconcileConfig(interval_s=0.5, grace_s=0.5),
                      admission=AdmissionConfig(capacity=sc.capacity))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for s in cl.sims:
            await set_faults(http, s, **OFF, segment=sc.segment, segment_seed=sc.seed)
        g = await start_gateway(cfg)
        closed = False
        try:
            work = [asyncio.create_task(client(http, g.url, r)) for r in sc.reqs]
            side = [asyncio.create_task(inject(http, cl, f)) for f in sc.faults]
            if sc.at_deadline:
                side.append(asyncio.create_task(at_deadline(g, sc.at_deadline)))
            drained_at = None
            if sc.drain is not None:
                await asyncio.sleep(sc.drain)
                drained_at = time.monotonic()
                await g.close()
                closed = True
            seen = await asyncio.gather(*work)
            await asyncio.gather(*side)
            cl.revive()
            for _ in range(int((TOTAL + TOL) / 0.02)):  # clients that left: the gateway notices at once, not before they go
                if not g.gw.live:
                    break
                await asyncio.sleep(0.02)
            problems = [p for r, s in zip(sc.reqs, seen, strict=True) for p in check_client(g, r, s, drained_at)]
            drain_by = None if drained_at is None else drained_at + sc.drain_s
            problems += [p for rec in list(g.gw.traces.finished.values()) for p in check_record(rec, drain_by)]
            problems += [f"terminal-outcome: {rid} still live" for rid in g.gw.traces.live]
            problems += queue_leftovers(g)
            problems += await leftovers(http, g, cl)
        finally:
            if not closed:
                await g.close()
    return [f"{p} [seed {sc.seed}]" for p in problems]


def queue_leftovers(g: Running) -> list[str]:
    """Admission control leaves nothing behind: an empty queue, no slot reserved for a request that is gone."""
    out = [f"queue-empty: {g.gw.gate.queue.n} requests still queued"] if g.gw.gate.queue.n else []
    out += [f"queue-empty: {w.id} still has {w.slots.reserved} reserved slots" for w in g.gw.pool.by_id.values()
            if w.slots.reserved]
    return out


def check_record(rec: Record, drain_by: float | None = None) -> list[str]:
    """What every finished record must show, whoever ended it: no life past the budget due, nor past the
    drain (``drain_by``: when the drain started + drain_s), and a deadline outcome that names the budget that
    was due first given its recorded token times."""
    if rec.live or rec.finished_at is None:
        return [f"terminal-outcome: {rec.id} has no terminal record"]
    out = []
    end = rec.finished_at
    if drain_by is not None and rec.created < drain_by and end > drain_by + TOL:
        out.append(f"drain-answers: {rec.id} ended {end - drain_by:.3f}s after the drain's end ({rec.outcome}: {rec.reason})")
    kind, due_at = rec.due()
    if end > due_at + TOL:
        out.append(f"within-deadline: {rec.id} ended {end - due_at:.3f}s after its {kind} budget was due "
                   f"({rec.outcome.value if rec.outcome else None}: {rec.reason})")
    ft = rec.first_token_at
    if ft is not None and ft - rec.created > rec.deadlines.ttft_s + TOL:
        out.append(f"ttft-enforced: {rec.id} got its first token {ft - rec.created:.3f}s in, past its TTFT budget "
                   f"of {rec.deadlines.ttft_s:g}s")
    if rec.outcome is Phase.DEADLINE_EXCEEDED:
        named = (rec.reason or "").split(" ", 1)[0]
        if named != kind:
            out.append(f"budget-named: {rec.id} says {named}, but {kind} was due first given its token times")
        elif end < due_at - 0.01:
            out.append(f"budget-named: {rec.id} expired {due_at - end:.3f}s before its {kind} budget was due")
    return out


def check_client(g: Running, r: Req, s: Seen, drained_at: float | None) -> list[str]:
    """What the client must have seen: a terminal answer that agrees with the record."""
    if s.error == "left":
        return []
    if s.rid is None and drained_at is not None and s.sent_at >= drained_at and "Connect call failed" in (s.error or ""):
        return []  # sent after the gateway stopped listening: refused, as it should be
    if s.rid is None:
        return [f"terminal-answer: {r} got no answer: {s.error}"]
    rec = g.gw.traces.get(s.rid)
    if rec is None or rec.live:
        return [f"terminal-outcome: {s.rid} has no terminal record"]
    out = []
    if s.error is not None:
        out.append(f"terminal-answer: {s.rid} ({r.client}) broken answer: {s.error}")
    elif r.stream and s.status == 200:
        if s.done_count != 1 or not s.events or s.events[-1][1] != b"[DONE]":
            out.append(f"one-done: {s.rid} stream ended with {s.done_count} [DONE] ({rec.outcome}: {rec.reason})")
        if rec.outcome is Phase.COMPLETED:
            if s.error_events:
                out.append(f"one-done: {s.rid} completed but the client got an error event")
            if len(s.tokens) != rec.chunks:
                out.append(f"tokens-agree: {s.rid} client saw {len(s.tokens)} tokens, the record {rec.chunks}")
        elif not s.error_events:
            out.append(f"terminal-answer: {s.rid} {rec.outcome} stream without an error event")
    elif s.status != 200:
        try:
            err = s.json["error"]
            ok = isinstance(err["message"], str) and bool(err["code"])
        except Exception:
            ok = False
        if not ok:
            out.append(f"terminal-answer: {s.rid} status {s.status} without an OpenAI error body: {s.body[:80]!r}")
        if s.status != rec.status:
            out.append(f"status-agrees: {s.rid} client got {s.status}, the record says {rec.status}")
    if r.stream and s.events and r.client != "slow_reader":  # no gap between tokens the idle budget allows
        times = [t for t, _ in s.events]
        gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        if gap > rec.deadlines.idle_s + TOL:
            out.append(f"idle-enforced: {s.rid} client waited {gap:.3f}s between events, its idle budget is "
                       f"{rec.deadlines.idle_s:g}s ({rec.outcome}: {rec.reason})")
    if r.stream and s.tokens and rec.first_token_at is not None and r.client != "slow_reader":
        seen_ttft = s.tokens[0] - s.sent_at
        if abs(seen_ttft - (rec.first_token_at - rec.created)) > 0.1:
            out.append(f"ttft-agrees: {s.rid} client saw TTFT {seen_ttft:.3f}s, "
                       f"recorded {rec.first_token_at - rec.created:.3f}s")
    return out


async def leftovers(http: aiohttp.ClientSession, g: Running, cl: Cluster) -> list[str]:
    """Afterwards nothing is live in the gateway and every engine is empty within reconcile interval + grace
    (+ the abort repeats and a health interval)."""
    if g.gw.live:
        return [f"gateway-clean: live requests left: {list(g.gw.live)}"]
    end = time.monotonic() + 0.5 + 0.5 + 1.25 + 2.0
    held: dict[str, Any] = {}
    while time.monotonic() < end:
        held = {}
        for s in cl.sims:
            try:
                reqs = await engine_requests(http, s)
            except aiohttp.ClientError:
                continue
            if reqs:
                held[s.url] = reqs
        if not held:
            return []
        await asyncio.sleep(0.1)
    return [f"engines-clean: still held: {held}"]
