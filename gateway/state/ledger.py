"""Gateway keys' spend counted by every replica in Redis (docs/tenancy.md#limits), so that N replicas never allow N
times a key's limits (``lua/key_reserve.lua``, ``lua/key_settle.lua``)."""

from __future__ import annotations

import os
from typing import Any

from redis.asyncio.client import Pipeline

from gateway.state.link import DAY_MS, MAX_PENDING, RedisLink, number
from gateway.tenancy.keys import Key
from gateway.tenancy.ledger import DIMENSIONS, Hold, MemoryLedger, Refusal, Spend, bounded, windows

TOMB_MS = 600_000  # a reservation that arrives later than this after its cancel is counted (none waits that long)


WINDOW_MS = {"minute": 120_000, "day": 2 * DAY_MS, "month": 32 * DAY_MS}  # a counter outlives its window a little
SYNC_KEYS = 500  # keys whose shared counters one sync reads (one MGET each); more keys are read in turn, 500 a tick


class SharedLedger:
    """Counters ``{prefix}:{key:NAME}:{level}:{dimension}:{window}:{id}``, one hash slot per key. Every value Redis
    gives is kept twice: in ``local``, so that while Redis is away this replica counts on from every replica's spend,
    not from zero; and as the counter's floor, sent with every write, so that a counter Redis lost (a restart without
    its data, an eviction) starts again from the last value seen. :meth:`sync` reads every configured key's counters
    every ``TICK_S`` seconds, :data:`SYNC_KEYS` a tick, so that an outage finds each replica at most a tick behind for
    the keys it has not served too. Settlements made while Redis is away wait (bounded) and are added when it answers; a
    reservation that got no answer in time but ran is replaced by its settlement, or voided by a tombstone if it arrives
    later still, so it counts once."""

    def __init__(self, shared: RedisLink, local: MemoryLedger) -> None:
        self.shared = shared
        self.local = local
        self.waiting: list[tuple[list[str], list[str]]] = []  # settlements for when Redis answers again
        # the last value Redis gave of each counter: (key, level, dim, window) -> (window id, value)
        self.seen: dict[tuple[str, str, str, str], tuple[str, float]] = {}
        self.keys: tuple[Key, ...] = ()  # every configured key (the composition root sets it, again on a reload)
        self._cursor = 0  # where the next sync starts in keys
        shared.on_restored.append(self._resend)
        shared.on_tick.append(self.sync)

    def _counter(self, key: Key, level: str, dim: str, window: str, at: str) -> str:
        return f"{self.shared.prefix}:{{key:{key.name}}}:{level}:{dim}:{window}:{at}"

    def _hold_keys(self, key: Key, hold_id: str) -> list[str]:
        base = f"{self.shared.prefix}:{{key:{key.name}}}"
        return [f"{base}:hold:{hold_id}", f"{base}:tomb:{hold_id}"]

    def _floor(self, key: Key, level: str, dim: str, window: str, at: str) -> str:
        found = self.seen.get((key.name, level, dim, window))
        return repr(found[1]) if found is not None and found[0] == at else "0"

    def _saw(self, key: Key, limits: list[tuple[str, str, str, float]], at: dict[str, str], values: list[Any]) -> None:
        counts = self.local.counts
        for (level, dim, window, _), raw in zip(limits, values, strict=False):
            value = number(raw)
            if value is not None:
                slot = (key.name, level, dim, window)
                self.seen[slot] = counts[slot] = (at[window], max(0.0, value))
        self.local.version += 1

    def sync(self) -> None:
        """One ``MGET`` per key (its counters share its hash slot), queued, not awaited. A counter Redis does not hold
        leaves the local one as it is."""
        keys = self.keys
        if not keys or not self.shared.up:
            return
        start = self._cursor % len(keys)
        batch = keys[start:start + SYNC_KEYS]
        self._cursor = start + len(batch)
        at = {w: v[0] for w, v in windows(self.local.wall()).items()}
        for key in batch:
            limits = bounded(key, ("all", "fast"))
            if not limits:
                continue
            counters = [self._counter(key, level, dim, window, at[window]) for level, dim, window, _ in limits]

            def read(pipe: Pipeline, counters: list[str] = counters) -> Any:
                return pipe.mget(counters)

            def learned(values: Any, key: Key = key, limits: list[tuple[str, str, str, float]] = limits) -> None:
                if isinstance(values, list):
                    self._saw(key, limits, at, values)
            self.shared.queue("keys", read, learned)

    async def reserve(self, key: Key, spend: Spend, fast: bool) -> Hold | Refusal:
        now = windows(self.local.wall())
        return await self._reserve(key, spend, ("all", "fast") if fast else ("all",), {w: v[0] for w, v in now.items()},
                                   now)

    async def extend(self, hold: Hold, level: str) -> Refusal | None:
        """The extension is a part of ``hold``, settled with it."""
        got = await self._reserve(hold.key, hold.spend, (level,), hold.at, windows(self.local.wall()))
        if isinstance(got, Refusal):
            return got
        hold.parts.append(got)  # its own counters and hold id; the hold's own levels stay its own
        return None

    async def _reserve(self, key: Key, spend: Spend, levels: tuple[str, ...], at: dict[str, str],
                       now: dict[str, tuple[str, float]]) -> Hold | Refusal:
        """``now``: the current windows, for a refusal's wait. Without an answer in time it is counted here, and settled
        there when Redis answers again."""
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
            self.shared.key_reserve.sha, len(keys), *keys, *args))
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
        """Each part (the hold and its extensions) is settled in Redis, queued and not awaited; a part counted here adds
        what was used there too, once."""
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
        self.shared.queue("keys", lambda pipe: pipe.evalsha(self.shared.key_settle.sha, len(keys), *keys, *args))

    def _resend(self) -> None:
        """The settlements that waited go in the pipeline before the sync, so that what it reads includes what was spent
        meanwhile."""
        waiting, self.waiting = self.waiting, []
        for keys, args in waiting:
            self._send(keys, args)
        self.sync()
