"""Request-aware policies (pure): session affinity and cache-aware prefill choice, their rebalance rules, and the
prefix tree's memory bound. No event loop."""

from __future__ import annotations

import dataclasses
import random
import sys

from pdgate.core.config import RoutingConfig
from pdgate.pool import policies
from pdgate.pool.policies import CacheAware, PrefixIndex, RequestView, Session


@dataclasses.dataclass
class W:
    id: str
    load: int = 0


def chat(*contents: str, user: str | None = None) -> RequestView:
    body = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]}
    return RequestView("/v1/chat/completions", "m", body, session=user)


def send(policy: policies.Policy, workers: list[W], req: RequestView) -> W:
    """What the gateway does: pick, then tell the policy where the attempt went (the load rises while it runs)."""
    w = policy.pick(workers, req)
    assert w is not None
    policy.dispatched(w.id, req)
    return w


def test_session_sticks_spreads_and_moves_when_its_worker_is_gone() -> None:
    pol = Session()
    ws = [W("p0"), W("p1")]
    first = {}
    for s in ("a", "b", "c", "d"):
        w = send(pol, ws, chat("hi", user=s))
        first[s] = w.id
        w.load += 1  # each session holds one request meanwhile
    assert sorted(first.values()) == ["p0", "p0", "p1", "p1"], "new sessions go by load"
    for _ in range(5):  # later rounds: the same worker, whatever the loads do below the thresholds
        ws[0].load, ws[1].load = random.randint(0, 60), random.randint(0, 60)
        for s in first:
            assert send(pol, ws, chat("hi", "there", user=s)).id == first[s]
    gone = [s for s in first if first[s] == "p0"]
    req = chat("next", user=gone[0])
    assert send(pol, [ws[1]], req).id == "p1", "p0 unavailable: the session moves"
    assert req.notes == ["session moved from p0 to p1: p0 unavailable or at its capacity"]
    assert send(pol, ws, chat("again", user=gone[0])).id == "p1", "and stays where it moved"
    assert pol.decisions == {"sticky": 21, "moved": 1, "new": 4, "none": 0}


def test_session_moves_off_a_worker_that_lost_its_cache_even_when_it_is_back() -> None:
    pol = Session()
    ws = [W("p0"), W("p1")]
    home = send(pol, ws, chat("x", user="s"))
    assert send(pol, ws, chat("x", user="s")) is home
    pol.forget(home.id)  # it restarted (the gateway's worker observer says so); it is available again
    req = chat("x", user="s")
    moved = send(pol, ws, req)
    assert moved is not home and req.notes == [f"session moved from {home.id} to {moved.id}: {home.id} lost its "
                                               "cache since (down or restarted)"]
    assert send(pol, ws, chat("x", user="s")) is moved, "and it stays there"


def test_session_rebalances_over_the_thresholds_only() -> None:
    cfg = RoutingConfig(balance_abs=4, balance_rel=1.5)
    pol = Session(cfg)
    ws = [W("p0"), W("p1")]
    home = send(pol, ws, chat("x", user="s"))
    other = ws[1] if home is ws[0] else ws[0]
    home.load, other.load = 5, 2  # 3 above the least: within balance_abs
    assert send(pol, ws, chat("x", user="s")) is home
    home.load, other.load = 7, 2  # 5 above and 3.5x: out of balance
    req = chat("x", user="s")
    assert send(pol, ws, req) is other
    assert req.notes and "over the balance thresholds (load 7, least 2)" in req.notes[0]
    other.load, home.load = 8, 5  # 3 above, 1.6x: within abs, so not out of balance
    assert send(pol, ws, chat("x", user="s")) is other


def test_session_key_sources_tenants_and_bound() -> None:
    assert policies.session_key(None, "h1", {"user": "u1"}) == "h1", "the header first"
    assert policies.session_key(None, None, {"user": "u1"}) == "u1"
    assert policies.session_key(None, None, {"user": 7}) is None
    assert policies.session_key("acme", None, {"user": "u1"}) != policies.session_key("beta", None, {"user": "u1"})
    long = policies.session_key(None, "x" * 10_000, {})
    assert long is not None and len(long) <= policies.MAX_SESSION_CHARS
    pol = Session(RoutingConfig(max_sessions=100))
    ws = [W("p0"), W("p1")]
    for i in range(1000):
        send(pol, ws, chat("x", user=f"s{i}"))
    assert len(pol.sticky) == 100 and "s999" in pol.sticky and "s0" not in pol.sticky
    anon = chat("x")
    assert send(pol, ws, anon) and not anon.notes and len(pol.sticky) == 100, "no key: by load, nothing kept"


def conversation(sid: int, rounds: int) -> list[RequestView]:
    """One session's requests: each sends the whole history so far."""
    rng = random.Random(sid)
    msgs = [f"You are agent {sid}. " + " ".join(rng.choice("abcdefgh") * 5 for _ in range(250))]
    out = []
    for _ in range(rounds):
        out.append(chat(*msgs))  # round 2 resends 1.5 k characters and adds 7.6 k: a share of 0.16
        msgs += ["reply " * 20, "tool output " + " ".join(f"{rng.random():.16f}" for _ in range(400))]
    return out


def test_cache_aware_follows_the_prefix_and_spreads_new_ones() -> None:
    pol = CacheAware()
    ws = [W("p0"), W("p1")]
    sessions = [conversation(s, 6) for s in range(8)]
    home: dict[int, str] = {}
    for rnd in range(6):
        order = list(enumerate(sessions))
        for s, reqs in order if rnd % 2 == 0 else reversed(order):  # rounds end in any order
            w = send(pol, ws, reqs[rnd])
            assert home.setdefault(s, w.id) == w.id, f"session {s} round {rnd + 1} left the worker holding its prefix"
    assert sorted(home.values()) == ["p0"] * 4 + ["p1"] * 4, "new prefixes go to the worker holding least"
    assert pol.decisions["cache"] == 8 * 5 and pol.decisions["new"] == 8
    assert pol.index.size("p0") > 0 and pol.index.size("p1") > 0
    pol.forget("p0")  # it restarted: its cache is gone
    moved = [s for s in home if home[s] == "p0"]
    req = conversation(moved[0], 7)[6]
    assert pol.index.match("p0", pol.prefix(req)) == 0


def test_cache_aware_by_share_alone_loses_sessions_whose_rounds_grow_fast() -> None:
    """The cache_min_chars rule switched off (SGLang router's rule, share alone): round 2 of these sessions holds
    0.16 of its prompt, below the threshold, so it goes to the worker holding least, not to its own."""
    pol = CacheAware(RoutingConfig(cache_min_chars=10**9))
    ws = [W("p0"), W("p1")]
    sessions = [conversation(s, 2) for s in range(8)]
    homes = [send(pol, ws, reqs[0]).id for reqs in sessions]
    seconds = [send(pol, ws, reqs[1]).id for reqs in reversed(sessions)][::-1]  # rounds end in any order
    assert pol.decisions["cache"] == 0, "every round-2 request chose anew"
    assert sum(a != b for a, b in zip(homes, seconds, strict=True)) >= 2, (homes, seconds)


def test_cache_aware_balance_keeps_a_hot_prefix_off_one_worker() -> None:
    """Every request shares one long prefix. With the balance rule, requests go to the other worker once the
    holder is out of balance; switched off (thresholds too high to reach), all pile onto one worker."""
    def run(cfg: RoutingConfig) -> dict[str, int]:
        pol = CacheAware(cfg)
        ws = {"p0": W("p0"), "p1": W("p1")}
        hot = "system: the same long tool manual. " * 200
        for i in range(40):  # none finishes: loads only grow
            w = send(pol, list(ws.values()), chat(hot + f"question {i}"))
            w.load += 1
        return {k: w.load for k, w in ws.items()}

    on = run(RoutingConfig(balance_abs=4, balance_rel=1.5))
    assert max(on.values()) - min(on.values()) <= 5, on
    off = run(RoutingConfig(balance_abs=10_000))
    assert sorted(off.values()) == [0, 40], off


def test_prefix_index_memory_is_bounded_and_evicts_branches_before_roots() -> None:
    idx = PrefixIndex(block_chars=16, max_blocks=1000)
    rng = random.Random(1)
    for i in range(2000):
        text = f"session {i:06d} " + "".join(rng.choice("xyz") for _ in range(16 * 20))
        idx.insert("p0", idx.hashes(text))
        assert idx.size("p0") <= 1000
    held = idx.by_worker["p0"]
    assert sys.getsizeof(held) < 200_000
    # a prefix sent long ago lost its branches first: its root (first block) is the last of it to go
    root_first = "r" * 16
    text = root_first + "b" * 16 * 50
    hs = idx.hashes(text)
    idx.insert("p1", hs)
    idx2 = PrefixIndex(block_chars=16, max_blocks=10)
    idx2.insert("w", hs)
    assert idx2.match("w", hs) == 0 or hs[0] in idx2.by_worker["w"]
    assert hs[0] in idx2.by_worker["w"] and hs[-1] not in idx2.by_worker["w"]
    # texts beyond max_text_blocks are indexed by their first blocks only (CPU and memory per request bounded)
    assert len(PrefixIndex(16, 10, max_text_blocks=8).hashes("q" * 16 * 100)) == 8


def test_prompt_text_prefix_is_stable_as_a_conversation_grows() -> None:
    r1 = {"messages": [{"role": "user", "content": "a"}]}
    r2 = {"messages": [*r1["messages"],
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "x.py"}]}
    t1, t2 = policies.prompt_text("/v1/chat/completions", r1), policies.prompt_text("/v1/chat/completions", r2)
    assert t2.startswith(t1) and "call ls {}" in t2
    assert policies.prompt_text("/generate", {"input_ids": [1, 2]}) == "1 2"
    assert policies.prompt_text("/v1/completions", {"prompt": ["a", "b"]}) == "a b"


def test_only_the_pick_that_is_used_counts_and_notes() -> None:
    """A queued request is picked for on every pump; until one of those picks is dispatched nothing is counted
    and nothing goes on its trace, and then only that pick's decision."""
    pol = Session()
    ws = [W("p0"), W("p1")]
    send(pol, [ws[0]], chat("x", user="s"))
    req = chat("y", user="s")
    for _ in range(5):
        assert pol.pick([ws[1]], req) is ws[1]  # p0 gone: a move, five times over
    assert pol.decisions["moved"] == 0 and not req.notes
    assert pol.pick(ws, req) is ws[0]  # p0 back before the grant: the pick that is used is sticky
    pol.dispatched("p0", req)
    assert pol.decisions == {"sticky": 1, "moved": 0, "new": 1, "none": 0} and not req.notes


def test_hostile_bodies_cost_little_and_never_raise() -> None:
    import time

    huge = "x" * 5_000_000
    for body in ({"messages": [{"role": "assistant", "tool_calls": 5}]},
                 {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": huge}}]}]},
                 {"messages": [{"role": "user", "content": [{"text": huge}] * 5000}]},
                 {"messages": [{"role": "user", "content": "a"}] * 200_000},
                 {"messages": "nope"}, {"messages": [None, 3, {"content": {"x": 1}}]}):
        t0 = time.monotonic()
        text = policies.prompt_text("/v1/chat/completions", body)
        assert len(text) <= policies.MAX_TEXT_CHARS and time.monotonic() - t0 < 0.5
    assert policies.prompt_text("/generate", {"messages": [{"role": "user", "content": "m"}], "text": "t"}) == "t"
    assert policies.prompt_text("/v1/completions", {"prompt": ["a"] * 10**6}).count("a") < policies.MAX_TEXT_CHARS
    assert policies.prompt_text("/generate", {"input_ids": list(range(10**6))}).startswith("0 1 2")


def test_processes_sharing_a_store_place_each_session_alike_and_maps_would_not() -> None:
    """Three processes, each with its own policy, see a session's rounds in turn. With rendezvous placement
    (``shared``) every round of every session lands on one worker whichever process serves it; with per-process
    maps (the mechanism off) a process that never saw the session places it by its own loads."""
    for make in (lambda: Session(shared=True), lambda: CacheAware(shared=True)):
        procs = [make() for _ in range(3)]
        ws = [W("p0"), W("p1"), W("p2")]
        homes: dict[str, set[str]] = {}
        for rnd in range(6):
            for s in range(30):
                w = send(procs[(s + rnd) % 3], ws, chat(f"round {rnd}", user=f"s{s}"))
                homes.setdefault(f"s{s}", set()).add(w.id)
                ws[rnd % 3].load = rnd  # loads differ between rounds, within the balance thresholds
        assert all(len(v) == 1 for v in homes.values()), homes
        assert {next(iter(v)) for v in homes.values()} == {"p0", "p1", "p2"}, "sessions spread over the workers"
    maps = [Session() for _ in range(3)]
    ws = [W("p0"), W("p1"), W("p2")]
    moved = 0
    for s in range(30):
        first = send(maps[s % 3], ws, chat("r0", user=f"s{s}"))
        first.load += 1
        moved += send(maps[(s + 1) % 3], ws, chat("r1", user=f"s{s}")).id != first.id
    assert moved >= 10, f"per-process maps: {moved} of 30 sessions moved on their second round"


def test_rendezvous_placement_moves_a_session_only_off_a_worker_over_the_thresholds() -> None:
    cfg = RoutingConfig(balance_abs=4, balance_rel=1.5)
    pol = Session(cfg, shared=True)
    ws = [W("p0"), W("p1")]
    home = send(pol, ws, chat("a", user="s")).id
    other = next(w for w in ws if w.id != home)
    next(w for w in ws if w.id == home).load = 5  # 5 - 0 > 4 and 5 > 0 * 1.5: over
    req = chat("b", user="s")
    assert send(pol, ws, req).id == other.id
    assert req.notes and f"not {home}: {home} over the balance thresholds" in req.notes[0]
    next(w for w in ws if w.id == home).load = 4  # back within: it returns home
    assert send(pol, ws, chat("c", user="s")).id == home
    assert pol.decisions["moved"] == 1 and pol.decisions["sticky"] == 2
