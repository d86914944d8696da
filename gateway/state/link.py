"""One process's link to the Redis the replicas share. Every command asked in one event-loop turn goes in one pipeline,
one round trip however many requests are in flight (measured: with each script's arguments packed in one string, that
halved the CPU a request spends on Redis; ``bench/RESULTS.md``). Redis being away is counted, logged once and pinged
every ``state.retry`` seconds until it answers. ``redis``, ``store``, ``ledger``, ``sessions`` and ``owners`` build on
it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable
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
from gateway.observability import logs
from gateway.observability.metrics import Metrics
from gateway.state import scripts

log = logging.getLogger("tiergate")

FAILURES = (RedisError, OSError, TimeoutError)

DAY_MS = 86_400_000
MAX_PENDING = 10_000  # commands asked in one event-loop turn; past it they are dropped (and counted)
STOP_S = 5.0  # seconds stop() waits for its cancelled tasks
TICK_S = 1.0  # seconds between the calls of ``on_tick`` while Redis answers

@dataclass
class _Ask:
    """``future`` (an awaiting request) gets the replies, else ``then`` gets the first."""

    op: str
    add: Callable[[Pipeline], Any]
    future: asyncio.Future[list[Any]] | None
    then: Callable[[Any], None] | None = None


@dataclass
class _Every:
    seconds: float
    callback: Callable[[], None]
    due: float = 0.0  # time.monotonic()


class _Failed(Exception):
    """Counted where the pipeline failed."""


def number(value: Any) -> float | None:
    """None for an absent or error reply, or not a finite number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None



class RedisLink:
    """``wall``: the clock (seconds) times cross processes in; ``replica`` (host, pid, random) lets it skip its own
    messages; ``up`` is False until the first ping answers."""

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
        self._admit = self.redis.register_script(scripts.ADMIT)
        self._observe = self.redis.register_script(scripts.OBSERVE)
        self._landed = self.redis.register_script(scripts.LANDED)
        self._rest = self.redis.register_script(scripts.REST)
        self.history = self.redis.register_script(scripts.HISTORY)
        self.store_put = self.redis.register_script(scripts.STORE_PUT)
        self.store_drop = self.redis.register_script(scripts.STORE_DROP)
        self.key_reserve = self.redis.register_script(scripts.KEY_RESERVE)
        self.key_settle = self.redis.register_script(scripts.KEY_SETTLE)
        self.session_begin = self.redis.register_script(scripts.SESSION_BEGIN)
        self.session_step = self.redis.register_script(scripts.SESSION_STEP)
        self.session_index = self.redis.register_script(scripts.SESSION_INDEX)
        self.up = False
        self.on_deleted: list[Callable[[str], None]] = []  # told the ids other replicas deleted
        self.on_restored: list[Callable[[], None]] = []  # called each time Redis answers again
        self.on_tick: list[Callable[[], None]] = []  # called about every TICK_S seconds while Redis answers
        self._every: list[_Every] = []
        self._next_tick = 0.0  # time.monotonic() of the next tick
        self._asks: list[_Ask] = []  # commands for the next pipeline (one per event-loop turn)
        self._flushes: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.stopping = False  # stop() began: a failure its cancel caused ends the loops, not retried
        self._said_down = False
        metrics.shared_up.set(0)

    async def ask(self, op: str, add: Callable[[Pipeline], Any]) -> tuple[bool, list[Any]]:
        """Bounded by ``state.timeout``. (False, []) when Redis is away, failed, refused a command (a script lost in a
        restart included) or was too slow: counted, and the caller goes on with its local state."""
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

    def forget(self, response_id: str) -> None:
        """Tells the other replicas to drop their local copy of a deleted response."""
        message = orjson.dumps({"r": self.replica, "e": "deleted", "id": response_id})
        self.queue("store", lambda pipe: pipe.publish(self.channel, message))

    def queue(self, op: str, add: Callable[[Pipeline], Any], then: Callable[[Any], None] | None = None) -> None:
        """Not awaited; ``then`` gets the first reply. Dropped, and counted, while Redis is away."""
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
        """Several pipelines may be in flight: each takes a connection from the pool."""
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
        """Its awaiting request goes on locally; an update is counted as dropped."""
        if ask.future is None:
            self.metrics.shared_dropped.inc()
        elif not ask.future.done():
            ask.future.set_exception(_Failed())

    def _failed(self, op: str, exc: BaseException) -> None:
        """The first failure since Redis last answered marks it away and is logged."""
        self.metrics.shared_errors.labels(op).inc()
        if self.up or not self._said_down:
            self._said_down = True
            logs.event("shared_state_unavailable", "warning", op=op, error=f"{type(exc).__name__}: {exc}",
                       retry_s=self.cfg.retry)
            log.warning("shared state (Redis) unavailable (%s: %s): going on with local state, retrying every %g s",
                        op, exc, self.cfg.retry)
        self.up = False
        self.metrics.shared_up.set(0)

    def every(self, seconds: float, callback: Callable[[], None]) -> None:
        """``callback`` about every ``seconds`` (under :data:`TICK_S`) while Redis answers."""
        self._every.append(_Every(seconds, callback))

    @property
    def poll(self) -> float:
        """Seconds the subscriber may wait for a message before it must :meth:`tick`."""
        return min([TICK_S, *(e.seconds for e in self._every)])

    def tick(self) -> None:
        """The subscriber calls this between messages, at least every :attr:`poll` seconds."""
        now = time.monotonic()
        if not self.up:
            return
        for entry in self._every:
            if now >= entry.due:
                entry.due = now + entry.seconds
                entry.callback()
        if now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        for callback in self.on_tick:
            callback()

    def _restored(self) -> None:
        if self._said_down:
            logs.event("shared_state_restored")
            log.warning("shared state (Redis) answers again")
        self._said_down = False
        self.up = True
        self.metrics.shared_up.set(1)
        for callback in self.on_restored:
            callback()

    async def stop(self) -> None:
        """Updates still queued are dropped. Waits at most :data:`STOP_S` for the cancelled tasks: a shutdown never
        hangs on Redis."""
        self.stopping = True
        tasks = [*self._tasks, *self._flushes]
        for task in tasks:
            task.cancel()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=STOP_S)
            if late:
                log.warning("shared state: %d Redis task(s) did not stop within %g s", len(late), STOP_S)
        self._tasks = []
        with contextlib.suppress(*FAILURES):
            await self.redis.aclose()
