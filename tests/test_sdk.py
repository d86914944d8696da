"""The real ``openai`` SDK, sync and async, streaming and not, through the gateway to the emulated tiers."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from conftest import Stack, fast_directive, sample

QUICK = fast_directive(tokens=6, tps=2000, ttft_ms=5)


def _messages(extra: str = "") -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Say something. {QUICK} {extra}"}]


@pytest.mark.parametrize(
    ("kwargs", "headers", "tier", "rule"),
    [
        ({"model": "gpt-5.6"}, {"x-tiergate-tier": "fast"}, "fast", "header"),
        ({"model": "gpt-5.6-sol-fast"}, {"x-tiergate-tier": "standard"}, "standard", "header"),
        ({"model": "gpt-5.6", "service_tier": "priority"}, {}, "fast", "service_tier"),
        ({"model": "gpt-5.6-sol-fast", "service_tier": "flex"}, {}, "standard", "service_tier"),
        ({"model": "gpt-5.6-sol-fast"}, {}, "fast", "model_alias"),
        ({"model": "gpt-5.6", "metadata": {"workload": "interactive"}}, {}, "fast", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "agent"}}, {}, "fast", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "batch"}}, {}, "standard", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "eval"}}, {}, "standard", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "background"}}, {}, "standard", "workload"),
        ({"model": "gpt-5.6"}, {}, "standard", "default"),
    ],
)
def test_each_routing_signal_lands_on_its_tier(stack: Stack, kwargs: dict[str, Any], headers: dict[str, str],
                                               tier: str, rule: str) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(messages=_messages(), extra_headers=headers, **kwargs)
    completion = raw.parse()
    assert raw.headers["x-tiergate-tier"] == tier
    assert raw.headers["x-tiergate-rule"] == rule
    assert raw.headers["x-tiergate-upstream"] == f"emu-{tier}"
    # the upstream's model id came from the tier's model map and is relayed as the upstream returned it
    assert completion.model == {"fast": "gpt-5.6-wse", "standard": "gpt-5.6-2026-10-01"}[tier]
    assert completion.choices[0].message.content


def test_sync_stream_through_both_tiers(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    for model, tier in (("gpt-5.6-sol-fast", "fast"), ("gpt-5.6", "standard")):
        raw = client.chat.completions.with_raw_response.create(model=model, messages=_messages(), stream=True)
        assert raw.headers["x-tiergate-tier"] == tier
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in raw.headers
        assert raw.headers["cache-control"] == "no-cache"
        assert raw.headers["x-accel-buffering"] == "no"
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == " Every token leaves the gateway the"
        # the client did not ask for usage: no usage-only chunk with empty choices reaches it
        assert all(c.choices for c in chunks)


async def test_async_stream_and_nonstream(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(model="gpt-5.6-sol-fast", messages=_messages(), stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    completion = await client.chat.completions.create(model="gpt-5.6", messages=_messages())
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    await client.close()


async def test_client_asked_usage_gets_exactly_one_usage_chunk_from_openai_dialect(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(model="gpt-5.6", messages=_messages(), stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1 and usage_chunks[0].usage.completion_tokens == 6
    await client.close()


def test_request_id_kept_or_generated(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="gpt-5.6", messages=_messages(),
                                                           extra_headers={"x-request-id": "req-mine-42"})
    assert raw.headers["x-request-id"] == "req-mine-42"
    raw2 = client.chat.completions.with_raw_response.create(model="gpt-5.6", messages=_messages())
    assert raw2.headers["x-request-id"].startswith("req_") and len(raw2.headers["x-request-id"]) > 12


def test_metrics_show_per_tier_ttft_and_tokens_per_second(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    before = stack.metrics()
    # 6 tokens over 25 ms: at 2,000 tokens/s (QUICK) the emulator's 1 ms timers may deliver all six in one read,
    # and a stream whose tokens all arrive at once has no decode time to measure (nothing is recorded then)
    timed = [{"role": "user", "content": "Say something. " + fast_directive(tokens=6, tps=200, ttft_ms=5)}]
    for model in ("gpt-5.6-sol-fast", "gpt-5.6"):
        list(client.chat.completions.create(model=model, messages=timed, stream=True))
    after = stack.metrics()
    for tier in ("fast", "standard"):
        for name in ("tiergate_time_to_first_token_seconds_count", "tiergate_output_tokens_per_second_count"):
            grew = sample(after, name, tier=tier) - sample(before, name, tier=tier)
            assert grew == 1, (name, tier)
        # tokens were counted for the standard tier too: usage was requested upstream and stripped
        out = sample(after, "tiergate_tokens_total", tier=tier, token_type="output") - sample(
            before, "tiergate_tokens_total", tier=tier, token_type="output")
        assert out == 6
