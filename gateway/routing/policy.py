"""Routing policy: request facts in, a route decision and its explanation out. Pure code, no I/O.

Rules are tried in order and the first whose conditions all hold names the tier (and optionally an upstream).
A config without ``rules:`` gets the default policy (:func:`gateway.routing.rules.default_rules`): explicit
signals first (the tier header, ``service_tier``, a tier-pinned alias), then the standard tier's bulk cases, then
the workload:

==============  ==========================================================  ========
rule            matches                                                     tier
==============  ==========================================================  ========
header          ``x-tiergate-tier: fast`` / ``standard``                    as asked
service_tier    ``service_tier`` ``fast``/``priority``/``ultrafast``;        fast;
                ``flex`` (``auto``/``default``/``scale``: no rule)           standard
model_alias     an alias pinned to a tier (``aliases.<name>.tier``)         its tier
n_gt_1          ``n`` > 1 (several choices: bulk work)                      standard
long_prompt     estimated prompt over ``long_prompt_tokens``                standard
workload        ``metadata.workload`` per ``workloads``                     as mapped
default         everything else                                             ``default_tier``
==============  ==========================================================  ========

Then candidates are listed: the chosen tier's upstreams that serve the model (the rule's upstream first),
then, when the rule and the config allow it, the other tier's. Upstreams that cannot take the request (its
estimated prompt plus ``max_tokens`` over their ``context_window``, or an image/audio input they lack) are
left out and the reason is reported as the fallback. Health, quota and concurrency are failover planning's
business (``gateway.routing.failover`` over ``gateway.routing.health``), not the policy's.
"""

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
    """The routing table built once from a :class:`GatewayConfig`; :meth:`decide` is pure."""

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
        """Choose a tier and list the upstreams to try; with ``explain``, also say why in words (``reason``, and
        one ``trace`` line per earlier rule). Without it, ``reason`` and ``trace`` are empty: the hot path
        only needs the rule's name.

        Raises:
            ModelNotFound: no upstream serves the model (after alias resolution).
        """
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
        """The route of a chat-completions or Responses request for a model no upstream is configured for but the
        passthrough upstream lists (``gateway.pipeline.models.UpstreamModels``): to that upstream, the model
        unchanged (rule ``passthrough``).

        Raises:
            ModelNotFound: passthrough is off, or the upstream serves no Responses API (``responses: none``).
        """
        up = self.config.passthrough_upstream
        if up is None or (facts.responses and up.responses_mode == "none"):
            raise ModelNotFound(f"The model `{facts.model}` does not exist or you do not have access to it.",
                                param="model")
        reason = f"model `{facts.model}` is listed by the passthrough upstream {up.name}" if explain else ""
        return Decision(up.tier, "passthrough", reason, facts.model, (Candidate(up, facts.model),))

    def decide_passthrough(self, path: str, facts: RequestFacts | None, explain: bool = False,
                           owner: str | None = None) -> Decision:
        """The route of a request to the rest of the /v1 surface (``gateway.pipeline.passthrough``); ``path`` is under
        /v1 (``embeddings``, ``files/file-abc``). A body with a configured ``model`` is routed by the rules, as chat
        completions are, among the upstreams that serve ``path`` (the others are skipped: ``endpoint``); any other
        request (object paths, no model, a model no upstream lists) goes to ``passthrough.upstream`` unchanged (rule
        ``passthrough``). ``owner``: the upstream that made the object the path names (a response made natively:
        rule ``response_affinity``), which alone can serve it.

        Raises:
            ModelNotFound: the model is configured but no upstream serving it serves ``path`` (404, as OpenAI
                answers a model that lacks an endpoint); UnknownURL: passthrough is off or nobody serves ``path``.
        """
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
        """The upstreams a route considers for ``model``, in order (its tier's, then the other tier's when it
        may fall back), all of them as candidates, and whether every one takes any request (no limits)."""
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
    """The candidates of a Responses API request (the rules chose as for chat completions):

    * a continuation of a response an upstream made natively goes back to that upstream (rule
      ``response_affinity``): only it holds the conversation;
    * upstreams with ``responses: none`` are left out (``no_responses_api``); bridged ones too when the request uses
      what the bridge cannot serve (``responses_feature``) or continues a response only a native upstream may know.

    Raises:
        InvalidRequest: only bridged upstreams serve the model and the request needs the Responses API itself (400
            naming the parameter); ModelNotFound: no upstream serves the Responses API for it.
    """
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
