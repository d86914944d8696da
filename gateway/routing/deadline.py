"""Deadline routing (docs/deadlines.md#deadline-routing): among the candidates the policy allows, the cheapest predicted
to meet the request's latency budget at the tail estimate, else the fastest. Pure code: estimates and times are passed
in; spillover (``gateway.routing.failover``) still applies after the choice."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.base import Tier
from gateway.config.routes import RouteConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.errors import InvalidRequest
from gateway.observability.estimates import Estimates, Latency, bucket
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.wire.body import dumps

DEADLINE_HEADER = "x-tiergate-deadline-ms"
TTFT_DEADLINE_HEADER = "x-tiergate-ttft-deadline-ms"
DEFAULT_COMPLETION = 256  # tokens assumed for a request without max_tokens until its route's lengths are measured
VERDICTS = ("meets", "fastest", "explore", "probe", "unmeasured")


@dataclass(frozen=True, slots=True)
class Budget:
    """A request's latency budget in seconds (``total``: the whole answer, ``ttft``: its first token; not both None);
    ``source``: ``header``, ``metadata`` and/or ``rule``, joined by ``+``."""

    total: float | None
    ttft: float | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"deadline_ms": _ms(self.total), "ttft_deadline_ms": _ms(self.ttft), "source": self.source}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _given(value: object, param: str) -> float | None:
    """Milliseconds (a number, or a string of one: OpenAI's metadata values are strings) to seconds. Raises
    InvalidRequest (400 naming ``param``) for anything but a positive finite number."""
    if value is None:
        return None
    shown = value if isinstance(value, str) else dumps(value).decode()[:40]
    try:
        ms = float(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else math.nan
    except (ValueError, OverflowError):  # a 400-digit integer is a number too, but not one a float holds
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0:
        raise InvalidRequest(f"Invalid value for '{param}': expected a number of milliseconds greater than 0, got "
                             f"{shown[:40]!r}.", param=param, code="invalid_value")
    return ms / 1000.0


def budget(facts: RequestFacts, route: RouteConfig | None) -> Budget | None:
    """Each part from the header, else ``metadata``, else the rule. Raises InvalidRequest for a value that is not a
    positive number of milliseconds."""
    headers = facts.headers
    given_total, given_ttft = headers.get(DEADLINE_HEADER), headers.get(TTFT_DEADLINE_HEADER)
    meta = facts.body.get("metadata")
    if given_total is None and given_ttft is None and (route is None or (
            route.deadline_ms is None and route.ttft_deadline_ms is None)) and (
            not isinstance(meta, dict) or ("deadline_ms" not in meta and "ttft_deadline_ms" not in meta)):
        return None  # the hot path without a budget: three lookups
    total = _given(given_total, DEADLINE_HEADER)
    ttft = _given(given_ttft, TTFT_DEADLINE_HEADER)
    sources = {"header"} if total is not None or ttft is not None else set()
    if isinstance(meta, dict) and (total is None or ttft is None):
        if total is None and (total := _given(meta.get("deadline_ms"), "metadata.deadline_ms")) is not None:
            sources.add("metadata")
        if ttft is None and (ttft := _given(meta.get("ttft_deadline_ms"), "metadata.ttft_deadline_ms")) is not None:
            sources.add("metadata")
    if route is not None:
        if total is None and route.deadline_ms is not None:
            total = route.deadline_ms / 1000.0
            sources.add("rule")
        if ttft is None and route.ttft_deadline_ms is not None:
            ttft = route.ttft_deadline_ms / 1000.0
            sources.add("rule")
    if total is None and ttft is None:
        return None
    return Budget(total, ttft, "+".join(s for s in ("header", "metadata", "rule") if s in sources))


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate's prediction at the tail (seconds, USD), None where unmeasured; ``meets`` None: cannot tell;
    ``age``: seconds since its newest TTFT sample."""

    upstream: str
    tier: Tier
    ttft: float | None
    total: float | None
    cost: float | None
    meets: bool | None
    age: float | None

    @property
    def time(self) -> float:
        """What "fastest" compares: the whole answer, else the TTFT (inf when unmeasured)."""
        value = self.total if self.total is not None else self.ttft
        return math.inf if value is None else value

    def as_dict(self) -> dict[str, Any]:
        return {"upstream": self.upstream, "tier": self.tier, "predicted_ttft_ms": _ms(self.ttft),
                "predicted_ms": _ms(self.total), "cost_usd": None if self.cost is None else round(self.cost, 8),
                "meets": self.meets}


@dataclass(frozen=True, slots=True)
class Choice:
    """The candidates reordered (the choice first, the rest behind it for failover) and each candidate's prediction in
    policy order. ``fallback``: ``deadline`` when the choice left the policy's first tier, else the policy's own."""

    budget: Budget
    candidates: tuple[Candidate, ...]
    verdict: str
    predictions: tuple[Prediction, ...]
    completion: int
    completion_source: str
    fallback: str | None

    def of(self, upstream: str) -> Prediction | None:
        return next((p for p in self.predictions if p.upstream == upstream), None)

    def as_dict(self) -> dict[str, Any]:
        return {**self.budget.as_dict(), "verdict": self.verdict, "chosen": self.candidates[0].upstream.name,
                "completion_tokens": self.completion, "completion_tokens_source": self.completion_source,
                "predictions": [p.as_dict() for p in self.predictions]}


class Explorer:
    """The only state of deadline routing. The ``share`` explored is a credit counter, so that it holds exactly and
    tests can count it; a candidate sampled less than ``fresh`` seconds ago is never explored: other traffic measures it
    already, and exploring it would only miss deadlines."""

    def __init__(self, share: float, probe: float, fresh: float = 1.0) -> None:
        self.share = share
        self.probe = probe
        self.fresh = fresh  # seconds: a candidate sampled more recently than this is measured by other traffic
        self._credit = 0.0
        self._probed: dict[tuple[str, str], float] = {}

    def preview(self) -> Explorer:
        """A copy that never explores and forgets the probes it makes: ``POST /v1/tiergate/route`` must not spend a
        probe or a share."""
        copy = Explorer(0.0, self.probe, self.fresh)
        copy._probed = dict(self._probed)
        return copy

    def explore(self) -> bool:
        self._credit += self.share
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    def probe_due(self, upstream: str, model: str, now: float) -> bool:
        """True at most once per ``probe`` seconds for (``upstream``, ``model``); a True counts as the probe."""
        key = (upstream, model)
        last = self._probed.get(key)
        if last is not None and now - last < self.probe:
            return False
        if len(self._probed) > 4096:  # bounded: upstreams x models, but never grow without end
            self._probed.clear()
        self._probed[key] = now
        return True


def price(up: UpstreamConfig, model: str, service_tier: str | None = None,
          prompt_tokens: int = 0) -> tuple[float, float, float] | None:
    """(input, cached input, output) USD per token of ``model`` on ``up``, None when unpriced, as
    ``gateway.observability.metrics`` bills it. ``service_tier``: what the request is sent with (``up.asks(...)``)."""
    priced = up.model_prices.get(model) or up.prices
    return priced.per_token(service_tier, prompt_tokens) if priced is not None else None


def predict(c: Candidate, est: Latency | None, facts: RequestFacts, model: str, completion_tail: int,
            completion_central: int, b: Budget, now: float, cached: int = 0) -> Prediction:
    """At the tail: the TTFT line at the prompt size plus its p90 residual, then (completion − 1) / p10 decode tokens/s.
    ``cached``: the prompt tokens its cache is believed to hold (docs/sessions.md#cache-warmth-is-priced), billed at
    ``cached_input`` and not prefilled."""
    prompt = facts.prompt_tokens
    priced = price(c.upstream, model, c.upstream.asks(facts.service_tier), prompt)
    cached = min(cached, prompt)
    cost = None if priced is None else (prompt - cached) * priced[0] + cached * priced[1] + \
        completion_central * priced[2]
    up = c.upstream
    if est is None:
        return Prediction(up.name, up.tier, None, None, cost, None, None)
    ttft = est.ttft(prompt - cached)
    decode = est.decode(completion_tail)
    total = None if decode is None else ttft + decode
    meets: bool | None = True
    if b.ttft is not None and ttft > b.ttft:
        meets = False
    if b.total is not None:
        meets = None if total is None and meets else (meets and total is not None and total <= b.total)
    return Prediction(up.name, up.tier, ttft, total, cost, meets, est.age(now))


def completion_tokens(facts: RequestFacts, decision: Decision, estimates: Estimates,
                      now: float) -> tuple[int, int, str]:
    """(tail, central, source): ``max_tokens``, else the route's measured lengths, else :data:`DEFAULT_COMPLETION`."""
    if facts.max_tokens is not None:
        return facts.max_tokens, facts.max_tokens, "request"
    length = estimates.completion(decision.rule, decision.model, now)
    if length is None:
        return DEFAULT_COMPLETION, DEFAULT_COMPLETION, "default"
    return max(1, round(length.tail)), max(1, round(length.central)), "measured"


def choose(decision: Decision, facts: RequestFacts, b: Budget, estimates: Estimates, now: float,
           explorer: Explorer, warm: Mapping[str, int] | None = None) -> Choice:
    """``now`` on the estimates' clock; ``warm``: the upstreams an agent session's cache is warm on and the tokens each
    holds, priced so that a move that saves less than the warm cache it throws away is not made. The verdicts, in order:
    docs/deadlines.md#deadline-routing."""
    tail, central, source = completion_tokens(facts, decision, estimates, now)
    warm = warm or {}
    preds = tuple(predict(c, estimates.latency(c.upstream.name, bucket(c.upstream_model,
                                                                     c.upstream.asks(facts.service_tier)), now),
                          facts, decision.model, tail, central, b, now, warm.get(c.upstream.name, 0))
                  for c in decision.candidates)
    pick: Prediction | None = None
    verdict = "unmeasured"
    unmeasured = [p for p in preds if p.meets is None]
    for p in unmeasured:
        cand = decision.candidates[preds.index(p)]
        if explorer.probe_due(p.upstream, cand.upstream_model, now):
            pick, verdict = p, "probe"
            break
    if pick is None:
        meeting = [p for p in preds if p.meets]
        measured = [p for p in preds if p.meets is not None]
        if meeting:
            pick, verdict = min(meeting, key=lambda p: (math.inf if p.cost is None else p.cost, p.time)), "meets"
        elif measured:
            pick, verdict = min(measured, key=lambda p: p.time), "fastest"
        else:
            pick = preds[0]
        # measured too slow and measured by nobody else (unmeasured ones are the probe's)
        others = [p for p in preds if p is not pick and p.meets is False and (p.age or 0.0) >= explorer.fresh]
        if others and verdict in ("meets", "fastest") and explorer.explore():
            pick, verdict = max(others, key=lambda p: p.age or 0.0), "explore"  # the stalest first
    i = preds.index(pick)
    cands = (decision.candidates[i], *decision.candidates[:i], *decision.candidates[i + 1:])
    # the fallback of the request as the deadline leaves it: the policy's own when the first candidate stays or the
    # choice stays on its tier (a model served by one tier only: nothing moved), ``deadline`` when it left it
    fallback = "deadline" if pick.tier != preds[0].tier else decision.fallback
    return Choice(b, cands, verdict, preds, tail, source, fallback)


def headers(choice: Choice, upstream: str) -> list[tuple[bytes, bytes]]:
    """Response headers for the upstream that served (docs/routing.md#response-headers)."""
    out = [(b"x-tiergate-deadline", choice.verdict.encode())]
    p = choice.of(upstream)
    if p is not None and p.total is not None:
        out.append((b"x-tiergate-predicted-ms", b"%d" % round(p.total * 1000)))
    if p is not None and p.ttft is not None:
        out.append((b"x-tiergate-predicted-ttft-ms", b"%d" % round(p.ttft * 1000)))
    return out


def describe(choice: Choice) -> str:
    """For ``POST /v1/tiergate/route``."""
    p = choice.of(choice.candidates[0].upstream.name)
    assert p is not None
    b = choice.budget
    parts = [f"deadline {_ms(b.total):g} ms" if b.total is not None else "",
             f"TTFT deadline {_ms(b.ttft):g} ms" if b.ttft is not None else ""]
    want = " and ".join(x for x in parts if x)
    said = {"meets": "the cheapest candidate predicted to meet it", "fastest": "no candidate is predicted to meet it: "
            "the fastest", "explore": "exploring a candidate predicted too slow (estimates.explore)",
            "probe": "re-measuring an unmeasured candidate (estimates.probe)",
            "unmeasured": "no candidate is measured yet: the policy's first"}[choice.verdict]
    numbers = (f"predicted {_ms(p.total)} ms whole, {_ms(p.ttft)} ms to first token" if p.ttft is not None
               else "no prediction")
    return f"{want} ({b.source}): {said}, {p.upstream} ({numbers})"

