"""State the replicas of one deployment share through Redis (``state:`` in the config; README "Replicas").

Without it each process keeps its own picture of the upstreams, and one replica's 429 teaches the others nothing.
With it (redis-py's asyncio client; any Redis 6.2 or newer):

* **Quota estimates.** Per upstream, the remaining requests and tokens as the last answer reported them, minus every
  replica's reservations made after that answer's request (those the upstream had not counted yet). Keys
  ``{prefix}:{upstream}:quota:{kind}`` (a float that expires at the reported reset) and ``...:sent:{kind}`` (the
  running total of reservations, whose value at an attempt's reservation is its *mark*). Before an attempt to an
  upstream that reports rate limits, :meth:`SharedState.admit` checks the estimate and reserves the request's
  estimated tokens in one atomic script: one round trip per attempt, awaited (refused: the request spills over as it
  does when its local estimate is short). The answer's report is written by another script, not awaited.
* **Cooldowns and breaker transitions.** A replica's 429 cooldown or opened breaker goes to the hash
  ``...:rest`` (until its end) and, like a closed breaker, to the channel ``{prefix}:events``; every replica applies
  the others' to its own :class:`gateway.routing.health.Health` (its ``shared_*`` methods), so planning stays local and
  pure. A replica that starts, or finds Redis again, reads the hashes first. Not awaited by any request.
* **The Responses store** (:class:`SharedResponseStore`): every bridged conversation and every native response's
  upstream, so a follow-up may reach any replica.

Every command a request or an update sends in one event-loop turn goes in one pipeline (one round trip on one
connection, however many requests are in flight): measured, that and packing each script's arguments into one string
halved the CPU a request spends on Redis (``bench/RESULTS.md``).

Redis unreachable, or slower than ``state.timeout``: the operation is abandoned, counted
(``tiergate_shared_state_errors_total``) and logged once; the replica goes on with its local state (its own traffic
keeps its estimates, as without Redis), asks Redis nothing on a request's path until a ping answers again (every
``state.retry`` seconds), then reads the shared state again and subscribes again. No request fails because of Redis,
and none waits for it longer than ``state.timeout``; the per-chunk path never touches it.

Times cross processes as wall-clock seconds (``time.time()``: replicas need synchronised clocks, as Kubernetes nodes
have); each replica turns them into its own health clock. Keys carry the upstream in a hash tag, so each script's keys
share a Redis Cluster slot (the Responses store's chain walk reads keys it finds on the way: one Redis, or a cluster
with the store on one node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import SecretStr
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from gateway.config.schema import StateConfig
from gateway.errors import GatewayError
from gateway.observability import logs
from gateway.observability.metrics import Metrics
from gateway.responses.store import MemoryResponseStore, Record, decode, encode, items_of, previous_of
from gateway.routing.health import Health, Mark, UpstreamHealth
from gateway.routing.ratelimits import quota_report
from gateway.tenancy.keys import DIMENSIONS, Hold, Key, MemoryLedger, Refusal, Spend, bounded, windows
from gateway.tenancy.objects import MemoryOwners

log = logging.getLogger("tiergate")
FAILURES = (RedisError, OSError, TimeoutError)
KINDS = ("requests", "tokens")
MAX_PENDING = 10_000  # commands asked in one event-loop turn; past it they are dropped (and counted)
DAY_MS = 86_400_000
IN_FLIGHT_S = 120.0  # a reservation whose answer never reports (a replica died) leaves the in-flight set after this

# The keys of one upstream's quota scripts, K[1..6] under the one key they declare (the upstream's base, whose hash tag
# puts them all in its Redis Cluster slot): quota requests, quota tokens (the estimates), sent requests, sent tokens
# (running totals of reservations), the in-flight set (members "{sent tokens}:{tokens}", scored by when they leave it
# if nothing removes them: a replica that died mid-flight), and its totals (a hash: r, t). Their arguments A[...] come
# in one string, joined by the unit separator: measured, redis-py's packing of each argument was most of the CPU a
# request spent on Redis (18 arguments each, twice per request).
QUOTA_KEYS = (":quota:requests", ":quota:tokens", ":sent:requests", ":sent:tokens", ":inflight", ":inflight:n")
SEP = "\x1f"
# Every script starts with SAFE: a key that holds something else than what the gateway keeps there (a string where a
# count belongs, a hash where a string does: another program's, or garbage) is dropped and counts from nothing, so
# that no stray value makes a script fail for every request (which the gateway would take for Redis being away).
_SAFE = """
local function safe(cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    redis.call('DEL', key)
    r = redis.call(cmd, key, ...)
  end
  return r
end
local function num(key)
  local v = tonumber(safe('GET', key))
  if v and (v ~= v or v == math.huge or v == -math.huge) then return nil end  -- 'nan', '1e999': not a count
  return v
end
"""
_PROLOGUE = (_SAFE + "local K, A = {}, {}\n"
             "for i, suffix in ipairs({" + ", ".join(f"'{k}'" for k in QUOTA_KEYS) + "}) do\n"
             "  K[i] = KEYS[1] .. suffix\nend\n"
             "for v in string.gmatch(ARGV[1] .. '\\31', '([^\\31]*)\\31') do A[#A + 1] = v end\n")
_LAND = _PROLOGUE + """
local function land(member)
  if member ~= '' and safe('ZREM', K[5], member) == 1 then
    safe('HINCRBY', K[6], 'r', -1)
    safe('HINCRBY', K[6], 't', -(tonumber(string.match(member, ':(%d+)$')) or 0))
  end
end
"""

# A: tokens needed (a whole number), requests kept, tokens kept, ms the totals live, the reservation's end (wall
# seconds), now (wall). Returns {admitted 1|0, refused kind index 1|2 (0), remaining requests ('' unknown), its ms to
# reset, remaining tokens, its ms, sent requests, sent tokens, requests in flight before it, tokens in flight before
# it} (floats as strings: a Lua number would reach Redis' reply as an integer).
_ADMIT = _LAND + """
for _, member in ipairs(safe('ZRANGEBYSCORE', K[5], '-inf', A[6])) do land(member) end
local need = {1, tonumber(A[1])}
local keep = {tonumber(A[2]), tonumber(A[3])}
local rem = {num(K[1]), num(K[2])}
for i = 1, 2 do
  if rem[i] and rem[i] - need[i] < keep[i] then
    return {0, i, tostring(rem[1] or ''), redis.call('PTTL', K[1]), tostring(rem[2] or ''), redis.call('PTTL', K[2]),
            '', '', '', ''}
  end
end
for i = 1, 2 do
  if rem[i] then rem[i] = safe('INCRBYFLOAT', K[i], -need[i]) end
end
local s1 = safe('INCRBY', K[3], need[1])
local s2 = safe('INCRBY', K[4], A[1])
local ahead = safe('HMGET', K[6], 'r', 't')
safe('ZADD', K[5], A[5], string.format('%d', s2) .. ':' .. A[1])
safe('HINCRBY', K[6], 'r', 1)
safe('HINCRBY', K[6], 't', A[1])
for k = 3, 6 do redis.call('PEXPIRE', K[k], A[4]) end
return {1, 0, rem[1] or '', redis.call('PTTL', K[1]), rem[2] or '', redis.call('PTTL', K[2]), s1, s2,
        ahead[1] or '0', ahead[2] or '0'}
"""

# A: per kind (requests, tokens) the reported remaining ('' none), ms to its reset, what the report leaves out ('':
# unknown); then the channel, this replica, the upstream, the attempt's in-flight member (''), its mark in sent
# tokens (''). The upstream counted what had reached it when it answered. Left out, as far as the gateway can tell:
# what was reserved after this attempt (the sent totals past its mark), and what was in flight when it was reserved
# (it may have reached the upstream after this attempt; counting it twice is the safe error, and its own report
# corrects it): the attempt passes the latter, and its mark. A report without a mark (its attempt reserved nothing:
# no estimate yet, or Redis was away) only starts an estimate where there is none. Publishes the estimates when one of
# them began or more than doubled (a new window, a refill: replicas that spilled over on a short estimate learn it;
# a fall they learn from their own admissions, and a small rise does not move a spill decision). Returns the
# estimates set ('' for a kind left as it was).
_OBSERVE = _LAND + """
land(A[10])
local out, ms, rose = {'', ''}, {'', ''}, false
for i = 1, 2 do
  local reported, ahead = tonumber(A[3 * i - 2]), A[3 * i]
  local old = num(K[i])
  if reported and (ahead ~= '' or not old) then
    local since = 0
    if ahead ~= '' then
      local mark = (i == 1) and A[11] or A[12]
      since = math.max(0, (num(K[i + 2]) or 0) - tonumber(mark)) + tonumber(ahead)
    end
    local value = reported - since
    redis.call('SET', K[i], tostring(value), 'PX', A[3 * i - 1])
    if (not old) or old * 2 < value then rose = true end
    out[i], ms[i] = tostring(value), A[3 * i - 1]
  end
end
if rose then
  redis.call('PUBLISH', A[7], cjson.encode({r = A[8], u = A[9], e = 'quota', q = out, ms = ms}))
end
return out
"""

# A: the in-flight member of an attempt that ended without a report.
_LANDED = _LAND + """
land(A[1])
return 1
"""

# KEYS: the rest hash. ARGV: field (cooldown | open | closed), until (wall seconds), exhausted (0|1), channel, message.
_REST = _SAFE + """
if ARGV[1] == 'closed' then
  safe('HDEL', KEYS[1], 'open')
else
  if tonumber(ARGV[2]) > (tonumber(safe('HGET', KEYS[1], ARGV[1])) or 0) then
    safe('HSET', KEYS[1], ARGV[1], ARGV[2])
    if ARGV[1] == 'cooldown' then safe('HSET', KEYS[1], 'exhausted', ARGV[3]) end
  end
  local latest = math.max(tonumber(safe('HGET', KEYS[1], 'cooldown')) or 0,
                          tonumber(safe('HGET', KEYS[1], 'open')) or 0)
  redis.call('PEXPIREAT', KEYS[1], math.ceil(latest * 1000))
end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
"""

# ARGV: key prefix, response id, ms to live again (0: a look, no refresh), most links. Returns the records' data from
# the newest back to the first turn, or nil when a link is missing (expired or deleted).
_HISTORY = """
local out, id = {}, ARGV[2]
while id and id ~= '' do
  local key = ARGV[1] .. ':response:' .. id
  local rec = redis.call('HMGET', key, 'data', 'previous')
  if not rec[1] or #out >= tonumber(ARGV[4]) then return false end
  out[#out + 1] = rec[1]
  if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', key, ARGV[3]) end
  id = rec[2]
end
return out
"""


# KEYS: one counter per limit of a gateway key (gateway.tenancy.keys: level, dimension, window id), then the
# reservation's hold and its tombstone (all under the key's hash tag). ARGV: per counter its limit, the amount to add,
# its ms to live and its floor; then the hold's ms to live. A counter Redis does not hold (it restarted without its
# data, or evicted it) starts from its floor: the last value the calling replica saw of it, never from nothing. All or
# nothing: {1, the counters' new values...} when every limit leaves room (the amounts added, and kept in the hold for
# its settlement), {0, the first that does not, the counters' values...} and nothing added, or {2}: the reservation was
# cancelled before it arrived (a replica that gave up waiting for it settled it locally; see _KEY_SETTLE).
_KEY_RESERVE = _SAFE + """
local n = #KEYS - 2
if redis.call('EXISTS', KEYS[n + 2]) == 1 then return {2} end
local v = {}
for i = 1, n do
  v[i] = num(KEYS[i]) or tonumber(ARGV[4 * i]) or 0
end
for i = 1, n do
  if v[i] + tonumber(ARGV[4 * i - 2]) > tonumber(ARGV[4 * i - 3]) then
    local out = {0, i}
    for k = 1, n do out[k + 2] = tostring(v[k]) end
    return out
  end
end
local held, out = {}, {1}
for i = 1, n do
  v[i] = v[i] + tonumber(ARGV[4 * i - 2])
  redis.call('DEL', KEYS[i])  -- garbage ('1e999', 'abc') or the old value: the new one is set whole
  redis.call('SET', KEYS[i], tostring(v[i]), 'PX', ARGV[4 * i - 1])
  held[i] = ARGV[4 * i - 2]
  out[i + 1] = tostring(v[i])
end
redis.call('SET', KEYS[n + 1], table.concat(held, ','), 'PX', ARGV[4 * n + 1])
return out
"""

# KEYS as _KEY_RESERVE. ARGV: per counter what the request used, its floor and its ms to live; then the tombstone's ms
# to live, and '1' when the reservation was counted by the replica itself (Redis did not answer it in time, or was
# away), else '0'. With its hold there: each counter takes what was used instead of what was held (a counter whose
# window is gone is not made again). Without: the reservation has not arrived (or its hold expired): a tombstone makes
# it void if it still comes, so that a reservation is counted once whatever the order; and a reservation the replica
# counted itself is added now (from the counter's floor if Redis lost it), so that what was spent while Redis was away
# is not lost when it returns.
_KEY_SETTLE = _SAFE + """
local n = #KEYS - 2
local held = redis.pcall('GET', KEYS[n + 1])
if type(held) ~= 'string' then
  redis.call('SET', KEYS[n + 2], '1', 'PX', ARGV[3 * n + 1])
  if ARGV[3 * n + 2] == '1' then
    for i = 1, n do
      local v = (num(KEYS[i]) or tonumber(ARGV[3 * i - 1]) or 0) + (tonumber(ARGV[3 * i - 2]) or 0)
      redis.call('DEL', KEYS[i])
      redis.call('SET', KEYS[i], tostring(v), 'PX', ARGV[3 * i])
    end
  end
  return 0
end
local i = 1
for amount in string.gmatch(held, '([^,]+)') do
  if i <= n and num(KEYS[i]) then  -- gone with its window (or garbage): not made again
    safe('INCRBYFLOAT', KEYS[i], (tonumber(ARGV[3 * i - 2]) or 0) - (tonumber(amount) or 0))
  end
  i = i + 1
end
redis.call('DEL', KEYS[n + 1])
return 1
"""
TOMB_MS = 600_000  # a reservation that arrives later than this after its cancel is counted (none waits that long)
WINDOW_MS = {"minute": 120_000, "day": 2 * DAY_MS, "month": 32 * DAY_MS}  # a counter outlives its window a little


@dataclass
class _Ask:
    """Commands for the next pipeline: ``add`` queues them; ``future`` (an awaiting request) gets their replies, else
    ``then`` gets the first one."""

    op: str
    add: Callable[[Pipeline], Any]
    future: asyncio.Future[list[Any]] | None
    then: Callable[[Any], None] | None = None


class _Failed(Exception):
    """The pipeline carrying an ask failed (counted there)."""


@dataclass
class Admission:
    """What :meth:`SharedState.admit` decided: ``ok`` (reserved; ``mark`` is the attempt's, for its answer's report),
    else ``refused`` (``requests`` or ``tokens``: the shared estimate does not cover the request)."""

    ok: bool
    refused: str | None = None
    mark: Mark | None = None
    member: str | None = None  # its entry in the in-flight set
    ahead: tuple[int, int] = (0, 0)  # requests and tokens in flight when it was reserved (its report may miss them)


class SharedState:
    """One process's link to the shared state (module docstring). Start it with :meth:`start` in the app's lifespan;
    :meth:`attach` it to each :class:`Health` the app builds (a reload builds a new one).

    Args:
        url: the Redis URL (a secret: it may hold a password); cfg: ``state:``; metrics: where its errors are counted;
        wall: the wall clock (seconds) times cross processes in.

    Attributes:
        up: Redis answered the last operation (False from start until the first ping answers).
        replica: this process's name in the messages (host, pid, random), so that it skips its own.
    """

    def __init__(self, url: SecretStr, cfg: StateConfig, metrics: Metrics, *,
                 wall: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.wall = wall
        self.prefix = cfg.key_prefix
        self.channel = f"{self.prefix}:events"
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        slow = max(cfg.timeout, 1.0)  # off the request path (connects, the subscriber); asyncio.timeout bounds the rest
        self.redis: Redis = Redis.from_url(url.get_secret_value(), socket_timeout=slow, socket_connect_timeout=slow,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._admit = self.redis.register_script(_ADMIT)
        self._observe = self.redis.register_script(_OBSERVE)
        self._landed = self.redis.register_script(_LANDED)
        self._rest = self.redis.register_script(_REST)
        self._history = self.redis.register_script(_HISTORY)
        self._key_reserve = self.redis.register_script(_KEY_RESERVE)
        self._key_settle = self.redis.register_script(_KEY_SETTLE)
        self.up = False
        self.health: Health | None = None
        self.on_deleted: list[Callable[[str], None]] = []  # told the ids other replicas deleted
        self.on_restored: list[Callable[[], None]] = []  # called each time Redis answers again
        self._asks: list[_Ask] = []  # commands for the next pipeline (one per event-loop turn)
        self._flushes: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._said_down = False
        metrics.shared_up.set(0)

    # lifecycle

    def attach(self, health: Health) -> None:
        """Apply the other replicas' state to ``health`` and tell them its transitions (a reload's new one replaces the
        old, whose upstreams it carried over)."""
        if self.health is not None:
            self.health.listen(None)
        self.health = health
        health.listen(self)

    async def start(self) -> None:
        """Start the subscriber (which connects, reads the shared state and subscribes in the background: start-up never
        waits for Redis)."""
        self._tasks = [asyncio.get_running_loop().create_task(self._subscriber())]

    async def stop(self) -> None:
        """Stop the subscriber and the pipelines in flight, and close the connections (updates still queued are
        dropped)."""
        tasks = [*self._tasks, *self._flushes]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(*FAILURES):
            await self.redis.aclose()

    # the request path

    async def admit(self, h: UpstreamHealth, need_tokens: int) -> Admission | None:
        """Reserve an attempt's request and ``need_tokens`` against ``h``'s shared estimate (module docstring), keeping
        its ``quota_reserve``; the reply also refreshes ``h``'s local estimate.

        Returns:
            the :class:`Admission`, or None: nothing was asked (Redis is away, or no answer of the upstream ever
            reported rate limits) or no answer came within ``state.timeout`` (the local estimate decides alone).
        """
        if not self.up or not h.reports_quota:
            return None
        keep, wall, base = h.cfg.quota_reserve, self.wall(), self._base(h.name)
        args = f"{need_tokens}{SEP}{keep.get('requests', 0)}{SEP}{keep.get('tokens', 0)}{SEP}{DAY_MS}{SEP}" \
               f"{wall + IN_FLIGHT_S!r}{SEP}{wall!r}"
        done, replies = await self.ask("admit", lambda pipe: pipe.evalsha(self._admit.sha, 1, base, args))
        if not done:
            return None
        reply = replies[0]
        ok = reply[0] == 1
        now = self._now()
        for i, kind in enumerate(KINDS):
            value, ttl = reply[2 + 2 * i], int(reply[3 + 2 * i])
            if value not in (b"", "") and ttl > 0:  # admitted: the attempt's start() takes its own share off again
                h.shared_quota(kind, float(value) + ((1 if i == 0 else need_tokens) if ok else 0), now + ttl / 1000)
        if not ok:
            return Admission(False, KINDS[int(reply[1]) - 1])
        return Admission(True, mark=(int(reply[6]), int(reply[7])), member=f"{int(reply[7])}:{need_tokens}",
                         ahead=(int(reply[8]), int(reply[9])))

    def observed(self, h: UpstreamHealth, report: dict[str, tuple[float, float]], admission: Admission | None) -> None:
        """An answer of ``h``'s upstream came: its rate-limit report (``gateway.routing.health.quota_report``; empty:
        none), and the end of its reservation's flight, go with the next pipeline, not awaited. ``admission``: the
        attempt's (None: it reserved nothing in Redis)."""
        mark = admission.mark if admission is not None else None
        if not report:
            if admission is not None and admission.member is not None:
                self.landed(h.name, admission.member)
            return
        args: list[Any] = []
        for i, kind in enumerate(KINDS):
            if kind in report:
                remaining, reset = report[kind]
                args += [repr(remaining), max(1, int(reset * 1000)), "" if admission is None else admission.ahead[i]]
            else:
                args += ["", 1, ""]
        args += [self.channel, self.replica, h.name, "", "", ""] if admission is None or mark is None else \
            [self.channel, self.replica, h.name, admission.member or "", mark[0], mark[1]]
        base, joined = self._base(h.name), SEP.join(map(str, args))

        def applied(reply: Any) -> None:
            now = self._now()
            for i, kind in enumerate(KINDS):
                if reply[i] not in (b"", ""):
                    h.shared_quota(kind, float(reply[i]), now + report[kind][1])
        # evalsha in a pipeline: redis-py's Script would ask SCRIPT EXISTS before every batch (the subscriber loads
        # the scripts whenever it connects; a Redis that lost them fails the batch, and the reconnect loads them)
        self._queue("observe", lambda pipe: pipe.evalsha(self._observe.sha, 1, base, joined), applied)

    def landed(self, upstream: str, member: str) -> None:
        """An admitted attempt ended without a report (an error, a cancel): its reservation leaves the in-flight set."""
        base = self._base(upstream)
        self._queue("observe", lambda pipe: pipe.evalsha(self._landed.sha, 1, base, member))

    # gateway.routing.health.Listener: this replica's transitions, for the others

    def rested(self, upstream: str, kind: str, until: float, exhausted: bool) -> None:
        """``upstream`` rests (``kind`` ``cooldown`` or ``open``) until ``until`` (the health clock's time)."""
        wall = self.wall() + (until - self._now())
        message = orjson.dumps({"r": self.replica, "u": upstream, "e": kind, "until": wall, "x": exhausted})
        self._queue("rest", lambda pipe: pipe.evalsha(self._rest.sha, 1, self._key(upstream, "rest"), kind, repr(wall),
                                                      int(exhausted), self.channel, message))

    def closed(self, upstream: str) -> None:
        """``upstream``'s breaker closed."""
        message = orjson.dumps({"r": self.replica, "u": upstream, "e": "closed"})
        self._queue("rest", lambda pipe: pipe.evalsha(self._rest.sha, 1, self._key(upstream, "rest"), "closed", "0", 0,
                                                      self.channel, message))

    # one pipeline per event-loop turn: what every request of the turn asks goes in one round trip, on one connection

    async def ask(self, op: str, add: Callable[[Pipeline], Any]) -> tuple[bool, list[Any]]:
        """Send the commands ``add(pipeline)`` queues with everything else asked in this event-loop turn, and wait
        for their replies within ``state.timeout``.

        Returns:
            (True, the replies of the commands ``add`` queued), or (False, []) when Redis is away, failed, answered
            one of them with an error (a lost script after a restart included) or was too slow: counted, and the
            caller goes on with its local state.
        """
        if not self.up:
            return False, []
        ask = _Ask(op, add, asyncio.get_running_loop().create_future())
        self._send(ask)
        assert ask.future is not None
        try:
            async with asyncio.timeout(self.cfg.timeout):
                replies = await ask.future
        except TimeoutError as exc:
            self._failed(op, exc)
            return False, []
        except _Failed:
            return False, []  # counted where the pipeline failed
        return True, replies

    def history_command(self, pipe: Pipeline, response_id: str, refresh_ms: int, most: int) -> Any:
        """Queue the chain walk of a conversation (see ``_HISTORY``) in ``pipe``."""
        return pipe.evalsha(self._history.sha, 0, self.prefix, response_id, refresh_ms, most)

    def forget(self, response_id: str) -> None:
        """Tell the other replicas to drop their local copy of a deleted response (queued, not awaited)."""
        message = orjson.dumps({"r": self.replica, "e": "deleted", "id": response_id})
        self._queue("store", lambda pipe: pipe.publish(self.channel, message))

    # inside

    def _key(self, upstream: str, what: str) -> str:
        return f"{self._base(upstream)}:{what}"

    def _base(self, upstream: str) -> str:
        """The key every key of ``upstream`` starts with (its hash tag: one Redis Cluster slot per upstream)."""
        return f"{self.prefix}:{{{upstream}}}"

    def _quota_keys(self, upstream: str) -> list[str]:
        return [self._base(upstream) + suffix for suffix in QUOTA_KEYS]

    def _now(self) -> float:
        return self.health.clock() if self.health is not None else time.monotonic()

    def _local(self, wall: float) -> float:
        """A wall-clock time from another replica as a time of this replica's health clock."""
        return self._now() + (wall - self.wall())

    def _queue(self, op: str, add: Callable[[Pipeline], Any], then: Callable[[Any], None] | None = None) -> None:
        """Send ``add``'s commands with the next pipeline, not awaited (``then`` gets the first reply); dropped (and
        counted) while Redis is away."""
        if not self.up:
            self.metrics.shared_dropped.inc()
            return
        self._send(_Ask(op, add, None, then))

    def _send(self, ask: _Ask) -> None:
        if len(self._asks) >= MAX_PENDING:
            self._refuse(ask)
            return
        self._asks.append(ask)
        if len(self._asks) == 1:  # the first of this turn: one pipeline will carry them all
            task = asyncio.get_running_loop().create_task(self._flush())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        """Send every command asked so far in one pipeline (several pipelines may be in flight: each takes a
        connection from the pool) and hand each asker its replies."""
        batch, self._asks = self._asks, []
        pipe = self.redis.pipeline(transaction=False)
        counts = []
        for ask in batch:
            before = len(pipe.command_stack)
            ask.add(pipe)
            counts.append(len(pipe.command_stack) - before)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except FAILURES as exc:
            self._failed(batch[0].op, exc)
            for ask in batch:
                self._refuse(ask)
            return
        at = 0
        for ask, n in zip(batch, counts, strict=True):
            self._answer(ask, replies[at:at + n])
            at += n

    def _answer(self, ask: _Ask, replies: list[Any]) -> None:
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            if isinstance(error, NoScriptError):  # Redis lost its scripts: the reconnect loads them again
                self._failed(ask.op, error)
            else:  # this command's own trouble, not Redis being away: the others go on
                self.metrics.shared_errors.labels(ask.op).inc()
                log.warning("shared state: Redis refused a %s command: %s", ask.op, error)
            self._refuse(ask)
        elif ask.future is not None:
            if not ask.future.done():
                ask.future.set_result(replies)
        elif ask.then is not None and replies:
            ask.then(replies[0])

    def _refuse(self, ask: _Ask) -> None:
        """An ask that will get no reply: its awaiting request goes on locally; an update is counted as dropped."""
        if ask.future is None:
            self.metrics.shared_dropped.inc()
        elif not ask.future.done():
            ask.future.set_exception(_Failed())

    async def _subscriber(self) -> None:
        """Until stopped: connect, read the shared state, subscribe and apply every message; when Redis goes away,
        ping every ``state.retry`` seconds until it answers, then again."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(max(self.cfg.timeout, 1.0) * 2):
                    await self.redis.ping()
                    await pubsub.subscribe(self.channel)
                    await self._resync()
                    if self._said_down:  # the pool's connections are from before: each would fail once
                        await self.redis.connection_pool.disconnect()
                self._restored()
                while self.up:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._apply(message["data"])
            except Exception as exc:  # noqa: BLE001 - whatever went wrong, the subscriber lives on and tries again
                self._failed("subscribe" if self.up else "ping", exc)
            finally:
                with contextlib.suppress(*FAILURES):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(self.cfg.retry)

    async def _resync(self) -> None:
        """Read every upstream's shared cooldown, breaker and quota estimate into the local health."""
        health = self.health
        names = list(health.by_name) if health is not None else []
        pipe = self.redis.pipeline(transaction=False)
        scripts = (self._admit, self._observe, self._landed, self._rest, self._history, self._key_reserve,
                   self._key_settle)
        for script in scripts:
            pipe.script_load(script.script)
        for name in names:
            pipe.hgetall(self._key(name, "rest"))
            for key in self._quota_keys(name)[:2]:
                pipe.get(key)
                pipe.pttl(key)
        replies = (await pipe.execute(raise_on_error=False))[len(scripts):]
        now = self._now()
        for i, name in enumerate(names):  # what the gateway does not keep there (an error reply, garbage) is skipped
            rest, q = replies[5 * i], replies[5 * i + 1:5 * i + 5]
            assert health is not None
            h = health.by_name[name]
            for field in (b"cooldown", b"open"):
                until = _number(rest.get(field)) if isinstance(rest, dict) else None
                if until is not None:
                    h.shared_rest(field.decode(), self._local(until), rest.get(b"exhausted") == b"1")
            for j, kind in enumerate(KINDS):
                value, ttl = _number(q[2 * j]), q[2 * j + 1]
                if value is not None and isinstance(ttl, int) and ttl > 0:
                    h.shared_quota(kind, value, now + ttl / 1000)

    def _apply(self, data: bytes) -> None:
        """Apply another replica's message to the local health (or the Responses store's local copies); a message
        that is not one of ours is counted and skipped."""
        try:
            self._apply_message(orjson.loads(data))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            self.metrics.shared_errors.labels("message").inc()

    def _apply_message(self, m: Any) -> None:
        if not isinstance(m, dict) or m.get("r") == self.replica or self.health is None:
            return
        kind = m.get("e")
        if kind == "deleted":
            for listener in self.on_deleted:
                listener(str(m.get("id")))
            return
        h = self.health.by_name.get(str(m.get("u")))
        if h is None:
            return
        if kind in ("cooldown", "open"):
            h.shared_rest(kind, self._local(float(m["until"])), bool(m.get("x")))
            logs.event("shared_rest", upstream=h.name, tier=h.tier, kind=kind,
                       until_s=round(float(m["until"]) - self.wall(), 3), replica=m.get("r"))
        elif kind == "closed":
            h.shared_closed()
        elif kind == "quota":
            now = self._now()
            for i, q in enumerate(KINDS):
                value, ms = m["q"][i], m["ms"][i]
                if value != "" and ms != "":
                    h.shared_quota(q, float(value), now + float(ms) / 1000)

    def _failed(self, op: str, exc: BaseException) -> None:
        """An operation failed: count it; the first failure since Redis last answered marks it away and is logged."""
        self.metrics.shared_errors.labels(op).inc()
        if self.up or not self._said_down:
            self._said_down = True
            logs.event("shared_state_unavailable", "warning", op=op, error=f"{type(exc).__name__}: {exc}",
                       retry_s=self.cfg.retry)
            log.warning("shared state (Redis) unavailable (%s: %s): going on with local state, retrying every %g s",
                        op, exc, self.cfg.retry)
        self.up = False
        self.metrics.shared_up.set(0)

    def _restored(self) -> None:
        if self._said_down:
            logs.event("shared_state_restored")
            log.warning("shared state (Redis) answers again")
        self._said_down = False
        self.up = True
        self.metrics.shared_up.set(1)
        for callback in self.on_restored:
            callback()


class SharedVerdicts:
    """An attempt's verdicts (``gateway.upstream.client.Verdicts``) told to its upstream's local health, and its
    answer's rate-limit report also to the shared estimate (with the attempt's admission mark)."""

    __slots__ = ("local", "shared", "admission", "reported")

    def __init__(self, local: UpstreamHealth, shared: SharedState, admission: Admission | None) -> None:
        self.local, self.shared, self.admission = local, shared, admission
        self.reported = False

    def start(self, now: float, need_tokens: int) -> Mark:
        return self.local.start(now, need_tokens)

    def finish(self) -> None:
        self.local.finish()
        if not self.reported and self.admission is not None and self.admission.member is not None:
            self.shared.landed(self.local.name, self.admission.member)

    def observe_headers(self, headers: Mapping[str, str], now: float, mark: Any = None) -> None:
        report = quota_report(headers)
        self.local.observe_report(report, now, mark)
        self.reported = True
        self.shared.observed(self.local, report, self.admission)

    def settle(self, exc: GatewayError | None, now: float, need_tokens: int = 0, source: str | None = None) -> None:
        self.local.settle(exc, now, need_tokens, source)

    def retract(self, source: str) -> None:
        self.local.retract(source)


class SharedResponseStore:
    """A :class:`gateway.responses.store.ResponseStore` that keeps every record in Redis (``{prefix}:response:{id}``, a
    hash of its encoded record and the id it continues, living ``response_store.ttl`` after it was put or last
    continued) and in this process's :class:`MemoryResponseStore` too, which answers while Redis is away. Redis holds
    the records of every replica; its own ``maxmemory`` bounds them (``response_store.max_*`` bound the local copy).
    A record is found only by its owner, here as in the local copy (``gateway.responses.store``)."""

    def __init__(self, local: MemoryResponseStore, shared: SharedState) -> None:
        self.local = local
        self.shared = shared
        self.ttl_ms = max(1, int(local.ttl * 1000))
        shared.on_deleted = [local.forget]

    def __len__(self) -> int:
        return len(self.local)

    def _key(self, response_id: str) -> str:
        return f"{self.shared.prefix}:response:{response_id}"

    async def get(self, response_id: str, owner: str | None) -> Record | None:
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.hget(self._key(response_id), "data"))
        if ok and replies[0] is not None:
            record = decode(replies[0])
            return record if record is not None and record.owner == owner else None
        return await self.local.get(response_id, owner)

    async def history(self, response_id: str, owner: str | None, refresh: bool = True) -> list[dict[str, Any]] | None:
        # a look at the first link before the walk: a conversation of another owner is never refreshed by this one
        if await self.get(response_id, owner) is None:
            return None
        ok, replies = await self.shared.ask("store", lambda pipe: self.shared.history_command(
            pipe, response_id, self.ttl_ms if refresh else 0, self.local.max_items))
        chain = replies[0] if ok else None
        if not chain:
            return await self.local.history(response_id, owner, refresh)
        records = [decode(data) for data in chain]
        if any(r is None or r.owner != owner for r in records):
            return None
        return items_of(chain)

    async def put(self, response_id: str, record: Record) -> bool:
        if not await self.local.put(response_id, record):
            return False
        data = encode(record)
        previous = previous_of(record)
        key = self._key(response_id)

        def write(pipe: Pipeline) -> None:  # awaited: a follow-up may reach another replica as soon as it answers
            pipe.hset(key, mapping={"data": data, "previous": previous or ""})
            pipe.pexpire(key, self.ttl_ms)
        await self.shared.ask("store", write)
        return True

    async def delete(self, response_id: str, owner: str | None) -> bool:
        if await self.get(response_id, owner) is None:
            return False  # another owner's stays, here and in Redis
        here = await self.local.delete(response_id, owner)
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.delete(self._key(response_id)))
        if ok:
            self.shared.forget(response_id)
        return here or bool(ok and replies[0])


class SharedOwners:
    """A ``gateway.tenancy.objects.Owners`` every replica shares: ``{prefix}:object:{id}`` holds the key that made the
    object, living ``ttl`` after it was claimed; ``local`` (this process's) answers while Redis is away."""

    def __init__(self, local: MemoryOwners, shared: SharedState) -> None:
        self.local = local
        self.shared = shared
        self.ttl_ms = max(1, int(local.ttl * 1000))

    def _key(self, object_id: str) -> str:
        return f"{self.shared.prefix}:object:{object_id}"

    async def owner(self, object_id: str) -> str | None:
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.get(self._key(object_id)))
        if ok:
            return replies[0].decode() if isinstance(replies[0], bytes) else None
        return await self.local.owner(object_id)

    async def owned(self, object_ids: Iterable[str], owner: str) -> set[str]:
        ids = list(object_ids)

        def add(pipe: Pipeline) -> None:
            for i in ids:
                pipe.get(self._key(i))
        ok, replies = await self.shared.ask("store", add) if ids else (True, [])
        if not ok:
            return await self.local.owned(ids, owner)
        mine = owner.encode()
        return {i for i, found in zip(ids, replies, strict=True) if found == mine}

    async def claim(self, object_id: str, owner: str) -> None:
        await self.local.claim(object_id, owner)
        # awaited: the client may name the object on another replica as soon as it has the answer
        await self.shared.ask("store", lambda pipe: pipe.set(self._key(object_id), owner, px=self.ttl_ms))


def _number(value: Any) -> float | None:
    """A Redis reply as a finite number, or None (absent, an error reply, or not a number)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class SharedLedger:
    """A ``gateway.tenancy.keys.Ledger`` whose counts every replica shares
    (``{prefix}:{key:NAME}:{level}:{dimension}:{window}: {id}`` counters, one hash slot per key): a reservation is one
    atomic script in the request's pipeline, which keeps what it added in a hold; its settlement replaces that by what
    the request used.

    Every answer of Redis gives the counters' values, which the replica keeps twice: in ``local`` (so that while Redis
    is away it counts on from what every replica had spent, not from zero; ``gateway.state.ledger_file`` keeps ``local``
    across a restart of the replica) and as each counter's *floor*, sent with every write: a counter Redis lost (it
    restarted without its data, or evicted it) starts again from the last value this replica saw, not from zero.

    While Redis is away, ``local`` counts this replica's requests, and their settlements wait (bounded) and add what
    they used to the shared counters when Redis answers again, so that what was spent meanwhile counts for every
    replica. A reservation that got no answer in time may still be counted when Redis answers: its settlement then
    replaces it by what was used (a tombstone voids it if it arrives later still), so it counts once.
    """

    def __init__(self, shared: SharedState, local: MemoryLedger) -> None:
        self.shared = shared
        self.local = local
        self.waiting: list[tuple[list[str], list[str]]] = []  # settlements for when Redis answers again
        # the last value Redis gave of each counter: (key, level, dim, window) -> (window id, value)
        self.seen: dict[tuple[str, str, str, str], tuple[str, float]] = {}
        shared.on_restored.append(self._resend)

    def _counter(self, key: Key, level: str, dim: str, window: str, at: str) -> str:
        return f"{self.shared.prefix}:{{key:{key.name}}}:{level}:{dim}:{window}:{at}"

    def _hold_keys(self, key: Key, hold_id: str) -> list[str]:
        base = f"{self.shared.prefix}:{{key:{key.name}}}"
        return [f"{base}:hold:{hold_id}", f"{base}:tomb:{hold_id}"]

    def _floor(self, key: Key, level: str, dim: str, window: str, at: str) -> str:
        found = self.seen.get((key.name, level, dim, window))
        return repr(found[1]) if found is not None and found[0] == at else "0"

    def _saw(self, key: Key, limits: list[tuple[str, str, str, float]], at: dict[str, str], values: list[Any]) -> None:
        """Redis gave ``values`` for the counters of ``limits``: keep them as floors, and as this replica's own counts
        (what it counts on from while Redis is away)."""
        counts = self.local.counts
        for (level, dim, window, _), raw in zip(limits, values, strict=False):
            value = _number(raw)
            if value is not None:
                slot = (key.name, level, dim, window)
                self.seen[slot] = counts[slot] = (at[window], max(0.0, value))
        self.local.version += 1

    async def reserve(self, key: Key, spend: Spend, fast: bool) -> Hold | Refusal:
        """See ``gateway.tenancy.keys.MemoryLedger.reserve``."""
        now = windows(self.local.wall())
        return await self._reserve(key, spend, ("all", "fast") if fast else ("all",), {w: v[0] for w, v in now.items()},
                                   now)

    async def extend(self, hold: Hold, level: str) -> Refusal | None:
        """See ``gateway.tenancy.keys.MemoryLedger.extend``: the extension is a part of ``hold``, settled with it."""
        got = await self._reserve(hold.key, hold.spend, (level,), hold.at, windows(self.local.wall()))
        if isinstance(got, Refusal):
            return got
        hold.parts.append(got)  # its own counters and hold id; the hold's own levels stay its own
        return None

    async def _reserve(self, key: Key, spend: Spend, levels: tuple[str, ...], at: dict[str, str],
                       now: dict[str, tuple[str, float]]) -> Hold | Refusal:
        """Reserve ``spend`` at ``levels`` in the windows ``at`` (ids; ``now``: the current windows, for a refusal's
        wait): in Redis, or, without an answer in time, here (and settled there when Redis answers again)."""
        limits = bounded(key, levels)
        if not limits:
            return Hold(key, levels, spend, dict(at), self, local=False)
        counters = [self._counter(key, level, dim, window, at[window]) for level, dim, window, _ in limits]
        hold_id = os.urandom(8).hex()
        args: list[Any] = []
        for level, dim, window, limit in limits:
            args += [repr(limit), repr(max(0.0, spend.get(dim))), WINDOW_MS[window],
                     self._floor(key, level, dim, window, at[window])]
        args.append(max(WINDOW_MS[w] for _, _, w, _ in limits))
        keys = [*counters, *self._hold_keys(key, hold_id)]
        done, replies = await self.shared.ask("keys", lambda pipe: pipe.evalsha(
            self.shared._key_reserve.sha, len(keys), *keys, *args))
        if not done or replies[0][0] == 2:  # counted here; settled there when Redis answers
            got = self.local.take_at(key, spend, levels, at, now)
            if isinstance(got, Hold):
                got.ledger, got.remote = self, (counters, hold_id)
            return got
        reply = replies[0]
        if reply[0] == 0:
            self._saw(key, limits, at, list(reply[2:]))
            level, dim, window, _ = limits[int(reply[1]) - 1]
            return Refusal(level, next(a for d, w, a in DIMENSIONS if d == dim and w == window), now[window][1])
        self._saw(key, limits, at, list(reply[1:]))
        return Hold(key, levels, spend, dict(at), self, local=False, remote=(counters, hold_id))

    def settle(self, hold: Hold, used: Spend, fast: bool) -> None:
        """See ``gateway.tenancy.keys.MemoryLedger.settle``: each part of the hold (it and its extensions) takes what
        the request used, here (a part counted here) and in Redis (queued, not awaited; kept for later while Redis is
        away): a part counted here adds what was used there too, once."""
        for part in [hold, *hold.parts]:
            if part.local:
                self.local.settle(part, used, fast)
            if part.remote is None:
                continue
            counters, hold_id = part.remote
            args: list[str] = []
            for level, dim, window, _ in bounded(part.key, part.levels):
                args += [repr(max(0.0, used.get(dim))) if level == "all" or fast else "0",
                         self._floor(part.key, level, dim, window, part.at[window]), str(WINDOW_MS[window])]
            self._send([*counters, *self._hold_keys(part.key, hold_id)],
                       [*args, str(TOMB_MS), "1" if part.local else "0"])

    def _send(self, keys: list[str], args: list[str]) -> None:
        if not self.shared.up:
            if len(self.waiting) < MAX_PENDING:
                self.waiting.append((keys, args))
            else:
                self.shared.metrics.shared_dropped.inc()
            return
        self.shared._queue("keys", lambda pipe: pipe.evalsha(self.shared._key_settle.sha, len(keys), *keys, *args))

    def _resend(self) -> None:
        waiting, self.waiting = self.waiting, []
        for keys, args in waiting:
            self._send(keys, args)
