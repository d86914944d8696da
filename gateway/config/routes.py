"""The routing rules of the config (``rules:``, ``aliases:``): the conditions a rule matches (headers, metadata, model,
service tier, sizes, ...) and the route it names (a tier, an upstream, a latency budget, hedging)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Strict, Tier


class StrMatch(Strict):
    """How a string matches: exactly one of ``exact``, ``prefix``, ``regex`` (``re.search``) or ``glob``.

    A plain string in the YAML means ``exact``.
    """

    exact: str | None = None
    prefix: str | None = None
    regex: str | None = None
    glob: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _plain(cls, value: object) -> object:
        return {"exact": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one(self) -> StrMatch:
        given = [k for k in ("exact", "prefix", "regex", "glob") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of exact, prefix, regex, glob")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"bad regex {self.regex!r}: {exc}") from exc
        return self


class Range(Strict):
    """A numeric condition: any of ``gt``, ``gte``, ``lt``, ``lte`` (all given must hold)."""

    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None

    @model_validator(mode="after")
    def _some(self) -> Range:
        if self.gt is None and self.gte is None and self.lt is None and self.lte is None:
            raise ValueError("give at least one of gt, gte, lt, lte")
        return self


def _listify(value: object) -> object:
    return [value] if isinstance(value, str | bool) else value


class MatchConfig(Strict):
    """Conditions on request facts; all given must hold (an empty match matches every request).

    headers: header name -> StrMatch; metadata: ``metadata`` key -> allowed values; service_tier: allowed
    values; model: globs on the requested model or alias; stream / tools / images / audio: presence;
    tool_choice: ``auto``, ``none``, ``required`` or ``function``; prompt_tokens: estimated prompt size
    (request bytes / 4); max_tokens: ``max_completion_tokens`` or ``max_tokens``; n: choices;
    user_agent: StrMatch on ``User-Agent``.
    """

    headers: dict[str, StrMatch] | None = None
    metadata: dict[str, list[str]] | None = None
    service_tier: list[str] | None = None
    model: list[str] | None = None
    stream: bool | None = None
    tools: bool | None = None
    tool_choice: list[str] | None = None
    images: bool | None = None
    audio: bool | None = None
    prompt_tokens: Range | None = None
    max_tokens: Range | None = None
    n: Range | None = None
    user_agent: StrMatch | None = None

    @field_validator("service_tier", "model", "tool_choice", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return _listify(value)

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_values(cls, value: object) -> object:
        if isinstance(value, dict):
            return {k: _listify(v) for k, v in value.items()}
        return value

    @field_validator("headers", mode="before")
    @classmethod
    def _lower_names(cls, value: object) -> object:
        if isinstance(value, dict):
            return {str(k).lower(): v for k, v in value.items()}
        return value


class RouteConfig(Strict):
    """A rule's action: the tier, optionally one upstream of it first, and whether the other tier may serve.

    deadline_ms / ttft_deadline_ms: a latency budget for the requests the rule matches (whole answer / first token,
    milliseconds), as if each had sent ``x-tiergate-deadline-ms`` / ``x-tiergate-ttft-deadline-ms`` (a request's own
    budget wins): the gateway then picks among the candidates by their live estimates (``gateway.routing.deadline``).
    hedge: streams only, first-token hedging: after this many seconds without a token from the first candidate, start
    the next one too; the first to produce a token is relayed, the other cancelled. ``p95``: that candidate's live TTFT
    p95 (``gateway.observability.estimates``; no hedge while it is unmeasured). None: no hedging.
    """

    tier: Tier
    upstream: str | None = None
    fallback: bool = True
    deadline_ms: float | None = Field(None, gt=0)
    ttft_deadline_ms: float | None = Field(None, gt=0)
    hedge: float | Literal["p95"] | None = None

    @field_validator("hedge")
    @classmethod
    def _hedge_delay(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float | int) and value <= 0:
            raise ValueError("give a delay in seconds greater than 0, or 'p95'")
        return value


class RuleConfig(Strict):
    """One routing rule: a name (reported in ``x-tiergate-rule``), conditions, and a route."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    match: MatchConfig = MatchConfig()
    route: RouteConfig


class AliasConfig(Strict):
    """A client-facing model name that stands for a configured model, optionally pinned to a tier (through the default
    policy's ``model_alias`` rule: a ``rules:`` table needs a rule that matches the alias for the pin to apply;
    ``tiergate check-config`` warns when none does)."""

    model: str
    tier: Tier | None = None
