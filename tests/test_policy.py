"""The routing policy, table-driven and pure: request facts in, tier, rule and explanation out."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.schema import GatewayConfig
from gateway.errors import ModelNotFound
from gateway.routing.facts import RequestFacts
from gateway.routing.policy import Policy

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
    return RequestFacts({"messages": [{"role": "user", "content": "x"}], **body}, headers or {})


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
    decision = POLICY.decide(facts(body, headers), explain=True)
    assert (decision.tier, decision.rule) == (tier, rule)
    assert decision.reason
    assert decision.candidates[0].upstream.tier == tier
    assert decision.fallback is None
    # every earlier rule that did not match is explained, one line each, in order
    names = [r.name for r in POLICY.rules]
    tried = decision.index - 1 if decision.index else len(names)
    assert len(decision.trace) == tried
    assert all(f"'{name}'" in line for name, line in zip(names, decision.trace, strict=False))
    assert decision.index == 0 or names[decision.index - 1] == rule


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
        POLICY.decide(RequestFacts({"model": model}, {}))
    assert info.value.status == 404 and info.value.param == "model"


RULES = GatewayConfig.model_validate({
    "default_tier": "fast",
    "long_prompt_tokens": 1000,
    "upstreams": [
        {"name": "fast-a", "tier": "fast", "base_url": "http://127.0.0.1:1/v1", "context_window": 8192,
         "modalities": ["text"], "models": {"gpt-5.6": "wse", "coder": "qwen"}},
        {"name": "fast-b", "tier": "fast", "base_url": "http://127.0.0.1:3/v1", "models": {"gpt-5.6": "wse-b"}},
        {"name": "std-a", "tier": "standard", "base_url": "http://127.0.0.1:2/v1",
         "models": {"gpt-5.6": "gpt", "coder": "gpt-coder"}},
    ],
    "rules": [
        {"name": "ci-bots", "match": {"user_agent": {"regex": "(?i)github-actions|jenkins"}},
         "route": {"tier": "standard", "fallback": False}},
        {"name": "team-header", "match": {"headers": {"x-team": {"prefix": "search-"}}},
         "route": {"tier": "fast", "upstream": "fast-b"}},
        {"name": "forced-tools", "match": {"tools": True, "tool_choice": ["required", "function"]},
         "route": {"tier": "fast"}},
        {"name": "vision", "match": {"images": True}, "route": {"tier": "standard"}},
        {"name": "voice", "match": {"audio": True}, "route": {"tier": "standard"}},
        {"name": "bulk", "match": {"n": {"gte": 2}}, "route": {"tier": "standard"}},
        {"name": "long-output", "match": {"max_tokens": {"gt": 4000}}, "route": {"tier": "standard"}},
        {"name": "big-prompt", "match": {"prompt_tokens": {"gt": 1000}}, "route": {"tier": "standard"}},
        {"name": "coder-models", "match": {"model": "cod*"}, "route": {"tier": "fast"}},
        {"name": "offline", "match": {"stream": False, "metadata": {"priority": ["low", "bulk"]}},
         "route": {"tier": "standard"}},
        {"name": "evals", "match": {"metadata": {"workload": "eval"}}, "route": {"tier": "standard"}},
    ],
})
RULES_POLICY = Policy(RULES)
IMAGE = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
AUDIO = {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("body", "headers", "size", "tier", "rule", "explains"),
    [
        ({"model": "gpt-5.6"}, {"user-agent": "GitHub-Actions/2.3"}, 0, "standard", "ci-bots", "user-agent regex"),
        ({"model": "gpt-5.6"}, {"user-agent": "curl/8"}, 0, "fast", "default", "no rule matched"),
        ({"model": "gpt-5.6"}, {"x-team": "search-ranking"}, 0, "fast", "team-header", "prefix 'search-'"),
        ({"model": "gpt-5.6"}, {"x-team": "ads"}, 0, "fast", "default", "no rule matched"),
        ({"model": "gpt-5.6", "tools": TOOL, "tool_choice": "required"}, {}, 0, "fast", "forced-tools", "tools=True"),
        ({"model": "gpt-5.6", "tools": TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}}}, {}, 0,
         "fast", "forced-tools", "tool_choice in [required, function]"),
        ({"model": "gpt-5.6", "tools": TOOL, "tool_choice": "auto", "n": 3}, {}, 0, "standard", "bulk", "n >= 2"),
        ({"model": "gpt-5.6", "tools": [], "tool_choice": "required", "n": 2}, {}, 0, "standard", "bulk", "n >= 2"),
        ({"model": "gpt-5.6", "messages": [IMAGE]}, {}, 0, "standard", "vision", "images=True"),
        ({"model": "gpt-5.6", "messages": [AUDIO]}, {}, 0, "standard", "voice", "audio=True"),
        ({"model": "gpt-5.6", "modalities": ["text", "audio"]}, {}, 0, "standard", "voice", "audio=True"),
        ({"model": "gpt-5.6", "n": 1}, {}, 0, "fast", "default", "no rule matched"),
        ({"model": "gpt-5.6", "max_tokens": 8000}, {}, 0, "standard", "long-output", "max_tokens > 4000"),
        ({"model": "gpt-5.6", "max_completion_tokens": 4001}, {}, 0, "standard", "long-output", "max_tokens > 4000"),
        ({"model": "gpt-5.6", "max_completion_tokens": 4000}, {}, 0, "fast", "default", "no rule matched"),
        ({"model": "gpt-5.6"}, {}, 4004, "standard", "big-prompt", "prompt_tokens > 1000"),
        ({"model": "gpt-5.6"}, {}, 4000, "fast", "default", "no rule matched"),
        ({"model": "coder"}, {}, 0, "fast", "coder-models", "model in [cod*]"),
        ({"model": "gpt-5.6", "stream": False, "metadata": {"priority": "bulk"}}, {}, 0, "standard", "offline",
         "metadata.priority in [low, bulk]"),
        ({"model": "gpt-5.6", "stream": True, "metadata": {"priority": "bulk"}}, {}, 0, "fast", "default",
         "no rule matched"),
        ({"model": "gpt-5.6", "metadata": {"workload": "eval"}}, {}, 0, "standard", "evals", "workload in [eval]"),
    ],
)
def test_custom_rules_match_on_every_fact(body: dict[str, Any], headers: dict[str, str], size: int, tier: str,
                                          rule: str, explains: str) -> None:
    full = {"messages": [{"role": "user", "content": "x"}], **body}
    decision = RULES_POLICY.decide(RequestFacts(full, headers, size), explain=True)
    assert RULES_POLICY.decide(RequestFacts(full, headers, size)).rule == rule  # the hot path agrees
    assert (decision.tier, decision.rule) == (tier, rule)
    assert explains in decision.reason
    assert len(decision.trace) == (decision.index - 1 if decision.index else len(RULES_POLICY.rules))


def test_rule_upstream_goes_first_and_no_fallback_rule_keeps_its_tier() -> None:
    decision = RULES_POLICY.decide(RequestFacts({"model": "gpt-5.6", "messages": []}, {"x-team": "search-x"}))
    assert [c.upstream.name for c in decision.candidates] == ["fast-b", "fast-a", "std-a"]
    decision = RULES_POLICY.decide(RequestFacts({"model": "gpt-5.6", "messages": []}, {"user-agent": "jenkins"}))
    assert [c.upstream.name for c in decision.candidates] == ["std-a"]


def test_inputs_the_fast_tier_cannot_take_skip_its_upstreams() -> None:
    # 40,000 bytes ~ 10,000 tokens: over fast-a's 8,192-token window; fast-b has no window configured
    facts = RequestFacts({"model": "coder", "messages": []}, {}, 40_000)
    decision = RULES_POLICY.decide(facts)
    assert decision.rule == "big-prompt"
    facts = RequestFacts({"model": "coder", "messages": []}, {"x-team": "search-1"}, 40_000)
    decision = RULES_POLICY.decide(facts)
    assert [c.upstream.name for c in decision.candidates] == ["std-a"]  # fast-b does not serve "coder"
    assert decision.fallback == "context_window" and decision.skipped == (("fast-a", "context_window"),)
    decision = RULES_POLICY.decide(RequestFacts({"model": "coder", "messages": [IMAGE]}, {"x-team": "search-1"}))
    assert decision.tier == "fast" and decision.fallback == "modality"


@pytest.mark.parametrize(
    ("rules", "needle"),
    [
        ([{"name": "r", "route": {"tier": "fast", "upstream": "nope"}}], "rule 1 'r' (rules.0): route.upstream 'nope'"),
        ([{"name": "r", "route": {"tier": "standard", "upstream": "fast-a"}}], "is on the fast tier"),
        ([{"name": "r", "match": {"user_agent": {"regex": "("}}, "route": {"tier": "fast"}}], "bad regex"),
        ([{"name": "all", "route": {"tier": "fast"}}, {"name": "later", "match": {"n": {"gt": 1}},
                                                      "route": {"tier": "standard"}}],
         "rule 2 'later' (rules.1): unreachable: rule 1 'all' (rules.0) matches every request"),
        ([{"name": "a", "match": {"stream": True}, "route": {"tier": "fast"}},
          {"name": "b", "match": {"stream": True}, "route": {"tier": "standard"}}],
         "rule 2 'b' (rules.1): unreachable: rule 1 'a' (rules.0) has the same conditions"),
        ([{"name": "r", "match": {"tier": "fast"}, "route": {"tier": "fast"}}], "rules.0.match.tier"),
        ([{"name": "r", "match": {"n": {}}, "route": {"tier": "fast"}}], "at least one of gt"),
        ([{"name": "r", "match": {"headers": {"x": {"exact": "a", "prefix": "b"}}}, "route": {"tier": "fast"}}],
         "exactly one of exact"),
    ],
)
def test_bad_rules_stop_startup_naming_the_rule(rules: list[dict[str, Any]], needle: str) -> None:
    data = RULES.model_dump(exclude_none=True)
    data["rules"] = rules
    with pytest.raises(ValueError) as info:
        GatewayConfig.model_validate(data)
    assert needle in str(info.value)
