"""First-token hedging (docs/deadlines.md#hedging): when a hedged stream's first candidate has produced no
token-bearing event after the hedge delay, the second starts too, if its health would take a request now (a hedge is
extra load, never forced). The first to produce a token is relayed, the other cancelled at once (its cost counted); a
failure of the first before the second started fails over at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import GatewayError
from gateway.observability.estimates import Estimates, bucket
from gateway.pipeline.attempts import Attempts, Turn
from gateway.pipeline.exchange import Exchange
from gateway.routing import deadline
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.failover import Plan
from gateway.routing.health import Health
from gateway.stream.relay import Relay
from gateway.upstream.attempt import Attempt


def may_race(decision: Decision, plan: Plan) -> bool:
    route = decision.route
    return route is not None and route.hedge is not None and len(plan.candidates) > 1 and not plan.queued


def asked_series(cand: Candidate, facts: RequestFacts) -> str:
    return bucket(cand.upstream_model, cand.upstream.asks(facts.service_tier))


class Race:
    """One hedged request, the racers' ``Claim``; ``settled`` is set at a claim or a failure."""

    def __init__(self, hedging: Hedging, turn: Turn) -> None:
        self.hedging = hedging
        self.turn = turn
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.winner: Candidate | None = None
        self.hedged = False  # the second candidate was started as a hedge (not as a failover)
        self.failures: dict[str, GatewayError] = {}
        self.settled = asyncio.Event()

    def start(self, cand: Candidate, hedge: bool = False) -> None:
        racer = self._run(cand, hedge)
        self.tasks[cand.upstream.name] = asyncio.get_running_loop().create_task(racer)

    async def _run(self, cand: Candidate, hedge: bool) -> None:
        try:
            await self.hedging.attempts.run(self.turn, cand, self, hedge)
        except GatewayError as exc:
            self.failures[cand.upstream.name] = exc
            self.settled.set()

    def claim(self, cand: Candidate) -> bool:
        """Wins unless the other won first; the other is cancelled now."""
        if self.winner is not None:
            return False
        self.winner = cand
        for name, task in self.tasks.items():
            if name != cand.upstream.name:
                task.cancel()
        self.settled.set()
        return True

    def won(self, cand: Candidate, hedge: bool) -> None:
        """Counted before the answer leaves."""
        if self.hedged:
            self.turn.ex.rec.hedged("won" if hedge else "lost")

    def lost(self, cand: Candidate, attempt: Attempt, relay: Relay | None) -> None:
        """When the other won, what this racer may have cost is counted."""
        if self.winner is not None and self.winner is not cand:
            self.hedging.lost(self.turn.ex, cand.upstream, self.turn.decision, self.turn.facts, attempt, relay)

    async def finish(self) -> None:
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for task in self.tasks.values():
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a bug in a racer: the frame answers it

    async def stop(self) -> None:
        """The client left or the drain ran out."""
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


class Hedging:

    def __init__(self, attempts: Attempts, estimates: Estimates, health: Health) -> None:
        self.attempts = attempts
        self.estimates = estimates  # read for the delay and a loser's wait; fed through the request's recorder
        self.health = health

    async def race(self, turn: Turn) -> list[Candidate]:
        """The candidates failover may still go on to: none when a racer answered, else those after the two if the
        second's failure allows (``turn.last``, ``turn.tried`` tell how it went)."""
        plan, ex = turn.plan, turn.ex
        race = Race(self, turn)
        first, second = plan.candidates[0], plan.candidates[1]
        race.start(first)
        hedged = False
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.moving_delay(turn, first, second)):
                    await race.settled.wait()  # a first token, or a failure
            if race.winner is None and not race.failures:
                if self.takes(turn, second):
                    hedged = race.hedged = True  # no token within the delay: hedge
                    race.start(second, hedge=True)
                else:
                    await race.settled.wait()  # the second would refuse: no hedge; the first's token or failure
            failed = race.failures.get(first.upstream.name)
            if race.winner is None and len(race.tasks) == 1 and failed is not None and plan.go_on(first, failed):
                ex.rec.failed_over(first.upstream.tier, first.upstream.name, plan.reason)
                race.start(second)
            await race.finish()
        except asyncio.CancelledError:
            await race.stop()
            if hedged and race.winner is None:
                ex.rec.hedged("cancelled")
            raise
        return self._after(turn, race, hedged)

    def takes(self, turn: Turn, second: Candidate) -> bool:
        """The second's health would take the request now, and so would the scheduler: a hedge to a fast upstream
        draws on its budget like any attempt, so a class's share holds against hedges too."""
        h, now = self.health[second.upstream.name], self.health.clock()
        if turn.ask is not None and turn.ask.refuses(h, turn.need, now) is not None:
            return False
        cached = turn.ask.cached.get(h.name, 0) if turn.ask is not None else 0
        return h.unavailable(now, turn.need, turn.ex.blame, cached) is None

    def _after(self, turn: Turn, race: Race, hedged: bool) -> list[Candidate]:
        if race.winner is not None:
            return []
        if hedged:  # won and lost are counted at the claim, before the answer leaves
            turn.ex.rec.hedged("cancelled")
        turn.tried = len(race.tasks)
        if not race.failures:
            return []
        first, second = turn.plan.candidates[0], turn.plan.candidates[1]
        name, turn.last = [*race.failures.items()][-1]  # the one that failed last
        up = first.upstream if name == first.upstream.name else second.upstream
        model = turn.decision.model
        turn.ex.rec.labelled(up.tier, up.name, up.models.get(model, model), turn.tried)
        go_on = turn.tried == 2 and turn.plan.go_on(second, turn.last)
        return turn.plan.candidates[2:] if go_on else []

    def moving_delay(self, turn: Turn, first: Candidate, second: Candidate) -> float | None:
        """For a session step whose prompt cache is warm on ``first`` and cold on ``second``, :meth:`delay` plus the
        prefill ``second`` would spend on the cached tokens: a hedge moves the session, so it starts only once the
        first is late by more than the move costs (docs/sessions.md#cache-warmth-is-priced)."""
        base = self.delay(turn.decision, first, turn.facts)
        run = turn.run
        if base is None or run is None:
            return base
        warm = run.affinity.warm
        cached = warm.get(first.upstream.name, 0)
        if not cached or second.upstream.name in warm:
            return base
        est = self.estimates.latency(second.upstream.name, asked_series(second, turn.facts), self.health.clock())
        return base + (est.per_token * cached if est is not None else 0.0)

    def delay(self, decision: Decision, cand: Candidate, facts: RequestFacts) -> float | None:
        """Seconds: the route's fixed delay, or with ``p95`` the live TTFT p95 at the prompt's size (None while
        unmeasured: no hedge)."""
        hedge = decision.route.hedge if decision.route is not None else None
        if hedge != "p95":
            return float(hedge) if hedge is not None else None
        est = self.estimates.latency(cand.upstream.name, asked_series(cand, facts), self.health.clock())
        return est.ttft_p95(facts.prompt_tokens) if est is not None else None

    def lost(self, ex: Exchange, up: UpstreamConfig, decision: Decision, facts: RequestFacts, attempt: Attempt,
             relay: Relay | None) -> None:
        """Its cost is counted (its usage, else the estimated prompt at the input price). A wait past its TTFT
        estimate's median is fed to the estimate as a lower bound, so a tier whose hedges keep winning is still seen
        to be slow; a shorter wait says nothing, nor does an unmeasured upstream's (it would become its estimate)."""
        usage: Any = relay.stats.usage if relay is not None else None
        price = deadline.price(up, decision.model)
        if price is not None:
            p_in, _, p_out = price
            prompt = usage.get("prompt_tokens") if usage else None
            completion = usage.get("completion_tokens") if usage else None
            cost = (prompt if isinstance(prompt, int) else facts.prompt_tokens) * p_in + \
                (completion if isinstance(completion, int) else 0) * p_out
            if cost > 0:
                ex.rec.hedge_cost(up.tier, up.name, cost)
        if attempt.sent_at is None:
            return
        waited, now = time.perf_counter() - attempt.sent_at, self.health.clock()
        model = bucket(up.models.get(decision.model, decision.model), up.asks(facts.service_tier))
        est = self.estimates.latency(up.name, model, now)
        if est is not None and waited > est.ttft(facts.prompt_tokens, tail=False):
            ex.rec.waited(up.name, model, facts.prompt_tokens, waited)
