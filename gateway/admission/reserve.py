"""Reservations made before anything is sent: the tiers and limits of a request's gateway key (:class:`KeyBudgets`),
and what a request holds in flight until it is recorded (:class:`Reserved`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from gateway.admission.body import BodyBudget, Held
from gateway.config.upstreams import FAST_SERVICE_TIERS
from gateway.errors import GatewayError, KeyNotAllowed
from gateway.observability.metrics import BILLABLE
from gateway.observability.recorder import Recorded, Recorder
from gateway.routing import deadline
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.failover import Plan
from gateway.tenancy.keys import Key
from gateway.tenancy.ledger import Hold, Ledger, Refusal, Spend, bounded

MAX_NEED = 10**9  # tokens a request may count against a quota estimate or a key: no context window is larger


def key_tiers(key: Key, decision: Decision) -> Decision:
    """Candidates off ``key``'s tiers dropped (``x-tiergate-fallback: key_tier`` if the first moved); pure, so the
    route endpoint can show it. Raises KeyNotAllowed (403) if none is left."""
    allowed = tuple(c for c in decision.candidates if c.upstream.tier in key.cfg.tiers)
    if not allowed:
        raise KeyNotAllowed(f"The gateway key '{key.name}' may use the {' and '.join(key.cfg.tiers)} tier, and no "
                            f"upstream there serves `{decision.model}`.", param="model")
    if len(allowed) == len(decision.candidates):
        return decision
    moved = allowed[0] is not decision.candidates[0]
    return dataclasses.replace(decision, candidates=allowed, fallback="key_tier" if moved else decision.fallback)


def need_of(facts: RequestFacts | None) -> int:
    """Estimated prompt plus ``max_tokens`` (0 without facts: a body that is not JSON)."""
    return min(facts.prompt_tokens + (facts.max_tokens or 0), MAX_NEED) if facts is not None else 0


def estimated_cost(cand: Candidate, decision: Decision, facts: RequestFacts | None, speed: bool = True) -> float:
    """USD: the estimated prompt and ``max_tokens`` (else ``deadline.DEFAULT_COMPLETION``) at the prices metrics
    bills (an unconfigured model: the upstream's ``model_prices`` only); 0 when unpriced."""
    if facts is None:
        return 0.0
    up = cand.upstream
    tier = up.asks(facts.service_tier, speed)  # what the request is sent with: what it is billed at, without an echo
    if decision.rule == "passthrough":  # not a configured model: priced by model_prices alone, as metrics does
        listed = up.model_prices.get(decision.model)
        priced = listed.per_token(tier, facts.prompt_tokens) if listed is not None else None
    else:
        priced = deadline.price(up, decision.model, tier, facts.prompt_tokens)
    if priced is None:
        return 0.0
    return float(facts.prompt_tokens * priced[0] + (facts.max_tokens or deadline.DEFAULT_COMPLETION) * priced[2])


class KeyBudgets:

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def keyed(self, rec: Recorder, key: Key, decision: Decision,
                    facts: RequestFacts | None) -> tuple[Decision, Hold, str | None]:
        """Reserve one request, its need and estimated cost on the key's tiers, at the fast level too when the first
        candidate is fast or the request asks a fast ``service_tier`` of any upstream (speed is the fast tier,
        whoever sells it); a spent fast allowance moves it off fast (:meth:`off_fast`). Also returns why an asked
        fast ``service_tier`` is dropped. Raises KeyNotAllowed (403), RateLimited or KeyOverBudget (429)."""
        decision = self.on_key_tiers(rec, key, decision)
        asked = facts is not None and facts.service_tier in FAST_SERVICE_TIERS
        dropped = "key_tier" if asked and "fast" not in key.cfg.tiers else None
        on_fast = decision.candidates[0].upstream.tier == "fast"
        spend = Spend(1.0, float(need_of(facts)), estimated_cost(decision.candidates[0], decision, facts,
                                                                 dropped is None))
        held = await self.ledger.reserve(key, spend, on_fast or (asked and dropped is None))
        if isinstance(held, Refusal) and held.level == "fast":
            if on_fast:
                decision = self.off_fast(rec, key, decision, held)
            dropped = "key_allowance" if asked else dropped
            spend.usd = estimated_cost(decision.candidates[0], decision, facts, False)
            held = await self.ledger.reserve(key, spend, False)
        if isinstance(held, Refusal):
            rec.key_refused(held.limit)
            raise held.error(key)
        return decision, held, dropped

    def on_key_tiers(self, rec: Recorder, key: Key, decision: Decision) -> Decision:
        """As :func:`key_tiers`, a moved first candidate counted as a ``key_tier`` downgrade."""
        narrowed = key_tiers(key, decision)
        if narrowed.candidates[0] is not decision.candidates[0]:
            rec.key_downgraded("key_tier")
        return narrowed

    def off_fast(self, rec: Recorder, key: Key, decision: Decision, refused: Refusal) -> Decision:
        """Raises RateLimited (429) when only the fast tier serves the request."""
        rest = tuple(c for c in decision.candidates if c.upstream.tier != "fast")
        if not rest:
            rec.key_refused(refused.limit)
            raise refused.fast_error(key)
        rec.key_downgraded("key_allowance")
        return dataclasses.replace(decision, candidates=rest, fallback="key_allowance")

    async def fast_allowance(self, rec: Recorder, hold: Hold, plan: Plan) -> None:
        """For a fast attempt the reservation did not cover (failover, spillover, hedge). Raises RateLimited when it
        is spent: the attempt is passed over."""
        if not bounded(hold.key, ("fast",)):
            return
        refused = await self.ledger.extend(hold, "fast")
        if refused is None:
            return
        rec.key_downgraded("key_allowance")
        plan.reason = plan.reason or "key_allowance"
        raise refused.fast_error(hold.key)


def refusal_outcome(exc: GatewayError) -> str:
    return "key_limit" if exc.status == 429 else "client_error"


class Settles(Protocol):
    """What settles an agent session's step once its request is recorded (``gateway.admission.sessions.Sessions``)."""

    def finished(self, rec: Recorder, run: Any, done: Recorded, answered: bool) -> None: ...


class Reserved:
    """What one request holds in flight, settled once when it is recorded."""

    __slots__ = ("body", "hold", "run", "sessions")

    def __init__(self, budget: BodyBudget, key: Key | None) -> None:
        self.body = Held(budget, key.name if key is not None else None)
        self.hold: Hold | None = None
        self.run: Any = None
        self.sessions: Settles | None = None

    def settle(self, rec: Recorder, done: Recorded) -> None:
        """Without usage, a billable outcome keeps what it reserved and any other gives it back; the key is charged
        on the tier that served it (a fast ``service_tier`` counts as fast); the session counts a step only if an
        upstream answered it."""
        self.body.release()
        billable = done.outcome in BILLABLE
        hold = self.hold
        if hold is not None:
            tokens = done.tokens if done.tokens is not None else (int(hold.spend.tokens) if billable else 0)
            cost = done.cost if done.cost is not None else (hold.spend.usd if billable else 0.0)
            speed = done.service_tier in FAST_SERVICE_TIERS  # a fast service tier of a standard upstream counts
            hold.settle(tokens, cost, "fast" if speed else rec.tier)
        if self.run is not None and self.sessions is not None:
            self.sessions.finished(rec, self.run, done, billable)
