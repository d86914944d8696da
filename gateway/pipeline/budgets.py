"""What a request's gateway key allows it (``auth:``; ``gateway.tenancy``): the tiers it may use, and a reservation
against its limits before anything is sent, on every path that reaches an upstream (chat completions, the Responses
API and the passthrough alike). Refusals are raised; a reservation made is the request's ``ex.hold``, settled when
the request is recorded (``gateway.pipeline.exchange``).
"""

from __future__ import annotations

import dataclasses

from gateway.errors import GatewayError, KeyNotAllowed
from gateway.pipeline.exchange import Exchange
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


def estimated_cost(cand: Candidate, decision: Decision, facts: RequestFacts | None) -> float:
    """USD a request is expected to cost on ``cand``: its estimated prompt, and its ``max_tokens`` (else
    ``deadline.DEFAULT_COMPLETION``), at the prices ``gateway.observability.metrics`` will bill it at (a model the
    config does not name: only the upstream's ``model_prices``); 0 when unpriced or without ``facts``."""
    if facts is None:
        return 0.0
    up = cand.upstream
    tier = up.asks(facts.service_tier)  # what the request is sent with: what it is billed at, without an echo
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

    async def keyed(self, ex: Exchange, key: Key, decision: Decision, facts: RequestFacts | None) -> Decision:
        """The candidates on ``key``'s tiers (:meth:`on_key_tiers`), and a reservation against its limits of one
        request, the request's need (:func:`need_of`) and its estimated cost (:func:`estimated_cost`), at the fast
        level too when the first candidate is on the fast tier; a fast allowance short sends the request to the other
        tier (:meth:`off_fast`). The reservation becomes ``ex.hold``.

        Raises:
            KeyNotAllowed: no tier it may use serves the model (403); RateLimited, KeyOverBudget: a limit (429).
        """
        decision = self.on_key_tiers(ex, key, decision)
        spend = Spend(1.0, float(need_of(facts)), estimated_cost(decision.candidates[0], decision, facts))
        held = await self.ledger.reserve(key, spend, decision.candidates[0].upstream.tier == "fast")
        if isinstance(held, Refusal) and held.level == "fast":
            decision = self.off_fast(ex, key, decision, held)
            spend.usd = estimated_cost(decision.candidates[0], decision, facts)
            held = await self.ledger.reserve(key, spend, False)
        if isinstance(held, Refusal):
            ex.key_refused(held.limit)
            raise held.error(key)
        ex.hold = held
        return decision

    def on_key_tiers(self, ex: Exchange, key: Key, decision: Decision) -> Decision:
        """``decision`` with only the candidates on the tiers ``key`` may use (:func:`key_tiers`), a first candidate
        that moved counted as a ``key_tier`` downgrade.

        Raises:
            KeyNotAllowed: no upstream on those tiers serves the request (403).
        """
        narrowed = key_tiers(key, decision)
        if narrowed.candidates[0] is not decision.candidates[0]:
            ex.key_downgraded("key_tier")
        return narrowed

    def off_fast(self, ex: Exchange, key: Key, decision: Decision, refused: Refusal) -> Decision:
        """``decision`` without its fast-tier candidates: ``key``'s fast allowance is spent (``key_allowance``;
        counted).

        Raises:
            RateLimited: only the fast tier serves the request (429 with ``retry-after``).
        """
        rest = tuple(c for c in decision.candidates if c.upstream.tier != "fast")
        if not rest:
            ex.key_refused(refused.limit)
            raise refused.fast_error(key)
        ex.key_downgraded("key_allowance")
        return dataclasses.replace(decision, candidates=rest, fallback="key_allowance")

    async def fast_allowance(self, ex: Exchange, hold: Hold, plan: Plan) -> None:
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
        ex.key_downgraded("key_allowance")
        plan.reason = plan.reason or "key_allowance"
        raise refused.fast_error(hold.key)


def refusal_outcome(exc: GatewayError) -> str:
    """The outcome label of a refusal by a request's key: ``key_limit`` (429), else ``client_error`` (403)."""
    return "key_limit" if exc.status == 429 else "client_error"
