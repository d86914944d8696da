"""Metrics of streams of known shape land in the right buckets, read from ``/metrics`` as users see them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.utils import floatToGoString

from gateway.observability.families import TPOT_BUCKETS, TPS_BUCKETS, TTFT_BUCKETS

from conftest import Stack, fast_directive, sample

TTFT = "tiergate_time_to_first_token_seconds"
TPOT = "tiergate_time_per_output_token_seconds"
TPS = "tiergate_output_tokens_per_second"


def _delta(before: str, after: str, name: str, **labels: str) -> float:
    """How much a series grew; the series must exist afterwards (a typo in a label cannot pass vacuously)."""
    return sample(after, name, missing_ok=False, **labels) - sample(before, name, **labels)


@dataclass
class Seen:
    """One stream as the client saw it (``time.perf_counter()`` seconds): its request sent, its first and last
    token-bearing chunks received, and how many there were."""

    sent: float
    first: float
    last: float
    tokens: int


def _stream(stack: Stack, model: str, directive: str) -> Seen:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": directive}]}
    first = last = 0.0
    tokens = 0
    with httpx.Client(timeout=10) as client:
        sent = time.perf_counter()
        with client.stream("POST", stack.base_url + "/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for part in resp.iter_raw():
                if n := part.count(b'"delta":{"content":"'):  # token-bearing chunks (not the role-only one)
                    last = time.perf_counter()
                    first = first or last
                    tokens += n
    return Seen(sent, first, last, tokens)


def _bracketed(before: str, after: str, name: str, buckets: tuple[float, ...], low: float, high: float,
               **labels: str) -> None:
    """The one observation of ``name`` lies in [low, high]: none in the largest bucket below ``low``, one in the
    smallest at or above ``high`` (bucket resolution, bounds measured in the run)."""
    under = [b for b in buckets if b < low]
    if under:
        assert _delta(before, after, name + "_bucket", le=floatToGoString(under[-1]), **labels) == 0, (low, high)
    over = next(b for b in buckets if b >= high)
    assert _delta(before, after, name + "_bucket", le=floatToGoString(over), **labels) == 1, (low, high)


def _decode_bounds(seen: Seen, ttft: float, tps: float) -> tuple[float, float]:
    """Seconds per output token the gateway may have measured for a one-token-per-chunk stream the emulator paced at
    ``tps`` after ``ttft``, bounded by what the client saw. The gateway's first token came after the emulator's
    (which waited ``ttft`` after the request, itself after the client sent it) and before the client's; its last
    before the client's, and not before the emulator's schedule (``ttft`` + (n - 1) / ``tps`` after the request:
    the emulator writes on loop timers at fixed times, so a stall makes tokens late, never early)."""
    gaps = seen.tokens - 1
    high = (seen.last - seen.sent - ttft) / gaps
    low = (gaps / tps - (seen.first - seen.sent - ttft)) / gaps
    return low, high


@pytest.mark.parametrize(("model", "tier"), [("gpt-5.6-sol-fast", "fast"), ("gpt-5.6", "standard")])
def test_known_stream_lands_in_the_right_buckets(stack: Stack, model: str, tier: str) -> None:
    # 200 tokens at 750 tokens/s after a 100 ms TTFT; the role-only chunk is sent at t=0 by the emulator. Each figure
    # is bounded by what the emulator was told and what the client saw in this run, never by a wall-clock margin: a
    # busy machine only delays the client's view, and a stall of the emulator only makes its tokens late
    directive = fast_directive(tokens=200, tps=750, ttft_ms=100)
    before = stack.metrics()
    seen = _stream(stack, model, directive)
    assert seen.tokens == 200
    after = stack.metrics()
    lab = {"tier": tier, "model": "gpt-5.6"}
    assert _delta(before, after, TTFT + "_count", **lab) == 1
    # TTFT is timed at the first token-bearing chunk: not the headers, not the role-only chunk at t=0 (both would
    # be under the emulator's 100 ms), nor a later chunk (over what the client waited for the first token)
    ttft = _delta(before, after, TTFT + "_sum", **lab)
    assert 0.100 <= ttft <= seen.first - seen.sent, (ttft, seen)
    _bracketed(before, after, TTFT, TTFT_BUCKETS, 0.100, seen.first - seen.sent, **lab)
    # 1.333 ms per token (the 1.25 ms < x <= 1.5 ms bucket on a quiet machine); test_accuracy holds it to 2 % of
    # what the emulator's own clock logged
    low, high = _decode_bounds(seen, 0.100, 750)
    tpot = _delta(before, after, TPOT + "_sum", **lab)
    assert low <= tpot <= high, (low, tpot, high)
    _bracketed(before, after, TPOT, TPOT_BUCKETS, low, high, **lab)
    _bracketed(before, after, TPS, TPS_BUCKETS, 1 / high, 1 / low, **lab)
    assert _delta(before, after, "tiergate_tokens_total", token_type="output", **lab) == 200
    assert _delta(before, after, "tiergate_requests_total", outcome="success", **lab) == 1


def test_standard_pace_lands_in_the_25ms_bucket(stack: Stack) -> None:
    # 22.2 ms per token (the 20 ms < x <= 25 ms bucket, and 40 < tokens/s <= 50, on a quiet machine)
    before = stack.metrics()
    seen = _stream(stack, "gpt-5.6", fast_directive(tokens=12, tps=45, ttft_ms=20))
    after = stack.metrics()
    assert seen.tokens == 12
    lab = {"tier": "standard", "model": "gpt-5.6"}
    low, high = _decode_bounds(seen, 0.020, 45)
    assert low <= _delta(before, after, TPOT + "_sum", **lab) <= high, (low, high)
    _bracketed(before, after, TPOT, TPOT_BUCKETS, low, high, **lab)
    _bracketed(before, after, TPS, TPS_BUCKETS, 1 / high, 1 / low, **lab)


def test_stream_without_usage_counts_usage_missing_and_estimated_tokens(stack: Stack) -> None:
    directive = fast_directive(tokens=5, tps=2000, ttft_ms=2, usage="none")
    before = stack.metrics()
    httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
        "model": "gpt-5.6-sol-fast", "stream": True,
        "messages": [{"role": "user", "content": directive}]}).raise_for_status()
    after = stack.metrics()
    lab = {"tier": "fast", "model": "gpt-5.6"}
    assert _delta(before, after, "tiergate_usage_missing_total", **lab) == 1
    assert sample(after, "tiergate_tokens_total", usage="reported", **lab) == sample(
        before, "tiergate_tokens_total", usage="reported", **lab)  # nothing invented as reported
    # estimated, and said so: the five relayed token chunks, and the prompt as the gateway estimated it
    assert _delta(before, after, "tiergate_tokens_total", usage="estimated", token_type="output", **lab) == 5
    assert _delta(before, after, "tiergate_tokens_total", usage="estimated", token_type="input", **lab) > 0
    assert _delta(before, after, "tiergate_usage_estimated_total", **lab) == 1
    assert _delta(before, after, TTFT + "_count", **lab) == 1


@pytest.mark.parametrize(("model", "tier"), [("gpt-5.6-sol-fast", "fast"), ("gpt-5.6", "standard")])
def test_a_stream_without_usage_is_timed_from_its_token_chunks_marked_estimated(stack: Stack, model: str,
                                                                                tier: str) -> None:
    """An upstream that sends no usage (llama-cpp-python, even asked): its decode is timed from the relayed token
    chunks, one token each (the estimate its tokens are counted by), in the ``usage="estimated"`` series only; the
    same stream with usage, in the same run, is the yardstick."""
    lab = {"tier": tier, "model": "gpt-5.6"}

    def timed(usage: str) -> tuple[str, str]:
        extra = {"usage": "none"} if usage == "estimated" else {}
        directive = fast_directive(tokens=200, tps=750, ttft_ms=20, **extra)  # 1.333 ms per token, one per chunk
        before = stack.metrics()
        r = httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
            "model": model, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": directive}]})
        assert r.status_code == 200 and ('"usage":{' in r.text) == (usage == "reported")
        return before, stack.metrics()

    before, after = timed("estimated")
    assert _delta(before, after, "tiergate_usage_estimated_total", **lab) == 1
    for name in (TPOT, TPS):
        assert _delta(before, after, name + "_count", usage="estimated", **lab) == 1
        assert sample(after, name + "_count", usage="reported", **lab) == sample(
            before, name + "_count", usage="reported", **lab)  # nothing estimated passes as reported
    estimated = _delta(before, after, TPOT + "_sum", usage="estimated", **lab)
    assert estimated >= 0.97 / 750  # never faster than the emulator paced it (a delay only slows it)
    assert _delta(before, after, TPOT + "_bucket", le="0.00125", usage="estimated", **lab) == 0
    before, after = timed("reported")
    reported = _delta(before, after, TPOT + "_sum", usage="reported", **lab)
    assert 0.5 <= estimated / reported <= 2.0, (estimated, reported)  # the same pace, by the same clock


def test_cerebras_time_info_and_labels_are_bounded(stack: Stack) -> None:
    directive = fast_directive(tokens=4, tps=1000, ttft_ms=10)
    before = stack.metrics()
    httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
        "model": "gpt-5.6-sol-fast", "stream": True,
        "messages": [{"role": "user", "content": directive}]}).raise_for_status()
    after = stack.metrics()
    for phase in ("queue", "prompt", "completion", "total"):
        assert _delta(before, after, "tiergate_upstream_reported_seconds_count", phase=phase, tier="fast") == 1
    # labels never carry request ids or raw client values
    assert "req_" not in after and "chatcmpl" not in after


def test_every_family_of_the_table_is_an_attribute_of_its_kind() -> None:
    """The families table (gateway.observability.families) is what Metrics builds: each row an attribute of the kind
    its annotation says, registered under its name."""
    from prometheus_client import CollectorRegistry

    from gateway.observability.families import FAMILIES, PREFIX
    from gateway.observability.metrics import Metrics

    registry = CollectorRegistry()
    metrics = Metrics(registry, [], [])
    names = {m.name for m in registry.collect()}
    for family in FAMILIES:
        assert isinstance(getattr(metrics, family.attr), family.kind)
        assert Metrics.__annotations__[family.attr] == family.kind.__name__
        assert f"{PREFIX}_{family.name}" in names
    assert len({f.attr for f in FAMILIES}) == len(FAMILIES) == len(Metrics.__annotations__)


def test_the_lock_free_families_expose_what_prometheus_clients_own_do() -> None:
    """``gateway.observability.values``: the same observations through prometheus-client's Histogram, Counter and Gauge
    and through the gateway's lock-free ones give the same exposition, bucket bounds, NaN and refusals included."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from gateway.observability import values

    assert values.kind(Histogram) is values.LoopHistogram  # this process is not in multiprocess mode
    buckets = (0.001, 0.01, 0.1, 1.0)
    seen = [0.0, -1.0, 0.001, 0.0010001, 0.01, 0.5, 1.0, 1.5, 1e9, float("inf"), float("nan"), 0.0999]
    texts = []
    for hist, counter, gauge in ((Histogram, Counter, Gauge),
                                 (values.LoopHistogram, values.LoopCounter, values.LoopGauge)):
        reg = CollectorRegistry()
        h = hist("t_seconds", "h", ("tier",), buckets=buckets, registry=reg).labels("fast")
        c = counter("t_requests", "c", ("tier",), registry=reg).labels("fast")
        g = gauge("t_in_flight", "g", ("tier",), registry=reg).labels("fast")
        for x in seen:
            h.observe(x)
        c.inc()
        c.inc(2.5)
        with pytest.raises(ValueError):
            c.inc(-1)
        g.inc(3)
        g.dec()
        g.set(7)
        g.inc(0.5)
        for parent, use in ((h, "observe"), (c, "inc"), (g, "inc"), (g, "dec"), (g, "set")):
            with pytest.raises(ValueError, match="missing label values"):  # a labelled parent is refused alike
                getattr(type(parent)("t_parent_" + use, "p", ("tier",), registry=CollectorRegistry()), use)(1)
        texts.append(b"\n".join(line for line in generate_latest(reg).splitlines() if b"_created" not in line))
    assert texts[0] == texts[1]
    for gauge in (Gauge, values.LoopGauge):  # a mostrecent gauge is only set, in one process as under --workers
        with pytest.raises(RuntimeError):
            gauge("t_est", "g", registry=CollectorRegistry(), multiprocess_mode="mostrecent").inc()
    assert b't_seconds_bucket{le="0.001",tier="fast"} 3.0' in texts[1]  # 0, -1 and the bound itself
