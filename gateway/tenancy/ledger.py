"""What gateway keys spent, and the limits it is held to (docs/tenancy.md#limits). A request reserves before it is sent
and settles when it ends, so that concurrent requests never overshoot a limit by more than what is in flight. Pure code,
no I/O: the replicas' ledger is ``gateway.state.ledger``."""

from __future__ import annotations

import calendar
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from gateway.config.auth import KeyLimits
from gateway.errors import GatewayError, KeyOverBudget, RateLimited
from gateway.tenancy.keys import Key

# (dimension, window, the KeyLimits field that bounds it)
DIMENSIONS = (("requests", "minute", "requests_per_minute"), ("tokens", "minute", "tokens_per_minute"),
              ("usd", "day", "usd_per_day"), ("usd", "month", "usd_per_month"))


@dataclass
class Spend:
    requests: float = 1.0
    tokens: float = 0.0
    usd: float = 0.0

    def get(self, dim: str) -> float:
        return float(getattr(self, dim))


def windows(now: float) -> dict[str, tuple[str, float]]:
    """Each window's id at wall-clock ``now`` and the seconds to its end, in UTC. The calendar part is worked out once
    per minute (measured: 4.3 us a call otherwise)."""
    minute = int(now // 60)
    cached = _CALENDAR.get(minute)
    if cached is None:
        t = datetime.fromtimestamp(minute * 60, UTC)
        next_month = calendar.timegm((t.year + (t.month == 12), t.month % 12 + 1, 1, 0, 0, 0))
        cached = (str(minute), f"{t:%Y-%m-%d}", float((minute * 60 // 86400 + 1) * 86400), f"{t:%Y-%m}",
                  float(next_month))
        _CALENDAR.clear()  # one minute at a time: bounded
        _CALENDAR[minute] = cached
    minute_id, day_id, day_end, month_id, month_end = cached
    return {"minute": (minute_id, (minute + 1) * 60 - now), "day": (day_id, day_end - now),
            "month": (month_id, month_end - now)}


_CALENDAR: dict[int, tuple[str, str, float, str, float]] = {}


def limits_of(key: Key, level: str) -> KeyLimits:
    return key.cfg.limits if level == "all" else key.cfg.fast


@functools.lru_cache(maxsize=4096)  # keys and levels are few; asked twice per request
def bounded(key: Key, levels: tuple[str, ...]) -> list[tuple[str, str, str, float]]:
    """(level, dimension, window, limit); cached, so never change the list."""
    out = []
    for level in levels:
        lim = limits_of(key, level)
        for dim, window, attr in DIMENSIONS:
            value = getattr(lim, attr)
            if value is not None:
                out.append((level, dim, window, float(value)))
    return out


@dataclass
class Refusal:
    """``limit``: the field's name; ``retry_after``: seconds until its window ends."""

    level: str
    limit: str
    retry_after: float

    def error(self, key: Key) -> GatewayError:
        """At level ``all``. A spent budget says ``x-should-retry: false`` (the OpenAI SDKs honour it): waiting a minute
        will not help."""
        if self.limit.startswith("usd"):
            period = "day" if self.limit == "usd_per_day" else "month"
            return KeyOverBudget(f"The gateway key '{key.name}' has spent its budget for this {period} "
                                 f"({self.limit}); ask its owner to raise it.",
                                 headers={"x-should-retry": "false"})
        what = "requests" if self.limit == "requests_per_minute" else "tokens"
        return RateLimited(f"The gateway key '{key.name}' is over its {what} per minute ({self.limit}); retry in "
                           f"{self.retry_s()} s.", headers={"retry-after": str(self.retry_s())})

    def fast_error(self, key: Key) -> GatewayError:
        return RateLimited(f"The gateway key '{key.name}' has spent its fast-tier allowance ({self.limit}), and only "
                           "the fast tier can serve this request.", headers={"retry-after": str(self.retry_s())})

    def retry_s(self) -> int:
        """At least 1: ``retry-after`` takes whole seconds."""
        return max(1, math.ceil(self.retry_after))


@dataclass
class Hold:
    """Settled once, when the request is recorded. ``at``: the window ids it was reserved in; ``remote``: (counters,
    hold id) in Redis; ``parts``: its extensions (:meth:`Ledger.extend`)."""

    key: Key
    levels: tuple[str, ...]
    spend: Spend
    at: dict[str, str]
    ledger: Ledger
    settled: bool = field(default=False)
    local: bool = True
    remote: tuple[list[str], str] | None = None
    parts: list[Hold] = field(default_factory=list)

    def charges(self, level: str) -> bool:
        return level in self.levels or any(level in p.levels for p in self.parts)

    def settle(self, tokens: float, usd: float, tier: str) -> None:
        """The fast allowance is given back when another tier served it."""
        if self.settled:
            return
        self.settled = True
        self.ledger.settle(self, Spend(1.0, tokens, usd), fast=tier == "fast")


class Ledger(Protocol):
    """:class:`MemoryLedger`, or ``gateway.state.ledger.SharedLedger`` across replicas."""

    async def reserve(self, key: Key, spend: Spend, fast: bool) -> Hold | Refusal: ...
    async def extend(self, hold: Hold, level: str) -> Refusal | None: ...
    def settle(self, hold: Hold, used: Spend, fast: bool) -> None: ...


class MemoryLedger:
    def __init__(self, wall: Callable[[], float]) -> None:
        self.wall = wall
        self.counts: dict[tuple[str, str, str, str], tuple[str, float]] = {}  # (key, level, dim, window) -> (id, n)
        self.version = 0  # bumped by every change of counts (gateway.state.ledger_file writes only what changed)

    def used(self, key: str, level: str, dim: str, window: str, at: str) -> float:
        """Reservations in flight included."""
        found = self.counts.get((key, level, dim, window))
        return found[1] if found is not None and found[0] == at else 0.0

    async def reserve(self, key: Key, spend: Spend, fast: bool) -> Hold | Refusal:
        """The first limit without room is the refusal, and nothing is reserved then."""
        return self.take(key, spend, fast, windows(self.wall()))

    def take(self, key: Key, spend: Spend, fast: bool, at: dict[str, tuple[str, float]]) -> Hold | Refusal:
        levels = ("all", "fast") if fast else ("all",)
        ids = {w: v[0] for w, v in at.items()}
        hold = Hold(key, levels, spend, ids, self)
        refused = self._charge(hold, bounded(key, levels), at)
        return hold if refused is None else refused

    def _charge(self, hold: Hold, limits: list[tuple[str, str, str, float]],
                now: dict[str, tuple[str, float]]) -> Refusal | None:
        """One pass to check, one to add: measured, this is the per-request cost of a key."""
        counts, name, at, spend = self.counts, hold.key.name, hold.at, hold.spend
        slots = []
        for level, dim, window, limit in limits:
            slot = (name, level, dim, window)
            found = counts.get(slot)
            if found is not None and found[0] > at[window]:
                continue  # the hold's window is over (an extension after the minute turned): nothing counts there
            n = getattr(spend, dim)
            base = found[1] if found is not None and found[0] == at[window] else 0.0
            if base + n > limit:
                return Refusal(level, _field(dim, window), now[window][1])
            slots.append((slot, at[window], base + n))
        for slot, window_id, total in slots:
            counts[slot] = (window_id, total)
        self.version += 1
        return None

    def take_at(self, key: Key, spend: Spend, levels: tuple[str, ...], at: dict[str, str],
                now: dict[str, tuple[str, float]]) -> Hold | Refusal:
        """At the window ids ``at``: an extension's are those of the hold it extends."""
        hold = Hold(key, (), spend, dict(at), self)
        for level in levels:
            refused = self.extend_now(hold, level, now)
            if refused is not None:
                return refused
        return hold

    async def extend(self, hold: Hold, level: str) -> Refusal | None:
        """For a fast-tier attempt the request was not reserved for: a failover, a spillover, a hedge."""
        return self.extend_now(hold, level, windows(self.wall()))

    def extend_now(self, hold: Hold, level: str, now: dict[str, tuple[str, float]]) -> Refusal | None:
        """``now``: the current windows, for the refusal's wait."""
        refused = self._charge(hold, bounded(hold.key, (level,)), now)
        if refused is None:
            hold.levels = (*hold.levels, level)
        return refused

    def settle(self, hold: Hold, used: Spend, fast: bool) -> None:
        """The fast level gives back all it reserved when ``fast`` is false."""
        for level, dim, window, _ in bounded(hold.key, hold.levels):
            delta = (used.get(dim) if level == "all" or fast else 0.0) - hold.spend.get(dim)
            self._add(hold.key.name, level, dim, window, hold.at[window], delta)

    def _add(self, key: str, level: str, dim: str, window: str, at: str, n: float) -> None:
        slot = (key, level, dim, window)
        found = self.counts.get(slot)
        if found is None or found[0] != at:
            if found is not None and found[0] > at:
                return  # a settlement for a window already over: nothing counts there any more
            found = (at, 0.0)
        self.counts[slot] = (at, max(0.0, found[1] + n))
        self.version += 1


def _field(dim: str, window: str) -> str:
    return next(attr for d, w, attr in DIMENSIONS if d == dim and w == window)
