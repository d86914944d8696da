"""State the replicas of one deployment share through Redis (``state:`` in the config;
docs/operations.md#replicas-share-state-through-redis).

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
* **The Responses store** (``gateway.state.store``), **the keys' ledger** (``gateway.state.ledger``) and **who made
  which object** (``gateway.state.owners``), over the same link (``gateway.state.link``). The store holds every
  bridged conversation and every native response's upstream, so a follow-up may reach any replica.

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
share a Redis Cluster slot (the Responses store's keys all share one: its scripts read and count records they find
on the way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import SecretStr

from gateway.config.schema import StateConfig
from gateway.observability import logs
from gateway.observability.metrics import Metrics
from gateway.routing.health import Health, Mark, UpstreamHealth
from gateway.routing.ratelimits import Window
from gateway.state.link import DAY_MS, FAILURES, RedisLink, number
from gateway.state.scripts import QUOTA_KEYS, SEP

log = logging.getLogger("tiergate")




KINDS = ("requests", "tokens")






IN_FLIGHT_S = 120.0  # a reservation whose answer never reports (a replica died) leaves the in-flight set after this






@dataclass
class Admission:
    """What :meth:`SharedState.admit` decided: ``ok`` (reserved; ``mark`` is the attempt's, for its answer's report),
    else ``refused`` (``requests`` or ``tokens``: the shared estimate does not cover the request)."""

    ok: bool
    refused: str | None = None
    mark: Mark | None = None
    member: str | None = None  # its entry in the in-flight set
    ahead: tuple[int, int] = (0, 0)  # requests and tokens in flight when it was reserved (its report may miss them)


class SharedState(RedisLink):
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
        super().__init__(url, cfg, metrics, wall=wall)
        self.health: Health | None = None

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

    def observed(self, h: UpstreamHealth, report: dict[str, Window], admission: Admission | None) -> None:
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
                remaining, reset = report[kind].remaining, report[kind].reset
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
                    h.shared_quota(kind, float(reply[i]), now + report[kind].reset)
        # evalsha in a pipeline: redis-py's Script would ask SCRIPT EXISTS before every batch (the subscriber loads
        # the scripts whenever it connects; a Redis that lost them fails the batch, and the reconnect loads them)
        self.queue("observe", lambda pipe: pipe.evalsha(self._observe.sha, 1, base, joined), applied)

    def landed(self, upstream: str, member: str) -> None:
        """An admitted attempt ended without a report (an error, a cancel): its reservation leaves the in-flight set."""
        base = self._base(upstream)
        self.queue("observe", lambda pipe: pipe.evalsha(self._landed.sha, 1, base, member))

    # gateway.routing.health.Listener: this replica's transitions, for the others

    def rested(self, upstream: str, kind: str, until: float, exhausted: bool) -> None:
        """``upstream`` rests (``kind`` ``cooldown`` or ``open``) until ``until`` (the health clock's time)."""
        wall = self.wall() + (until - self._now())
        message = orjson.dumps({"r": self.replica, "u": upstream, "e": kind, "until": wall, "x": exhausted})
        self.queue("rest", lambda pipe: pipe.evalsha(self._rest.sha, 1, self._key(upstream, "rest"), kind, repr(wall),
                                                      int(exhausted), self.channel, message))

    def closed(self, upstream: str) -> None:
        """``upstream``'s breaker closed."""
        message = orjson.dumps({"r": self.replica, "u": upstream, "e": "closed"})
        self.queue("rest", lambda pipe: pipe.evalsha(self._rest.sha, 1, self._key(upstream, "rest"), "closed", "0", 0,
                                                      self.channel, message))

    # one pipeline per event-loop turn: what every request of the turn asks goes in one round trip, on one connection




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
                    self.tick()
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
        scripts = (self._admit, self._observe, self._landed, self._rest, self.history, self.store_put, self.store_drop,
                   self.key_reserve, self.key_settle, self.session_begin, self.session_step, self.session_index)
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
                until = number(rest.get(field)) if isinstance(rest, dict) else None
                if until is not None:
                    h.shared_rest(field.decode(), self._local(until), rest.get(b"exhausted") == b"1")
            for j, kind in enumerate(KINDS):
                value, ttl = number(q[2 * j]), q[2 * j + 1]
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




