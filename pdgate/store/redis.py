"""The Redis store: what several gateway processes or hosts must agree on, in one Redis (redis-py's asyncio
client; ``redis://``, ``rediss://`` or ``unix:``; ACL user and password from a file or the environment).

Keys (under ``prefix``; one Redis, not a cluster: the scripts name keys they build):

    inst:<id>              an instance's registry entry (JSON), with a PX lease renewed by its heartbeat
    known                  every instance that wrote rids (so the gone ones are found after their entry expired)
    rids:<id>              its live attempt rids -> the workers they are on (rewritten whole by each heartbeat)
    held:<worker>          instance -> its live requests on that worker (counted only while the instance lives)
    live:<tenant>          instance -> its live requests of that key (likewise)
    bucket:<tenant>:<kind> a key's requests or tokens per minute: level and time (refilled on Redis's clock)
    workers, workers:v     the worker set (id -> JSON) and its version; workers:n:<role> the next id's number
    reap:<id>              who cleans up a gone instance's rids (one survivor)
    resp:<tenant>:<id>     a stored response (/v1/responses), with a PX TTL; ids hold no ':' (checked before)
    resps:<tenant>         its tenant's stored ids by time written (the count bound takes the oldest)

A request with something to agree on (a key with limits, a worker with a capacity) costs one round trip on
its path (``ACQUIRE``: the key's limits and a slot on each worker, all or nothing); one with nothing to agree
on costs none (its counts and rid go in the next batch). What it gives back and what it is charged after the
fact go in batches, off its path (with the next ``ACQUIRE``, or in a ``GIVE_BACK`` within 5 ms when it frees a
bounded place, 50 ms when not). One
``ACQUIRE`` is out at a time: what is asked while it is out goes in the next, so its batch grows with the load
rather than the number of calls. Each
heartbeat rewrites what this instance holds, whole, so a Redis that restarted empty has it back by the next
one. Every call on a request's path is bounded by ``timeout_s``, what is off it (the heartbeat, reaping, the
worker set) by ``background_s`` (at least 1 s); while Redis cannot be reached, limits fall back to this
process's share (each limit divided among the instances last seen: ``EmbeddedStore``) and nobody is taken
for dead. Client keys never reach the store (tenants are named by their key's name); nothing in it lets its
reader call an engine or an admin plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdgate.core.config import ResponsesConfig, StoreConfig
from pdgate.core.errors import StoreUnavailable
from pdgate.store.base import Beat, Grant, TenantAsk
from pdgate.store.embedded import EmbeddedStore

log = logging.getLogger("pdgate.store")

SOON_S = 0.005  # a give-back that frees a bounded place goes within this (or with the next ACQUIRE)
LAZY_S = 0.05  # the others' (counts and rids of requests with nothing to agree on)

# the sum of a hash's counts over the instances that are alive (or this one)
LIVE_SUM = """
local function live_sum(p, inst, key)
  local total, h = 0, redis.call('HGETALL', key)
  for i = 1, #h, 2 do
    if h[i] == inst or redis.call('EXISTS', p .. 'inst:' .. h[i]) == 1 then total = total + tonumber(h[i + 1]) end
  end
  return total
end
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function level(key, per_min, at_now)
  local b = redis.call('HMGET', key, 'level', 'at')
  local lv, at = tonumber(b[1]), tonumber(b[2])
  if lv == nil then return per_min end
  return math.min(per_min, lv + (at_now - at) * per_min / 60)
end
"""

# ops: 'r' tenant|'' rid|'' n workers... (given back) | 'c' tenant tokens_per_min tokens (charged after the fact)
# | 'a' tenant|'' hold rid|'' n workers... (taken with nothing to agree on: counted, its rid recorded)
OPS = """
local function apply_ops(p, inst, t, i, last)
  local function down(key)
    if tonumber(redis.call('HGET', key, inst) or '0') > 0 then redis.call('HINCRBY', key, inst, -1) end
  end
  while i <= last do
    if ARGV[i] == 'a' then
      if ARGV[i + 1] ~= '' and ARGV[i + 2] == '1' then redis.call('HINCRBY', p .. 'live:' .. ARGV[i + 1], inst, 1) end
      local n, ws = tonumber(ARGV[i + 4]), {}
      for j = 1, n do
        redis.call('HINCRBY', p .. 'held:' .. ARGV[i + 4 + j], inst, 1)
        ws[#ws + 1] = ARGV[i + 4 + j]
      end
      if ARGV[i + 3] ~= '' then redis.call('HSET', p .. 'rids:' .. inst, ARGV[i + 3], table.concat(ws, ' ')) end
      i = i + 5 + n
    elseif ARGV[i] == 'r' then
      if ARGV[i + 1] ~= '' then down(p .. 'live:' .. ARGV[i + 1]) end
      if ARGV[i + 2] ~= '' then redis.call('HDEL', p .. 'rids:' .. inst, ARGV[i + 2]) end
      local n = tonumber(ARGV[i + 3])
      for j = 1, n do down(p .. 'held:' .. ARGV[i + 3 + j]) end
      i = i + 4 + n
    else
      local key, tpm = p .. 'bucket:' .. ARGV[i + 1] .. ':tokens', tonumber(ARGV[i + 2])
      redis.call('HSET', key, 'level', level(key, tpm, t) - tonumber(ARGV[i + 3]), 'at', t)
      i = i + 4
    end
  end
end
"""

# ARGV: prefix, instance, then ops (above)
GIVE_BACK = LIVE_SUM + OPS + """
apply_ops(ARGV[1], ARGV[2], now(), 3, #ARGV)
return 1
"""

# ARGV: prefix, instance, k, k arguments of ops (give-backs that were waiting: they go first), then asks (the
# requests that asked meanwhile), each: tenant|'' max_concurrent rpm tpm tokens unbounded hold rid|'' n, then n
# pairs of worker and capacity (-1: none). Each is all or nothing, in order; the answer is one list per ask.
ACQUIRE = LIVE_SUM + OPS + """
local p, inst, t = ARGV[1], ARGV[2], now()
local k = tonumber(ARGV[3])
apply_ops(p, inst, t, 4, 3 + k)
local function one(i)
  local tenant, maxc, rpm, tpm = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local tokens, unbounded, hold, rid = tonumber(ARGV[i + 4]), ARGV[i + 5] == '1', ARGV[i + 6] == '1', ARGV[i + 7]
  local w0, n = i + 9, tonumber(ARGV[i + 8])
  local rkey, tkey = p .. 'bucket:' .. tenant .. ':requests', p .. 'bucket:' .. tenant .. ':tokens'
  local rl, tl
  if tenant ~= '' then
    if hold and maxc >= 0 and live_sum(p, inst, p .. 'live:' .. tenant) >= maxc then return {'concurrency', '1'} end
    if rpm >= 0 then
      rl = level(rkey, rpm, t)
      if rl < 1 then return {'requests', tostring((1 - rl) * 60 / rpm)} end
    end
    if tpm >= 0 then
      tl = level(tkey, tpm, t)
      if unbounded then
        if math.floor(tl) <= tokens then return {'tokens', tostring((tokens + 1 - tl) * 60 / tpm)} end
        tokens = math.floor(tl)
      elseif tokens > tpm then return {'too_large', '60'}
      elseif tl < tokens then return {'tokens', tostring((tokens - tl) * 60 / tpm)} end
    end
  end
  local out = {'ok', tostring(tokens)}
  for j = w0, w0 + 2 * n - 1, 2 do
    local key, cap = p .. 'held:' .. ARGV[j], tonumber(ARGV[j + 1])
    local total = live_sum(p, inst, key)
    local others = total - tonumber(redis.call('HGET', key, inst) or '0')
    if cap >= 0 and total + 1 > cap then return {'full', ARGV[j], tostring(others)} end
    out[#out + 1] = ARGV[j]
    out[#out + 1] = tostring(others)
  end
  if tenant ~= '' then
    if rl ~= nil then redis.call('HSET', rkey, 'level', rl - 1, 'at', t) end
    if tl ~= nil then redis.call('HSET', tkey, 'level', tl - tokens, 'at', t) end
    if hold then redis.call('HINCRBY', p .. 'live:' .. tenant, inst, 1) end
  end
  local ws = {}
  for j = w0, w0 + 2 * n - 1, 2 do
    redis.call('HINCRBY', p .. 'held:' .. ARGV[j], inst, 1)
    ws[#ws + 1] = ARGV[j]
  end
  if rid ~= '' then redis.call('HSET', p .. 'rids:' .. inst, rid, table.concat(ws, ' ')) end
  return out
end
local answers, i = {}, 4 + k
while i <= #ARGV do
  answers[#answers + 1] = one(i)
  i = i + 9 + 2 * tonumber(ARGV[i + 8])
end
return answers
"""

# ARGV: prefix, instance, lease_ms, info json, rids json, held json, tenants json, workers json (every worker
# id), whole ('1': the counts are written whole). The counts are written whole when asked, or when this
# instance's entry is not there (a Redis that restarted empty, a lease that ran out): else each count is the
# requests' own increments and give-backs, which a whole write racing them would undo.
BEAT = LIVE_SUM + """
local p, inst = ARGV[1], ARGV[2]
local whole = ARGV[9] == '1' or redis.call('EXISTS', p .. 'inst:' .. inst) == 0
redis.call('SET', p .. 'inst:' .. inst, ARGV[4], 'PX', ARGV[3])
redis.call('SADD', p .. 'known', inst)
if whole then
  redis.call('DEL', p .. 'rids:' .. inst)
  for rid, ws in pairs(cjson.decode(ARGV[5])) do redis.call('HSET', p .. 'rids:' .. inst, rid, ws) end
  for w, n in pairs(cjson.decode(ARGV[6])) do redis.call('HSET', p .. 'held:' .. w, inst, n) end
  for tn, n in pairs(cjson.decode(ARGV[7])) do redis.call('HSET', p .. 'live:' .. tn, inst, n) end
end
local out = {tostring(redis.call('GET', p .. 'workers:v') or '0'), whole and '1' or '0'}
for _, w in ipairs(cjson.decode(ARGV[8])) do
  local key = p .. 'held:' .. w
  out[#out + 1] = w
  out[#out + 1] = tostring(live_sum(p, inst, key) - tonumber(redis.call('HGET', key, inst) or '0'))
end
return out
"""

GONE = """
local p, out = ARGV[1], {}
for _, inst in ipairs(redis.call('SMEMBERS', p .. 'known')) do
  if redis.call('EXISTS', p .. 'inst:' .. inst) == 0 then out[#out + 1] = inst end
end
return out
"""

# ARGV: prefix, instance: a gone instance's records, all of them (its counts no longer counted already)
FORGET = """
local p, inst = ARGV[1], ARGV[2]
redis.call('DEL', p .. 'rids:' .. inst)
redis.call('SREM', p .. 'known', inst)
for _, w in ipairs(redis.call('HKEYS', p .. 'workers')) do redis.call('HDEL', p .. 'held:' .. w, inst) end
local cur = '0'
repeat
  local got = redis.call('SCAN', cur, 'MATCH', p .. 'live:*', 'COUNT', 100)
  cur = got[1]
  for _, k in ipairs(got[2]) do redis.call('HDEL', k, inst) end
until cur == '0'
return 1
"""

# ARGV: prefix, spec json (role, url, ...): the new worker's id, or '' if one with that role and URL is there
ADD_WORKER = """
local p, spec = ARGV[1], cjson.decode(ARGV[2])
for _, v in ipairs(redis.call('HVALS', p .. 'workers')) do
  local w = cjson.decode(v)
  if w.role == spec.role and w.url == spec.url then return '' end
end
local n = redis.call('INCR', p .. 'workers:n:' .. spec.role) - 1
local id = string.sub(spec.role, 1, 1) .. n
spec.id = id
redis.call('HSET', p .. 'workers', id, cjson.encode(spec))
redis.call('PUBLISH', p .. 'workers', redis.call('INCR', p .. 'workers:v'))
return id
"""

REMOVE_WORKER = """
local p = ARGV[1]
if redis.call('HDEL', p .. 'workers', ARGV[2]) == 0 then return 0 end
redis.call('PUBLISH', p .. 'workers', redis.call('INCR', p .. 'workers:v'))
return 1
"""

# ARGV: prefix, specs json (each with its id): only into a store that has no worker set
SEED = """
local p = ARGV[1]
if redis.call('EXISTS', p .. 'workers:v') == 1 then return 0 end
for _, w in ipairs(cjson.decode(ARGV[2])) do
  redis.call('HSET', p .. 'workers', w.id, cjson.encode(w))
  local n = tonumber(string.sub(w.id, 2)) + 1
  local key = p .. 'workers:n:' .. w.role
  if tonumber(redis.call('GET', key) or '0') < n then redis.call('SET', key, n) end
end
redis.call('PUBLISH', p .. 'workers', redis.call('INCR', p .. 'workers:v'))
return 1
"""

# ARGV: prefix, tenant, id, blob, ttl ms, most kept: written, the tenant's oldest beyond the bound forgotten
PUT_RESPONSE = """
local p, t, id = ARGV[1], ARGV[2], ARGV[3]
local ttl, most = tonumber(ARGV[5]), tonumber(ARGV[6])
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local idx = p .. 'resps:' .. t
redis.call('SET', p .. 'resp:' .. t .. ':' .. id, ARGV[4], 'PX', ttl)
redis.call('ZADD', idx, now, id)
redis.call('ZREMRANGEBYSCORE', idx, '-inf', now - ttl)
local n = redis.call('ZCARD', idx)
if n > most then
  for _, old in ipairs(redis.call('ZRANGE', idx, 0, n - most - 1)) do redis.call('DEL', p .. 'resp:' .. t .. ':' .. old) end
  redis.call('ZREMRANGEBYRANK', idx, 0, n - most - 1)
end
redis.call('PEXPIRE', idx, ttl)
return 1
"""


def secret(cfg: StoreConfig) -> str | None:
    if cfg.password_file:
        with open(cfg.password_file) as f:
            return f.read().strip()
    return os.environ.get(cfg.password_env) if cfg.password_env else None


class RedisStore:
    shared = True

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.lease_s = cfg.lease_s
        self.prefix = cfg.prefix
        url = cfg.url if not cfg.url.startswith("unix:") or cfg.url.startswith("unix://") else "unix://" + cfg.url[5:]
        self.r = aioredis.Redis.from_url(url, username=cfg.username, password=secret(cfg),
                                         # the outer cap: a request's calls are bounded by timeout_s themselves
                                         socket_timeout=max(1.0, cfg.timeout_s * 20),
                                         socket_connect_timeout=max(1.0, cfg.timeout_s * 20),
                                         max_connections=64)
        self.scripts = {name: self.r.register_script(src) for name, src in (
            ("acquire", ACQUIRE), ("give_back", GIVE_BACK), ("beat", BEAT), ("gone", GONE), ("forget", FORGET),
            ("add_worker", ADD_WORKER), ("remove_worker", REMOVE_WORKER), ("seed", SEED),
            ("put_response", PUT_RESPONSE))}
        # what is off every request's path (the heartbeat, reaping, an operator's change) waits longer than a request's
        # step may: on a loaded box a 50 ms bound kept a restarted process's heartbeat from ever landing (a
        # reconnect inside it each time), so it was never in the registry
        self.background_s = max(1.0, cfg.timeout_s * 20)
        self.instance = ""
        self.instances_seen = 1  # live instances at the last heartbeat (the fallback divides limits by it)
        self.registry: dict[str, dict[str, Any]] = {}  # their entries then (their learned limits among them)
        self.local = EmbeddedStore(cfg.lease_s, lambda: self.instances_seen)
        self.reachable = True
        self.fallbacks = 0  # calls answered by the local share
        self.round_trips = 0
        self.version = 0  # of the worker set, as last read
        self._ops: list[Any] = []  # give-backs and charges to send (batched)
        self._flush_at = 0.0  # when the batch goes (loop time), if _flush_handle
        self._flush_handle: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self._lazy_rids: set[str] = set()  # attempts that took nothing bounded: their give-back may wait
        self._free_tenants: set[str] = set()  # keys without limits (named in the config: a bounded set)
        self._tasks: list[asyncio.Task[None]] = []
        self.on_workers: Callable[[], None] = lambda: None
        self.written: set[str] = set()  # the count hashes this instance has a field in (withdrawn at close)
        self.tenants: set[str] = set()  # the tenants whose live count it wrote (a whole write sets theirs to 0)
        self.resync = True  # the next heartbeat writes the counts whole (an answer lost: a count may be off)
        self.sent = 0  # acquires and give-backs sent
        self.inflight = 0  # ... and not answered yet
        self.local_rids: set[str] = set()  # attempts given slots by the local share (nothing of theirs in Redis)
        self._asks: list[Any] = []  # acquires not sent yet (sent together)
        self._asking: asyncio.Task[None] | None = None  # the ACQUIRE out

    async def start(self, instance: str, on_workers: Callable[[], None]) -> None:
        self.instance, self.on_workers = instance, on_workers
        self._tasks.append(asyncio.get_running_loop().create_task(self._listen()))
        await self.prepare()

    async def prepare(self) -> None:
        """The connection opened and every script loaded before the first bounded call: a call's ``timeout_s`` (50
        ms) bounds one EVALSHA, not a connect plus a SCRIPT LOAD on a loaded box (a test timed out so). Redis that
        does not answer now is not fatal: the calls fall back, and a script is loaded again where it is missing."""
        with contextlib.suppress(RedisError, OSError):
            async with asyncio.timeout(self.background_s):
                for script in self.scripts.values():
                    script.sha = await self.r.script_load(script.script)

    async def close(self) -> None:
        """Withdraw: this instance stopped (drained), nobody needs to clean up after it."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        await self._flush()
        with contextlib.suppress(RedisError, OSError):
            async with asyncio.timeout(self.cfg.timeout_s * 4):
                p, me = self.prefix, self.instance
                async with self.r.pipeline(transaction=True) as pipe:
                    pipe.delete(p + "inst:" + me, p + "rids:" + me)
                    pipe.srem(p + "known", me)
                    for key in self.written:
                        pipe.hdel(key, me)
                    await pipe.execute()
        with contextlib.suppress(RedisError, OSError):
            await self.r.aclose()

    async def _call(self, name: str, *args: Any, bound: float | None = None) -> Any:
        """One script, bounded (``timeout_s`` on a request's path; ``bound``: ``background_s`` off it);
        ``RedisError`` / ``OSError`` (a timeout is one) when Redis does not answer."""
        self.round_trips += 1
        async with asyncio.timeout(bound or self.cfg.timeout_s):
            return await self.scripts[name](args=[self.prefix, *args])

    async def _count(self, name: str, *args: Any) -> Any:
        """A call that changes counts: one lost (it may have run, or not) makes the next heartbeat write whole."""
        self.sent += 1
        self.inflight += 1
        try:
            return await self._call(name, *args)
        except BaseException:
            self.resync = True
            raise
        finally:
            self.inflight -= 1

    def _lost(self, exc: BaseException) -> None:
        self.fallbacks += 1
        if self.reachable:
            self.reachable = False
            log.warning("store %s unreachable (%s): limits fall back to this process's share (1/%d); nobody is "
                        "taken for dead meanwhile", self.cfg.url, exc.__class__.__name__, self.instances_seen)

    def _found(self) -> None:
        if not self.reachable:
            self.reachable = True
            log.info("store %s reachable again", self.cfg.url)

    # ---- a request's path -------------------------------------------------------------------
    async def acquire(self, tenant: TenantAsk | None, workers: tuple[tuple[str, int | None], ...],
                      now: float, rid: str = "") -> Grant:
        t = tenant
        if (t is None or (t.max_concurrent is None and t.requests_per_min is None and t.tokens_per_min is None)) \
                and all(cap is None for _, cap in workers):  # nothing to agree on: counted in the next batch
            self._ops += ["a", t.name if t else "", int(bool(t and t.hold)), rid, len(workers), *(w for w, _ in workers)]
            if rid:
                self._lazy_rids.add(rid)
            if t is not None:
                self._free_tenants.add(t.name)
            self._soon(LAZY_S)
            return Grant(True, tokens=t.tokens if t else 0)
        ask: list[Any] = [t.name if t else "", _n(t.max_concurrent if t and t.hold else None),
                          _n(t.requests_per_min if t else None), _n(t.tokens_per_min if t else None),
                          t.tokens if t else 0, int(bool(t and t.unbounded)), int(bool(t and t.hold)), rid, len(workers)]
        for wid, cap in workers:
            ask += [wid, _n(cap)]
        waiter: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        self._asks.append((ask, t, rid, tuple(w for w, _ in workers), now, waiter))
        if len(self._asks) == 1 and self._asking is None:  # who asks in this turn of the loop goes in the same call
            asyncio.get_running_loop().call_soon(self._send_asks)
        return await waiter

    def _send_asks(self) -> None:
        """One ``ACQUIRE`` out at a time: what is asked while it is out goes in the next one, at its answer (the
        batch grows with the load, a request waits at most for the call before its own)."""
        if self._asking is not None or not self._asks:
            return
        asks, self._asks = self._asks, []
        ops, self._ops = self._ops, []  # the give-backs waiting go along (first: they free what the asks want)
        self._asking = asyncio.get_running_loop().create_task(self._ask(asks, ops))
        self._asking.add_done_callback(self._asked)

    def _asked(self, task: asyncio.Task[None]) -> None:
        self._asking = None
        self._send_asks()

    async def _ask(self, asks: list[Any], ops: list[Any]) -> None:
        """An asker gone meanwhile (its request ended) gives back what it was granted, at once."""
        try:
            got = await self._count("acquire", self.instance, len(ops), *ops, *(a for ask in asks for a in ask[0]))
        except (RedisError, OSError) as exc:
            self._lost(exc)
            for _, t, rid, workers, now, waiter in asks:
                grant = self.local.take(t, now)
                if grant.ok and rid and workers:
                    self.local_rids.add(rid)
                if waiter.done():
                    if grant.ok:
                        self.release(t.name if t and t.hold else None, workers, now, rid)
                else:
                    waiter.set_result(grant)
            return
        except BaseException as exc:  # cancelled (the store closing): nobody waits forever
            for *_, waiter in asks:
                if not waiter.done():
                    waiter.set_exception(exc if isinstance(exc, Exception) else RedisError("the store closed"))
            raise
        self._found()
        for (_, t, rid, workers, now, waiter), answer in zip(asks, got, strict=True):
            grant = _grant(answer)
            if waiter.done():
                if grant.ok:
                    self.release(t.name if t and t.hold else None, workers, now, rid)
            else:
                waiter.set_result(grant)

    def release(self, tenant: str | None, workers: tuple[str, ...], now: float, rid: str = "") -> None:
        """What the local share gave is given back there (a live request of a key, or slots of an attempt taken
        while Redis was unreachable: nothing of theirs is in Redis until a whole write puts them there)."""
        if tenant and self.local.live.get(tenant, 0) > 0:
            self.local.release(tenant, (), now)
            tenant = None
        if rid in self.local_rids:
            self.local_rids.discard(rid)
            workers, rid = (), ""
        if tenant or workers or rid:
            lazy = (not rid or rid in self._lazy_rids) and (not tenant or tenant in self._free_tenants)
            self._lazy_rids.discard(rid)
            self._ops += ["r", tenant or "", rid, len(workers), *workers]
            self._soon(LAZY_S if lazy else SOON_S)

    def charge(self, tenant: str, tokens_per_min: int, tokens: int, now: float) -> None:
        self.local.charge(tenant, tokens_per_min, tokens, now)
        if tokens:
            self._ops += ["c", tenant, tokens_per_min, tokens]
            self._soon(SOON_S)

    def _soon(self, within: float) -> None:
        """The batch goes within ``within`` (or with the next ``ACQUIRE``): what frees a bounded place (a key's
        live request, a slot of a worker with a capacity, tokens) soon, for the other instances to take; the
        rest (counts and rids of requests with nothing to agree on) may wait longer in a bigger batch."""
        loop = asyncio.get_running_loop()
        at = loop.time() + within
        if self._flush_handle is not None:
            if self._flush_at <= at:
                return
            self._flush_handle.cancel()
        self._flush_at, self._flush_handle = at, loop.call_at(at, self._flush_now)

    def _flush_now(self) -> None:
        self._flush_handle = None
        self._flushes.add(task := asyncio.get_running_loop().create_task(self._flush()))
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        ops, self._ops = self._ops, []
        if not ops:
            return
        try:
            await self._count("give_back", self.instance, *ops)
        except (RedisError, OSError) as exc:  # the next heartbeat writes what this instance holds, whole
            self._lost(exc)

    # ---- registry ----------------------------------------------------------------------------
    async def heartbeat(self, beat: Beat) -> dict[str, int] | None:
        whole = self.resync
        clean, sent = self.inflight == 0, self.sent  # nothing in flight can race a whole write
        dropped = self._drop_releases() if whole else []  # what a whole write writes makes them moot
        if whole:  # it writes every live request of this instance: the local share's ones are then in Redis too
            local_live, local_rids = dict(self.local.live), set(self.local_rids)
            self.local.live.clear()
            self.local_rids.clear()
        self.written |= {self.prefix + "held:" + w for w in beat.held} | {self.prefix + "live:" + t for t in beat.tenants}
        self.tenants |= set(beat.tenants)
        tenants = {**dict.fromkeys(self.tenants, 0), **beat.tenants}
        try:
            got = await self._call("beat", self.instance, int(self.lease_s * 1000),
                                   orjson.dumps({**beat.info, "at": time.time()}).decode(),
                                   orjson.dumps({r: " ".join(ws) for r, ws in beat.rids.items()} or {}).decode(),
                                   orjson.dumps(beat.held).decode(), orjson.dumps(tenants).decode(),
                                   orjson.dumps(sorted(beat.held)).decode(), "1" if whole else "0",
                                   bound=self.background_s)
            live = await self.instances()
        except (RedisError, OSError) as exc:
            self._lost(exc)
            self._ops = dropped + self._ops
            if whole:
                self.local.live.update(local_live)
                self.local_rids |= local_rids
            self.resync = True
            return None
        self._found()
        if got[1] == b"1":  # written whole (asked, or the store had lost this instance): settled if nothing raced it
            self.resync = not (clean and self.sent == sent and whole)
        if live is not None:
            self.instances_seen = max(1, len(live))
            self.registry = live
        version = int(got[0])
        if version != self.version:
            self.version = version
            self.on_workers()
        rest = got[2:]
        return {rest[i].decode(): int(rest[i + 1]) for i in range(0, len(rest), 2)}

    def _drop_releases(self) -> list[Any]:
        """Take the pending takes and give-backs of slots out (a heartbeat writes the counts whole); charges stay."""
        kept, dropped, ops, i = [], [], self._ops, 0
        while i < len(ops):
            if ops[i] in ("r", "a"):
                n = 4 + int(ops[i + 3]) if ops[i] == "r" else 5 + int(ops[i + 4])
                dropped += ops[i:i + n]
                i += n
            else:
                kept += ops[i:i + 4]
                i += 4
        self._ops = kept
        return dropped

    async def instances(self) -> dict[str, dict[str, Any]] | None:
        try:
            async with asyncio.timeout(self.background_s):
                names = [_text(m) for m in await self.r.smembers(self.prefix + "known")]
                names = sorted({*names, self.instance})
                raw = await self.r.mget([self.prefix + "inst:" + n for n in names]) if names else []
        except (RedisError, OSError) as exc:
            self._lost(exc)
            return None
        return {n: orjson.loads(v) for n, v in zip(names, raw, strict=True) if v is not None}

    async def gone(self) -> list[str]:
        try:
            return [g.decode() for g in await self._call("gone", bound=self.background_s)]
        except (RedisError, OSError) as exc:
            self._lost(exc)
            return []

    async def rids_of(self, instance: str) -> dict[str, tuple[str, ...]] | None:
        try:
            async with asyncio.timeout(self.background_s), self.r.pipeline(transaction=True) as pipe:
                pipe.set(self.prefix + "reap:" + instance, self.instance, nx=True, px=int(self.lease_s * 1000))
                pipe.hgetall(self.prefix + "rids:" + instance)
                claimed, got = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._lost(exc)
            return None
        if not claimed:
            return None
        return {_text(k): tuple(_text(v).split()) for k, v in got.items()}

    async def forget(self, instance: str) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._call("forget", instance, bound=self.background_s)

    # ---- the worker set ------------------------------------------------------------------------
    async def worker_set(self) -> tuple[int, list[dict[str, Any]]]:
        async with asyncio.timeout(self.cfg.timeout_s * 4):
            version, specs = await self.r.get(self.prefix + "workers:v"), await self.r.hgetall(self.prefix + "workers")
        self.version = int(version or 0)
        return self.version, [orjson.loads(v) for v in specs.values()]

    async def add_worker(self, spec: dict[str, Any]) -> str | None:
        got = await self._call("add_worker", orjson.dumps(spec).decode(), bound=self.background_s)
        return got.decode() or None

    async def remove_worker(self, wid: str) -> bool:
        return bool(await self._call("remove_worker", wid, bound=self.background_s))

    async def seed_workers(self, specs: list[dict[str, Any]]) -> None:
        await self._call("seed", orjson.dumps(specs).decode(), bound=self.background_s)

    async def _listen(self) -> None:
        """The worker set's changes, pushed (a message missed while disconnected is caught by the heartbeat's
        version check)."""
        while True:
            try:
                async with self.r.pubsub() as ps:
                    await ps.subscribe(self.prefix + "workers")
                    async for msg in ps.listen():
                        if msg.get("type") == "message" and int(msg["data"]) != self.version:
                            self.version = int(msg["data"])
                            self.on_workers()
            except (RedisError, OSError, ValueError):
                await asyncio.sleep(1.0)

    # ---- stored responses ---------------------------------------------------------------------------------
    async def put_response(self, tenant: str, rid: str, blob: bytes, now: float, limits: ResponsesConfig) -> bool:
        try:
            async with asyncio.timeout(self.cfg.timeout_s * 4):  # a blob of up to max_response_bytes
                await self.scripts["put_response"](args=[self.prefix, tenant, rid, blob, int(limits.ttl_s * 1000),
                                                         limits.max_stored])
        except (RedisError, OSError) as exc:
            self._lost(exc)
            log.warning("response %s not stored: the store %s did not answer (%s)", rid, self.cfg.url,
                        exc.__class__.__name__)
            return False
        return True

    async def get_response(self, tenant: str, rid: str, now: float) -> bytes | None:
        try:
            async with asyncio.timeout(self.cfg.timeout_s * 4):
                got = await self.r.get(f"{self.prefix}resp:{tenant}:{rid}")
        except (RedisError, OSError) as exc:
            self._lost(exc)
            raise StoreUnavailable(f"stored responses cannot be read: the store did not answer "
                                   f"({exc.__class__.__name__})") from None
        return got if isinstance(got, bytes) or got is None else got.encode()

    async def delete_response(self, tenant: str, rid: str) -> bool:
        try:
            async with asyncio.timeout(self.cfg.timeout_s * 4), self.r.pipeline(transaction=True) as pipe:
                pipe.delete(f"{self.prefix}resp:{tenant}:{rid}")
                pipe.zrem(f"{self.prefix}resps:{tenant}", rid)
                gone, _ = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._lost(exc)
            raise StoreUnavailable(f"stored responses cannot be changed: the store did not answer "
                                   f"({exc.__class__.__name__})") from None
        return bool(gone)


def _grant(got: list[bytes]) -> Grant:
    head = got[0].decode()
    if head == "ok":
        rest = got[2:]
        return Grant(True, tokens=int(got[1]), others={rest[i].decode(): int(rest[i + 1]) for i in range(0, len(rest), 2)})
    if head == "full":
        return Grant(False, "full", worker=got[1].decode(), others={got[1].decode(): int(got[2])})
    return Grant(False, head, float(got[1]))


def _n(v: int | None) -> int:
    return -1 if v is None else v


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def registry(cfg: StoreConfig) -> dict[str, dict[str, Any]] | None:
    """The live instances' registry entries in the store (a supervisor's look: its processes, up or not), or
    None when Redis does not answer."""
    store = RedisStore(dataclasses.replace(cfg, timeout_s=max(cfg.timeout_s, 1.0)))
    try:
        await store.r.ping()
        return await store.instances()
    except (RedisError, OSError):
        return None
    finally:
        with contextlib.suppress(RedisError, OSError):
            await store.r.aclose()
