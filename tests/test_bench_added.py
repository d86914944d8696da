"""``bench.added``'s arithmetic (docs/metrics.md#gateway-added-time): the live figures are compared with the benchmark
by drawing from the gateway's histograms, so the draws must follow a histogram's buckets, and a gateway that adds
nothing must predict exactly the direct delays."""

from __future__ import annotations

import random

from bench.added import _delta, draw, predicted, quantile


def _cumulative(counts: dict[float, int]) -> list[tuple[float, float]]:
    total, out = 0.0, []
    for le in sorted(counts):
        total += counts[le]
        out.append((le, total))
    return out


def test_draws_fall_in_the_buckets_in_proportion() -> None:
    buckets = _cumulative({0.001: 900, 0.002: 90, 0.005: 10, float("inf"): 0})
    values = draw(buckets, 20_000, random.Random(1))
    assert all(0 <= v <= 0.005 for v in values)
    share = sum(v > 0.001 for v in values) / len(values)
    assert 0.08 < share < 0.12, share
    # and histogram_quantile of the source agrees with the draws' own percentile to within a bucket's interpolation
    assert abs(sorted(values)[int(0.99 * len(values))] - quantile(buckets, 0.99)) < 0.0002


def test_a_gateway_that_adds_nothing_predicts_the_direct_delays() -> None:
    zero = [(0.000001, 5.0), (float("inf"), 5.0)]  # every observation in the first bucket: at most 1 us
    direct = [100_000, 200_000, 300_000]
    out = predicted(direct, [zero, zero], random.Random(2), n=1_000)
    assert all(any(0 <= v - d <= 2_000 for d in direct) for v in out)


def test_a_rounds_buckets_are_the_difference_of_two_scrapes() -> None:
    before = {"chunk": [(0.001, 3.0), (float("inf"), 4.0)]}
    after = {"chunk": [(0.001, 10.0), (float("inf"), 12.0)], "loop_lag": [(0.001, 2.0), (float("inf"), 2.0)]}
    assert _delta(after, before) == {"chunk": [(0.001, 7.0), (float("inf"), 8.0)],
                                     "loop_lag": [(0.001, 2.0), (float("inf"), 2.0)]}
