"""Metrics of streams of known shape land in the right buckets, read from ``/metrics`` as users see them."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import Stack, fast_directive, sample

TTFT = "tiergate_time_to_first_token_seconds"
TPOT = "tiergate_time_per_output_token_seconds"
TPS = "tiergate_output_tokens_per_second"


def _delta(before: str, after: str, name: str, **labels: str) -> float:
    """How much a series grew; the series must exist afterwards (a typo in a label cannot pass vacuously)."""
    return sample(after, name, missing_ok=False, **labels) - sample(before, name, **labels)


@pytest.mark.parametrize(("model", "tier"), [("gpt-5.6-sol-fast", "fast"), ("gpt-5.6", "standard")])
def test_known_stream_lands_in_the_right_buckets(stack: Stack, model: str, tier: str) -> None:
    # 200 tokens at 750 tokens/s after a 100 ms TTFT; the role-only chunk is sent at t=0 by the emulator
    directive = fast_directive(tokens=200, tps=750, ttft_ms=100)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    before = stack.metrics()
    chunks = list(client.chat.completions.create(model=model, stream=True,
                                                 messages=[{"role": "user", "content": directive}]))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 200
    after = stack.metrics()
    lab = {"tier": tier, "model": "gpt-5.6"}
    assert _delta(before, after, TTFT + "_count", **lab) == 1
    # TTFT is timed at the first token-bearing chunk: not the headers, not the role-only chunk at t=0
    assert _delta(before, after, TTFT + "_bucket", le="0.075", **lab) == 0
    assert _delta(before, after, TTFT + "_bucket", le="0.15", **lab) == 1
    ttft = _delta(before, after, TTFT + "_sum", **lab)
    assert 0.100 <= ttft < 0.115
    # 1.333 ms per token: above the 1.25 ms bound, inside the 1.5 ms one
    assert _delta(before, after, TPOT + "_bucket", le="0.00125", **lab) == 0
    assert _delta(before, after, TPOT + "_bucket", le="0.0015", **lab) == 1
    # the figure itself, one-sided: a scheduler delay in the emulator only slows the decode (a starved CI runner
    # once paced it at 1.40 ms), and test_accuracy holds it to 2 % of what the emulator's own clock logged
    tpot = _delta(before, after, TPOT + "_sum", **lab)
    assert 0.97 / 750 <= tpot <= 0.0015
    assert _delta(before, after, TPS + "_bucket", le="600.0", **lab) == 0
    assert _delta(before, after, TPS + "_bucket", le="1000.0", **lab) == 1
    assert _delta(before, after, "tiergate_tokens_total", token_type="output", **lab) == 200
    assert _delta(before, after, "tiergate_requests_total", outcome="success", **lab) == 1


def test_standard_pace_lands_in_the_25ms_bucket(stack: Stack) -> None:
    directive = fast_directive(tokens=12, tps=45, ttft_ms=20)  # 22.2 ms per token
    before = stack.metrics()
    httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
        "model": "gpt-5.6", "stream": True, "messages": [{"role": "user", "content": directive}]}).raise_for_status()
    after = stack.metrics()
    lab = {"tier": "standard", "model": "gpt-5.6"}
    assert _delta(before, after, TPOT + "_bucket", le="0.02", **lab) == 0
    assert _delta(before, after, TPOT + "_bucket", le="0.025", **lab) == 1
    assert _delta(before, after, TPS + "_bucket", le="40.0", **lab) == 0
    assert _delta(before, after, TPS + "_bucket", le="50.0", **lab) == 1


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
