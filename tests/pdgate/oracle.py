"""The oracle: generated scenarios against the real gateway and real sim processes, every request checked
against the promise.

A scenario is a handful of requests (route x stream x budgets, idle sometimes shorter than the time to the
first token) x client behaviour (reads all, leaves before the first token or mid-stream, reads slowly) x
faults switched at random moments (every sim fault, SIGKILL and SIGSTOP of a worker) x the sims'
re-segmentation of every response (cut at random offsets, merged), sometimes a drain or an operator abort
at the very moment a deadline expires. Some shapes are drawn on purpose, each for the mechanism it needs:
streams whose decodes stall (idle, re-arming), a drain under load, a deadline and a drain or abort at once,
legs the gateway alone can free (reconciliation off, a decode that notices a gone client late), and aborts
that are lost (only reconciliation frees them).

The oracle trusts nothing the gateway says: it computes each request's budgets from what it sent (its
headers, the config's defaults and caps) and judges deadlines and gaps on the client's own clock (its send
and receive times); every answer is checked (a 200's body parses, its text and token count are what the
decode sim says it sent); the gateway's record is read only to cross-check the status it recorded, and its
live tables only to find leaks. ``check_client`` names the invariant a request broke and ``run`` adds the
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
import orjson
from hypothesis import strategies as st

from pdgate.core.config import AdmissionConfig, DeadlineConfig, HealthConfig, ReconcileConfig
from pdgate.path.scope import Cause, Reason
from tests.engine.simclient import engine_requests, set_faults
from tests.pdgate.harness import Running, make_config, start_gateway
from tests.pdgate.sse import DELTA, Seen, anthropic_error, call
from tests.procs import Procs, Sim, wait_http

TOL = 0.35  # seconds a terminal answer may come after the budget that applies (timers, a loaded 2-core CI)
TOTAL, TTFT, IDLE = 4.0, 3.0, 2.0  # the gateway's defaults in the oracle: every scenario ends within seconds
MAX_TOTAL, MAX_TTFT, MAX_IDLE = DeadlineConfig().max_total_s, DeadlineConfig().max_ttft_s, DeadlineConfig().max_idle_s
# the sims notice a client that left only after this (SGLang: SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s by default):
# an engine that notices late, so that only the gateway's aborts free what it leaves
SIM_ENV = {"SGLANG_REQUEST_STATE_WAIT_TIMEOUT": "30"}
DECODE_ARGS = ("--speed", "8")  # ~30 ms a token: streams last long enough for faults to land in them
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses", "/v1/messages")
SIM_FAULTS = ("slow_prefill", "decode_freeze", "decode_stall", "http_500_rate", "slow_first_token", "decode_crash", "abort_race",
              "ack_loss", "bootstrap_loss", "slow_accept", "done_stall")
OFF = {"slow_prefill": 0, "decode_freeze": False, "decode_stall": False, "http_500_rate": 0, "slow_first_token": 0, "decode_crash": False,
       "abort_race": False, "ack_loss": False, "bootstrap_loss": False, "slow_accept": 0, "split_stall": 0,
       "done_stall": 0}


@dataclass(frozen=True)
class Req:
    route: str
    stream: bool
    max_tokens: int
    total: float | None  # the budgets it asks for in its headers (None: not sent)
    ttft: float | None
    idle: float | None
    client: str  # "reads" | "leaves_before_first" | "leaves_mid" | "slow_reader"
    leave_after: int
    start: float


@dataclass(frozen=True)
class Fault:
    at: float
    worker: int  # index into the scenario's sims, ALL_PREFILLS or ALL_DECODES
    kind: str  # a sim fault, or "sigkill" / "sigstop"
    value: float
    lasts: float  # then switched off; a "persist" fault stays on until the next scenario (its leftovers checked meanwhile)
    persist: bool = False


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
    reconcile: bool = True  # off: only the gateway's own aborts free what a request leaves on the engines


budget = st.one_of(st.none(), st.floats(0.1, 3.0).map(lambda x: round(x, 2)), st.sampled_from((0.2, 0.5, 1.0)))
seeds = st.integers(0, 2**31)
segments = st.sampled_from((0.0, 0.5, 1.0))


@st.composite
def requests(draw: st.DrawFn) -> Req:
    stream = draw(st.booleans())
    client = draw(st.sampled_from(("reads", "reads", "leaves_before_first", "leaves_mid", "slow_reader")))
    return Req(route=draw(st.sampled_from(ROUTES)), stream=stream, max_tokens=draw(st.integers(1, 24)),
               total=draw(budget), ttft=draw(budget), idle=draw(budget) if stream else None, client=client,
               leave_after=draw(st.integers(1, 6)), start=draw(st.floats(0, 0.3)))


ALL_PREFILLS, ALL_DECODES = 5, 4
DECODE_SIDE = ("decode_freeze", "decode_stall", "slow_first_token", "decode_crash", "ack_loss", "bootstrap_loss",
               "done_stall")
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
    return Scenario(seed=draw(seeds), segment=draw(segments), reqs=tuple(draw(st.lists(requests(), min_size=1, max_size=4))),
                    faults=tuple(draw(st.lists(faults(), max_size=2))), drain=drain,
                    drain_s=draw(st.sampled_from((0.0, 0.3))),
                    at_deadline=draw(st.sampled_from((None, None, None, "drain", "abort"))),
                    capacity=draw(st.sampled_from((0, 0, 1))))  # 1: requests wait in the gateway's queue


@st.composite
def stalled_streams(draw: st.DrawFn) -> Scenario:
    """The shape behind most stuck requests: streams under way when every decode stops making tokens (a gray
    failure: /health still answers) or answers its first token late; idle budgets shorter than the TTFT one
    (the watchdog must re-arm at the first token)."""
    reqs = tuple(Req(route=draw(st.sampled_from(ROUTES)), stream=True, max_tokens=draw(st.integers(12, 40)),
                     total=draw(budget), ttft=draw(budget), idle=draw(st.sampled_from((0.2, 0.4, 0.8))),
                     client="reads", leave_after=1, start=draw(st.floats(0, 0.1)))
                 for _ in range(draw(st.integers(1, 3))))
    kind = draw(st.sampled_from(("decode_stall", "decode_stall", "slow_first_token")))
    fault = Fault(at=draw(st.floats(0.05, 0.4)), worker=ALL_DECODES, kind=kind,
                  value=draw(st.sampled_from((0.5, 1.0, 1.5))), lasts=draw(st.floats(0.8, 2.5)))
    return Scenario(seed=draw(seeds), segment=draw(segments), reqs=reqs, faults=(fault,), drain=None, drain_s=0.0,
                    at_deadline=None)


@st.composite
def drained_under_load(draw: st.DrawFn) -> Scenario:
    """A drain while requests are still far from done (every decode stalled): past drain_s each must have its
    answer, not run on to its own deadline."""
    reqs = tuple(Req(route=draw(st.sampled_from(ROUTES)), stream=draw(st.booleans()), max_tokens=draw(st.integers(8, 30)),
                     total=None, ttft=None, idle=None, client="reads", leave_after=1, start=0.0)
                 for _ in range(draw(st.integers(1, 3))))
    fault = Fault(at=draw(st.floats(0.0, 0.2)), worker=ALL_DECODES, kind="decode_stall", value=1.0,
                  lasts=draw(st.floats(2.0, 3.0)))
    return Scenario(seed=draw(seeds), segment=draw(segments), reqs=reqs, faults=(fault,), drain=draw(st.floats(0.3, 0.8)),
                    drain_s=draw(st.sampled_from((0.0, 0.3))), at_deadline=None)


@st.composite
def two_causes(draw: st.DrawFn) -> Scenario:
    """A deadline and a drain or an operator's abort in the same instant (a timer set for the deadline's own
    time), on a request that cannot have its first token by then (every prefill slow): the first cause must be
    the answer (``first-cause``)."""
    req = Req(route=draw(st.sampled_from(ROUTES)), stream=draw(st.booleans()), max_tokens=8, total=None,
              ttft=draw(st.sampled_from((0.3, 0.5))), idle=None, client="reads", leave_after=1, start=0.0)
    fault = Fault(at=0.0, worker=ALL_PREFILLS, kind="slow_prefill", value=2.0, lasts=1.0)
    return Scenario(seed=draw(seeds), segment=draw(segments), reqs=(req,), faults=(fault,), drain=None,
                    drain_s=0.0, at_deadline=draw(st.sampled_from(("drain", "abort"))))


@st.composite
def abandoned_legs(draw: st.DrawFn) -> Scenario:
    """Streams that end on their idle budget while every decode stays stalled, with reconciliation off and
    engines that notice a gone client late (``SIM_ENV``): only the gateway's aborts of both legs free them."""
    reqs = tuple(Req(route=draw(st.sampled_from(ROUTES)), stream=True, max_tokens=30, total=None, ttft=None,
                     idle=draw(st.sampled_from((0.2, 0.3))), client="reads", leave_after=1, start=0.0)
                 for _ in range(draw(st.integers(1, 2))))
    fault = Fault(at=draw(st.floats(0.1, 0.2)), worker=ALL_DECODES, kind="decode_stall", value=1.0, lasts=0.0,
                  persist=True)
    return Scenario(seed=draw(seeds), segment=draw(segments), reqs=reqs, faults=(fault,), drain=None, drain_s=0.0,
                    at_deadline=None, reconcile=False)


@st.composite
def lost_aborts(draw: st.DrawFn) -> Scenario:
    """Aborts that cannot land: each prefill takes a request in only after the abort and its repeats came and
    went (``slow_accept``), and its decode never hands it a destination (``bootstrap_loss``): the prefill would
    wait in its bootstrap queue for minutes. Only reconciliation, which knows the rid for one of this
    gateway's, frees it."""
    reqs = tuple(Req(route=draw(st.sampled_from(ROUTES)), stream=draw(st.booleans()), max_tokens=8, total=None,
                     ttft=draw(st.sampled_from((0.3, 0.5))), idle=None, client="reads", leave_after=1, start=0.0)
                 for _ in range(draw(st.integers(1, 2))))
    return Scenario(seed=draw(seeds), segment=draw(segments), reqs=reqs, drain=None, drain_s=0.0, at_deadline=None,
                    faults=(Fault(0.0, ALL_PREFILLS, "slow_accept", 2.2, 0.0, persist=True),
                            Fault(0.0, ALL_DECODES, "bootstrap_loss", 1.0, 0.0, persist=True)))


scenarios = lambda: st.one_of(free_scenarios(), stalled_streams(), drained_under_load(), two_causes(),  # noqa: E731
                              abandoned_legs(), lost_aborts())

CHAT_STREAM = Req("/v1/chat/completions", True, 30, None, None, 0.3, "reads", 1, 0.0)
RESPONSES_STREAM = dataclasses.replace(CHAT_STREAM, route="/v1/responses")
MESSAGES_STREAM = dataclasses.replace(CHAT_STREAM, route="/v1/messages")
# Each shape a mechanism needs, run in every oracle run besides the generated ones (whatever hypothesis draws):
SHAPES = (
    # idle much shorter than TTFT, every decode stalled after a few tokens: the watchdog must re-arm
    Scenario(1, 0.0, (CHAT_STREAM,), (Fault(0.15, ALL_DECODES, "decode_stall", 1.0, 1.5),), None, 0.0, None),
    # every decode stuck in the middle of an event when the idle budget runs out: the gateway's own error event
    # must not land inside the engine's half event (events are judged and relayed whole)
    Scenario(2, 0.0, (CHAT_STREAM, Req("/generate", True, 20, None, None, 0.3, "reads", 1, 0.0)),
             (Fault(0.15, ALL_DECODES, "split_stall", 1.0, 0.0, persist=True),), None, 0.0, None),
    # the stream's [DONE] went out, its end comes late and the total budget runs out meanwhile: nothing follows it
    Scenario(8, 0.0, (Req("/v1/completions", True, 6, 0.8, None, None, "reads", 1, 0.0),),
             (Fault(0.0, ALL_DECODES, "done_stall", 1.5, 2.0),), None, 0.0, None),
    # a drain while every decode stalls: answered by drain_s
    Scenario(3, 0.0, (dataclasses.replace(CHAT_STREAM, idle=None), Req("/v1/completions", False, 20, None, None, None,
                                                                       "reads", 1, 0.0)),
             (Fault(0.1, ALL_DECODES, "decode_stall", 1.0, 2.5),), 0.5, 0.3, None),
    # a deadline and a drain, a deadline and an operator's abort, at once
    Scenario(4, 0.0, (Req("/v1/chat/completions", False, 8, None, 0.4, None, "reads", 1, 0.0),),
             (Fault(0.0, ALL_PREFILLS, "slow_prefill", 2.0, 1.0),), None, 0.0, "drain"),
    Scenario(5, 0.0, (Req("/generate", True, 8, None, 0.4, None, "reads", 1, 0.0),),
             (Fault(0.0, ALL_PREFILLS, "slow_prefill", 2.0, 1.0),), None, 0.0, "abort"),
    # legs only the gateway's aborts free (reconciliation off, engines that notice a gone client late)
    Scenario(6, 0.0, (CHAT_STREAM,), (Fault(0.15, ALL_DECODES, "decode_stall", 1.0, 0.0, persist=True),), None, 0.0,
             None, reconcile=False),
    # aborts that cannot land: only reconciliation frees the prefill
    Scenario(7, 0.0, (Req("/v1/chat/completions", False, 8, None, 0.4, None, "reads", 1, 0.0),), (
        Fault(0.0, ALL_PREFILLS, "slow_accept", 2.2, 0.0, persist=True),
        Fault(0.0, ALL_DECODES, "bootstrap_loss", 1.0, 0.0, persist=True)), None, 0.0, None),
    # the Responses route: its stream stuck in the middle of an engine event at its idle budget (the gateway's
    # response.failed after whole events only), beside a stored non-stream one
    Scenario(9, 0.0, (RESPONSES_STREAM, Req("/v1/responses", False, 12, None, None, None, "reads", 1, 0.0)),
             (Fault(0.15, ALL_DECODES, "split_stall", 1.0, 0.0, persist=True),), None, 0.0, None),
    # ... a TTFT deadline and a drain at once, before its first token (response.failed, never a 504)
    Scenario(10, 0.0, (Req("/v1/responses", True, 8, None, 0.4, None, "reads", 1, 0.0),),
             (Fault(0.0, ALL_PREFILLS, "slow_prefill", 2.0, 1.0),), None, 0.0, "drain"),
    # ... and an operator's abort at its TTFT deadline, not streamed
    Scenario(11, 0.0, (Req("/v1/responses", False, 8, None, 0.4, None, "reads", 1, 0.0),),
             (Fault(0.0, ALL_PREFILLS, "slow_prefill", 2.0, 1.0),), None, 0.0, "abort"),
    # ... a drain while every decode stalls mid-stream
    Scenario(12, 0.5, (dataclasses.replace(RESPONSES_STREAM, idle=None),),
             (Fault(0.1, ALL_DECODES, "decode_stall", 1.0, 2.5),), 0.5, 0.3, None),
    # the Messages route: its stream stuck mid-event at its idle budget (the error event after whole events only),
    # beside a non-stream one
    Scenario(13, 0.0, (MESSAGES_STREAM, Req("/v1/messages", False, 12, None, None, None, "reads", 1, 0.0)),
             (Fault(0.15, ALL_DECODES, "split_stall", 1.0, 0.0, persist=True),), None, 0.0, None),
    # ... a TTFT deadline and a drain at once, before its first token (an error event, never a 504)
    Scenario(14, 0.0, (Req("/v1/messages", True, 8, None, 0.4, None, "reads", 1, 0.0),),
             (Fault(0.0, ALL_PREFILLS, "slow_prefill", 2.0, 1.0),), None, 0.0, "drain"),
    # ... an operator's abort at its TTFT deadline, not streamed; and a drain while every decode stalls mid-stream
    Scenario(15, 0.0, (Req("/v1/messages", False, 8, None, 0.4, None, "reads", 1, 0.0),),
             (Fault(0.0, ALL_PREFILLS, "slow_prefill", 2.0, 1.0),), None, 0.0, "abort"),
    Scenario(16, 0.5, (dataclasses.replace(MESSAGES_STREAM, idle=None),),
             (Fault(0.1, ALL_DECODES, "decode_stall", 1.0, 2.5),), 0.5, 0.3, None),
)


VLLM_ENV = {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "1"}  # a prefill's unread KV: freed by the engine within the check


@dataclass
class Cluster:
    """Two prefill and two decode sims that live across scenarios; a killed one is started again. ``mixed``: the
    second of each role speaks vLLM's protocol (``--protocol vllm``), so one gateway fronts an SGLang pair (sims 0,
    2) and a vLLM pair (sims 1, 3), pairing within a kind."""

    procs: Procs
    sims: list[Sim] = field(default_factory=list)
    mixed: bool = False

    def args(self, i: int) -> tuple[tuple[str, ...], dict[str, str]]:
        extra: tuple[str, ...] = DECODE_ARGS if i >= 2 else ()
        if self.mixed and i in (1, 3):
            return (*extra, "--protocol", "vllm"), {**SIM_ENV, **VLLM_ENV}
        return extra, SIM_ENV

    def kind(self, i: int) -> str:
        return "vllm" if self.mixed and i in (1, 3) else "sglang"

    def start(self) -> None:
        for i, role in enumerate(("prefill", "prefill", "decode", "decode")):
            extra, env = self.args(i)
            self.sims.append(self.procs.sim(role, *extra, env=env))

    def revive(self) -> None:
        for i, s in enumerate(self.sims):
            assert s.proc.popen is not None
            if s.proc.popen.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)
                continue
            extra, env = self.args(i)
            self.sims[i] = self.procs.sim(s.role, *extra, env=env, port=s.port, bootstrap_port=s.bootstrap_port,
                                          wait=False)
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
    if r.route == "/v1/responses":
        return {"model": "sim-model", "input": "tell me a story", "max_output_tokens": r.max_tokens, "stream": r.stream}
    if r.route == "/v1/messages":
        return {"model": "sim-model", "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": r.max_tokens, "stream": r.stream}
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
    if f.worker in (ALL_DECODES, ALL_PREFILLS):
        both = (2, 3) if f.worker == ALL_DECODES else (0, 1)
        await asyncio.gather(*(inject(http, cl, dataclasses.replace(f, at=0, worker=i)) for i in both))
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
        if f.persist:  # switched off when the next scenario starts
            return
        await asyncio.sleep(f.lasts)
        await set_faults(http, s, **{f.kind: OFF[f.kind]})
    except aiohttp.ClientError:
        pass  # killed meanwhile


async def at_deadline(g: Running, what: str, first: dict[str, str]) -> None:
    """Fire a drain or an operator abort by a timer set for the first live request's own deadline timer: the
    same loop iteration as its deadline, two causes at once. Which came first is noted when ours fires (the
    deadline's already in, or not yet): ``first-cause`` then checks the client's answer names that one."""
    gw = g.gw
    loop = asyncio.get_running_loop()
    for _ in range(100):
        if gw.live:
            break
        await asyncio.sleep(0.01)
    if not gw.live:
        return
    ctx = next(iter(gw.live.values()))
    timer = ctx.watchdog.handle
    if timer is None:
        return

    def fire() -> None:
        if not ctx.rec.live:
            return
        reason = ctx.scope.reason
        first[ctx.rec.id] = "deadline" if reason is not None and reason.cause is Cause.DEADLINE else what
        if what == "drain":
            gw.drain("oracle: at a deadline")
        else:
            ctx.cancel(Reason(Cause.OPERATOR))

    loop.call_at(timer.when(), fire)


async def sent_by_decodes(http: aiohttp.ClientSession, cl: Cluster) -> dict[str, dict[str, Any]] | None:
    """What the decode sims say they sent, by rid (None: a decode died meanwhile, its log with it)."""
    out: dict[str, dict[str, Any]] = {}
    for s in cl.sims[2:]:
        try:
            async with http.get(s.url + "/pdgate/v1/sent", timeout=aiohttp.ClientTimeout(total=2)) as r:
                out.update({e["rid"]: e for e in (await r.json())["sent"]})
        except (aiohttp.ClientError, TimeoutError):
            return None
    return out


async def run(cl: Cluster, sc: Scenario) -> list[str]:
    """One scenario; returns the broken invariants (empty: the promise held)."""
    cl.revive()
    cfg = make_config(cl.sims[:2], cl.sims[2:], drain_s=sc.drain_s, prefill_grace_s=0.5, abort_timeout_s=0.5,
                      deadlines=DeadlineConfig(total_s=TOTAL, ttft_s=TTFT, idle_s=IDLE),
                      health=HealthConfig(interval_s=0.3, timeout_s=0.3, failures=2, degraded_after_s=30),
                      reconcile=ReconcileConfig(enabled=sc.reconcile, interval_s=0.5, grace_s=0.5),
                      admission=AdmissionConfig(capacity=sc.capacity))
    if cl.mixed:  # the vLLM pair's specs say so: the gateway talks to them through its vLLM adapter
        cfg = dataclasses.replace(cfg, prefill=tuple(dataclasses.replace(w, engine=cl.kind(i)) for i, w in enumerate(cfg.prefill)),
                                  decode=tuple(dataclasses.replace(w, engine=cl.kind(i + 2)) for i, w in enumerate(cfg.decode)))
    first: dict[str, str] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for s in cl.sims:
            await set_faults(http, s, **OFF, segment=sc.segment, segment_seed=sc.seed)
        g = await start_gateway(cfg)
        closed = False
        lag = LoopLag()
        watching = asyncio.create_task(lag.watch())
        try:
            work = [asyncio.create_task(client(http, g.url, r)) for r in sc.reqs]
            side = [asyncio.create_task(inject(http, cl, f)) for f in sc.faults]
            if sc.at_deadline:
                side.append(asyncio.create_task(at_deadline(g, sc.at_deadline, first)))
            drained_at = None
            if sc.drain is not None:
                await asyncio.sleep(sc.drain)
                drained_at = time.monotonic()
                await g.close()
                closed = True
            seen = await asyncio.gather(*work)
            await asyncio.gather(*side)
            cl.revive()
            # a decode that was killed took its log of what it sent with it: that check cannot be made then
            killed = any(f.kind in ("sigkill", "decode_crash") for f in sc.faults)
            sent = None if killed else await sent_by_decodes(http, cl)
            for _ in range(int((TOTAL + TOL) / 0.02)):  # clients that left: the gateway notices at once, not before they go
                if not g.gw.live:
                    break
                await asyncio.sleep(0.02)
            problems = [p for r, s in zip(sc.reqs, seen, strict=True)
                        for p in check_client(g, r, s, drained_at, sc.drain_s, sent, first, lag.worst)]
            problems += [f"terminal-outcome: {rid} still live" for rid in g.gw.traces.live]
            problems += queue_leftovers(g)
            problems += await leftovers(http, g, cl)
        finally:
            watching.cancel()
            if not closed:
                await g.close()
    return [f"{p} [seed {sc.seed}]" for p in problems]


def queue_leftovers(g: Running) -> list[str]:
    """Admission control leaves nothing behind: an empty queue, no slot reserved for a request that is gone."""
    out = [f"queue-empty: {g.gw.gate.queue.n} requests still queued"] if g.gw.gate.queue.n else []
    out += [f"queue-empty: {w.id} still has {w.slots.reserved} reserved slots" for w in g.gw.pool.by_id.values()
            if w.slots.reserved]
    return out


@dataclass(frozen=True)
class Budgets:
    total: float
    ttft: float
    idle: float


def budgets(r: Req) -> Budgets:
    """What the request's budgets must be, from what it sent: its header, else the config's default; capped."""
    def one(asked: float | None, default: float, cap: float) -> float:
        return min(asked if asked is not None else default, cap)
    return Budgets(one(r.total, TOTAL, MAX_TOTAL), one(r.ttft, TTFT, MAX_TTFT), one(r.idle, IDLE, MAX_IDLE))


def dues(r: Req, b: Budgets, s: Seen, before: float) -> dict[str, float]:
    """When each budget that applies is due, on the client's clock, given the tokens it saw before ``before``.
    A non-streaming client sees no token: its TTFT budget applies until a prefill answer it cannot see."""
    toks = [t for t in s.tokens if t <= before]
    out = {"total": s.sent_at + b.total}
    if not toks:
        out["ttft"] = s.sent_at + b.ttft
    elif r.stream:
        out["idle"] = toks[-1] + b.idle
    return out


def allowed_end(r: Req, b: Budgets, due: dict[str, float]) -> float:
    """The latest its answer may end by its budgets (a non-streaming client cannot see the first token that
    ends the TTFT budget: its total one bounds it)."""
    return due["total"] if not r.stream else min(due.values())


def lateness(r: Req, s: Seen) -> float:
    """How long after its budgets allowed the client's answer ended (negative: before)."""
    b, end = budgets(r), s.ended_at or time.monotonic()
    return end - allowed_end(r, b, dues(r, b, s, end))


def text_of(route: str, s: Seen, stream: bool) -> str | None:
    """The text the client got (None: not an answer of that route's shape)."""
    try:
        if route == "/v1/messages":
            if stream:
                objs = [orjson.loads(d) for _, d in s.events]
                deltas = [o["delta"]["text"] for o in objs if o["type"] == "content_block_delta"]
                kinds = [o["type"] for o in objs]
                ok = kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
                return "".join(deltas) if ok else None
            return "".join(b["text"] for b in s.json["content"] if b["type"] == "text")
        if route == "/v1/responses":
            if stream:
                deltas = [orjson.loads(d)["delta"] for _, d in s.events if d.startswith(DELTA)]
                final = orjson.loads(s.events[-1][1])["response"]
                whole = "".join(c["text"] for it in final["output"] if it["type"] == "message" for c in it["content"])
                return "".join(deltas) if whole == "".join(deltas) else None  # the deltas add up to the output
            out = s.json["output"]
            return "".join(c["text"] for it in out if it["type"] == "message" for c in it["content"])
        if stream:
            objs = [orjson.loads(d) for _, d in s.events if d != b"[DONE]" and not d.startswith(b'{"error"')]
            if route == "/generate":
                return str(objs[-1]["text"]) if objs else ""
            key = "delta" if route.endswith("chat/completions") else None
            return "".join((o["choices"][0][key].get("content") or "") if key else o["choices"][0]["text"]
                           for o in objs if o.get("choices"))
        obj = s.json
        if route == "/generate":
            return str(obj["text"])
        c = obj["choices"][0]
        return str(c["message"]["content"] if route.endswith("chat/completions") else c["text"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None


class LoopLag:
    """How late the clients' event loop ran a 5 ms timer at worst: a client reads an event at least that late after
    it arrived, so a deadline the gateway timed from the event's relay may look that much early on the client's
    clock (CI at load 70: an idle budget 12 ms early)."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def watch(self, every_s: float = 0.005) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + every_s
            await asyncio.sleep(every_s)
            self.worst = max(self.worst, loop.time() - due)


def check_client(g: Running, r: Req, s: Seen, drained_at: float | None, drain_s: float,
                 sent: dict[str, dict[str, Any]] | None, first: dict[str, str], lag: float = 0.0) -> list[str]:
    """What the client must have seen, judged from what it sent and when it saw what (``lag``: the clients' loop's
    worst lateness in the scenario)."""
    if s.error == "left":
        return []
    if s.rid is None and drained_at is not None and s.sent_at >= drained_at and "Connect call failed" in (s.error or ""):
        return []  # sent after the gateway stopped listening: refused, as it should be
    if s.rid is None:
        return [f"terminal-answer: {r} got no answer: {s.error}"]
    rid, b, end = s.rid, budgets(r), s.ended_at or time.monotonic()
    if s.error is not None:
        return [f"terminal-answer: {rid} ({r.client}) broken answer: {s.error}"]
    out: list[str] = []
    streamed = r.stream and s.status == 200
    errors = s.error_events if streamed else []
    if streamed and (s.done_count != 1 or not s.events or not s.is_done(s.events[-1][1])):
        out.append(f"one-done: {rid} stream ended with {s.done_count} terminal events, the last not one")
    err: dict[str, Any] | None = errors[-1] if errors else None
    if s.status != 200:
        try:
            if r.route == "/v1/messages":  # Anthropic's shape, and only that
                assert s.json["type"] == "error" and set(s.json["error"]) == {"type", "message"}
                err = anthropic_error(s.json["error"])
            else:
                err = dict(s.json["error"])
            assert isinstance(err["message"], str) and err["code"]
        except Exception:
            out.append(f"terminal-answer: {rid} status {s.status} without the route's error body: {s.body[:80]!r}")
            err = None
    if s.status == 200 and not errors:
        out += answer_agrees(r, s, rid, sent)
    rec = g.gw.traces.get(rid)  # cross-checked only: what the gateway recorded must be what the client saw
    if rec is None or rec.live:
        out.append(f"status-agrees: {rid} has no terminal record")
    elif (rec.outcome is not None and rec.outcome.value == "completed") != (s.status == 200 and not errors):
        out.append(f"status-agrees: {rid} client got {s.status}{' and an error event' if errors else ''}, the record "
                   f"says {rec.outcome} ({rec.status})")
    if r.client == "slow_reader":  # its own reading sets the times it sees
        return out
    due = dues(r, b, s, end)
    limit = allowed_end(r, b, due)
    if end > limit + TOL:
        out.append(f"within-deadline: {rid} answered {end - limit:.3f}s after its budgets allowed ({err})")
    if drained_at is not None and s.sent_at < drained_at and end > drained_at + drain_s + TOL:
        out.append(f"drain-answers: {rid} answered {end - drained_at - drain_s:.3f}s after the drain's end ({err})")
    if r.stream and s.tokens and s.tokens[0] - s.sent_at > min(b.ttft, b.total) + TOL:
        out.append(f"ttft-enforced: {rid} first token {s.tokens[0] - s.sent_at:.3f}s in, its TTFT budget {b.ttft:g}s")
    gap = max((y - x for (x, _), (y, _) in itertools.pairwise(s.events)), default=0.0) if streamed else 0.0
    if gap > b.idle + TOL:
        out.append(f"idle-enforced: {rid} waited {gap:.3f}s between events, its idle budget is {b.idle:g}s")
    if err is not None and err.get("code") == "deadline_exceeded":
        out += budget_named(r, rid, err, due, end, lag)
    if rid in first and err is not None:
        want = {"deadline": "deadline_exceeded", "drain": "gateway_draining", "abort": "request_aborted"}[first[rid]]
        if err.get("code") != want:
            out.append(f"first-cause: {rid} met its {first[rid]} first, but was answered {err.get('code')}")
    return out


def budget_named(r: Req, rid: str, err: dict[str, Any], due: dict[str, float], end: float, lag: float = 0.0) -> list[str]:
    """A deadline answer names a budget that was due by then (the first of those due, streams: the client saw
    its tokens), and does not come before it by more than 10 ms and the clients' loop's worst lateness (``lag``:
    the client saw the event the budget counts from at most that late)."""
    named = str(err.get("message", "")).split(" ", 1)[0]
    if named not in due:
        return [f"budget-named: {rid} says {named}, which does not apply (due: {sorted(due)})"]
    if end < due[named] - 0.01 - lag:
        return [f"budget-named: {rid} said {named} {due[named] - end:.3f}s before its {named} budget was due "
                f"(the clients' loop ran up to {lag * 1000:.1f} ms late)"]
    if r.stream and due[named] > min(due.values()) + TOL:
        return [f"budget-named: {rid} says {named}, but {min(due, key=due.__getitem__)} was due first"]
    return []


def answer_agrees(r: Req, s: Seen, rid: str, sent: dict[str, dict[str, Any]] | None) -> list[str]:
    """A 200's body has the route's shape, and its text and token count are what the decode said it sent for
    the request's last attempt (its rid: ``<id>.<n>``)."""
    text = text_of(r.route, s, r.stream)
    if text is None:
        return [f"answer-valid: {rid} 200 whose body is not a {r.route} answer: {(s.body or s.events[-2:])!r:.120}"]
    if sent is None:
        return []  # a decode died meanwhile, and what it sent with it
    tries = sorted((k for k in sent if k.startswith(rid + ".")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if not tries:
        return [f"tokens-agree: {rid} completed, but no decode says it answered it"]
    mine = sent[tries[-1]]
    usage = {} if r.stream else (s.json.get("usage") or s.json.get("meta_info") or {})
    n = len(s.tokens) if r.stream else usage.get("completion_tokens", usage.get("output_tokens"))
    out = []
    if text != mine["text"]:
        out.append(f"tokens-agree: {rid} client got {text!r:.60}, the decode sent {mine['text']!r:.60}")
    if n != mine["tokens"]:
        out.append(f"tokens-agree: {rid} client saw {n} tokens, the decode sent {mine['tokens']}")
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
