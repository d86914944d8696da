"""Per-upstream health, in memory per worker and updated from every answer: why an upstream should not get a request
*now* (:meth:`UpstreamHealth.unavailable`), so that the request spills over before the upstream can refuse it
(docs/routing.md#spillover, docs/routing.md#circuit-breakers, docs/routing.md#cooldowns). No I/O; replicas that share
state (``gateway.state.redis``) exchange cooldowns and breaker transitions through a :class:`Listener`."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from random import random
from typing import Any, Protocol, TypeVar, cast

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import GatewayError, UpstreamStatusError
from gateway.observability import logs
from gateway.routing.blame import MAX_SOURCES, Blame, request_shaped
from gateway.routing.ratelimits import Window, quota_report, retry_wait, zero_limit

# estimates (and the scheduler's share): try anyway if nothing else
SOFT_REASONS = frozenset({"quota_requests", "quota_tokens", "quota_uncached", "concurrency", "class_share"})


T = TypeVar("T")


@dataclass
class _Quota:
    remaining: float
    resets_at: float  # monotonic seconds; the estimate is void after it


Mark = tuple[int, int]  # (requests, tokens) sent to an upstream so far, its own included: see UpstreamHealth.start


class Listener(Protocol):
    """Told of the transitions other replicas should know (``gateway.state.redis``); times are the health clock's."""

    def rested(self, upstream: str, kind: str, until: float, exhausted: bool) -> None:
        """``kind``: ``cooldown`` (a 429; ``exhausted``: the quota is) or ``open`` (the breaker)."""

    def closed(self, upstream: str) -> None:
        ...


class UpstreamHealth:
    """Times are ``time.monotonic()`` seconds."""

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
        self.full = False  # the current cooldown is for a full capacity tier (Groq's 498), not a rate
        self.unavailable_until = 0.0  # a bucket's limit is 0: no use of it before then
        self.limits: dict[str, tuple[float, float]] = {}  # bucket -> (limit, window seconds), as last reported
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.quota: dict[str, _Quota] = {}  # "requests" | "tokens" -> the tightest reported window
        self.sent = (0, 0)  # requests and tokens (estimated) sent so far, for the marks of start()
        self.reports_quota = False  # some answer (here or, shared, another replica's) carried rate-limit headers
        self.listener: Listener | None = None
        # the current run of consecutive failures: those with no status line, and the request-shaped ones by source
        self.hard = 0
        self.shaped: dict[str, int] = {}
        # per source: (request-shaped failures in a row, when the last came, rested for that source until)
        self.by_source: OrderedDict[str, tuple[int, float, float]] = OrderedDict()

    def state(self, now: float) -> str:
        if self.open_until > now:
            return "open"
        if self.half_open or self.open_until:
            return "half_open"
        if self.cooldown_until > now:
            return "cooldown"
        return "closed"

    def unavailable(self, now: float, need_tokens: int, blame: Blame | None = None, cached: int = 0) -> str | None:
        """The spillover reason (docs/routing.md#spillover), or None. ``need_tokens``: the estimated prompt plus
        ``max_tokens``; ``cached``: those of them believed in its prompt cache, which its ``uncached`` bucket does not
        count."""
        if self.open_until > now or (blame is not None and self.by_source and self.source_rests(blame.who(), now)):
            return "circuit_open"
        # a probe that never reports back is forgotten after open_seconds: recovery always comes
        probing = self.probe_started is not None and now - self.probe_started < self.cfg.open_seconds
        if (self.open_until or self.half_open) and probing:
            return "circuit_half_open"  # one probe at a time
        if self.unavailable_until > now:
            return "quota_unavailable"
        if self.cooldown_until > now:
            return "capacity" if self.full else "cooldown"
        if self.cfg.max_concurrent is not None and self.in_flight >= self.cfg.max_concurrent:
            return "concurrency"
        keep = cast(Mapping[str, int], self.cfg.quota_reserve)
        for kind, q in self.quota.items():
            if q.resets_at > now:
                need = 1 if kind == "requests" else need_tokens if kind == "tokens" else need_tokens - cached
                if q.remaining - need < keep.get(kind, 0):
                    return f"quota_{kind}"
        return None

    def start(self, now: float, need_tokens: int) -> Mark:
        """Count a request in flight and against the quota estimate, taking the half-open probe slot; the mark returned
        goes back with the answer's headers (:meth:`observe_headers`)."""
        self.in_flight += 1
        self.sent = (self.sent[0] + 1, self.sent[1] + need_tokens)
        if self.open_until and self.open_until <= now:
            self.open_until = 0.0
            self.half_open = True
            logs.event("breaker_half_open", upstream=self.name, tier=self.tier)
        if self.half_open:
            self.probe_started = now
        for kind, q in self.quota.items():
            q.remaining -= 1 if kind == "requests" else need_tokens
        return self.sent

    def finish(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def can_queue(self) -> bool:
        return self.cfg.queue_seconds is not None

    async def wait_for_slot(self) -> bool:
        """Up to ``health.queue_seconds``: True when a slot is free; take it with :meth:`start` at once."""
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

    def observe_headers(self, headers: Mapping[str, str], now: float, mark: Mark | None = None) -> None:
        """The upstream counted the requests it had received when it answered (OpenAI and Cerebras count a request when
        it arrives), so what was sent after ``mark``'s request (:meth:`start`) is taken off what it reports."""
        self.observe_report(quota_report(headers), now, mark)

    def observe_report(self, report: dict[str, Window], now: float, mark: Mark | None = None) -> None:
        """A bucket whose limit is 0 makes the upstream unavailable until its reset, at least ``exhausted_cooldown``: no
        waiting makes room in it."""
        if not report:
            return
        self.reports_quota = True
        for kind, w in report.items():
            since = 0 if mark is None else max(0, self.sent[kind != "requests"] - mark[kind != "requests"])
            self.quota[kind] = _Quota(w.remaining - since, now + w.reset)
            if w.limit is not None:
                self.limits[kind] = (w.limit, w.length)
                if w.limit <= 0:
                    self.unavailable_until = now + max(w.reset, self.cfg.exhausted_cooldown)
                    logs.event("quota_unavailable", "warning", upstream=self.name, tier=self.tier, bucket=kind)

    def source_rests(self, source: str, now: float) -> bool:
        found = self.by_source.get(source)
        return found is not None and found[2] > now

    def success(self) -> None:
        if self.open_until or self.half_open:
            logs.event("breaker_closed", upstream=self.name, tier=self.tier)
            if self.listener is not None:
                self.listener.closed(self.name)
        self.failures = self.hard = 0
        self.shaped.clear()
        self.open_until = 0.0
        self.half_open = False
        self.probe_started = None

    def failure(self, now: float, source: str | None = None) -> None:
        """``source``: the request's, when the failure is request-shaped (``gateway.routing.blame``); each source counts
        at most half of ``health.failures``, so that one client alone never opens the breaker for everyone."""
        self.failures += 1
        if source is None:
            self.hard += 1
        else:
            self._charge(source, now)
        cap = max(1, self.cfg.failures // 2)  # one source alone never reaches the threshold (from 2 up)
        counted = self.hard + sum(min(n, cap) for n in self.shaped.values())
        if self.half_open or counted >= self.cfg.failures:
            logs.event("breaker_opened", "warning", upstream=self.name, tier=self.tier, failures=self.failures,
                       open_s=self.cfg.open_seconds, after_probe=self.half_open)
            self.open_until = now + self.cfg.open_seconds
            self.half_open = False
            self.probe_started = None
            if self.listener is not None:
                self.listener.rested(self.name, "open", self.open_until, False)

    def _charge(self, source: str, now: float) -> None:
        """Also rests the upstream for ``source`` alone after ``health.failures`` in a row, none more than
        ``open_seconds`` apart."""
        if source in self.shaped or len(self.shaped) < MAX_SOURCES:
            self.shaped[source] = self.shaped.get(source, 0) + 1
        n, last, until = self.by_source.pop(source, (0, now, 0.0))
        n = n + 1 if now - last <= self.cfg.open_seconds else 1
        if n >= self.cfg.failures and until <= now:
            until = now + self.cfg.open_seconds
            logs.event("source_rested", "warning", upstream=self.name, tier=self.tier, failures=n,
                       open_s=self.cfg.open_seconds, source=source if not source.startswith("body:") else "body")
        self.by_source[source] = (n, now, until)
        while len(self.by_source) > MAX_SOURCES:
            self.by_source.popitem(last=False)

    def retract(self, source: str) -> None:
        """The request failed that way everywhere it went: its own fault. A breaker it helped open stays open: others'
        failures opened it with it."""
        self.failures = max(0, self.failures - 1)
        n = self.shaped.get(source, 0)
        if n > 1:
            self.shaped[source] = n - 1
        else:
            self.shaped.pop(source, None)
        found = self.by_source.get(source)
        if found is not None:
            self.by_source[source] = (max(0, found[0] - 1), found[1], found[2])
        if self.half_open and self.probe_started is not None:
            self.probe_started = None  # the probe said nothing of the upstream: the next request probes again

    def settle(self, exc: GatewayError | None, now: float, need_tokens: int = 0, source: str | None = None) -> None:
        """Told once per attempt (``exc`` None: it worked). Only a 5xx or a failure with no status of its own counts
        against the breaker; any other 4xx is the request's fault and the upstream is up (a context overflow too,
        whatever status the upstream used)."""
        if exc is None:
            self.success()
        elif isinstance(exc, UpstreamStatusError) and exc.code == "capacity_exceeded":
            self.rate_limited(exc.headers, now, full=True)  # Groq's 498: full for now, not failing
        elif not isinstance(exc, UpstreamStatusError) or exc.status >= 500:
            self.failure(now, source if request_shaped(exc) else None)
        elif exc.status == 429:
            self.rate_limited(exc.headers, now, exhausted=exc.quota_exhausted or zero_limit(exc.headers),
                              need_tokens=need_tokens)
        else:
            self.success()

    def resting_until(self, source: str | None = None) -> float:
        found = self.by_source.get(source) if source is not None else None
        return max(self.open_until, self.cooldown_until, found[2] if found is not None else 0.0)

    def rate_limited(self, headers: Mapping[str, str], now: float, exhausted: bool = False,
                     need_tokens: int = 0, full: bool = False) -> float:
        """A 429: returns the rest in seconds and counts no breaker failure. No rest (0) after a 429 with no retry hint
        whose report has tokens left, fewer than ``need_tokens``: it refused this request's size (a ``max_tokens`` over
        what is left), not everyone's, so smaller requests go on, here and on the other replicas."""
        wait = retry_wait(headers)
        rest = min(wait if wait is not None else self.cfg.cooldown_default, self.cfg.cooldown_max)
        left = quota_report(headers).get("tokens")
        if wait is None and not exhausted and left is not None and 0 < left.remaining < need_tokens:
            logs.event("rate_limited_request", upstream=self.name, tier=self.tier, need_tokens=need_tokens,
                       tokens_left=left.remaining)
            if self.half_open:
                self.success()
            return 0.0
        if exhausted:
            rest = max(rest, self.cfg.exhausted_cooldown)
        self.cooldown_until = now + rest
        self.exhausted, self.full = exhausted, full
        logs.event("cooldown_started", "warning", upstream=self.name, tier=self.tier, retry_after_s=round(rest, 3),
                   quota_exhausted=exhausted)
        if self.listener is not None:
            self.listener.rested(self.name, "cooldown", self.cooldown_until, exhausted)
        if self.half_open:  # the probe got an answer: the upstream is up, only busy
            self.success()
        return rest

    # what other replicas report (gateway.state.redis): applied without telling the listener back

    def shared_rest(self, kind: str, until: float, exhausted: bool) -> None:
        if kind == "cooldown" and until > self.cooldown_until:
            self.cooldown_until, self.exhausted = until, exhausted
        elif kind == "open" and until > self.open_until:
            self.open_until, self.half_open, self.probe_started = until, False, None

    def shared_closed(self) -> None:
        listener, self.listener = self.listener, None
        try:
            self.success()
        finally:
            self.listener = listener

    def shared_quota(self, kind: str, remaining: float, resets_at: float) -> None:
        self.reports_quota = True
        self.quota[kind] = _Quota(remaining, resets_at)


class Health:
    """Every upstream's health and the one clock all of it is read and told with (``time.monotonic`` seconds; injectable
    for tests)."""

    def __init__(self, upstreams: list[UpstreamConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self.by_name = {u.name: UpstreamHealth(u) for u in upstreams}
        self.clock = clock

    def listen(self, listener: Listener | None) -> None:
        for h in self.by_name.values():
            h.listener = listener

    def carry(self, previous: Health) -> None:
        """After a reload, each upstream that stays keeps its breaker, cooldown and quota estimate; its requests in
        flight stay counted on the old one, which they release."""
        for name, h in self.by_name.items():
            old = previous.by_name.get(name)
            if old is not None:
                h.failures, h.open_until, h.half_open = old.failures, old.open_until, old.half_open
                h.probe_started, h.cooldown_until, h.exhausted = old.probe_started, old.cooldown_until, old.exhausted
                h.quota, h.sent, h.reports_quota = dict(old.quota), old.sent, old.reports_quota
                h.full, h.unavailable_until, h.limits = old.full, old.unavailable_until, dict(old.limits)
                h.hard, h.shaped, h.by_source = old.hard, dict(old.shaped), OrderedDict(old.by_source)

    def __getitem__(self, name: str) -> UpstreamHealth:
        return self.by_name[name]

    def order(self, candidates: tuple[T, ...], keep: str | None = None) -> list[T]:
        """Each run of same-tier candidates shuffled by ``weight`` when weights differ: weighted sampling without
        replacement (Efraimidis & Spirakis 2006: sort by ``random() ** (1/w)``). ``keep`` stays first of its run (an
        agent session's warm upstream)."""
        out: list[T] = []
        i = 0
        while i < len(candidates):
            tier = _up(candidates[i]).tier
            j = i
            while j < len(candidates) and _up(candidates[j]).tier == tier:
                j += 1
            group = list(candidates[i:j])
            if len({_up(c).weight for c in group}) > 1:
                group.sort(key=lambda c: 2.0 if _up(c).name == keep else random() ** (1.0 / _up(c).weight),
                           reverse=True)
            out += group
            i = j
        return out


def _up(candidate: Any) -> UpstreamConfig:
    return candidate.upstream  # type: ignore[no-any-return]


class Untracked:
    """The health of a passthrough request (``gateway.pipeline.passthrough``), which must move no upstream's breaker,
    cooldown, quota estimate or concurrency count: its rate-limit headers are another model's or endpoint's (OpenAI's
    are per model), its failures another endpoint's, and an upload may hold a connection for minutes."""

    def start(self, now: float, need_tokens: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def observe_report(self, report: dict[str, Window], now: float, mark: Any = None) -> None:
        pass

    def settle(self, exc: GatewayError | None, now: float, need_tokens: int = 0, source: str | None = None) -> None:
        pass

    def retract(self, source: str) -> None:
        pass


UNTRACKED = Untracked()
