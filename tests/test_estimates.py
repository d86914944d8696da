"""Unit tests of the live estimates and the deadline choice, on synthetic series and plain values (no I/O, no clock:
every time is passed in)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.routes import RouteConfig
from gateway.config.schema import GatewayConfig
from gateway.errors import InvalidRequest
from gateway.observability.estimates import Estimates, quantile
from gateway.routing.deadline import DEFAULT_COMPLETION, Budget, Explorer, budget, choose, describe, headers
from gateway.routing.facts import RequestFacts
from gateway.routing.policy import Policy


def test_quantile_interpolates_between_ranks_like_numpy() -> None:
    assert quantile([1.0], 0.9) == 1.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)


def test_an_unmeasured_series_is_none_and_one_sample_makes_an_estimate() -> None:
    est = Estimates(window=10, samples=8)
    assert est.latency("fast", "m", 0.0) is None
    est.observe_stream("fast", "m", 1.0, prompt_tokens=100, ttft=0.05, speed=700.0)
    lat = est.latency("fast", "m", 1.5)
    assert lat is not None and lat.samples == 1
    assert lat.ttft(100) == pytest.approx(0.05)
    assert lat.decode(101) == pytest.approx(100 / 700)
    assert lat.age(1.5) == pytest.approx(0.5) and lat.age(31.0) == pytest.approx(30.0)  # read at a time


def test_samples_age_out_of_the_window_and_the_estimate_goes_unmeasured() -> None:
    est = Estimates(window=5, samples=64)
    for i in range(5):
        est.observe_stream("fast", "m", float(i), prompt_tokens=100, ttft=0.05)
    assert est.latency("fast", "m", 5.0) is not None
    assert est.latency("fast", "m", 8.5).samples == 1  # type: ignore[union-attr]  # only t=4 is younger than 5 s
    assert est.latency("fast", "m", 9.5) is None
    est.observe_stream("fast", "m", 10.0, prompt_tokens=100, ttft=0.07)  # traffic refreshes it
    assert est.latency("fast", "m", 10.0).ttft(100) == pytest.approx(0.07)  # type: ignore[union-attr]


def test_a_step_change_moves_the_tail_within_the_sample_window() -> None:
    """TTFT steps from 50 ms to 3 s: the p90 follows as the new samples become a tenth of the window, the median once
    they are half; with a sample bound of 8 the old regime is gone after 8 new samples."""
    est = Estimates(window=1000, samples=8)
    for i in range(8):
        est.observe_stream("fast", "m", float(i), prompt_tokens=100, ttft=0.05)
    tails = []
    for i in range(8):
        est.observe_stream("fast", "m", 10.0 + i, prompt_tokens=100, ttft=3.0)
        lat = est.latency("fast", "m", 10.0 + i)
        assert lat is not None
        tails.append((round(lat.ttft(100, tail=False), 3), round(lat.ttft(100), 3)))
    assert tails[0][1] > 0.9  # one slow sample in eight already lifts the p90 by almost a third of the step
    assert tails[1][1] == pytest.approx(3.0)  # two: the p90 is the new regime
    assert tails[1][0] == pytest.approx(0.05)  # the median is not fooled by two
    assert tails[4][0] == pytest.approx(3.0)
    assert tails[7] == (3.0, 3.0)


def test_ttft_grows_with_the_prompt_size() -> None:
    """Prefill: TTFT = 40 ms + 0.2 ms per prompt token, with noise; the fitted line predicts a size it never saw."""
    est = Estimates(window=1000, samples=64)
    noise = [0.004, -0.003, 0.001, 0.0, -0.002, 0.003, -0.001, 0.002]
    for i in range(40):
        prompt = 200 + 100 * (i % 20)
        est.observe_stream("fast", "m", float(i), prompt_tokens=prompt, ttft=0.04 + 0.0002 * prompt + noise[i % 8])
    lat = est.latency("fast", "m", 40.0)
    assert lat is not None
    assert lat.per_token == pytest.approx(0.0002, rel=0.05)
    assert lat.ttft(5000, tail=False) == pytest.approx(1.04, rel=0.02)
    assert lat.ttft(5000) >= lat.ttft(5000, tail=False)
    assert lat.ttft(100) < lat.ttft(1000) < lat.ttft(10000)


def test_a_flat_series_has_no_slope_and_a_falling_one_is_clamped() -> None:
    est = Estimates(window=1000, samples=64)
    for i in range(10):
        est.observe_stream("a", "m", float(i), prompt_tokens=500, ttft=0.1 + 0.01 * (i % 3))
        est.observe_stream("b", "m", float(i), prompt_tokens=100 * (i + 1), ttft=1.0 - 0.05 * i)
    assert est.latency("a", "m", 10.0).per_token == 0.0  # type: ignore[union-attr]
    assert est.latency("b", "m", 10.0).per_token == 0.0  # type: ignore[union-attr]


def test_a_narrow_span_of_prompt_sizes_fits_no_slope() -> None:
    """25-35-token prompts on a flat-TTFT upstream with noise: no slope, so a 20k-token prompt is not predicted from
    the noise (a fresh user saw 2 s predicted for an upstream whose TTFT is a flat 0.4 s)."""
    est = Estimates(window=1000, samples=64)
    for i in range(30):
        est.observe_stream("std", "m", float(i), prompt_tokens=25 + i % 11, ttft=0.4 + (0.003 if i % 11 > 5 else 0.0))
    lat = est.latency("std", "m", 30.0)
    assert lat is not None and lat.per_token == 0.0
    assert lat.ttft(20000) == pytest.approx(0.403, abs=0.002)


def test_decode_speed_tail_is_the_slow_side_and_completion_lengths_per_route() -> None:
    est = Estimates(window=1000, samples=64)
    for i, tps in enumerate([700, 720, 740, 760, 300, 710, 730, 750, 705, 715]):
        est.observe_stream("fast", "m", float(i), prompt_tokens=10, ttft=0.05, speed=float(tps))
    lat = est.latency("fast", "m", 10.0)
    assert lat is not None and lat.speed is not None
    assert lat.speed.tail < lat.speed.central
    assert lat.speed.tail == pytest.approx(quantile(sorted([700, 720, 740, 760, 300, 710, 730, 750, 705, 715]), 0.1))
    for i, n in enumerate(range(100, 200, 10)):
        est.observe_length("workload", "m", float(i), n)
    length = est.completion("workload", "m", 10.0)
    assert length is not None and length.central == pytest.approx(145) and length.tail == pytest.approx(181)
    assert est.completion("default", "m", 10.0) is None


def test_the_cached_summary_follows_new_samples() -> None:
    est = Estimates(window=1000, samples=64)
    est.observe_stream("fast", "m", 0.0, prompt_tokens=10, ttft=0.05)
    first = est.latency("fast", "m", 0.0)
    assert est.latency("fast", "m", 0.1) is first  # cached: nothing changed
    est.observe_stream("fast", "m", 0.2, prompt_tokens=10, ttft=0.5)
    assert est.latency("fast", "m", 0.2) is not first


def test_a_busy_series_is_recomputed_at_most_every_refresh_interval() -> None:
    """Samples arriving faster than REFRESH (0.1 s) are summarised within 0.1 s, not on every read."""
    est = Estimates(window=1000, samples=64)
    est.observe_stream("fast", "m", 0.0, prompt_tokens=10, ttft=0.05)
    first = est.latency("fast", "m", 0.0)
    est.observe_stream("fast", "m", 0.05, prompt_tokens=10, ttft=3.0)
    assert est.latency("fast", "m", 0.06) is first
    later = est.latency("fast", "m", 0.11)
    assert later is not first and later is not None and later.samples == 2


def test_snapshot_is_json_shaped() -> None:
    est = Estimates(window=60, samples=16)
    est.observe_stream("fast", "m", 0.0, prompt_tokens=10, ttft=0.05, speed=700)
    est.observe_length("default", "m", 0.0, 50)
    snap = est.snapshot(1.0)
    assert snap["latency"][0]["upstream"] == "fast" and snap["latency"][0]["measured"]
    assert snap["latency"][0]["tokens_per_second"]["p50"] == 700
    assert snap["completion_tokens"][0]["p50"] == 50
    assert est.snapshot(100.0)["latency"][0] == {"upstream": "fast", "model": "m", "measured": False}


# the deadline choice

def _policy(**route: Any) -> Policy:
    cfg = GatewayConfig.model_validate({
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": "http://x/v1", "models": {"m": "m-fast"},
             "prices": {"input": 2.0, "output": 8.0}},
            {"name": "std", "tier": "standard", "base_url": "http://y/v1", "models": {"m": "m"},
             "prices": {"input": 1.0, "output": 4.0}},
        ],
        "rules": [{"name": "agent", "match": {"metadata": {"workload": ["agent"]}},
                   "route": {"tier": "fast", **route}}],
    })
    return Policy(cfg)


def _facts(headers: dict[str, str] | None = None, **body: Any) -> RequestFacts:
    b = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], **body}
    return RequestFacts(b, headers or {}, 400)


def _measured(fast_ttft: float = 0.05, std_ttft: float = 0.4, fast_tps: float = 750, std_tps: float = 50) -> Estimates:
    est = Estimates(window=60, samples=16)
    for i in range(4):
        est.observe_stream("fast", "m-fast", float(i), prompt_tokens=100, ttft=fast_ttft, speed=fast_tps)
        est.observe_stream("std", "m", float(i), prompt_tokens=100, ttft=std_ttft, speed=std_tps)
    return est


NEVER = Explorer(0.0, 1e9)


def test_no_budget_changes_nothing() -> None:
    policy = _policy()
    facts = _facts(metadata={"workload": "agent"})
    assert budget(facts, policy.decide(facts).route) is None


def test_the_budget_comes_from_header_then_metadata_then_rule() -> None:
    policy = _policy(deadline_ms=5000, ttft_deadline_ms=900)
    f = _facts({"x-tiergate-deadline-ms": "1500"}, metadata={"workload": "agent", "ttft_deadline_ms": "300"})
    b = budget(f, policy.decide(f).route)
    assert b == Budget(1.5, 0.3, "header+metadata")
    f = _facts(metadata={"workload": "agent"})
    assert budget(f, policy.decide(f).route) == Budget(5.0, 0.9, "rule")


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", ""])
def test_a_bad_budget_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        budget(_facts({"x-tiergate-deadline-ms": value}), None)
    assert err.value.param == "x-tiergate-deadline-ms" and err.value.status == 400
    with pytest.raises(InvalidRequest) as err:
        budget(_facts(metadata={"deadline_ms": value or []}), None)
    assert err.value.param == "metadata.deadline_ms"


def test_the_cheapest_that_meets_the_budget_wins() -> None:
    """Both meet a generous budget: the standard tier is cheaper, so it serves, and says so with the numbers."""
    policy = _policy()
    f = _facts(metadata={"workload": "agent"}, max_tokens=20)
    d = policy.decide(f)
    c = choose(d, f, Budget(5.0, None, "header"), _measured(), 10.0, NEVER)
    assert c.verdict == "meets" and c.candidates[0].upstream.name == "std" and c.fallback == "deadline"
    std = c.of("std")
    assert std is not None and std.total == pytest.approx(0.4 + 19 / 50)
    assert (b"x-tiergate-predicted-ms", b"780") in headers(c, "std")
    assert "cheapest" in describe(c) and "std" in describe(c)


def test_only_the_fast_tier_meets_a_tight_budget() -> None:
    policy = _policy()
    f = _facts(metadata={"workload": "agent"}, max_tokens=100)
    d = policy.decide(f)
    c = choose(d, f, Budget(1.5, None, "header"), _measured(), 10.0, NEVER)
    assert c.verdict == "meets" and c.candidates[0].upstream.name == "fast" and c.fallback is None
    assert [x.upstream.name for x in c.candidates] == ["fast", "std"]  # the rest stays for failover
    assert c.of("std").meets is False  # type: ignore[union-attr]


def test_when_none_meets_the_fastest_wins() -> None:
    policy = _policy()
    f = _facts(metadata={"workload": "agent"}, max_tokens=100)
    c = choose(policy.decide(f), f, Budget(1.5, None, "header"), _measured(fast_ttft=3.0), 10.0, NEVER)
    assert c.verdict == "fastest" and c.candidates[0].upstream.name == "std"  # 2.4 s against 3.13 s
    c = choose(policy.decide(f), f, Budget(0.01, None, "header"), _measured(), 10.0, NEVER)
    assert c.verdict == "fastest" and c.candidates[0].upstream.name == "fast"


def test_a_ttft_budget_alone_compares_first_tokens() -> None:
    policy = _policy()
    f = _facts(metadata={"workload": "agent"})
    c = choose(policy.decide(f), f, Budget(None, 0.2, "header"), _measured(), 10.0, NEVER)
    assert c.verdict == "meets" and c.candidates[0].upstream.name == "fast"
    c = choose(policy.decide(f), f, Budget(None, 1.0, "header"), _measured(), 10.0, NEVER)
    assert c.candidates[0].upstream.name == "std"  # both meet: the cheaper


def test_completion_length_without_max_tokens_comes_from_the_route() -> None:
    policy = _policy()
    f = _facts(metadata={"workload": "agent"})
    est = _measured()
    c = choose(policy.decide(f), f, Budget(2.0, None, "header"), est, 10.0, NEVER)
    assert c.completion == DEFAULT_COMPLETION and c.completion_source == "default"
    for i in range(5):
        est.observe_length("agent", "m", float(i), 20)
    c = choose(policy.decide(f), f, Budget(2.0, None, "header"), est, 10.0, NEVER)
    assert c.completion == 20 and c.completion_source == "measured"
    assert c.candidates[0].upstream.name == "std"  # 20 tokens at 50/s fit in 2 s: the cheaper tier


def test_an_unmeasured_candidate_is_probed_once_per_interval() -> None:
    policy = _policy()
    f = _facts(metadata={"workload": "agent"}, max_tokens=100)
    est = Estimates(window=60, samples=16)
    for i in range(4):
        est.observe_stream("std", "m", float(i), prompt_tokens=100, ttft=0.4, speed=50)
    explorer = Explorer(0.0, probe=5.0)
    c = choose(policy.decide(f), f, Budget(1.5, None, "header"), est, 10.0, explorer)
    assert c.verdict == "probe" and c.candidates[0].upstream.name == "fast"
    c = choose(policy.decide(f), f, Budget(1.5, None, "header"), est, 11.0, explorer)
    assert c.verdict == "fastest" and c.candidates[0].upstream.name == "std"
    c = choose(policy.decide(f), f, Budget(1.5, None, "header"), est, 15.5, explorer)
    assert c.verdict == "probe"


def test_a_share_of_requests_explores_a_candidate_predicted_too_slow() -> None:
    policy = _policy()
    f = _facts(metadata={"workload": "agent"}, max_tokens=100)
    est = _measured(fast_ttft=3.0)
    explorer = Explorer(0.25, probe=1e9)
    chosen = [choose(policy.decide(f), f, Budget(1.5, None, "header"), est, 10.0, explorer) for _ in range(8)]
    verdicts = [c.verdict for c in chosen]
    assert verdicts.count("explore") == 2 and verdicts[3] == "explore" and verdicts[7] == "explore"
    assert all(c.candidates[0].upstream.name == "fast" for c in chosen if c.verdict == "explore")


def test_route_config_validates_hedge_and_deadlines() -> None:
    assert RouteConfig(tier="fast", hedge="p95").hedge == "p95"
    assert RouteConfig(tier="fast", hedge=0.25).hedge == 0.25
    for bad in ({"hedge": 0}, {"hedge": "p99"}, {"deadline_ms": 0}, {"ttft_deadline_ms": -1}):
        with pytest.raises(ValueError):
            RouteConfig.model_validate({"tier": "fast", **bad})


def test_a_huge_integer_budget_is_a_400_not_a_crash() -> None:
    with pytest.raises(InvalidRequest) as err:
        budget(_facts(metadata={"deadline_ms": 10 ** 400}), None)
    assert err.value.param == "metadata.deadline_ms"
    with pytest.raises(InvalidRequest):
        budget(_facts({"x-tiergate-deadline-ms": "1e400"}), None)


def test_a_cached_estimate_still_ages_so_exploration_fires() -> None:
    """The summary is cached for the window; its age is read against the time of the choice, so a candidate nobody
    measures becomes explorable once its newest sample is older than ``fresh``."""
    policy = _policy()
    f = _facts(metadata={"workload": "agent"}, max_tokens=100)
    est = _measured(fast_ttft=3.0)  # samples at t = 0..3
    explorer = Explorer(1.0, probe=1e9, fresh=1.0)
    est.latency("fast", "m-fast", 3.0)  # cached at t = 3.0
    c = choose(policy.decide(f), f, Budget(1.5, None, "header"), est, 3.5, explorer)
    assert c.verdict == "fastest"  # sampled 0.5 s ago: other traffic measures it, no exploring
    est.observe_stream("std", "m", 5.9, prompt_tokens=100, ttft=0.4, speed=50)  # the chosen one keeps being measured
    c = choose(policy.decide(f), f, Budget(1.5, None, "header"), est, 6.0, explorer)
    assert c.verdict == "explore" and c.candidates[0].upstream.name == "fast"


def test_a_model_on_one_tier_is_not_moved_by_the_deadline() -> None:
    """The rule says standard but only the fast tier serves the model: the policy's own fallback stands, the deadline
    moved nothing (it must not claim ``deadline``)."""
    cfg = GatewayConfig.model_validate({"upstreams": [
        {"name": "fast", "tier": "fast", "base_url": "http://x/v1", "models": {"solo": "solo"}},
        {"name": "std", "tier": "standard", "base_url": "http://y/v1", "models": {"m": "m"}}]})
    policy = Policy(cfg)
    f = RequestFacts({"model": "solo", "messages": []}, {"x-tiergate-deadline-ms": "1500"}, 100)
    d = policy.decide(f)
    assert d.tier == "standard" and d.fallback == "model_not_on_standard_tier"
    est = Estimates(60, 16)
    est.observe_stream("fast", "solo", 0.0, prompt_tokens=25, ttft=0.05, speed=750)
    c = choose(d, f, Budget(1.5, None, "header"), est, 1.0, NEVER)
    assert c.candidates[0].upstream.name == "fast" and c.fallback == "model_not_on_standard_tier"
