"""Routing policy: request facts in, a route decision and its explanation out. Pure code, no I/O.

Rules are tried in order and the first whose conditions all hold names the tier (and optionally an upstream).
A config without ``rules:`` gets the default policy (:func:`default_rules`), which keeps issue 2's order and
adds the standard-tier cases of issue 4:

==============  ==========================================================  ========
rule            matches                                                     tier
==============  ==========================================================  ========
header          ``x-tiergate-tier: fast`` / ``standard``                    as asked
service_tier    OpenAI ``service_tier``: ``priority`` / ``flex``            fast / standard
model_alias     an alias pinned to a tier (``aliases.<name>.tier``)         its tier
n_gt_1          ``n`` > 1 (several choices: bulk work)                      standard
long_prompt     estimated prompt over ``long_prompt_tokens``                standard
workload        ``metadata.workload`` per ``workloads``                     as mapped
default         everything else                                             ``default_tier``
==============  ==========================================================  ========

Then candidates are listed: the chosen tier's upstreams that serve the model (the rule's upstream first),
then, when the rule and the config allow it, the other tier's. Upstreams that cannot take the request (its
estimated prompt plus ``max_tokens`` over their ``context_window``, or an image/audio input they lack) are
left out and the reason is reported as the fallback. Health, quota and concurrency are the upstream layer's
business (``gateway.routing.health``), not the policy's.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.base import TIERS, Tier
from gateway.config.routes import MatchConfig, Range, RouteConfig, RuleConfig, StrMatch
from gateway.config.schema import GatewayConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.errors import InvalidRequest, ModelNotFound, UnknownURL
from gateway.responses import bridge

TIER_HEADER = "x-tiergate-tier"
BYTES_PER_TOKEN = 4  # OpenAI's rule of thumb for English text: ~4 characters per token
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_AUDIO_PARTS = frozenset({"input_audio", "audio"})


class _lazy:  # noqa: N801 - a decorator, named like functools.cached_property
    """Compute an attribute on first use and store it on the instance (``functools.cached_property`` without the
    lock it takes on every access in Python 3.11, which made it the costliest part of routing)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.name = fn.__name__

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True, slots=True)
class Continuation:
    """What the gateway knows of the response a Responses request continues (its ``previous_response_id``).

    upstream: the upstream that made it natively (only it can continue it: affinity), or None; held: the gateway
    made it through the bridge and holds the whole conversation (any upstream may continue it); history: that
    conversation's items when held. Neither: made elsewhere; only a native upstream might know it.
    """

    response_id: str
    upstream: str | None = None
    held: bool = False
    history: tuple[dict[str, Any], ...] = ()


class RequestFacts:
    """What routing can read from one request; each fact is computed on first use.

    Args:
        body: the parsed chat-completions or Responses API body (``model`` already checked to be a string).
        headers: request headers with lower-case names.
        size: the request body's length in bytes (for the prompt-size estimate).
        responses: the body is a Responses API request (``POST /v1/responses``).
        continuation: for a Responses request with ``previous_response_id``, what the gateway knows of it.
        defaults: ``metadata`` read as if the client had sent it, under what it did send (its gateway key's).
    """

    def __init__(self, body: Mapping[str, Any], headers: Mapping[str, str], size: int = 0, *,
                 responses: bool = False, continuation: Continuation | None = None,
                 defaults: Mapping[str, str] | None = None) -> None:
        self.defaults = defaults
        self.body = body
        self.headers = headers
        self.size = size
        self.model: str = body["model"]
        self.responses = responses
        self.continuation = continuation

    @_lazy
    def unbridgeable(self) -> tuple[str, str, str] | None:
        """For a Responses request: (param, why, code) of what the bridge cannot serve
        (:func:`gateway.responses.bridge.unbridgeable`), or None."""
        return bridge.unbridgeable(self.body) if self.responses else None

    @_lazy
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @_lazy
    def service_tier(self) -> str | None:
        value = self.body.get("service_tier")
        return value if isinstance(value, str) else None

    @_lazy
    def metadata(self) -> dict[str, Any]:
        value = self.body.get("metadata")
        given = value if isinstance(value, dict) else {}
        return {**self.defaults, **given} if self.defaults else given

    @_lazy
    def tier_header(self) -> str | None:
        value = self.headers.get(TIER_HEADER)
        return value.strip().lower() if value else None

    @_lazy
    def user_agent(self) -> str:
        return self.headers.get("user-agent", "")

    @_lazy
    def tools(self) -> bool:
        tools = self.body.get("tools")
        return isinstance(tools, list) and len(tools) > 0

    @_lazy
    def tool_choice(self) -> str | None:
        value = self.body.get("tool_choice")
        if isinstance(value, dict):
            return "function"
        return value if isinstance(value, str) else None

    @_lazy
    def _parts(self) -> frozenset[str]:
        kinds: set[str] = set()
        messages = self.body.get("messages")
        if not isinstance(messages, list):  # a Responses API body: ``input`` items carry content parts
            messages = self.body.get("input")
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                kinds.update(str(p["type"]) for p in content if isinstance(p, dict) and isinstance(p.get("type"), str))
        return frozenset(kinds)

    @_lazy
    def images(self) -> bool:
        return not self._parts.isdisjoint(_IMAGE_PARTS)

    @_lazy
    def audio(self) -> bool:
        modalities = self.body.get("modalities")
        wants_audio = isinstance(modalities, list) and "audio" in modalities
        return wants_audio or not self._parts.isdisjoint(_AUDIO_PARTS)

    @_lazy
    def prompt_tokens(self) -> int:
        """Estimated prompt tokens: request bytes / 4 (cheap and offline; no tokenizer on the hot path)."""
        return -(-self.size // BYTES_PER_TOKEN)

    @_lazy
    def max_tokens(self) -> int | None:
        for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
            value = self.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @_lazy
    def n(self) -> int:
        value = self.body.get("n")
        return value if isinstance(value, int) and not isinstance(value, bool) else 1

    def as_dict(self) -> dict[str, Any]:
        """Every fact, for ``POST /v1/tiergate/route``."""
        return {"model": self.model, "stream": self.stream, "service_tier": self.service_tier,
                "metadata": self.metadata, "tier_header": self.tier_header, "user_agent": self.user_agent,
                "tools": self.tools, "tool_choice": self.tool_choice, "images": self.images, "audio": self.audio,
                "prompt_tokens_estimate": self.prompt_tokens, "max_tokens": self.max_tokens, "n": self.n,
                "api": "responses" if self.responses else "chat", "unbridgeable": self.unbridgeable,
                "previous_response_id": self.continuation.response_id if self.continuation else None}


@dataclass(frozen=True, slots=True)
class Candidate:
    """One upstream to try: the upstream config and the model id to send it."""

    upstream: UpstreamConfig
    upstream_model: str


@dataclass(frozen=True, slots=True)
class Decision:
    """The route for one request.

    tier: the tier the matching rule chose; rule: its name; reason: one human sentence; model: the configured
    (alias-resolved) model name; candidates: upstreams in the order to try; fallback: why the first candidate
    is not on the chosen tier (``model_not_on_fast_tier``, ``context_window``, ``modality``), or None;
    trace: one line per earlier rule saying why it did not match; skipped: (upstream, reason) left out;
    index: the 1-based position of the matching rule (0 for the default); route: the matching rule's route (its
    deadline and hedging settings), or None; deadline: the deadline choice (``gateway.routing.deadline.Choice``) that
    ordered the candidates when the request had a latency budget, else None.
    """

    tier: Tier
    rule: str
    reason: str
    model: str
    candidates: tuple[Candidate, ...]
    fallback: str | None = None
    trace: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    index: int = 0
    route: RouteConfig | None = None
    deadline: Any = None


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


def _say(failed: tuple[Any, ...]) -> str:
    """A :meth:`Rule.failure` tuple in words."""
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
    """A compiled :class:`RuleConfig`: its checks (:meth:`failure`) and its description."""

    def __init__(self, cfg: RuleConfig) -> None:
        self.name = cfg.name
        self.route: RouteConfig = cfg.route
        self.match: MatchConfig = cfg.match
        self._headers = {k: _StrTest(v) for k, v in (cfg.match.headers or {}).items()}
        self._ua = _StrTest(cfg.match.user_agent) if cfg.match.user_agent else None
        self._checks = self._compile()

    def failure(self, f: RequestFacts) -> tuple[Any, ...] | None:
        """None when every condition holds, else (kind, details...) of the first failing one.

        The hot path calls this: it runs only the checks of the conditions the rule has, and only
        explanations format the details into words (``_say``).
        """
        for check in self._checks:
            failed = check(f)
            if failed is not None:
                return failed
        return None

    def _compile(self) -> list[Check]:
        """One small function per condition the rule has, in a fixed order (headers first: the cheapest)."""
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
        """The rule's conditions in one line, for ``tiergate check-config`` and explanations."""
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
    """The default policy for a config that has no ``rules:`` (see the module docstring)."""
    rules: list[dict[str, Any]] = []
    for tier in TIERS:
        rules.append({"name": "header", "match": {"headers": {TIER_HEADER: {"regex": rf"(?i)^\s*{tier}\s*$"}}},
                      "route": {"tier": tier}})
    rules.append({"name": "service_tier", "match": {"service_tier": ["priority"]}, "route": {"tier": "fast"}})
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
                trace.append(f"rule {i} {rule.name!r}: {_say(failed)}")
        cands, fallback, skipped = self._candidates(facts, model, route)
        decision = Decision(route.tier, name, reason, model, cands, fallback, tuple(trace), skipped, index, route)
        if facts.responses:
            decision = _responses_route(decision, facts, (u for u in self.config.upstreams if model in u.models))
        return decision

    def decide_listed(self, facts: RequestFacts, explain: bool = False) -> Decision:
        """The route of a chat-completions or Responses request for a model no upstream is configured for but the
        passthrough upstream lists (``gateway.pipeline.passthrough.UpstreamModels``): to that upstream, the model
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


def config_warnings(config: GatewayConfig) -> list[str]:
    """What ``tiergate check-config`` warns about: a config that is valid but cannot do what it says.

    * a rule whose conditions can never hold: a range that no number satisfies (``n: {gt: 5, lt: 2}``), model globs
      that match no model or alias the gateway serves;
    * a rule's tier that no upstream serves for a model it matches (those requests always fall back:
      ``model_not_on_<tier>_tier``);
    * a model served on one tier only while ``fallback`` is on: failover, spillover and deadline routing can never
      move its requests to the other tier.
    """
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
    if config.fallback:
        for model in sorted(tiers_of):
            if len(tiers_of[model]) == 1:
                (tier,) = tiers_of[model]
                other = "standard" if tier == "fast" else "fast"
                out.append(f"model {model}: served on the {tier} tier only: fallback, spillover and deadlines can "
                           f"never move its requests to the {other} tier (add a {other} upstream serving it)")
    return out


def _empty(r: Range) -> bool:
    """Whether no number satisfies the range."""
    lows = [(v, v == r.gt) for v in (r.gt, r.gte) if v is not None]
    highs = [(v, v == r.lt) for v in (r.lt, r.lte) if v is not None]
    if not lows or not highs:
        return False
    lo, lo_open = max(lows, key=lambda x: (x[0], x[1]))
    hi, hi_open = min(highs, key=lambda x: (x[0], not x[1]))
    return lo > hi or (lo == hi and (lo_open or hi_open))


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
