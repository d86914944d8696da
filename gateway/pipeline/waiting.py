"""Deadline-aware waiting for the fast tier (docs/routing.md#waiting-for-the-fast-tier): a request with a deadline whose
fast candidates are short for now (their budget, or the share other classes hold) may wait, a bounded time, for the
bucket that headers say refills soon, when waiting and then running fast still beats the standard tier's predicted
time and its deadline; otherwise it spills at once.

Waiters queue per class (at most ``scheduling.classes[].queue`` each; the rest spill at once) and are released in
order, higher class first and, within a class, least slack first, one per event-loop pass, so that each released
request can reserve what it takes before the next plans. Released together after one refill, a few may still find
the upstream short: its 429 fails them over to the standard tier, as without waiting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config.scheduling import SchedulingConfig
from gateway.pipeline.exchange import Exchange
from gateway.routing.facts import Decision
from gateway.routing.failover import Plan
from gateway.routing.health import Health
from gateway.routing.scheduling import Ask

WAIT_REASONS = frozenset({"quota_requests", "quota_tokens", "quota_uncached", "class_share"})  # refills; no rest
POLL = 0.25  # seconds between looks while a held share (not a refill) keeps a request out


@dataclass(frozen=True, slots=True)
class Wait:
    """``seconds``: the longest it may wait and still meet its deadline fast; ``slack``: what its deadline leaves
    after waiting for the refill and running fast (orders the queue); ``reset``: seconds to the soonest refill."""

    seconds: float
    slack: float
    reset: float


class Waiting:

    def __init__(self, cfg: SchedulingConfig) -> None:
        self.cfg = cfg
        self.queue = {c.name: c.queue for c in cfg.classes}
        self.count: dict[str, int] = {}
        self._heap: list[tuple[int, float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    def worth(self, decision: Decision, plan: Plan, health: Health) -> Wait | None:
        """A :class:`Wait` when the request should wait (module docstring), else None."""
        choice = decision.deadline
        if choice is None or not plan.candidates or plan.candidates[0].upstream.tier == "fast":
            return None
        fast = [c for c, why in plan.spilled if c.upstream.tier == "fast"]
        if not fast or any(why not in WAIT_REASONS for c, why in plan.spilled if c.upstream.tier == "fast"):
            return None
        now = health.clock()
        resets = [q.resets_at - now for c in fast for q in health[c.upstream.name].quota.values() if q.resets_at > now]
        reset = min(resets, default=0.0)
        preds = [p for c in fast if (p := choice.of(c.upstream.name)) is not None]
        here = choice.of(plan.candidates[0].upstream.name)
        if not preds or here is None:
            return None
        best = min(preds, key=lambda p: p.time)
        total = choice.budget.total is not None
        fast_s = best.time if total else (best.ttft if best.ttft is not None else math.inf)
        here_s = here.time if total else (here.ttft if here.ttft is not None else math.inf)
        limit = choice.budget.total if total else choice.budget.ttft
        assert limit is not None
        longest = min(self.cfg.max_wait, limit - fast_s)
        if not math.isfinite(fast_s) or reset > longest or reset + fast_s >= here_s:
            return None
        return Wait(longest, limit - (reset + fast_s), reset)

    async def wait(self, ex: Exchange, ask: Ask, w: Wait, plan: Plan, replan: Callable[[], Plan]) -> Plan:
        """Wait up to ``w.seconds`` for a plan whose first candidate is fast; the last plan when none came in time
        (or the class's queue is full: at once). The client leaving cancels it, as anywhere."""
        cls = ask.cls
        assert cls is not None
        if self.count.get(cls, 0) >= self.queue[cls]:
            return plan
        loop = asyncio.get_running_loop()
        start = loop.time()
        until = start + w.seconds
        self.count[cls] = self.count.get(cls, 0) + 1
        fast = False
        try:
            reset = w.reset
            while (left := until - loop.time()) > 0:
                waiter: asyncio.Future[None] = loop.create_future()
                heapq.heappush(self._heap, (self.cfg.rank(cls), w.slack, next(self._seq), waiter))
                self._arm(loop, min(left, max(reset, 0.001) + 0.001, POLL))
                try:
                    await waiter
                finally:
                    if not waiter.done():
                        waiter.cancel()
                plan = replan()
                loop.call_soon(self._release)  # the next in line plans after this one reserved
                if plan.candidates and plan.candidates[0].upstream.tier == "fast":
                    fast = True
                    break
                reset = POLL
        finally:
            self.count[cls] -= 1
            ex.rec.waited_for_fast(cls, loop.time() - start, fast)
        return plan

    def _arm(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        when = loop.time() + delay
        if self._timer is None or self._timer.when() > when:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._release()

    def _release(self) -> None:
        """Wake the first waiter in line (the next is woken once it planned)."""
        while self._heap:
            waiter = heapq.heappop(self._heap)[3]
            if not waiter.done():
                waiter.set_result(None)
                return
