"""The routing policy, table-driven and pure: request facts in, tier, rule and explanation out."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.errors import ModelNotFound
from gateway.policy import Policy, RequestFacts

CONFIG = GatewayConfig.model_validate({
    "default_tier": "standard",
    "upstreams": [
        {"name": "fast-a", "tier": "fast", "base_url": "http://127.0.0.1:1/v1",
         "models": {"gpt-5.6": "wse-gpt-5.6", "qwen-coder": "qwen-3-coder"}},
        {"name": "std-a", "tier": "standard", "base_url": "http://127.0.0.1:2/v1",
         "models": {"gpt-5.6": "gpt-5.6-2026", "big-context": "big"}},
    ],
    "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"},
                "gpt-5.6-batch": {"model": "gpt-5.6", "tier": "standard"},
                "latest": {"model": "gpt-5.6"}},
})
POLICY = Policy(CONFIG)


def facts(body: dict[str, Any], headers: dict[str, str] | None = None) -> RequestFacts:
    return RequestFacts.from_request({"messages": [{"role": "user", "content": "x"}], **body}, headers or {})


@pytest.mark.parametrize(
    ("body", "headers", "tier", "rule"),
    [
        # 1. the header wins over everything
        ({"model": "gpt-5.6"}, {"x-tiergate-tier": "fast"}, "fast", "header"),
        ({"model": "gpt-5.6"}, {"x-tiergate-tier": " FAST "}, "fast", "header"),
        ({"model": "gpt-5.6-sol-fast", "service_tier": "priority"}, {"x-tiergate-tier": "standard"}, "standard",
         "header"),
        ({"model": "gpt-5.6", "metadata": {"workload": "interactive"}}, {"x-tiergate-tier": "standard"}, "standard",
         "header"),
        ({"model": "gpt-5.6"}, {"x-tiergate-tier": "turbo"}, "standard", "default"),  # not a tier: ignored
        # 2. service_tier
        ({"model": "gpt-5.6", "service_tier": "priority"}, {}, "fast", "service_tier"),
        ({"model": "gpt-5.6", "service_tier": "flex"}, {}, "standard", "service_tier"),
        ({"model": "gpt-5.6-sol-fast", "service_tier": "flex"}, {}, "standard", "service_tier"),
        ({"model": "gpt-5.6", "service_tier": "auto"}, {}, "standard", "default"),
        ({"model": "gpt-5.6", "service_tier": "default", "metadata": {"workload": "agent"}}, {}, "fast", "workload"),
        ({"model": "gpt-5.6", "service_tier": 3}, {}, "standard", "default"),
        # 3. aliases that pin a tier
        ({"model": "gpt-5.6-sol-fast"}, {}, "fast", "model_alias"),
        ({"model": "gpt-5.6-batch"}, {}, "standard", "model_alias"),
        ({"model": "gpt-5.6-sol-fast", "metadata": {"workload": "batch"}}, {}, "fast", "model_alias"),
        ({"model": "latest"}, {}, "standard", "default"),  # an alias without a tier pins nothing
        ({"model": "latest", "metadata": {"workload": "interactive"}}, {}, "fast", "workload"),
        # 4. metadata.workload
        ({"model": "gpt-5.6", "metadata": {"workload": "interactive"}}, {}, "fast", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "agent"}}, {}, "fast", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "batch"}}, {}, "standard", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "eval"}}, {}, "standard", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "background"}}, {}, "standard", "workload"),
        ({"model": "gpt-5.6", "metadata": {"workload": "INTERACTIVE"}}, {}, "standard", "default"),
        ({"model": "gpt-5.6", "metadata": {"workload": ["agent"]}}, {}, "standard", "default"),
        ({"model": "gpt-5.6", "metadata": "agent"}, {}, "standard", "default"),
        ({"model": "gpt-5.6", "metadata": {"team": "agent"}}, {}, "standard", "default"),
        # 5. default
        ({"model": "gpt-5.6"}, {}, "standard", "default"),
        ({"model": "gpt-5.6", "stream": True}, {}, "standard", "default"),
    ],
)
def test_first_matching_rule_wins(body: dict[str, Any], headers: dict[str, str], tier: str, rule: str) -> None:
    decision = POLICY.decide(facts(body, headers))
    assert (decision.tier, decision.rule) == (tier, rule)
    assert decision.reason
    assert decision.candidates[0].upstream.tier == tier
    assert decision.fallback is None
    # the earlier rules that did not match are explained, one line each
    order = ["header", "service_tier", "model_alias", "workload", "default"]
    assert len(decision.trace) == order.index(rule)


def test_candidates_are_chosen_tier_then_other_tier_with_mapped_model_ids() -> None:
    decision = POLICY.decide(facts({"model": "gpt-5.6-sol-fast"}))
    assert [(c.upstream.name, c.upstream_model) for c in decision.candidates] == [
        ("fast-a", "wse-gpt-5.6"), ("std-a", "gpt-5.6-2026")]
    assert decision.model == "gpt-5.6"


def test_model_only_on_other_tier_is_served_there_and_says_why() -> None:
    decision = POLICY.decide(facts({"model": "big-context"}, {"x-tiergate-tier": "fast"}))
    assert decision.tier == "fast"
    assert [c.upstream.name for c in decision.candidates] == ["std-a"]
    assert decision.fallback == "model_not_on_fast_tier"
    decision = POLICY.decide(facts({"model": "qwen-coder"}))
    assert [c.upstream.name for c in decision.candidates] == ["fast-a"]
    assert decision.fallback == "model_not_on_standard_tier"


def test_no_fallback_config_keeps_only_the_chosen_tier() -> None:
    policy = Policy(CONFIG.model_copy(update={"fallback": False}))
    assert [c.upstream.name for c in policy.decide(facts({"model": "gpt-5.6"})).candidates] == ["std-a"]


@pytest.mark.parametrize("model", ["gpt-9", "GPT-5.6", "wse-gpt-5.6", ""])
def test_unknown_model_is_a_404(model: str) -> None:
    with pytest.raises(ModelNotFound) as info:
        POLICY.decide(RequestFacts(model=model))
    assert info.value.status == 404 and info.value.param == "model"
