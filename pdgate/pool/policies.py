"""Worker selection policies: pure, synchronous, named (the name is a metric label).

A policy picks an index among candidate workers, seeing each one's id and live load and the request
(``RequestView``: route, model, its text, its session key); pair selection runs it once per role. It hears
what followed through three hooks: ``dispatched`` (an attempt was sent to that worker), ``completed`` (it
ended), ``forget`` (the worker was removed, went down or restarted: whatever it held is gone).

- ``round_robin``, ``least_loaded``, ``power_of_two``: by load alone (``by_load``).
- ``session``: a session (``x-session-id``, or OpenAI's ``user``) stays on the worker it was sent to, and
  moves, with a note in the trace, when that worker is unavailable or over the balance thresholds. Where several
  gateway processes serve (a shared store), a map of one process's could not say where another sent the session:
  there a session's worker is the first of its **rendezvous order** (highest random weight of (session, worker
  id): the same order in every process, and a worker's arrival or departure moves only its own sessions) that is
  available and not over the balance thresholds (bounded load).
- ``cache_aware``: the worker that was sent the longest prefix of this request's text (``PrefixIndex``, an
  approximate prefix tree per worker, bounded); when none holds enough of it, the worker holding least; when
  loads are out of balance, the least loaded. SGLang router's policy of that name, same thresholds, and one
  more: a held prefix of ``cache_min_chars`` or more is enough whatever its share of the prompt (an agent's
  round often adds more tool output than the history it resends; by share alone that session would move
  and recompute its whole history). Where several processes serve, a request of a session goes by the
  session's rendezvous order instead (another process's index holds the session's earlier rounds, this one's
  does not).

Add one by writing a ``select`` and registering it in ``POLICIES``.
"""

from __future__ import annotations

import abc
import hashlib
import json
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdgate.core.config import RoutingConfig


class Candidate(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def load(self) -> int: ...


W = TypeVar("W", bound=Candidate)

MAX_SESSION_CHARS = 64  # a longer session key is kept as its hash (the map's memory stays bounded per entry)


SESSION_ID = re.compile(r"_session_([0-9A-Za-z-]{1,64})$")


def user_id_session(meta: Any) -> str | None:
    """The session in Anthropic's ``metadata.user_id``: Claude Code sends JSON with a ``session_id`` (earlier
    versions ``user_<hash>_account_<uuid>_session_<uuid>``); another client's user id stands for its session."""
    uid = meta.get("user_id") if isinstance(meta, dict) else None
    if not isinstance(uid, str) or not uid:
        return None
    if uid.startswith("{"):
        try:
            obj = json.loads(uid[:4096])
        except ValueError:
            obj = None
        sid = obj.get("session_id") if isinstance(obj, dict) else None
        if isinstance(sid, str) and sid:
            return sid
    m = SESSION_ID.search(uid)
    return m.group(1) if m else uid


def client_session(headers: Any, body: dict[str, Any], header: str) -> str | None:
    """The session a client names, by one precedence (docs/routing.md, "The session key"): Claude Code's
    ``X-Claude-Code-Session-Id``, the session in ``metadata.user_id``, Codex's ``session-id`` header, a Responses
    ``prompt_cache_key``, the configured header (``routing.session_header``, default ``x-session-id``). Not here,
    and after these: a Responses chain's session, then OpenAI's ``user`` (``Pipeline.handle``)."""
    for raw in (headers.get("x-claude-code-session-id"), user_id_session(body.get("metadata")),
                headers.get("session-id"), body.get("prompt_cache_key"), headers.get(header)):
        if isinstance(raw, str) and raw:
            return raw
    return None


def session_key(tenant: str | None, header: str | None, body: dict[str, Any]) -> str | None:
    """The request's session: the configured header, else OpenAI's ``user`` field; per tenant (one client's
    session name cannot steer another's)."""
    raw = header if header else body.get("user")
    if not isinstance(raw, str) or not raw:
        return None
    if len(raw) > MAX_SESSION_CHARS:
        raw = hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()
    return f"{tenant}/{raw}" if tenant else raw


MAX_TEXT_CHARS = 1 << 20  # the prefix a policy looks at (the cache_aware index hashes no more than this)


def prompt_text(route: str, body: dict[str, Any], limit: int = MAX_TEXT_CHARS) -> str:
    """The request's input as text, in a form whose prefix stays the same as a conversation grows: chat
    messages in order (role, content, tool calls), a completion's prompt, /generate's text or token ids.
    At most about ``limit`` characters: a huge body costs no more than its first megabyte."""
    parts: list[str] = []
    size = 0

    def add(piece: str) -> bool:
        nonlocal size
        parts.append(piece[:limit - size])
        size += len(parts[-1]) + 1
        return size < limit

    if route.endswith("chat/completions"):
        msgs = body.get("messages")
        for m in msgs if isinstance(msgs, list) else ():
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: their texts, no more than the limit
                texts, n = [], 0
                for part in content:
                    if n >= limit:
                        break
                    if isinstance(part, dict):
                        texts.append(str(part.get("text", ""))[:limit - n])
                        n += len(texts[-1]) + 1
                content = " ".join(texts)
            if not add(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}"):
                break
            calls = m.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and not add(f"call {str(fn.get('name', ''))[:256]} {str(fn.get('arguments', ''))[:limit]}"):
                    break
            if size >= limit:
                break
        return "\n".join(parts)[:limit]
    prompt = body.get("prompt") if route.endswith("/completions") else body.get("text")
    if isinstance(prompt, list):
        for x in prompt:
            if not add(str(x)[:limit]):
                break
        return " ".join(parts)[:limit]
    if isinstance(prompt, str):
        return prompt[:limit]
    ids = body.get("input_ids")
    if isinstance(ids, list):
        for x in ids:
            if not add(str(x)[:32]):
                break
        return " ".join(parts)[:limit]
    return ""


@dataclass(slots=True, eq=False)
class RequestView:
    """What a policy may see of a request: ``prompt_text(route, body)`` is its text, made only by a policy that
    needs it (load-based ones never do)."""

    route: str
    model: str | None
    body: dict[str, Any]
    session: str | None = None
    notes: list[str] | None = None  # why the policy chose as it did, when that is news (traces); made when needed
    # policy name -> (decision, note or None) of its last pick: counted and noted when the attempt is sent (a
    # queued request is picked for again and again; only the pick that was used counts)
    pending: dict[str, tuple[str, str | None]] | None = None
    prefix: list[int] | None = None  # the text's block hashes (PrefixIndex), made once (the text is not kept)


NO_REQUEST = RequestView("", None, {})


class Policy(abc.ABC):
    name = "base"
    decisions: dict[str, int] = {}  # what decided, counted (a metric); the load-based policies count nothing

    def decided(self, req: RequestView, decision: str, note: str | None = None) -> None:
        """Record this pick's decision on the request (``settle`` counts it once it is used)."""
        if req.pending is None:
            req.pending = {}
        req.pending[self.name] = (decision, note)

    def settle(self, req: RequestView) -> None:
        d = req.pending.pop(self.name, None) if req.pending else None
        if d is not None:
            if "decisions" not in vars(self):  # never the class's shared (empty) dict
                self.decisions = {}
            self.decisions[d[0]] = self.decisions.get(d[0], 0) + 1
            if d[1]:
                if req.notes is None:
                    req.notes = []
                req.notes.append(d[1])

    @abc.abstractmethod
    def select(self, workers: Sequence[Candidate], req: RequestView = NO_REQUEST) -> int | None:
        """Index of the chosen worker, or None if there is none."""

    def pick(self, candidates: Sequence[W], req: RequestView = NO_REQUEST) -> W | None:
        i = self.select(candidates, req)
        return None if i is None else candidates[i]

    def dispatched(self, worker: str, req: RequestView) -> None:  # noqa: B027 (a hook: most policies ignore it)
        """An attempt of ``req`` was sent to ``worker``."""

    def completed(self, worker: str, req: RequestView, ok: bool) -> None:  # noqa: B027
        """That attempt ended (``ok``: it answered)."""

    def forget(self, worker: str) -> None:  # noqa: B027
        """``worker`` was removed, went down or restarted: what it held is gone."""


class LoadPolicy(Policy):
    """A policy that needs only the loads."""

    def select(self, workers: Sequence[Candidate], req: RequestView = NO_REQUEST) -> int | None:
        return self.by_load([w.load for w in workers])

    @abc.abstractmethod
    def by_load(self, loads: Sequence[int]) -> int | None:
        """Index of the chosen worker given each candidate's live load."""


class RoundRobin(LoadPolicy):
    name = "round_robin"

    def __init__(self, cfg: RoutingConfig | None = None) -> None:
        self._next = 0

    def by_load(self, loads: Sequence[int]) -> int | None:
        if not loads:
            return None
        i = self._next % len(loads)
        self._next += 1
        return i


class LeastLoaded(LoadPolicy):
    """Fewest live requests of ours; ties broken in turn so equal workers share."""

    name = "least_loaded"

    def __init__(self, cfg: RoutingConfig | None = None) -> None:
        self._turn = 0

    def by_load(self, loads: Sequence[int]) -> int | None:
        if not loads:
            return None
        self._turn += 1
        if len(loads) == 1:
            return 0
        low = min(loads)
        ties = [i for i, v in enumerate(loads) if v == low]
        return ties[self._turn % len(ties)]


class PowerOfTwo(LoadPolicy):
    name = "power_of_two"

    def __init__(self, cfg: RoutingConfig | None = None, rng: Callable[[int, int], int] | None = None) -> None:
        self._rng = rng or random.randint

    def by_load(self, loads: Sequence[int]) -> int | None:
        if not loads:
            return None
        if len(loads) == 1:
            return 0
        a = self._rng(0, len(loads) - 1)
        b = self._rng(0, len(loads) - 2)
        b = b + 1 if b >= a else b
        return a if loads[a] <= loads[b] else b


def imbalanced(load: int, low: int, cfg: RoutingConfig) -> bool:
    """SGLang router's rule: a worker is over the others when it holds more than ``balance_abs`` above the least
    loaded and more than ``balance_rel`` times it."""
    return load - low > cfg.balance_abs and load > low * cfg.balance_rel


def rendezvous(key: str, workers: Sequence[Candidate]) -> list[int]:
    """The indices of ``workers`` in ``key``'s rendezvous order: by a hash of (key, worker id), highest first."""
    weight = [hashlib.blake2b(f"{key}\0{w.id}".encode(), digest_size=8).digest() for w in workers]
    return sorted(range(len(workers)), key=weight.__getitem__, reverse=True)


def placed(key: str, workers: Sequence[Candidate], cfg: RoutingConfig) -> tuple[int, str | None]:
    """The first worker of ``key``'s rendezvous order that is not over the balance thresholds, and a note when
    that is not the first one."""
    loads = [w.load for w in workers]
    low = min(loads)
    order = rendezvous(key, workers)
    for i in order:
        if not imbalanced(loads[i], low, cfg):
            break
    if i == order[0]:
        return i, None
    first = workers[order[0]]
    return i, (f"session placed on {workers[i].id}, not {first.id}: {first.id} over the balance thresholds "
               f"(load {loads[order[0]]}, least {low})")


class Session(Policy):
    """Sticky by session key (module docstring). Requests without one go to the least loaded. The map keeps the
    ``max_sessions`` most recently used sessions; with ``shared`` (several processes), the rendezvous order
    places every request of a session instead."""

    name = "session"

    def __init__(self, cfg: RoutingConfig | None = None, shared: bool = False) -> None:
        self.cfg = cfg or RoutingConfig()
        self.shared = shared
        self.sticky: OrderedDict[str, tuple[str, int]] = OrderedDict()  # session -> (worker id, its epoch then)
        self.epochs: dict[str, int] = {}  # worker id -> times it lost its cache (went down, restarted)
        self._fallback = LeastLoaded()
        self.decisions = {"sticky": 0, "moved": 0, "new": 0, "none": 0}

    def select(self, workers: Sequence[Candidate], req: RequestView = NO_REQUEST) -> int | None:
        if not workers:
            return None
        key = req.session
        loads = [w.load for w in workers]
        if key is None:
            self.decided(req, "none")
            return self._fallback.by_load(loads)
        if self.shared:
            at, note = placed(key, workers, self.cfg)
            self.decided(req, "sticky" if note is None else "moved", note)
            return at
        was, epoch = self.sticky.get(key, (None, 0))
        if was is None:
            self.decided(req, "new")
            return self._fallback.by_load(loads)
        i = next((i for i, w in enumerate(workers) if w.id == was), None)
        if i is None:
            why = "unavailable or at its capacity"
        elif epoch != self.epochs.get(was, 0):
            why = "lost its cache since (down or restarted)"
        elif imbalanced(loads[i], min(loads), self.cfg):
            why = f"over the balance thresholds (load {loads[i]}, least {min(loads)})"
        else:
            self.decided(req, "sticky")
            return i
        rest = [k for k in range(len(workers)) if k != i]
        if not rest:  # its own worker is the only one: it stays, with an empty cache
            self.decided(req, "new", f"session stays on {was}: it {why}")
            return i
        j = rest[self._fallback.by_load([loads[k] for k in rest]) or 0]
        self.decided(req, "moved", f"session moved from {was} to {workers[j].id}: {was} {why}")
        return j

    def dispatched(self, worker: str, req: RequestView) -> None:
        self.settle(req)
        key = req.session
        if key is None or self.shared:
            return
        self.sticky[key] = (worker, self.epochs.get(worker, 0))
        self.sticky.move_to_end(key)
        while len(self.sticky) > self.cfg.max_sessions:
            self.sticky.popitem(last=False)

    def forget(self, worker: str) -> None:
        self.epochs[worker] = self.epochs.get(worker, 0) + 1  # its sessions move on their next request


class PrefixIndex:
    """An approximate prefix tree of what each worker was sent. A text is cut into blocks of ``block_chars``;
    block i's hash covers blocks 0..i, so it names a node of the tree (the whole prefix up to there), and the
    longest prefix a worker holds is the number of leading hashes found in its set. Each worker keeps at most
    ``max_blocks`` hashes, least recently sent first out; a text's blocks are touched leaf first, so a prefix's
    root is evicted after its branches (an evicted root would orphan every branch below it)."""

    def __init__(self, block_chars: int, max_blocks: int, max_text_blocks: int = 4096) -> None:
        self.block = block_chars
        self.max_blocks = max_blocks
        self.max_text_blocks = max_text_blocks  # a longer text is indexed by its first this many blocks
        self.by_worker: dict[str, OrderedDict[int, None]] = {}

    def hashes(self, text: str) -> list[int]:
        b = self.block
        out: list[int] = []
        h = 0
        for start in range(0, min(len(text), b * self.max_text_blocks), b):
            h = hash((h, text[start:start + b]))
            out.append(h)
        return out

    def match(self, worker: str, hashes: Sequence[int]) -> int:
        held = self.by_worker.get(worker)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def insert(self, worker: str, hashes: Sequence[int]) -> None:
        held = self.by_worker.setdefault(worker, OrderedDict())
        for h in reversed(hashes):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def size(self, worker: str) -> int:
        return len(self.by_worker.get(worker, ()))

    def forget(self, worker: str) -> None:
        self.by_worker.pop(worker, None)


class CacheAware(Policy):
    """The worker holding the longest prefix of the request (module docstring)."""

    name = "cache_aware"

    def __init__(self, cfg: RoutingConfig | None = None, shared: bool = False) -> None:
        self.cfg = cfg or RoutingConfig()
        self.shared = shared
        self.index = PrefixIndex(self.cfg.block_chars, self.cfg.max_blocks)
        self.decisions = {"cache": 0, "new": 0, "balance": 0, "only": 0, "session": 0}

    def prefix(self, req: RequestView) -> list[int]:
        if req.prefix is None:
            req.prefix = self.index.hashes(prompt_text(req.route, req.body, self.index.block * self.index.max_text_blocks))
        return req.prefix

    def select(self, workers: Sequence[Candidate], req: RequestView = NO_REQUEST) -> int | None:
        if not workers:
            return None
        if len(workers) == 1:
            self.decided(req, "only")
            return 0
        loads = [w.load for w in workers]
        low = min(loads)
        if imbalanced(max(loads), low, self.cfg):  # a hot prefix must not pile onto one worker
            i = min(range(len(workers)), key=lambda k: (loads[k], self.index.size(workers[k].id)))
            self.decided(req, "balance",
                         f"cache_aware: loads out of balance ({max(loads)} vs {low}); least loaded {workers[i].id}")
            return i
        if self.shared and req.session is not None:
            i, note = placed(req.session, workers, self.cfg)
            self.decided(req, "session", note)
            return i
        hs = self.prefix(req)
        matches = [self.index.match(w.id, hs) for w in workers]
        best = max(matches)
        if best and (best / len(hs) >= self.cfg.cache_threshold or best * self.index.block >= self.cfg.cache_min_chars):
            self.decided(req, "cache")
            return min((k for k in range(len(workers)) if matches[k] == best), key=lambda k: loads[k])
        self.decided(req, "new")  # nobody holds enough of it: the worker holding least gets it
        return min(range(len(workers)), key=lambda k: (self.index.size(workers[k].id), loads[k]))

    def dispatched(self, worker: str, req: RequestView) -> None:
        self.settle(req)
        if not (self.shared and req.session is not None):
            self.index.insert(worker, self.prefix(req))

    def forget(self, worker: str) -> None:
        self.index.forget(worker)


POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PowerOfTwo.name: PowerOfTwo,
    Session.name: Session,
    CacheAware.name: CacheAware,
}
REQUEST_AWARE = frozenset({Session.name, CacheAware.name})  # for the prefill choice; decode stays load-based


def make(name: str, cfg: RoutingConfig | None = None, shared: bool = False) -> Policy:
    """Policy ``name``; ``shared``: several gateway processes route (the request-aware ones place sessions by
    rendezvous order)."""
    cfg = cfg or RoutingConfig()
    return POLICIES[name](cfg, shared) if name in REQUEST_AWARE else POLICIES[name](cfg)


def select_pair(prefills: Sequence[W], decodes: Sequence[W], prefill_policy: Policy, decode_policy: Policy,
                avoid: frozenset[int] = frozenset(), req: RequestView = NO_REQUEST,
                same: Callable[[W, W], bool] | None = None) -> tuple[W, W] | None:
    """Pick a (prefill, decode) pair; workers whose id() is in ``avoid`` are used only if nothing else is left;
    with ``same``, a decode that ``same(prefill, decode)`` says goes with the prefill picked."""
    def pool(ws: Sequence[W]) -> Sequence[W]:
        if not avoid:  # a first attempt: every candidate
            return ws
        fresh = [w for w in ws if id(w) not in avoid]
        return fresh or ws

    p = prefill_policy.pick(pool(prefills), req)
    if p is None:
        return None
    d = decode_policy.pick(pool(decodes if same is None else [d for d in decodes if same(p, d)]), req)
    return None if d is None else (p, d)
