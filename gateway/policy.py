"""Routing policy: request facts in, a route decision and its explanation out. No I/O.

Rules are tried in order; the first that names a tier wins (issue 2, "Routing, first match wins"):

1. ``header``        ``x-tiergate-tier: fast|standard``
2. ``service_tier``  OpenAI's ``service_tier``: ``priority`` -> fast, ``flex`` -> standard
3. ``model_alias``   a configured alias that pins a tier (``aliases.<name>.tier``)
4. ``workload``      ``metadata.workload`` looked up in ``workloads`` (interactive/agent -> fast, ...)
5. ``default``       ``default_tier``

The decision lists the candidate upstreams: those of the chosen tier that serve the model, then (when
``fallback`` is on) those of the other tier, so the upstream layer can fail over in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config import TIERS, GatewayConfig, Tier, UpstreamConfig
from gateway.errors import ModelNotFound

SERVICE_TIER_MAP: dict[str, Tier] = {"priority": "fast", "flex": "standard"}
TIER_HEADER = "x-tiergate-tier"


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What routing reads from one request.

    model: the client's ``model`` string; stream: its ``stream`` flag; service_tier / workload: the
    request's ``service_tier`` and ``metadata.workload`` when they are strings; tier_header: the
    ``x-tiergate-tier`` header value, lower-cased, or None.
    """

    model: str
    stream: bool = False
    service_tier: str | None = None
    workload: str | None = None
    tier_header: str | None = None

    @classmethod
    def from_request(cls, body: Mapping[str, Any], headers: Mapping[str, str]) -> RequestFacts:
        """Extract facts from a parsed chat-completions body (already checked to hold a string ``model``)."""
        metadata = body.get("metadata")
        workload = metadata.get("workload") if isinstance(metadata, dict) else None
        service_tier = body.get("service_tier")
        tier_header = headers.get(TIER_HEADER)
        return cls(
            model=body["model"],
            stream=body.get("stream") is True,
            service_tier=service_tier if isinstance(service_tier, str) else None,
            workload=workload if isinstance(workload, str) else None,
            tier_header=tier_header.strip().lower() if tier_header else None,
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    """One upstream to try: the upstream config and the model id to send it."""

    upstream: UpstreamConfig
    upstream_model: str


@dataclass(frozen=True, slots=True)
class Decision:
    """The route for one request.

    tier: the tier the policy chose; rule: the name of the rule that chose it; reason: one human sentence;
    model: the configured (client-facing, alias-resolved) model name; candidates: upstreams in the order
    to try; fallback: why the first candidate is not on the chosen tier, or None.
    """

    tier: Tier
    rule: str
    reason: str
    model: str
    candidates: tuple[Candidate, ...]
    fallback: str | None = None
    trace: tuple[str, ...] = field(default=())


class Policy:
    """The routing table built once from a :class:`GatewayConfig`; :meth:`decide` is pure and cheap."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._by_tier: dict[Tier, list[UpstreamConfig]] = {
            t: [u for u in config.upstreams if u.tier == t] for t in TIERS}
        self._served = {m for u in config.upstreams for m in u.models}

    def decide(self, facts: RequestFacts) -> Decision:
        """Choose a tier and the upstreams to try for ``facts``.

        Raises:
            ModelNotFound: no upstream serves the model (after alias resolution).
        """
        alias = self.config.aliases.get(facts.model)
        model = alias.model if alias else facts.model
        if model not in self._served:
            raise ModelNotFound(f"The model `{facts.model}` does not exist or you do not have access to it.",
                                param="model")
        trace: list[str] = []
        tier, rule, reason = self._choose(facts, alias.tier if alias else None, trace)
        first = self._serving(tier, model)
        other_tier: Tier = "standard" if tier == "fast" else "fast"
        other = self._serving(other_tier, model) if (self.config.fallback or not first) else []
        fallback = None if first else f"model_not_on_{tier}_tier"
        candidates = tuple(Candidate(u, u.models[model]) for u in (*first, *other))
        return Decision(tier, rule, reason, model, candidates, fallback, tuple(trace))

    def _serving(self, tier: Tier, model: str) -> list[UpstreamConfig]:
        return [u for u in self._by_tier[tier] if model in u.models]

    def _choose(self, facts: RequestFacts, alias_tier: Tier | None, trace: list[str]) -> tuple[Tier, str, str]:
        if facts.tier_header in TIERS:
            return facts.tier_header, "header", f"header {TIER_HEADER}: {facts.tier_header}"  # type: ignore[return-value]
        trace.append("header: absent" if facts.tier_header is None else f"header: {facts.tier_header!r} is no tier")
        mapped = SERVICE_TIER_MAP.get(facts.service_tier or "")
        if mapped:
            return mapped, "service_tier", f"service_tier={facts.service_tier}"
        trace.append(f"service_tier: {facts.service_tier!r} maps to no tier")
        if alias_tier:
            return alias_tier, "model_alias", f"model alias {facts.model} is pinned to the {alias_tier} tier"
        trace.append(f"model_alias: {facts.model!r} pins no tier")
        wl = self.config.workloads.get(facts.workload or "")
        if wl:
            return wl, "workload", f"metadata.workload={facts.workload}"
        trace.append(f"workload: {facts.workload!r} maps to no tier")
        return self.config.default_tier, "default", f"default tier {self.config.default_tier}"
