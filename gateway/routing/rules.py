"""Routing rules compiled from the config: one small check per condition a rule has, each saying why it did not match
(for explanations only); the default policy and the start-up warnings of a rule table. Pure code, no I/O."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from typing import Any

from gateway.config.base import TIERS
from gateway.config.routes import MatchConfig, Range, RouteConfig, RuleConfig, StrMatch
from gateway.config.schema import GatewayConfig
from gateway.config.upstreams import FAST_SERVICE_TIERS
from gateway.routing.facts import TIER_HEADER, RequestFacts


class _StrTest:
    __slots__ = ("kind", "value", "_re")

    def __init__(self, m: StrMatch) -> None:
        self.kind, self.value = next((k, str(v)) for k, v in m.model_dump().items() if v is not None)
        self._re = re.compile(self.value) if self.kind == "regex" else None

    def __call__(self, text: str) -> bool:
        if self.kind == "exact":
            return text == self.value
        if self.kind == "prefix":
            return text.startswith(self.value)
        if self.kind == "glob":
            return fnmatch.fnmatchcase(text, self.value)
        assert self._re is not None
        return self._re.search(text) is not None

    def __str__(self) -> str:
        return f"{self.kind} {self.value!r}"


_FAILURES = {
    "header": "header {0} is {1}, not {2}",
    "in": "{0} {1!r} not in {2}",
    "model": "model {0!r} matches none of {1}",
    "flag": "{0} is {1}, rule wants {2}",
    "range": "{0} {1} is not {2}",
    "ua": "user-agent {0} does not match {1}",
}


def say(failed: tuple[Any, ...]) -> str:
    kind, *args = failed
    if kind == "range":
        args[2] = _range_text(args[2])
    return _FAILURES[kind].format(*args)


def _in_range(value: float, r: Range) -> bool:
    return ((r.gt is None or value > r.gt) and (r.gte is None or value >= r.gte)
            and (r.lt is None or value < r.lt) and (r.lte is None or value <= r.lte))


def _range_text(r: Range) -> str:
    ops = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
    return " and ".join(f"{ops[k]} {v:g}" for k, v in r.model_dump().items() if v is not None)


Check = Callable[[RequestFacts], "tuple[Any, ...] | None"]  # None when the condition holds, else why not


def _header_check(name: str, test: _StrTest) -> Check:
    def check(f: RequestFacts) -> tuple[Any, ...] | None:
        value = f.headers.get(name)
        if value is None or not test(value):
            return ("header", name, "absent" if value is None else repr(value), test)
        return None
    return check


def _service_tier_check(tiers: list[str]) -> Check:
    return lambda f: None if f.service_tier in tiers else ("in", "service_tier", f.service_tier, tiers)


def _tool_choice_check(choices: list[str]) -> Check:
    return lambda f: None if f.tool_choice in choices else ("in", "tool_choice", f.tool_choice, choices)


def _model_check(globs: list[str]) -> Check:
    return lambda f: None if any(fnmatch.fnmatchcase(f.model, g) for g in globs) else ("model", f.model, globs)


def _metadata_check(key: str, allowed: list[str]) -> Check:
    def check(f: RequestFacts) -> tuple[Any, ...] | None:
        value = f.metadata.get(key)
        return None if isinstance(value, str) and value in allowed else ("in", f"metadata.{key}", value, allowed)
    return check


def _flag_check(fact: str, want: bool) -> Check:
    def check(f: RequestFacts) -> tuple[Any, ...] | None:
        got = getattr(f, fact)
        return None if got == want else ("flag", fact, got, want)
    return check


def _range_check(fact: str, r: Range) -> Check:
    def check(f: RequestFacts) -> tuple[Any, ...] | None:
        value = getattr(f, fact)
        return None if value is not None and _in_range(value, r) else ("range", fact, value, r)
    return check


def _ua_check(ua: _StrTest) -> Check:
    return lambda f: None if ua(f.user_agent) else ("ua", repr(f.user_agent), ua)


class Rule:
    def __init__(self, cfg: RuleConfig) -> None:
        self.name = cfg.name
        self.route: RouteConfig = cfg.route
        self.match: MatchConfig = cfg.match
        self._headers = {k: _StrTest(v) for k, v in (cfg.match.headers or {}).items()}
        self._ua = _StrTest(cfg.match.user_agent) if cfg.match.user_agent else None
        self._checks = self._compile()

    def failure(self, f: RequestFacts) -> tuple[Any, ...] | None:
        """None when every condition holds, else (kind, details...) of the first failing one. The hot path calls this:
        only explanations format the details into words (:func:`say`)."""
        for check in self._checks:
            failed = check(f)
            if failed is not None:
                return failed
        return None

    def _compile(self) -> list[Check]:
        """Headers first: the cheapest."""
        m = self.match
        checks = [_header_check(name, test) for name, test in self._headers.items()]
        if m.service_tier is not None:
            checks.append(_service_tier_check(m.service_tier))
        if m.model is not None:
            checks.append(_model_check(m.model))
        checks += [_metadata_check(key, allowed) for key, allowed in (m.metadata or {}).items()]
        checks += [_flag_check(fact, want) for fact in ("stream", "tools", "images", "audio")
                   if (want := getattr(m, fact)) is not None]
        if m.tool_choice is not None:
            checks.append(_tool_choice_check(m.tool_choice))
        checks += [_range_check(fact, r) for fact, r in (("prompt_tokens", m.prompt_tokens),
                                                         ("max_tokens", m.max_tokens), ("n", m.n)) if r is not None]
        if self._ua is not None:
            checks.append(_ua_check(self._ua))
        return checks

    def describe(self) -> str:
        """For ``tiergate check-config`` and explanations."""
        m = self.match
        conds = [f"header {name} {test}" for name, test in self._headers.items()]
        for fact in ("service_tier", "model", "tool_choice"):
            if getattr(m, fact) is not None:
                conds.append(f"{fact} in [{', '.join(getattr(m, fact))}]")
        conds += [f"metadata.{k} in [{', '.join(v)}]" for k, v in (m.metadata or {}).items()]
        conds += [f"{fact}={getattr(m, fact)}" for fact in ("stream", "tools", "images", "audio")
                  if getattr(m, fact) is not None]
        conds += [f"{fact} {_range_text(r)}" for fact, r in (("prompt_tokens", m.prompt_tokens),
                                                            ("max_tokens", m.max_tokens), ("n", m.n)) if r]
        if self._ua is not None:
            conds.append(f"user-agent {self._ua}")
        return " and ".join(conds) or "every request"


def default_rules(config: GatewayConfig) -> list[RuleConfig]:
    """The policy of a config without ``rules:`` (docs/routing.md#rules)."""
    rules: list[dict[str, Any]] = []
    for tier in TIERS:
        rules.append({"name": "header", "match": {"headers": {TIER_HEADER: {"regex": rf"(?i)^\s*{tier}\s*$"}}},
                      "route": {"tier": tier}})
    # OpenAI's speed tiers ask for the fast tier (``fast`` is ``priority``'s new name; ``ultrafast`` the wafer-scale
    # one), ``flex`` for the standard; ``auto``, ``default`` and ``scale`` leave the choice to the rules below
    rules.append({"name": "service_tier", "match": {"service_tier": sorted(FAST_SERVICE_TIERS)},
                  "route": {"tier": "fast"}})
    rules.append({"name": "service_tier", "match": {"service_tier": ["flex"]}, "route": {"tier": "standard"}})
    for tier in TIERS:
        pinned = sorted(a for a, t in config.aliases.items() if t.tier == tier)
        if pinned:
            rules.append({"name": "model_alias", "match": {"model": pinned}, "route": {"tier": tier}})
    rules.append({"name": "n_gt_1", "match": {"n": {"gt": 1}}, "route": {"tier": "standard"}})
    rules.append({"name": "long_prompt", "match": {"prompt_tokens": {"gt": config.long_prompt_tokens}},
                  "route": {"tier": "standard"}})
    for tier in TIERS:
        values = sorted(w for w, t in config.workloads.items() if t == tier)
        if values:
            rules.append({"name": "workload", "match": {"metadata": {"workload": values}}, "route": {"tier": tier}})
    return [RuleConfig.model_validate(r) for r in rules]


def config_warnings(config: GatewayConfig) -> list[str]:
    """What ``tiergate check-config`` warns about: a config that is valid but cannot do what it says (a rule that can
    never match or whose tier lacks a model it matches; a model on one tier only while ``fallback`` is on; an alias
    pinned to a tier that ``rules:`` drops, the pin living in the default policy's ``model_alias`` rule; prices for a
    service tier the dialect does not act on, billed at the default prices unless the answer names the tier)."""
    out: list[str] = []
    names = config.model_names()
    tiers_of = {m: {u.tier for u in config.upstreams if m in u.models} for m in {m for u in config.upstreams
                                                                                   for m in u.models}}

    def target(name: str) -> str:
        alias = config.aliases.get(name)
        return alias.model if alias else name

    for i, rule in enumerate(config.rules or [], 1):
        where = f"rule {i} {rule.name!r}"
        m = rule.match
        for fact, r in (("prompt_tokens", m.prompt_tokens), ("max_tokens", m.max_tokens), ("n", m.n)):
            if r is not None and _empty(r):
                out.append(f"{where}: never matches: no {fact} is {_range_text(r)}")
        matched = names if m.model is None else [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in m.model)]
        if m.model is not None and not matched:
            out.append(f"{where}: never matches: no model the gateway serves matches {m.model}")
        lacking = sorted({target(n) for n in matched} - {t for t in tiers_of if rule.route.tier in tiers_of[t]})
        if m.model is not None and lacking:
            out.append(f"{where}: routes to the {rule.route.tier} tier, but no {rule.route.tier} upstream serves "
                       f"{', '.join(lacking)}: those requests always fall back (model_not_on_{rule.route.tier}_tier)")
    for name, alias in sorted(config.aliases.items()):  # rules: replaces the default policy, its model_alias rule too
        if alias.tier is not None and config.rules is not None and not any(
                r.match.model and any(fnmatch.fnmatchcase(name, g) for g in r.match.model) for r in config.rules):
            out.append(f"aliases.{name}: pinned to the {alias.tier} tier, but no rule of rules: matches it, so the pin "
                       f"does not apply (rules: replaces the default policy); add {{name: model_alias, match: "
                       f"{{model: [{name}]}}, route: {{tier: {alias.tier}}}}} to your rules")
    out += _unheard_tier_prices(config)
    if config.fallback:
        for model in sorted(tiers_of):
            if len(tiers_of[model]) == 1:
                (tier,) = tiers_of[model]
                other = "standard" if tier == "fast" else "fast"
                out.append(f"model {model}: served on the {tier} tier only: fallback, spillover and deadlines can "
                           f"never move its requests to the {other} tier (add a {other} upstream serving it)")
    return out


def _unheard_tier_prices(config: GatewayConfig) -> list[str]:
    out = []
    for up in config.upstreams:
        priced = [t for p in (up.prices, *up.model_prices.values()) if p is not None for t in p.service_tiers]
        unheard = sorted({t for t in priced if not up.honours(t)})
        if unheard:
            out.append(f"upstream {up.name}: prices for service tier(s) {', '.join(unheard)}, which its dialect "
                       f"({up.dialect}) does not act on: its requests are billed at the default prices unless its "
                       "answers name the tier they were served at")
    return out


def _empty(r: Range) -> bool:
    lows = [(v, v == r.gt) for v in (r.gt, r.gte) if v is not None]
    highs = [(v, v == r.lt) for v in (r.lt, r.lte) if v is not None]
    if not lows or not highs:
        return False
    lo, lo_open = max(lows, key=lambda x: (x[0], x[1]))
    hi, hi_open = min(highs, key=lambda x: (x[0], not x[1]))
    return lo > hi or (lo == hi and (lo_open or hi_open))
