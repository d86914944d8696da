"""Reservations: what a request's gateway key allows it (``auth:``; ``gateway.tenancy``), the tiers it may use and a
reservation against its limits before anything is sent, on every entrance (:class:`KeyBudgets`); and what a request
holds while it is in flight, settled once when it is recorded (:class:`Reserved`). Refusals are raised.
"""

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
    """``decision`` with only the candidates on the tiers ``key`` may use, failover ones included
    (``x-tiergate-fallback: key_tier`` when the first moved); ``decision`` itself when all are allowed. No side
    effect: the route endpoint shows it as the request would get it.

    Raises:
        KeyNotAllowed: no upstream on those tiers serves the request (403).
    """
    allowed = tuple(c for c in decision.candidates if c.upstream.tier in key.cfg.tiers)
    if not allowed:
        raise KeyNotAllowed(f"The gateway key '{key.name}' may use the {' and '.join(key.cfg.tiers)} tier, and no "
                            f"upstream there serves `{decision.model}`.", param="model")
    if len(allowed) == len(decision.candidates):
        return decision
    moved = allowed[0] is not decision.candidates[0]
    return dataclasses.replace(decision, candidates=allowed, fallback="key_tier" if moved else decision.fallback)


def need_of(facts: RequestFacts | None) -> int:
    """Tokens a request counts against quotas and its key while it runs: its estimated prompt plus ``max_tokens``
    (0 without facts: a body that is not JSON)."""
    return min(facts.prompt_tokens + (facts.max_tokens or 0), MAX_NEED) if facts is not None else 0


def estimated_cost(cand: Candidate, decision: Decision, facts: RequestFacts | None, speed: bool = True) -> float:
    """USD a request is expected to cost on ``cand``: its estimated prompt, and its ``max_tokens`` (else
    ``deadline.DEFAULT_COMPLETION``), at the prices ``gateway.observability.metrics`` will bill it at (a model the
    config does not name: only the upstream's ``model_prices``); 0 when unpriced or without ``facts``."""
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
    """The gateway keys' side of every request (module docstring), over ``ledger`` (a ``MemoryLedger``, or the
    replicas' ``SharedLedger``); refusals and downgrades are told to the request's recorder."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def keyed(self, rec: Recorder, key: Key, decision: Decision,
                    facts: RequestFacts | None) -> tuple[Decision, Hold, str | None]:
        """The candidates on ``key``'s tiers (:meth:`on_key_tiers`), and a reservation against its limits of one
        request, the request's need (:func:`need_of`) and its estimated cost (:func:`estimated_cost`), at the fast
        level too when the first candidate is on the fast tier or the request asks a fast ``service_tier`` of any
        upstream (speed is the fast tier, whoever sells it); a fast allowance short sends the request to the other
        tier (:meth:`off_fast`). Returns the decision, the reservation, and why the request may not have the fast
        ``service_tier`` it asked (``key_tier``, ``key_allowance``; None: it may, or asked none).

        Raises:
            KeyNotAllowed: no tier it may use serves the model (403); RateLimited, KeyOverBudget: a limit (429).
        """
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
        """``decision`` with only the candidates on the tiers ``key`` may use (:func:`key_tiers`), a first candidate
        that moved counted as a ``key_tier`` downgrade.

        Raises:
            KeyNotAllowed: no upstream on those tiers serves the request (403).
        """
        narrowed = key_tiers(key, decision)
        if narrowed.candidates[0] is not decision.candidates[0]:
            rec.key_downgraded("key_tier")
        return narrowed

    def off_fast(self, rec: Recorder, key: Key, decision: Decision, refused: Refusal) -> Decision:
        """``decision`` without its fast-tier candidates: ``key``'s fast allowance is spent (``key_allowance``;
        counted).

        Raises:
            RateLimited: only the fast tier serves the request (429 with ``retry-after``).
        """
        rest = tuple(c for c in decision.candidates if c.upstream.tier != "fast")
        if not rest:
            rec.key_refused(refused.limit)
            raise refused.fast_error(key)
        rec.key_downgraded("key_allowance")
        return dataclasses.replace(decision, candidates=rest, fallback="key_allowance")

    async def fast_allowance(self, rec: Recorder, hold: Hold, plan: Plan) -> None:
        """An attempt on the fast tier that the request's key reservation did not cover (a failover, a spillover, a
        hedge): its fast-tier allowance is reserved now.

        Raises:
            RateLimited: the allowance is spent: the attempt is passed over (``key_allowance``; counted).
        """
        if not bounded(hold.key, ("fast",)):
            return
        refused = await self.ledger.extend(hold, "fast")
        if refused is None:
            return
        rec.key_downgraded("key_allowance")
        plan.reason = plan.reason or "key_allowance"
        raise refused.fast_error(hold.key)


def refusal_outcome(exc: GatewayError) -> str:
    """The outcome label of a refusal by a request's key: ``key_limit`` (429), else ``client_error`` (403)."""
    return "key_limit" if exc.status == 429 else "client_error"


class Settles(Protocol):
    """What settles an agent session's step once its request is recorded (``gateway.admission.sessions.Sessions``)."""

    def finished(self, rec: Recorder, run: Any, done: Recorded, answered: bool) -> None: ...


class Reserved:
    """What one request holds while it is in flight, settled once when it is recorded (``settle``): the body bytes
    it holds (:class:`Held`), its key's reservation (``hold``), and the agent session step it takes (``run``, settled
    by ``sessions``)."""

    __slots__ = ("body", "hold", "run", "sessions")

    def __init__(self, budget: BodyBudget, key: Key | None) -> None:
        self.body = Held(budget, key.name if key is not None else None)
        self.hold: Hold | None = None
        self.run: Any = None
        self.sessions: Settles | None = None

    def settle(self, rec: Recorder, done: Recorded) -> None:
        """The request was recorded: its bytes are free; its key is charged what it used (without usage, a billable
        outcome keeps what it reserved, any other gives it back) on the tier that served it; its step is added to its
        session (an answer an upstream made counts)."""
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
