"""State the replicas of one deployment share through Redis (docs/operations.md#replicas-share-state-through-redis):
quota estimates, cooldowns and breakers here; the Responses store, the keys' ledger, sessions and object owners beside
it, all over one :class:`gateway.state.link.RedisLink` (redis-py's asyncio client; any Redis 6.2 or newer).

A quota estimate is ``{prefix}:{upstream}:quota:{kind}`` (what the last answer reported left, expiring at its reset)
minus ``...:sent:{kind}``, the running total of every replica's reservations made after that answer's request; an
attempt's *mark* is that total at its reservation. Cooldowns and breakers go to the hash ``...:rest`` and the channel
``{prefix}:events``; each replica applies the others' to its own :class:`gateway.routing.health.Health`, so that
planning stays local and pure.

Times cross processes as wall-clock seconds (replicas need synchronised clocks, as Kubernetes nodes have). Each key
carries its upstream in a hash tag, so that each script's keys share a Redis Cluster slot."""

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
from gateway.routing.scheduling import Scheduler
from gateway.state.classes import SharedClasses
from gateway.state.link import DAY_MS, FAILURES, RedisLink, number
from gateway.state.scripts import QUOTA_KEYS, SEP

log = logging.getLogger("tiergate")


KINDS = ("requests", "tokens")


IN_FLIGHT_S = 120.0  # a reservation whose answer never reports (a replica died) leaves the in-flight set after this


@dataclass
class Admission:
    """``mark``: the attempt's, for its answer's report; ``refused``: ``requests`` or ``tokens``, the estimate that did
    not cover the request."""

    ok: bool
    refused: str | None = None
    mark: Mark | None = None
    member: str | None = None  # its entry in the in-flight set
    ahead: tuple[int, int] = (0, 0)  # requests and tokens in flight when it was reserved (its report may miss them)


class SharedState(RedisLink):
    """:meth:`attach` it to each :class:`Health` the app builds: a reload builds a new one, which carries the old one's
    upstreams over."""

    def __init__(self, url: SecretStr, cfg: StateConfig, metrics: Metrics, *,
                 wall: Callable[[], float] = time.time) -> None:
        super().__init__(url, cfg, metrics, wall=wall)
        self.health: Health | None = None
        self.classes = SharedClasses(self)

    # lifecycle

    def attach(self, health: Health, scheduler: Scheduler | None = None) -> None:
        if self.health is not None:
            self.health.listen(None)
        self.health = health
        health.listen(self)
        self.classes.health, self.classes.scheduler = health, scheduler

    async def start(self) -> None:
        """The subscriber connects in the background: start-up never waits for Redis."""
        self._tasks = [asyncio.get_running_loop().create_task(self._subscriber())]

    # the request path

    async def admit(self, h: UpstreamHealth, need_tokens: int) -> Admission | None:
        """Keeps the upstream's ``quota_reserve``; the reply also refreshes the local estimate. None when nothing was
        asked (Redis away, or the upstream never reported rate limits) or no answer came within ``state.timeout``: the
        local estimate then decides alone."""
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
        """Not awaited. ``report`` may be empty (none came); ``admission`` is None when the attempt reserved nothing in
        Redis."""
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
        """An admitted attempt ended without a report (an error, a cancel)."""
        base = self._base(upstream)
        self.queue("observe", lambda pipe: pipe.evalsha(self._landed.sha, 1, base, member))

    # gateway.routing.health.Listener: this replica's transitions, for the others

    def rested(self, upstream: str, kind: str, until: float, exhausted: bool) -> None:
        """``until``: the health clock's time."""
        wall = self.wall() + (until - self._now())
        message = orjson.dumps({"r": self.replica, "u": upstream, "e": kind, "until": wall, "x": exhausted})
        self.queue("rest", lambda pipe: pipe.evalsha(self._rest.sha, 1, self._key(upstream, "rest"), kind, repr(wall),
                                                      int(exhausted), self.channel, message))

    def closed(self, upstream: str) -> None:
        message = orjson.dumps({"r": self.replica, "u": upstream, "e": "closed"})
        self.queue("rest", lambda pipe: pipe.evalsha(self._rest.sha, 1, self._key(upstream, "rest"), "closed", "0", 0,
                                                      self.channel, message))

    # inside

    def _key(self, upstream: str, what: str) -> str:
        return f"{self._base(upstream)}:{what}"

    def _base(self, upstream: str) -> str:
        """Its hash tag puts every key of the upstream in one Redis Cluster slot."""
        return f"{self.prefix}:{{{upstream}}}"

    def _quota_keys(self, upstream: str) -> list[str]:
        return [self._base(upstream) + suffix for suffix in QUOTA_KEYS]

    def _now(self) -> float:
        return self.health.clock() if self.health is not None else time.monotonic()

    def _local(self, wall: float) -> float:
        """Another replica's wall-clock time as a time of this replica's health clock."""
        return self._now() + (wall - self.wall())

    async def _subscriber(self) -> None:
        """When Redis goes away, it is pinged every ``state.retry`` seconds until it answers, then read and subscribed
        to again."""
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
                    message = await pubsub.get_message(timeout=self.poll)
                    if message is not None and message.get("type") == "message":
                        self._apply(message["data"])
                    self.tick()
            except Exception as exc:  # noqa: BLE001 - whatever went wrong, the subscriber lives on and tries again
                if self.stopping:
                    # stop() cancelled it while a timeout (ours, or redis-py's in get_message) was due too: Python
                    # 3.11's asyncio.timeout can turn that cancel into TimeoutError, and looping on made stop() wait
                    # for ever (seen: a test's teardown hung after Redis had been paused). Task.cancelling() cannot
                    # tell: a timeout that fired before leaves it set
                    raise asyncio.CancelledError from exc
                self._failed("subscribe" if self.up else "ping", exc)
            finally:
                with contextlib.suppress(*FAILURES):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
            await asyncio.sleep(self.cfg.retry)

    async def _resync(self) -> None:
        """Also loads the scripts: a Redis that restarted has lost them."""
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
        """A message that is not one of ours is counted and skipped."""
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
