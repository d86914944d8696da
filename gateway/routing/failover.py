"""Failover planning: which candidates to try now, what a failure means, and whether to go on. Pure code, no I/O.

The policy (``gateway.routing.policy``) lists the candidates a request may go to; this module decides, from the
upstreams' health read at an injected ``now`` (``gateway.routing.health``), which of them to try and in what order, and,
after each failed attempt, whether the next one may still serve it. The caller (``gateway.pipeline.chat``) does the I/O.

Rules (docs/routing.md#failover; docs/reference/wire.md#errors-the-gateway-answers-itself):

* **Spillover before sending.** A candidate that is resting (breaker open or half-open with its probe out, 429
  cooldown) is passed over; one whose quota estimate or concurrency limit is short is passed over too, unless
  every candidate is, then the first of them is tried anyway (the upstream is the judge). With
  ``health.queue_seconds`` a candidate at its concurrency limit is waited for instead.
* **Refusal.** When every candidate rests: 429 ``rate_limit_exceeded`` with ``retry-after`` if each is cooling
  down after a 429 of its own (``insufficient_quota`` and ``x-should-retry: false`` if each one's quota is
  exhausted), else 503 ``upstreams_resting`` with ``retry-after``.
* **Failover**, only before the first byte reached the client: after connect and timeout failures, broken or
  silent answers, 429 and 5xx, and an upstream's 401 or 403 to the gateway's own key (``upstream_auth_failed``: that
  key is the upstream's problem, another upstream has its own); after a context-length 400 only when the next
  candidate is on the other tier (whose window may be larger). Any other 4xx is the request's fault and would fail
  the same way anywhere (so is a 401 or 403 from a ``pass_client_key`` upstream: the key it refused is the client's).
"""

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
    """The candidates of one request, as they stand at the time it was planned.

    Attributes:
        candidates: those to try, in order (at most ``max_attempts``).
        reason: why the first of them is not the policy's first choice (``x-tiergate-fallback``), or None; it
            becomes the reason of the last failure as attempts fail over.
        queued: names of the candidates to wait on for a concurrency slot (``health.queue_seconds``).
        spilled: (candidate, why) for each candidate passed over now (``tiergate_spillovers_total``).
        resting: when every candidate rests (then ``candidates`` is empty), their health: :func:`refusal` is the
            answer the caller raises.
    """

    candidates: list[Candidate]
    reason: str | None = None
    queued: frozenset[str] = frozenset()
    spilled: list[tuple[Candidate, str]] = field(default_factory=list)
    resting: list[UpstreamHealth] = field(default_factory=list)

    def go_on(self, failed: Candidate, exc: GatewayError) -> bool:
        """After ``failed``'s attempt failed with ``exc``: may the next candidate still serve the request? Records
        the failure as the fallback reason when it may."""
        i = self.candidates.index(failed)
        if i + 1 >= len(self.candidates):
            return False
        if not retryable(exc, failed.upstream.tier != self.candidates[i + 1].upstream.tier):
            return False
        self.reason = reason(exc)
        return True


def plan(decision: Decision, health: Health, now: float, need_tokens: int, max_attempts: int,
         blame: Blame | None = None, keep: str | None = None, ask: Ask | None = None) -> Plan:
    """The candidates to try now for ``decision`` (module docstring: spillover and refusal).

    Args:
        now: the health clock's time (``health.clock()``); need_tokens: the request's estimated prompt plus its
            ``max_tokens`` (for the quota estimates); blame: the request's source, for the upstreams that rest for
            some sources alone (``gateway.routing.health``: whose fault), or None; keep: an upstream that weights
            never move from the front of its tier's candidates (an agent session's warm one), or None; ask: the
            request's class and warm caches, for the scheduler (``gateway.routing.scheduling``), or None.
    """
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
    """The answer when every candidate rests (module docstring), for a request from ``source``."""
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
    """Whether a failure before the first byte may go to the next candidate (module docstring: failover; an
    :class:`UpstreamAuthFailed` may, as every failure that is not the upstream's own status relayed)."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status == 429 or exc.status >= 500 or (other_tier and exc.context_overflow)
    return True


def reason(exc: GatewayError) -> str:
    """The failure as a fallback reason and ``tiergate_upstream_errors_total`` label: ``context_length``,
    ``upstream_429``, ``upstream_4xx`` / ``upstream_5xx``, or the error's own code (``upstream_timeout``,
    ``upstream_ttft_timeout``, ``upstream_stream_interrupted``, ``upstream_auth_failed``, ...)."""
    if isinstance(exc, UpstreamStatusError):
        if exc.context_overflow:
            return "context_length"
        return "upstream_429" if exc.status == 429 else f"upstream_{exc.status // 100}xx"
    return exc.code or "upstream_error"


def outcome(exc: GatewayError, blame: Blame | None = None, tried: int = 1) -> str:
    """The request's outcome label when every one of its ``tried`` attempts failed with, last, ``exc``: ``client_error``
    when each failed request-shaped on two upstreams or more (``blame``: ``gateway.routing.health``, whose fault); else
    an upstream that answered with an error status (its own, or a refused key) is ``upstream_error``."""
    if blame is not None and blame.everywhere(tried):
        return "client_error"
    if isinstance(exc, UpstreamTimeout):
        return "upstream_timeout"
    return "upstream_error" if isinstance(exc, UpstreamStatusError | UpstreamAuthFailed) else "upstream_unavailable"


def final_retry_hint(exc: GatewayError, attempts: int) -> bool:
    """Whether the answer tells the SDK not to retry (``x-should-retry: false``): the gateway already tried several
    upstreams (the SDK would multiply the attempts), or waiting will not help (an exhausted quota)."""
    return attempts > 1 or (isinstance(exc, UpstreamStatusError) and exc.quota_exhausted)
