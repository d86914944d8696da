"""Failover planning: which candidates to try now, in what order, and whether a failed attempt may go on to the next
(docs/routing.md#spillover, docs/routing.md#failover). Pure code over health read at an injected ``now``; the caller
(``gateway.pipeline.chat``) does the I/O."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.errors import (
    GatewayError,
    RateLimited,
    UpstreamAuthFailed,
    UpstreamsResting,
    UpstreamStatusError,
    UpstreamTimeout,
)
from gateway.routing.blame import Blame
from gateway.routing.facts import Candidate, Decision
from gateway.routing.health import SOFT_REASONS, Health, UpstreamHealth
from gateway.routing.scheduling import Ask


@dataclass
class Plan:
    """``reason``: why the first candidate is not the policy's first choice (``x-tiergate-fallback``), updated as
    attempts fail over; ``spilled``: (candidate, why) passed over; ``resting``: when every candidate rests, their
    health, for :func:`refusal`."""

    candidates: list[Candidate]
    reason: str | None = None
    queued: frozenset[str] = frozenset()
    spilled: list[tuple[Candidate, str]] = field(default_factory=list)
    resting: list[UpstreamHealth] = field(default_factory=list)

    def go_on(self, failed: Candidate, exc: GatewayError) -> bool:
        """If so, the failure becomes the fallback reason."""
        i = self.candidates.index(failed)
        if i + 1 >= len(self.candidates):
            return False
        if not retryable(exc, failed.upstream.tier != self.candidates[i + 1].upstream.tier):
            return False
        self.reason = reason(exc)
        return True


def plan(decision: Decision, health: Health, now: float, need_tokens: int, max_attempts: int,
         blame: Blame | None = None, keep: str | None = None, ask: Ask | None = None) -> Plan:
    """A resting candidate is passed over; one short of quota or concurrency (:data:`SOFT_REASONS`) too, unless none is
    usable: then the first of those is tried anyway, the upstream being the judge. ``now``: the health clock's;
    ``need_tokens``: the estimated prompt plus ``max_tokens``; ``keep``: an upstream weights never move from the front
    of its tier (an agent session's warm one)."""
    usable: list[Candidate] = []
    soft: list[Candidate] = []
    queued: set[str] = set()
    spilled: list[tuple[Candidate, str]] = []
    resting: list[UpstreamHealth] = []
    first_spill: str | None = None  # a candidate before the first usable one was passed over: the fallback reason
    for cand in health.order(decision.candidates, keep):
        h = health[cand.upstream.name]
        if ask is None:
            why = h.unavailable(now, need_tokens, blame)
        else:
            held = ask.refuses(h, need_tokens, now)  # first: asking marks the class active there, available or not
            why = h.unavailable(now, need_tokens, blame, ask.cached.get(h.name, 0)) or held
        if why == "concurrency" and h.can_queue():
            queued.add(cand.upstream.name)  # waits for a slot, then spills over if none comes in time
            why = None
        if why is None:
            usable.append(cand)
            continue
        spilled.append((cand, why))
        if not usable and first_spill is None:
            first_spill = f"spillover_{why}"
        if why in SOFT_REASONS:
            soft.append(cand)
        else:
            resting.append(h)
    if not usable and soft:
        return Plan(soft[:1], decision.fallback, spilled=spilled)
    if not usable:
        return Plan([], spilled=spilled, resting=resting)
    return Plan(usable[:max_attempts], first_spill or decision.fallback, frozenset(queued), spilled)


def refusal(resting: Sequence[UpstreamHealth], now: float, source: str | None = None) -> GatewayError:
    """429 when each candidate cools down after a 429 of its own, else 503 (docs/routing.md#failover)."""
    retry = max(1, math.ceil(min((h.resting_until(source) - now for h in resting), default=1.0)))
    headers = {"retry-after": str(retry)}
    if resting and all(h.open_until <= now and h.cooldown_until > now for h in resting):
        if all(h.exhausted for h in resting):
            return RateLimited("Every upstream for this model reported its quota exhausted; check the upstream "
                               "accounts' plans and billing.", code="insufficient_quota",
                               headers={**headers, "x-should-retry": "false"})
        return RateLimited(f"Every upstream for this model is rate-limited; retry in {retry} s.", headers=headers)
    return UpstreamsResting("Every upstream for this model is resting (circuit breaker open or rate-limit "
                            f"cooldown); retry in {retry} s.", headers=headers)


def retryable(exc: GatewayError, other_tier: bool) -> bool:
    """Before the first byte. A relayed 4xx other than 429 would fail the same anywhere (a ``pass_client_key``
    upstream's 401/403 too: the key is the client's), except a context overflow when the next candidate is on the other
    tier, whose window may be larger. Every failure of the gateway's own may go on (an :class:`UpstreamAuthFailed` too:
    another upstream has its own key)."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status == 429 or exc.status >= 500 or (other_tier and exc.context_overflow)
    return True


def reason(exc: GatewayError) -> str:
    """A fallback reason and ``tiergate_upstream_errors_total`` label."""
    if isinstance(exc, UpstreamStatusError):
        if exc.context_overflow:
            return "context_length"
        return "upstream_429" if exc.status == 429 else f"upstream_{exc.status // 100}xx"
    return exc.code or "upstream_error"


def outcome(exc: GatewayError, blame: Blame | None = None, tried: int = 1) -> str:
    """``client_error`` when each of the ``tried`` attempts failed request-shaped on two upstreams or more
    (:class:`Blame`)."""
    if blame is not None and blame.everywhere(tried):
        return "client_error"
    if isinstance(exc, UpstreamTimeout):
        return "upstream_timeout"
    return "upstream_error" if isinstance(exc, UpstreamStatusError | UpstreamAuthFailed) else "upstream_unavailable"


def final_retry_hint(exc: GatewayError, attempts: int) -> bool:
    """``x-should-retry: false``: the gateway already tried several upstreams (the SDK's retries would multiply the
    attempts), or waiting will not help (an exhausted quota)."""
    return attempts > 1 or (isinstance(exc, UpstreamStatusError) and exc.quota_exhausted)
