"""Upstream health, pure and with a fake clock: cooldown, circuit breaker, quota estimate, concurrency, weights."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from gateway.config.upstreams import UpstreamConfig
from gateway.routing.facts import Candidate
from gateway.routing.health import Health, UpstreamHealth
from gateway.routing.ratelimits import parse_reset, parse_retry_after

from conftest import LoopLag


def upstream(name: str = "u", tier: str = "fast", **kw: Any) -> UpstreamConfig:
    return UpstreamConfig.model_validate({"name": name, "tier": tier, "base_url": "http://127.0.0.1:1/v1",
                                          "models": {"m": "m"}, **kw})


@pytest.mark.parametrize(("text", "seconds"), [
    ("1.5", 1.5), ("0", 0.0), ("6m0s", 360.0), ("120ms", 0.12), ("1m19.156s", 79.156), ("10.332999999s", 10.333),
    ("2h", 7200.0), ("1h2m3s", 3723.0), ("", None), ("soon", None), ("5 minutes", None), ("3x", None),
])
def test_parse_reset_reads_openai_and_cerebras_forms(text: str, seconds: float | None) -> None:
    got = parse_reset(text)
    assert got == seconds if seconds is None else got == pytest.approx(seconds, abs=1e-6)


def test_parse_retry_after_prefers_ms_like_the_sdk() -> None:
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == pytest.approx(1.5)
    assert parse_retry_after({"retry-after": "2.5"}) == pytest.approx(2.5)
    assert parse_retry_after({"retry-after-ms": "x", "retry-after": "3"}) == pytest.approx(3.0)
    assert parse_retry_after({}) is None


def test_429_cooldown_follows_retry_after_ms_and_is_capped() -> None:
    h = UpstreamHealth(upstream(health={"cooldown_max": 10}))
    h.rate_limited({"retry-after-ms": "1500"}, now=100.0)
    assert h.unavailable(101.4, 1) == "cooldown" and h.state(101.4) == "cooldown"
    assert h.unavailable(101.6, 1) is None and h.state(101.6) == "closed"
    h.rate_limited({"retry-after": "3600"}, now=200.0)
    assert h.unavailable(209.9, 1) == "cooldown" and h.unavailable(210.1, 1) is None
    h.rate_limited({}, now=300.0)  # no hint: the default rest (1 s)
    assert h.unavailable(300.9, 1) == "cooldown" and h.unavailable(301.1, 1) is None
    assert h.failures == 0  # a 429 is not a breaker failure


def test_breaker_opens_half_opens_with_one_probe_and_closes() -> None:
    h = UpstreamHealth(upstream(health={"failures": 3, "open_seconds": 10}))
    for t in (1.0, 2.0):
        h.failure(t)
        assert h.unavailable(t, 1) is None
    h.failure(3.0)
    assert h.unavailable(3.0, 1) == "circuit_open" and h.state(5.0) == "open"
    assert h.unavailable(12.9, 1) == "circuit_open"
    assert h.unavailable(13.1, 1) is None and h.state(13.1) == "half_open"  # time for one probe
    h.start(13.1, 1)
    assert h.unavailable(13.2, 1) == "circuit_half_open"  # only one probe at a time
    h.success()
    h.finish()
    assert h.unavailable(13.3, 1) is None and h.state(13.3) == "closed"


def test_failed_probe_reopens_and_a_lost_probe_is_forgotten() -> None:
    h = UpstreamHealth(upstream(health={"failures": 1, "open_seconds": 5}))
    h.failure(0.0)
    h.start(5.5, 1)  # the probe
    h.failure(6.0)  # fails: open again, for another 5 s
    assert h.unavailable(10.9, 1) == "circuit_open" and h.unavailable(11.1, 1) is None
    h.start(11.1, 1)  # a probe that never reports back
    assert h.unavailable(15.0, 1) == "circuit_half_open"
    assert h.unavailable(16.2, 1) is None  # recovery always happens: after open_seconds, another probe


def test_quota_estimate_counts_down_and_spills_before_the_limit() -> None:
    h = UpstreamHealth(upstream(health={"quota_reserve": {"tokens": 100}}))
    h.observe_headers({"x-ratelimit-remaining-requests": "2", "x-ratelimit-reset-requests": "30s",
                       "x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "1m0s"}, now=0.0)
    assert h.unavailable(1.0, 800) is None
    assert h.unavailable(1.0, 901) == "quota_tokens"  # 1000 - 901 < reserve of 100
    h.start(1.0, 200)
    h.start(1.0, 200)
    assert h.unavailable(1.0, 10) == "quota_requests"  # both requests of the window are used by this gateway
    assert h.unavailable(30.5, 10) is None  # the requests window reset
    assert h.unavailable(30.5, 600) == "quota_tokens"  # 600 tokens left; 600 + 100 reserve is more
    assert h.unavailable(60.5, 600) is None  # the tokens window reset too


def test_a_report_is_taken_minus_what_was_sent_after_its_request() -> None:
    h = UpstreamHealth(upstream())
    first = h.start(0.0, 300)
    h.start(0.0, 200)  # sent while the first was in flight: the first's report cannot count it
    h.start(0.0, 100)
    h.observe_headers({"x-ratelimit-remaining-tokens": "5000", "x-ratelimit-reset-tokens": "1m0s",
                       "x-ratelimit-remaining-requests": "50", "x-ratelimit-reset-requests": "1m0s"}, 0.1, first)
    assert h.quota["tokens"].remaining == 5000 - 300 and h.quota["requests"].remaining == 50 - 2
    last = h.start(0.2, 50)
    h.observe_headers({"x-ratelimit-remaining-tokens": "4350"}, 0.3, last)  # nothing sent after it
    assert h.quota["tokens"].remaining == 4350
    h.observe_headers({"x-ratelimit-remaining-tokens": "9000"}, 0.4)  # no mark (an untracked caller): as reported
    assert h.quota["tokens"].remaining == 9000


def test_cerebras_day_and_minute_headers_use_the_tightest_window() -> None:
    h = UpstreamHealth(upstream())
    h.observe_headers({"x-ratelimit-limit-requests-day": "14400", "x-ratelimit-remaining-requests-day": "5",
                       "x-ratelimit-reset-requests-day": "33011.38",
                       "x-ratelimit-remaining-tokens-minute": "4000", "x-ratelimit-reset-tokens-minute": "11.38",
                       "x-ratelimit-remaining-tokens-day": "900000", "x-ratelimit-reset-tokens-day": "33011.38"}, 0.0)
    assert h.quota["requests"].remaining == 5
    assert h.quota["tokens"].remaining == 4000 and h.quota["tokens"].resets_at == pytest.approx(11.38)
    assert h.unavailable(1.0, 4001) == "quota_tokens"
    assert h.unavailable(12.0, 4001) is None


def test_concurrency_limit() -> None:
    h = UpstreamHealth(upstream(health={"max_concurrent": 2}))
    h.start(0.0, 1)
    h.start(0.0, 1)
    assert h.unavailable(0.0, 1) == "concurrency"
    h.finish()
    assert h.unavailable(0.0, 1) is None


def test_weights_shuffle_within_a_tier_and_keep_tier_order() -> None:
    a, b = upstream("a", weight=3), upstream("b", weight=1)
    s = upstream("s", tier="standard")
    health = Health([a, b, s])
    cands = (Candidate(a, "m"), Candidate(b, "m"), Candidate(s, "m"))
    random.seed(7)
    firsts = [health.order(cands)[0].upstream.name for _ in range(4000)]
    assert 0.72 < firsts.count("a") / 4000 < 0.78  # 3:1
    assert all(health.order(cands)[2].upstream.name == "s" for _ in range(100))
    equal = Health([upstream("x"), upstream("y")])
    pair = (Candidate(upstream("x"), "m"), Candidate(upstream("y"), "m"))
    assert [c.upstream.name for c in equal.order(pair)] == ["x", "y"]  # equal weights: configured order


async def test_a_request_waits_for_a_concurrency_slot_up_to_queue_seconds() -> None:
    h = UpstreamHealth(upstream(health={"max_concurrent": 1, "queue_seconds": 0.2}))
    assert h.can_queue()
    h.start(0.0, 1)
    assert h.unavailable(0.0, 1) == "concurrency"
    waiting = asyncio.ensure_future(h.wait_for_slot())
    await asyncio.sleep(0.02)
    assert not waiting.done()
    h.finish()  # the slot frees: the first waiter gets it
    assert await asyncio.wait_for(waiting, 1) is True
    h.start(0.0, 1)
    async with LoopLag() as lag:
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(h.wait_for_slot(), 5) is False  # nobody finishes: gives up after queue_seconds
        waited = asyncio.get_running_loop().time() - t0
    # after queue_seconds (0.2), not twice that: the margin is the timer's few loop turns, and a stall of the machine
    # is what LoopLag measured on the same loop
    assert 0.18 < waited < 0.2 + 0.03 + lag.seconds, (waited, lag.seconds)
    assert not UpstreamHealth(upstream(health={"max_concurrent": 1})).can_queue()


def test_a_429_with_room_left_in_every_window_refused_the_request_not_the_upstream() -> None:
    h = UpstreamHealth(upstream(health={"cooldown_default": 5}))
    left = {"x-ratelimit-remaining-tokens": "999000", "x-ratelimit-reset-tokens": "20s",
            "x-ratelimit-remaining-requests": "40"}
    # a max_tokens over what is left: refused for its size, not a reason for anyone to wait
    assert h.rate_limited(left, now=10.0, need_tokens=5_000_000) == 0.0 and h.unavailable(10.0, 100) is None
    # it would have fitted: some limit the headers do not show refused it; everyone rests the default
    assert h.rate_limited(left, now=10.0, need_tokens=1_000) == 5 and h.unavailable(12.0, 100) == "cooldown"
    h = UpstreamHealth(upstream(health={"cooldown_default": 5}))
    h.rate_limited({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "20s"}, now=10.0)
    assert h.unavailable(15.0, 100) == "cooldown"  # an empty window: everyone waits for it
    h2 = UpstreamHealth(upstream(health={"cooldown_default": 5}))
    h2.rate_limited({}, now=10.0)  # no counts at all: the default rest
    assert h2.unavailable(14.0, 1) == "cooldown"
