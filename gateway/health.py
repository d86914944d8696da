"""Per-upstream health: 429 cooldown, circuit breaker, quota estimate from rate-limit headers, concurrency.

In-memory state per worker process, updated from every upstream answer; no I/O. :meth:`Health.unavailable`
says why an upstream should not get a request *now*, so the request spills over to the next candidate before
the upstream can refuse it:

* ``cooldown``: it answered 429; it rests for its ``retry-after-ms`` / ``retry-after``, else for the reset of the
  rate-limit window it exhausted (``x-ratelimit-reset-*``), capped by ``health.cooldown_max``
  (``health.cooldown_default`` when it gave neither). A 429 that says the quota or credit is exhausted rests for
  ``health.exhausted_cooldown`` instead: waiting seconds does not fix it.
* ``circuit_open``: ``health.failures`` consecutive failures (connect errors, timeouts, 5xx, broken streams)
  open the breaker for ``health.open_seconds``; then one probe request is let through (half-open) and its
  success closes the breaker, its failure re-opens it. Recovery always comes: an open breaker always
  half-opens after its time, and a probe that never reports back is forgotten after ``open_seconds``.
* ``quota_requests`` / ``quota_tokens``: the remaining requests or tokens last reported in
  ``x-ratelimit-remaining-*`` headers (OpenAI: ``-requests``/``-tokens`` with Go-duration resets such as
  ``6m0s``; Cerebras: ``-requests-day``/``-tokens-minute`` with resets in seconds), minus what this gateway
  sent since, would not cover the request's estimated prompt plus ``max_tokens`` with ``quota_reserve``
  left over. The estimate is dropped when the reported reset time passes.
* ``concurrency``: ``max_concurrent`` requests are already in flight to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from random import random
from typing import Any, TypeVar

from gateway import logs
from gateway.config import UpstreamConfig
from gateway.errors import GatewayError, UpstreamStatusError

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
SOFT_REASONS = frozenset({"quota_requests", "quota_tokens", "concurrency"})  # estimates: try anyway if nothing else
T = TypeVar("T")


def parse_reset(value: str) -> float | None:
    """Seconds from a rate-limit reset header: ``1.5`` (Cerebras), ``6m0s``, ``120ms``, ``1m19.156s`` (OpenAI)."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from ``retry-after-ms`` (float ms) or ``retry-after`` (float seconds), as the SDK reads them."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(0.0, float(value) * scale)
            except ValueError:
                continue
    return None


def retry_wait(headers: Mapping[str, str]) -> float | None:
    """Seconds a 429 asks to wait: its retry hint, else the reset of the window it exhausted, else None.

    Cerebras answers 429 with ``x-ratelimit-reset-requests-minute`` / ``-tokens-minute`` (float seconds) and no
    ``retry-after`` (its rate-limit docs). The windows whose ``x-ratelimit-remaining-*`` is 0 decide (the longest
    of them); with no remaining counts at all, the soonest reset (a daily window's reset is hours away and says
    nothing about which window ran out).
    """
    wait = parse_retry_after(headers)
    if wait is not None:
        return wait
    empty: list[float] = []
    resets: list[float] = []
    for name, value in headers.items():
        if not name.startswith("x-ratelimit-reset-"):
            continue
        reset = parse_reset(value)
        if reset is None:
            continue
        resets.append(reset)
        remaining = headers.get("x-ratelimit-remaining-" + name[len("x-ratelimit-reset-"):])
        with contextlib.suppress(ValueError):
            if remaining is not None and float(remaining) <= 0:
                empty.append(reset)
    if empty:
        return max(empty)
    has_counts = any(n.startswith("x-ratelimit-remaining-") for n in headers)
    return min(resets) if resets and not has_counts else None


@dataclass
class _Quota:
    remaining: float
    resets_at: float  # monotonic seconds; the estimate is void after it


class UpstreamHealth:
    """The state of one upstream (see the module docstring). Times are ``time.monotonic()`` seconds."""

    def __init__(self, upstream: UpstreamConfig) -> None:
        self.name = upstream.name
        self.tier = upstream.tier
        self.cfg = upstream.health
        self.failures = 0
        self.open_until = 0.0
        self.half_open = False
        self.probe_started: float | None = None
        self.cooldown_until = 0.0
        self.exhausted = False  # the current cooldown is for an exhausted quota, not a rate
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.quota: dict[str, _Quota] = {}  # "requests" | "tokens" -> the tightest reported window

    def state(self, now: float) -> str:
        """``closed``, ``open``, ``half_open`` or ``cooldown`` (for the state gauge)."""
        if self.open_until > now:
            return "open"
        if self.half_open or self.open_until:
            return "half_open"
        if self.cooldown_until > now:
            return "cooldown"
        return "closed"

    def unavailable(self, now: float, need_tokens: int) -> str | None:
        """Why this upstream should not take a request needing ``need_tokens`` now, or None."""
        if self.open_until > now:
            return "circuit_open"
        probing = self.probe_started is not None and now - self.probe_started < self.cfg.open_seconds
        if (self.open_until or self.half_open) and probing:
            return "circuit_half_open"  # one probe at a time
        if self.cooldown_until > now:
            return "cooldown"
        if self.cfg.max_concurrent is not None and self.in_flight >= self.cfg.max_concurrent:
            return "concurrency"
        reserve = self.cfg.quota_reserve
        for kind, need, keep in (("requests", 1, reserve.get("requests", 0)), ("tokens", need_tokens,
                                                                              reserve.get("tokens", 0))):
            q = self.quota.get(kind)
            if q is not None and q.resets_at > now and q.remaining - need < keep:
                return f"quota_{kind}"
        return None

    def start(self, now: float, need_tokens: int) -> None:
        """A request is being sent: count it in flight and against the quota estimate; take the probe slot."""
        self.in_flight += 1
        if self.open_until and self.open_until <= now:
            self.open_until = 0.0
            self.half_open = True
            logs.event("breaker_half_open", upstream=self.name, tier=self.tier)
        if self.half_open:
            self.probe_started = now
        for kind, spent in (("requests", 1), ("tokens", need_tokens)):
            q = self.quota.get(kind)
            if q is not None:
                q.remaining -= spent

    def finish(self) -> None:
        """The request is over (whatever its result); wakes the first request waiting for a slot."""
        self.in_flight = max(0, self.in_flight - 1)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def can_queue(self) -> bool:
        """Whether a request may wait for a concurrency slot here (``health.queue_seconds`` is set)."""
        return self.cfg.queue_seconds is not None

    async def wait_for_slot(self) -> bool:
        """Wait up to ``health.queue_seconds`` for fewer than ``max_concurrent`` requests in flight.

        Returns:
            True when a slot is free (take it with :meth:`start` at once), False when the wait timed out.
        """
        limit = self.cfg.max_concurrent
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.cfg.queue_seconds or 0.0)
        while limit is not None and self.in_flight >= limit:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                return False
            finally:
                if not waiter.done():
                    waiter.cancel()
        return True

    def observe_headers(self, headers: Mapping[str, str], now: float) -> None:
        """Update the quota estimate from ``x-ratelimit-remaining-*`` / ``x-ratelimit-reset-*`` headers."""
        seen: dict[str, _Quota] = {}
        for name, value in headers.items():
            if not name.startswith("x-ratelimit-remaining-"):
                continue
            suffix = name[len("x-ratelimit-remaining-"):]  # requests, tokens, requests-day, tokens-minute, ...
            kind = suffix.split("-", 1)[0]
            if kind not in ("requests", "tokens"):
                continue
            try:
                remaining = float(value)
            except ValueError:
                continue
            reset = parse_reset(headers.get(f"x-ratelimit-reset-{suffix}", ""))
            if reset is None:
                reset = 60.0  # no (readable) reset: assume the per-minute window both OpenAI and Cerebras use
            q = _Quota(remaining, now + reset)
            if kind not in seen or q.remaining < seen[kind].remaining:
                seen[kind] = q
        self.quota.update(seen)

    def success(self) -> None:
        """An answer that shows the upstream works: close the breaker."""
        if self.open_until or self.half_open:
            logs.event("breaker_closed", upstream=self.name, tier=self.tier)
        self.failures = 0
        self.open_until = 0.0
        self.half_open = False
        self.probe_started = None

    def failure(self, now: float) -> None:
        """A failure the upstream is to blame for; may open the breaker."""
        self.failures += 1
        if self.half_open or self.failures >= self.cfg.failures:
            logs.event("breaker_opened", "warning", upstream=self.name, tier=self.tier, failures=self.failures,
                       open_s=self.cfg.open_seconds, after_probe=self.half_open)
            self.open_until = now + self.cfg.open_seconds
            self.half_open = False
            self.probe_started = None

    def settle(self, exc: GatewayError | None, now: float) -> None:
        """One attempt's verdict, told once when it ends: None (it worked) or what it failed with. A 429 starts a
        cooldown; a 5xx or a failure without a status (connect, timeout, a broken, silent or bad answer) counts
        against the breaker; any other 4xx is the request's fault, so the upstream is up (a context overflow
        included, whatever status the upstream chose: ``errors.upstream_error`` made it a 400)."""
        if exc is None:
            self.success()
        elif not isinstance(exc, UpstreamStatusError) or exc.status >= 500:
            self.failure(now)
        elif exc.status == 429:
            self.rate_limited(exc.headers, now, exhausted=exc.quota_exhausted)
        else:
            self.success()

    def resting_until(self) -> float:
        """When the breaker or the cooldown ends (monotonic seconds)."""
        return max(self.open_until, self.cooldown_until)

    def rate_limited(self, headers: Mapping[str, str], now: float, exhausted: bool = False) -> float:
        """A 429: rest for :func:`retry_wait` (capped), or ``exhausted_cooldown`` when the quota is ``exhausted``;
        count no breaker failure. Returns the rest in seconds."""
        wait = retry_wait(headers)
        rest = min(wait if wait is not None else self.cfg.cooldown_default, self.cfg.cooldown_max)
        if exhausted:
            rest = max(rest, self.cfg.exhausted_cooldown)
        self.cooldown_until = now + rest
        self.exhausted = exhausted
        logs.event("cooldown_started", "warning", upstream=self.name, tier=self.tier, retry_after_s=round(rest, 3),
                   quota_exhausted=exhausted)
        if self.half_open:  # the probe got an answer: the upstream is up, only busy
            self.success()
        return rest


class Health:
    """Every upstream's :class:`UpstreamHealth`, by name, and the one clock all of them are read and told with
    (``time.monotonic`` seconds; injectable for tests)."""

    def __init__(self, upstreams: list[UpstreamConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self.by_name = {u.name: UpstreamHealth(u) for u in upstreams}
        self.clock = clock

    def carry(self, previous: Health) -> None:
        """After a reload: each upstream that stays keeps its breaker, cooldown and quota estimate (its requests in
        flight stay counted on the old one, which they release)."""
        for name, h in self.by_name.items():
            old = previous.by_name.get(name)
            if old is not None:
                h.failures, h.open_until, h.half_open = old.failures, old.open_until, old.half_open
                h.probe_started, h.cooldown_until, h.exhausted = old.probe_started, old.cooldown_until, old.exhausted
                h.quota = dict(old.quota)

    def __getitem__(self, name: str) -> UpstreamHealth:
        return self.by_name[name]

    def order(self, candidates: tuple[T, ...]) -> list[T]:
        """Candidates with each run of same-tier upstreams shuffled by ``weight`` when weights differ.

        Weighted sampling without replacement (Efraimidis & Spirakis 2006: sort by ``random() ** (1/w)``);
        with equal weights the configured order stands.
        """
        out: list[T] = []
        i = 0
        while i < len(candidates):
            tier = _up(candidates[i]).tier
            j = i
            while j < len(candidates) and _up(candidates[j]).tier == tier:
                j += 1
            group = list(candidates[i:j])
            if len({_up(c).weight for c in group}) > 1:
                group.sort(key=lambda c: random() ** (1.0 / _up(c).weight), reverse=True)
            out += group
            i = j
        return out


def _up(candidate: Any) -> UpstreamConfig:
    return candidate.upstream  # type: ignore[no-any-return]


class Untracked:
    """The health of an attempt that reads and changes no upstream's: a request of the rest of /v1
    (``gateway.passthrough``). Its rate-limit headers are the limits of another model or endpoint (OpenAI's are per
    model), its failures those of another endpoint, and an upload may hold a connection for minutes; none of that
    may move the breaker, cooldown, quota estimate or concurrency count that route chat completions."""

    def start(self, now: float, need_tokens: int) -> None:
        """Nothing is charged."""

    def finish(self) -> None:
        """Nothing to give back."""

    def observe_headers(self, headers: Mapping[str, str], now: float) -> None:
        """Nothing is read."""

    def settle(self, exc: GatewayError | None, now: float) -> None:
        """No verdict is kept."""


UNTRACKED = Untracked()

