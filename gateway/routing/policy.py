"""Routing policy: request facts in, a route decision and its explanation out (docs/routing.md#rules). The first rule
whose conditions all hold names the tier; without ``rules:`` the default policy (:func:`default_rules`) applies. Health,
quota and concurrency are failover planning's business (``gateway.routing.failover``), not the policy's. Pure code, no
I/O."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gateway.config.base import TIERS, Tier
from gateway.config.routes import RouteConfig
from gateway.config.schema import GatewayConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.errors import InvalidRequest, ModelNotFound, UnknownURL
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.rules import Rule, default_rules, say


class Policy:
    """Built once per config: the rules compiled and the candidate lists cached, so that :meth:`decide` is pure and
    cheap."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.rules = [Rule(r) for r in (config.rules if config.rules is not None else default_rules(config))]
        self._by_tier: dict[Tier, list[UpstreamConfig]] = {
            t: [u for u in config.upstreams if u.tier == t] for t in TIERS}
        self._served = {m for u in config.upstreams for m in u.models}
        self._default = RouteConfig(tier=config.default_tier)
        # a rule with one condition is its check: one call per rule instead of two and a loop
        self._checks = [(i, r, r._checks[0] if len(r._checks) == 1 else r.failure) for i, r in enumerate(self.rules, 1)]
        self._plans: dict[tuple[Any, ...], tuple[list[UpstreamConfig], list[UpstreamConfig],
                                                 tuple[Candidate, ...], bool]] = {}

    def decide(self, facts: RequestFacts, explain: bool = False) -> Decision:
        """Without ``explain``, ``reason`` and ``trace`` stay empty: the hot path needs only the rule's name. Raises
        ModelNotFound when no upstream serves the model (after alias resolution)."""
        alias = self.config.aliases.get(facts.model)
        model = alias.model if alias else facts.model
        if model not in self._served:
            raise ModelNotFound(f"The model `{facts.model}` does not exist or you do not have access to it.",
                                param="model")
        trace: list[str] = []
        name, index = "default", 0
        route = self._default
        reason = f"no rule matched: default tier {route.tier}" if explain else ""
        for i, rule, failure in self._checks:
            failed = failure(facts)
            if failed is None:
                name, index, route = rule.name, i, rule.route
                reason = f"rule {i} {rule.name!r}: {rule.describe()} -> {route.tier}" if explain else ""
                break
            if explain:
                trace.append(f"rule {i} {rule.name!r}: {say(failed)}")
        cands, fallback, skipped = self._candidates(facts, model, route)
        decision = Decision(route.tier, name, reason, model, cands, fallback, tuple(trace), skipped, index, route)
        if facts.responses:
            decision = _responses_route(decision, facts, (u for u in self.config.upstreams if model in u.models))
        return decision

    def decide_listed(self, facts: RequestFacts, explain: bool = False) -> Decision:
        """A model the passthrough upstream lists but no upstream is configured for: there, unchanged. Raises
        ModelNotFound when passthrough is off or that upstream serves no Responses API."""
        up = self.config.passthrough_upstream
        if up is None or (facts.responses and up.responses_mode == "none"):
            raise ModelNotFound(f"The model `{facts.model}` does not exist or you do not have access to it.",
                                param="model")
        reason = f"model `{facts.model}` is listed by the passthrough upstream {up.name}" if explain else ""
        return Decision(up.tier, "passthrough", reason, facts.model, (Candidate(up, facts.model),))

    def decide_passthrough(self, path: str, facts: RequestFacts | None, explain: bool = False,
                           owner: str | None = None) -> Decision:
        """The rest of /v1 (``gateway.pipeline.passthrough``). A configured ``model`` is routed by the rules among the
        upstreams that serve ``path``; anything else goes to ``passthrough.upstream`` unchanged. ``owner``: the upstream
        that made the object ``path`` names, which alone can serve it. Raises ModelNotFound when no upstream serving the
        model serves ``path`` (404, as OpenAI answers a model without the endpoint), UnknownURL when nobody serves
        ``path``."""
        if owner is not None:
            mine = next(u for u in self.config.upstreams if u.name == owner)
            return Decision(mine.tier, "response_affinity", f"/v1/{path} was made by {owner}" if explain else "",
                            "other", (Candidate(mine, ""),))
        alias = self.config.aliases.get(facts.model) if facts is not None else None
        model = alias.model if alias else facts.model if facts is not None else None
        if facts is not None and model in self._served:
            decision = self.decide(facts, explain)
            kept = tuple(c for c in decision.candidates if c.upstream.serves(path))
            if not kept:
                raise ModelNotFound(f"The model `{facts.model}` is not served on /v1/{path} by any upstream.",
                                    param="model")
            skipped = (*decision.skipped, *((c.upstream.name, "endpoint") for c in decision.candidates
                                            if c not in kept))
            fallback = decision.fallback
            if fallback is None and kept[0].upstream.tier != decision.tier:
                fallback = "endpoint"
            return dataclasses.replace(decision, candidates=kept, skipped=skipped, fallback=fallback)
        up = self.config.passthrough_upstream
        if up is None or not up.serves(path):
            raise UnknownURL(f"Unknown request URL: /v1/{path}: no upstream of the gateway serves it."
                             if up is not None else f"Unknown request URL: /v1/{path}: passthrough is off.")
        given = facts.model if facts is not None else None
        reason = (f"model `{given}` is not configured: sent unchanged to the passthrough upstream {up.name}"
                  if given else f"/v1/{path} has no model: the passthrough upstream {up.name}") if explain else ""
        return Decision(up.tier, "passthrough", reason, given or "other", (Candidate(up, given or ""),))

    def _candidates(self, facts: RequestFacts, model: str,
                    route: RouteConfig) -> tuple[tuple[Candidate, ...], str | None, tuple[tuple[str, str], ...]]:
        key = (route.tier, route.upstream, route.fallback, model)
        plan = self._plans.get(key)
        if plan is None:  # bounded: routes x configured models (decide() refuses other models first)
            plan = self._plans[key] = self._plan(model, route)
        first, other, every, takes_anything = plan
        if takes_anything:  # no context window or modality limit on any of them: nothing to check per request
            return every, (None if first else f"model_not_on_{route.tier}_tier"), ()
        skipped = [(u.name, why) for u in (*first, *other) if (why := _cannot_take(u, facts))]
        out = {name for name, _ in skipped}
        kept_first = [u for u in first if u.name not in out]
        kept = [*kept_first, *(u for u in other if u.name not in out)]
        if not kept:  # nobody fits by our estimate: let the upstreams judge (their answer is relayed)
            kept, kept_first, skipped = [*first, *other], first, []
        fallback = None
        if not kept_first:
            fallback = next((why for name, why in skipped if name in {u.name for u in first}),
                            f"model_not_on_{route.tier}_tier")
        return tuple(Candidate(u, u.models[model]) for u in kept), fallback, tuple(skipped)

    def _plan(self, model: str, route: RouteConfig) -> tuple[list[UpstreamConfig], list[UpstreamConfig],
                                                             tuple[Candidate, ...], bool]:
        """The candidate lists of a route, cached: whether all of them take any request is checked once, not per
        request."""
        first = [u for u in self._by_tier[route.tier] if model in u.models]
        if route.upstream:
            first.sort(key=lambda u: u.name != route.upstream)
        other_tier: Tier = "standard" if route.tier == "fast" else "fast"
        allow_other = (route.fallback and self.config.fallback) or not first
        other = [u for u in self._by_tier[other_tier] if model in u.models] if allow_other else []
        every = tuple(Candidate(u, u.models[model]) for u in (*first, *other))
        takes_anything = all(u.context_window is None and len(u.modalities) == 3 for u in (*first, *other))
        return first, other, every, takes_anything


def _responses_route(decision: Decision, facts: RequestFacts, served: Iterable[UpstreamConfig]) -> Decision:
    """A continuation of a response made natively goes back to its upstream: only it holds the conversation. A bridged
    upstream serves neither what the bridge lacks nor a continuation only a native upstream may know, except that
    hosted tools only offered, which no upstream of the model runs, are dropped (docs/responses.md#hosted-tools). Raises
    InvalidRequest (400) when only bridged upstreams serve the model and the request needs the Responses API itself,
    ModelNotFound when no upstream serves the Responses API for it."""
    cont = facts.continuation
    if cont is not None and cont.upstream is not None:
        mine = tuple(Candidate(u, u.models[decision.model]) for u in served if u.name == cont.upstream)
        if not mine:
            raise InvalidRequest(f"Previous response with id '{cont.response_id}' was made by an upstream that no "
                                 f"longer serves `{decision.model}`.", param="previous_response_id",
                                 code="previous_response_not_found")
        return dataclasses.replace(decision, tier=mine[0].upstream.tier, rule="response_affinity", candidates=mine,
                                   fallback=None, reason=decision.reason and f"{decision.reason}; then the response "
                                   f"it continues was made by {cont.upstream}")
    native_only = facts.unbridgeable is not None or (cont is not None and not cont.held)
    why = "responses_feature" if facts.unbridgeable is not None else "response_affinity"
    skipped = list(decision.skipped)
    kept: list[Candidate] = []
    for c in decision.candidates:
        mode = c.upstream.responses_mode
        if mode == "none" or (mode == "bridge" and native_only):
            skipped.append((c.upstream.name, "no_responses_api" if mode == "none" else why))
        else:
            kept.append(c)
    if not kept and facts.unbridgeable is not None and facts.droppable_tools and (cont is None or cont.held):
        # only offered hosted tools stood in the way, and no upstream of the model runs them: served without them
        bridged = tuple(c for c in decision.candidates if c.upstream.responses_mode == "bridge")
        if bridged:
            return dataclasses.replace(decision, candidates=bridged, dropped_tools=facts.droppable_tools)
    if not kept:
        if native_only and any(c.upstream.responses_mode == "bridge" for c in decision.candidates):
            if facts.unbridgeable is not None:
                param, reason, code = facts.unbridgeable
                raise InvalidRequest(f"{reason}, and no upstream serving `{decision.model}` speaks the Responses API "
                                     "natively.", param=param, code=code)
            raise InvalidRequest(f"Previous response with id '{cont.response_id if cont else ''}' not found.",
                                 param="previous_response_id", code="previous_response_not_found")
        raise ModelNotFound(f"No upstream serves the Responses API for `{decision.model}`; use /v1/chat/completions.",
                            param="model")
    fallback = decision.fallback
    if kept[0].upstream.tier != decision.tier and fallback is None:
        fallback = next((w for n, w in skipped[len(decision.skipped):] if n == decision.candidates[0].upstream.name),
                        "no_responses_api")
    return dataclasses.replace(decision, candidates=tuple(kept), fallback=fallback, skipped=tuple(skipped))


def _cannot_take(u: UpstreamConfig, f: RequestFacts) -> str | None:
    if u.context_window is None and len(u.modalities) == 3:
        return None  # takes anything
    if u.context_window is not None and f.prompt_tokens + (f.max_tokens or 0) > u.context_window:
        return "context_window"
    if f.images and "image" not in u.modalities:
        return "modality"
    if f.audio and "audio" not in u.modalities:
        return "modality"
    return None
