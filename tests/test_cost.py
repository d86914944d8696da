"""Cost from usage and per-upstream prices: the formula with cached tokens, unpriced requests, config validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from gateway.config.load import load_config
from gateway.errors import ConfigError
from gateway.observability.metrics import Metrics

from conftest import sample

LAB = {"tier": "fast", "upstream": "f", "model": "m"}


def _metrics() -> Metrics:
    prices = {"f": (0.35e-6, 0.10e-6, 0.75e-6)}  # USD per token: input, cached input, output
    return Metrics(CollectorRegistry(), ["m"], [("fast", "f", ["m"]), ("standard", "s", ["m"])], prices=prices)


def _record(m: Metrics, upstream: str = "f", outcome: str = "success", usage: dict[str, Any] | None = None) -> None:
    tier = "fast" if upstream == "f" else "standard"
    m.record(tier=tier, upstream=upstream, model="m", outcome=outcome, stream=True, duration=1.0, usage=usage)


def _text(m: Metrics) -> str:
    return generate_latest(m.registry).decode()


def test_cached_tokens_are_part_of_prompt_tokens_and_cost_less() -> None:
    m = _metrics()
    assert sample(_text(m), "tiergate_cost_usd_total", missing_ok=False, **LAB) == 0  # the series exists up front
    _record(m, usage={"prompt_tokens": 1000, "completion_tokens": 2000,
                      "prompt_tokens_details": {"cached_tokens": 400}})
    # (1000 - 400) * 0.35 + 400 * 0.10 + 2000 * 0.75 per million
    assert sample(_text(m), "tiergate_cost_usd_total", **LAB) == pytest.approx(1.75e-3, rel=1e-12)
    assert sample(_text(m), "tiergate_unpriced_requests_total", **LAB) == 0


def test_no_usage_or_no_prices_is_unpriced_and_failures_are_neither() -> None:
    m = _metrics()
    _record(m, usage=None)  # priced upstream, no usage
    _record(m, upstream="s", usage={"prompt_tokens": 10, "completion_tokens": 5})  # no prices for "s"
    _record(m, outcome="stream_error", usage=None)  # answered, then broke: may be billed, cannot be priced
    _record(m, outcome="upstream_error")  # never answered: no cost, not unpriced either
    m.record(tier="none", upstream="none", model="other", outcome="client_error", stream=False, duration=0.0)
    text = _text(m)
    assert sample(text, "tiergate_unpriced_requests_total", **LAB) == 2
    assert sample(text, "tiergate_unpriced_requests_total", upstream="s") == 1
    assert sample(text, "tiergate_unpriced_requests_total", upstream="none") == 0
    assert sample(text, "tiergate_cost_usd_total") == 0
    assert not [line for line in text.splitlines() if line.startswith("tiergate_cost_usd_total{")
                and 'upstream="s"' in line]  # an unpriced upstream has no cost series at all


def test_malformed_usage_details_do_not_break_recording() -> None:
    m = _metrics()
    _record(m, usage={"prompt_tokens": 10, "completion_tokens": 20, "prompt_tokens_details": [1],
                      "completion_tokens_details": "x"})
    assert sample(_text(m), "tiergate_cost_usd_total", **LAB) == pytest.approx((10 * 0.35 + 20 * 0.75) / 1e6)


def test_prices_in_the_config(tmp_path: Path) -> None:
    up = {"name": "f", "tier": "fast", "base_url": "http://127.0.0.1:1/v1", "models": {"m": "m"}}
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"upstreams": [{**up, "prices": {"input": 0.6, "output": 1.2}}]}))
    prices = load_config(path, {}).config.upstreams[0].prices
    assert prices is not None and prices.per_token() == pytest.approx((0.6e-6, 0.6e-6, 1.2e-6))  # cached = input
    path.write_text(yaml.safe_dump({"upstreams": [{**up, "prices": {"input": -1, "output": 1}}]}))
    with pytest.raises(ConfigError, match=r"upstreams\.0\.prices\.input"):
        load_config(path, {})
    path.write_text(yaml.safe_dump({"upstreams": [{**up, "prices": {"input": 1, "output": 1, "cachd": 1}}]}))
    with pytest.raises(ConfigError, match="cachd"):
        load_config(path, {})
