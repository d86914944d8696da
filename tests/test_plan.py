"""Failover planning (``gateway.routing.failover``), pure and with a fake clock: which candidates to try, the refusal
when every one rests, whether a failure may go to the next, and how an attempt's verdict reaches health."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.schema import GatewayConfig
from gateway.errors import (
    GatewayError,
    RateLimited,
    UpstreamBadResponse,
    UpstreamsResting,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    upstream_error,
)
from gateway.routing import failover
from gateway.routing.facts import RequestFacts
from gateway.routing.health import Health
from gateway.routing.policy import Policy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(**health: Any) -> tuple[Policy, Health, Clock]:
    ups = [{"name": name, "tier": tier, "base_url": "http://127.0.0.1:1/v1", "models": {"m": "m"},
            "health": {"failures": 2, "open_seconds": 10, **health}}
           for name, tier in (("f1", "fast"), ("f2", "fast"), ("s1", "standard"))]
    cfg = GatewayConfig.model_validate({"upstreams": ups, "aliases": {"m-fast": {"model": "m", "tier": "fast"}}})
    clock = Clock()
    return Policy(cfg), Health(cfg.upstreams, clock), clock


def _plan(policy: Policy, health: Health, clock: Clock, need: int = 10, max_attempts: int = 3) -> failover.Plan:
    decision = policy.decide(RequestFacts({"model": "m-fast", "messages": []}, {}))
    return failover.plan(decision, health, clock(), need, max_attempts)


def _names(plan: failover.Plan) -> list[str]:
    return [c.upstream.name for c in plan.candidates]


def test_healthy_candidates_in_policy_order_capped_by_max_attempts() -> None:
    policy, health, clock = _setup()
    plan = _plan(policy, health, clock)
    assert _names(plan) == ["f1", "f2", "s1"] and plan.reason is None and not plan.resting
    assert _names(_plan(policy, health, clock, max_attempts=2)) == ["f1", "f2"]


def test_a_resting_candidate_is_passed_over_and_named_as_the_reason() -> None:
    policy, health, clock = _setup()
    for _ in range(2):
        health["f1"].failure(clock())  # two failures open f1's breaker
    plan = _plan(policy, health, clock)
    assert _names(plan) == ["f2", "s1"] and plan.reason == "spillover_circuit_open"
    assert [(c.upstream.name, why) for c, why in plan.spilled] == [("f1", "circuit_open")]
    clock.now += 10  # open_seconds later the breaker half-opens: one probe goes through
    assert _names(_plan(policy, health, clock)) == ["f1", "f2", "s1"]


def test_a_spill_after_a_usable_candidate_is_not_the_reason() -> None:
    policy, health, clock = _setup()
    health["f2"].rate_limited({"retry-after": "5"}, clock())
    plan = _plan(policy, health, clock)
    assert _names(plan) == ["f1", "s1"] and plan.reason is None  # f1, the first choice, still serves


def test_only_soft_reasons_left_tries_the_first_anyway() -> None:
    policy, health, clock = _setup(max_concurrent=1)
    for name in ("f1", "f2", "s1"):
        health[name].start(clock(), 1)  # every one at its concurrency limit
    plan = _plan(policy, health, clock)
    assert _names(plan) == ["f1"] and not plan.resting  # the upstream is the judge


def test_a_concurrency_limit_with_queue_seconds_is_waited_on() -> None:
    policy, health, clock = _setup(max_concurrent=1, queue_seconds=0.5)
    health["f1"].start(clock(), 1)
    plan = _plan(policy, health, clock)
    assert _names(plan) == ["f1", "f2", "s1"] and plan.queued == frozenset({"f1"})


@pytest.mark.parametrize(("setup", "status", "code"), [
    ("cooldown", 429, "rate_limit_exceeded"),
    ("exhausted", 429, "insufficient_quota"),
    ("breaker", 503, "upstreams_resting"),
    ("mixed", 503, "upstreams_resting"),
])
def test_every_candidate_resting_is_refused(setup: str, status: int, code: str) -> None:
    policy, health, clock = _setup()
    for name in ("f1", "f2", "s1"):
        h = health[name]
        if setup == "cooldown" or (setup == "mixed" and name != "s1"):
            h.rate_limited({"retry-after": "4"}, clock())
        elif setup == "exhausted":
            h.rate_limited({}, clock(), exhausted=True)
        else:
            h.failure(clock())
            h.failure(clock())
    plan = _plan(policy, health, clock)
    assert plan.candidates == [] and plan.resting
    refused = failover.refusal(plan.resting, clock())
    assert (refused.status, refused.code) == (status, code)
    assert isinstance(refused, RateLimited if status == 429 else UpstreamsResting)
    assert int(refused.headers["retry-after"]) >= 1
    assert (refused.headers.get("x-should-retry") == "false") == (setup == "exhausted")


def _status(status: int, body: bytes = b"{}") -> UpstreamStatusError:
    return upstream_error(status, body, {})


OVERFLOW = (b'{"error":{"message":"This model\'s maximum context length is 8192 tokens",'
            b'"code":"context_length_exceeded"}}')


@pytest.mark.parametrize(("exc", "same_tier", "other_tier", "reason"), [
    (UpstreamUnavailable("refused"), True, True, "upstream_unavailable"),
    (UpstreamTimeout("slow", code="upstream_ttft_timeout"), True, True, "upstream_ttft_timeout"),
    (UpstreamBadResponse("html"), True, True, "upstream_bad_response"),
    (_status(429), True, True, "upstream_429"),
    (_status(503), True, True, "upstream_5xx"),
    (_status(400), False, False, "upstream_4xx"),
    (_status(400, OVERFLOW), False, True, "context_length"),
    (_status(500, b'{"error":{"code":500,"message":"request (9120 tokens) exceeds the available context size"}}'),
     False, True, "context_length"),
])
def test_which_failures_may_go_on(exc: GatewayError, same_tier: bool, other_tier: bool, reason: str) -> None:
    assert failover.retryable(exc, other_tier=False) is same_tier
    assert failover.retryable(exc, other_tier=True) is other_tier
    assert failover.reason(exc) == reason


def test_go_on_follows_the_candidates_and_records_the_reason() -> None:
    policy, health, clock = _setup()
    plan = _plan(policy, health, clock)
    f1, f2, s1 = plan.candidates
    assert plan.go_on(f1, _status(503)) and plan.reason == "upstream_5xx"
    assert not plan.go_on(f1, _status(400, OVERFLOW))  # f2 is on the same tier: its window is no larger
    assert plan.reason == "upstream_5xx"
    assert plan.go_on(f2, _status(400, OVERFLOW)) and plan.reason == "context_length"  # s1: the other tier
    assert not plan.go_on(s1, _status(503))  # the last one: nothing to go on to


def test_outcome_and_the_final_retry_hint() -> None:
    assert failover.outcome(UpstreamTimeout("x")) == "upstream_timeout"
    assert failover.outcome(_status(502)) == "upstream_error"
    assert failover.outcome(UpstreamUnavailable("x")) == "upstream_unavailable"
    quota = _status(429, b'{"error":{"type":"insufficient_quota","message":"You exceeded your current quota"}}')
    assert failover.final_retry_hint(quota, 1) and failover.final_retry_hint(_status(503), 2)
    assert not failover.final_retry_hint(_status(503), 1)


@pytest.mark.parametrize(("exc", "state", "failures"), [
    (None, "closed", 0),
    (_status(503), "closed", 1),
    (UpstreamTimeout("x"), "closed", 1),
    (_status(400), "closed", 0),
    (_status(429), "cooldown", 0),
    (_status(500, b'{"error":{"code":500,"message":"request exceeds the available context size"}}'), "closed", 0),
])
def test_an_attempts_verdict_reaches_health_once(exc: GatewayError | None, state: str, failures: int) -> None:
    _, health, clock = _setup()
    h = health["f1"]
    h.failures = 0
    h.settle(exc, clock())
    assert h.state(clock()) == state and h.failures == failures
