"""The YAML config: upstreams per tier, model maps, aliases and routing defaults, validated at start-up.

Shape (see ``config/gateway.yaml`` for a commented example)::

    default_tier: standard            # fast | standard
    upstreams:
      - name: cerebras                # unique, used in headers and metric labels
        tier: fast
        base_url: https://api.cerebras.ai/v1
        api_key_env: CEREBRAS_API_KEY # name of the env var holding the key; null = no key
        dialect: cerebras             # openai | cerebras: which request fields it accepts
        timeouts: {connect: 5, idle: 60, total: 600}   # seconds
        models: {gpt-oss-120b: gpt-oss-120b}           # client-facing name -> upstream model id
        prices: {input: 0.35, cached_input: 0.1, output: 0.75}   # USD per million tokens (optional)
    aliases:
      gpt-5.6-sol-fast: {model: gpt-5.6, tier: fast}   # a name that pins a tier
    workloads: {interactive: fast, agent: fast, batch: standard, eval: standard, background: standard}

A bad file raises :class:`gateway.errors.ConfigError` whose message names the file, the field path
and the problem; the process stops before it serves anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from gateway.errors import ConfigError

Tier = Literal["fast", "standard"]
TIERS: tuple[Tier, Tier] = ("fast", "standard")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    """Per-upstream timeouts in seconds.

    connect: TCP connect (and TLS) to the upstream.
    ttft: streams only: longest wait from sending the request to the first token-bearing event (status line
        included); past it, with nothing yet sent to the client, the next candidate is tried. When set, it and
        not ``idle`` bounds the silence before the first token (a model may think longer than ``idle`` allows
        between tokens). None: ``idle`` bounds it (reasoning models can think for minutes before their first
        visible token).
    idle: longest silence from the upstream between events once tokens flow (and, without ``ttft``, while
        waiting for the status line and the first token); a stream that stalls longer ends with an in-band
        error (detected within ``1.25 * idle``; bytes the upstream sent that wait for a slow client are not
        silence).
    finish_grace: once every choice has its ``finish_reason``, how long to wait for the rest of the stream (the
        usage chunk, ``[DONE]``) before ending the client's stream with ``[DONE]`` and closing the upstream;
        also how long the gateway reads on for usage when the client leaves after the finish.
    total: whole non-streaming request; streams have no total timeout.
    """

    connect: float = Field(5.0, gt=0)
    ttft: float | None = Field(None, gt=0)
    idle: float = Field(120.0, gt=0)
    finish_grace: float = Field(2.0, ge=0)
    total: float = Field(600.0, gt=0)


class HealthConfig(_Strict):
    """Per-upstream health settings (``gateway.routing.health``); times in seconds.

    failures: consecutive failures that open the circuit breaker; open_seconds: how long it stays open before
    one probe is let through; cooldown_default / cooldown_max: rest after a 429 without / with a retry hint
    (the hint is capped); max_concurrent: requests in flight before new ones spill over (None: no limit);
    quota_reserve: remaining ``requests`` / ``tokens`` to keep unused (spill over before going under);
    exhausted_cooldown: rest after a 429 that says the quota or credit is exhausted (``insufficient_quota``);
    queue_seconds: with ``max_concurrent``, wait up to this long for a free slot before spilling over (None:
    spill over at once).
    """

    failures: int = Field(5, ge=1)
    open_seconds: float = Field(30.0, gt=0)
    cooldown_default: float = Field(1.0, ge=0)
    cooldown_max: float = Field(60.0, ge=0)
    exhausted_cooldown: float = Field(300.0, ge=0)
    max_concurrent: int | None = Field(None, ge=1)
    queue_seconds: float | None = Field(None, gt=0)
    quota_reserve: dict[Literal["requests", "tokens"], int] = {}


class Prices(_Strict):
    """What an upstream charges, in USD per million tokens (``prompt_tokens`` includes the cached ones).

    cached_input: the price of cached prompt tokens; when absent they cost the ``input`` price.
    """

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cached_input: float | None = Field(None, ge=0)

    def per_token(self) -> tuple[float, float, float]:
        """(input, cached input, output) in USD per token."""
        cached = self.input if self.cached_input is None else self.cached_input
        return self.input / 1e6, cached / 1e6, self.output / 1e6


class UpstreamConfig(_Strict):
    """One upstream endpoint of a tier."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    tier: Tier
    base_url: str
    api_key_env: str | None = None
    dialect: Literal["openai", "cerebras"] = "openai"
    # how it serves POST /v1/responses: natively, through the gateway's Responses <-> chat bridge, or not at all;
    # None: native for the openai dialect, bridge for cerebras (whose API serves chat completions only)
    responses: Literal["native", "bridge", "none"] | None = None
    timeouts: Timeouts = Timeouts()
    models: dict[str, str] = Field(min_length=1)
    context_window: int | None = Field(None, ge=1)
    modalities: list[Literal["text", "image", "audio"]] = ["text", "image", "audio"]
    weight: int = Field(1, ge=1)
    health: HealthConfig = HealthConfig()
    prices: Prices | None = None  # USD per million tokens of the models above; None: unpriced (no cost is recorded)
    # USD per million tokens by model name as the client sends it, for any model (embeddings, models only this
    # upstream lists, ...); overrides prices. A model priced by neither adds no cost (tiergate_unpriced_requests)
    model_prices: dict[str, Prices] = {}
    # the rest of the /v1 surface it serves (gateway.pipeline.passthrough): paths under /v1, each covering its sub-paths
    # ("audio" covers "audio/speech"), "*" for all; None: all for the openai dialect, none for cerebras (whose API
    # serves chat completions only). Chat completions and the Responses API are governed by models and responses.
    endpoints: list[str] | None = None
    # send the client's own Authorization header to this upstream instead of the upstream's key (a sidecar in
    # front of applications that each hold their own OpenAI key); otherwise the client's key never leaves
    pass_client_key: bool = False

    @model_validator(mode="before")
    @classmethod
    def _no_max_connections(cls, value: object) -> object:
        if isinstance(value, dict) and "max_connections" in value:
            raise ValueError("max_connections is no longer a setting (it was never applied: each request in flight "
                             "has its own upstream connection); limit requests with health.max_concurrent")
        return value

    @model_validator(mode="after")
    def _one_key(self) -> UpstreamConfig:
        if self.pass_client_key and self.api_key_env is not None:
            raise ValueError("pass_client_key sends the client's own key: api_key_env would never be used (set it "
                             "to null)")
        return self

    @field_validator("endpoints")
    @classmethod
    def _endpoint_paths(cls, value: list[str] | None) -> list[str] | None:
        for path in value or ():
            if path != "*" and not re.fullmatch(r"[a-z0-9_]+(/[a-z0-9_]+)*", path):
                raise ValueError(f"{path!r}: give a path under /v1 such as 'embeddings' or 'audio/speech', or '*'")
        return value

    @property
    def endpoint_paths(self) -> tuple[str, ...]:
        """``endpoints``, or its default for the dialect."""
        if self.endpoints is not None:
            return tuple(self.endpoints)
        return () if self.dialect == "cerebras" else ("*",)

    def serves(self, path: str) -> bool:
        """Whether it serves ``path`` (under /v1, no leading slash: ``embeddings``, ``files/file-abc/content``)."""
        return any(mine == "*" or path == mine or path.startswith(mine + "/") for mine in self.endpoint_paths)

    @property
    def responses_mode(self) -> Literal["native", "bridge", "none"]:
        """``responses``, or its default for the dialect."""
        if self.responses is not None:
            return self.responses
        return "bridge" if self.dialect == "cerebras" else "native"

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        try:
            urlsplit(value).port  # noqa: B018 - urllib checks the port when it is read
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from exc
        return value.rstrip("/")


class StrMatch(_Strict):
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


class Range(_Strict):
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


class MatchConfig(_Strict):
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


class RouteConfig(_Strict):
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


class RuleConfig(_Strict):
    """One routing rule: a name (reported in ``x-tiergate-rule``), conditions, and a route."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    match: MatchConfig = MatchConfig()
    route: RouteConfig


class AliasConfig(_Strict):
    """A client-facing model name that stands for a configured model, optionally pinned to a tier."""

    model: str
    tier: Tier | None = None


class ResponseStore(_Strict):
    """Bounds of the gateway's store of bridged Responses API responses (``store: true``, the API's default), kept so
    that ``previous_response_id`` can continue them and ``GET``/``DELETE /v1/responses/{id}`` reach them. In memory,
    per process (``gateway.responses.store``). max_items: responses kept; max_bytes: the memory they may take (their
    JSON bytes, which is how they are held, plus 256 bytes each); ttl: seconds a response is kept after it was made or
    last continued; key_share: the share of both bounds one gateway key may hold (``auth:``). The oldest go first (a
    key over its share: its own oldest). The default 64 MiB fits the shipped container limit (512 MiB) beside the
    process (~85 MiB) and hundreds of streams."""

    max_items: int = Field(10_000, ge=1)
    max_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    ttl: float = Field(3600.0, gt=0)
    key_share: float = Field(0.25, gt=0, le=1)


class Limits(_Strict):
    """Size limits in bytes. max_request_bytes: a JSON request body (chat completions, Responses, and the JSON
    bodies of the other endpoints, which are read whole to route on their ``model``); max_event_bytes: one SSE
    event; max_passthrough_bytes: any other body (file uploads, audio), streamed to the upstream as it arrives and
    never held whole (OpenAI's own file limit is 512 MB); max_bytes_in_flight: the JSON request bodies held in memory
    at once, in all (past it, 503 ``gateway_busy``); key_share: the share of that one gateway key may hold (past it,
    429 ``request_bytes_in_flight``). The defaults fit the shipped container limit (512 MiB) with the process, the
    response store and hundreds of streams."""

    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_event_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_passthrough_bytes: int = Field(1024 * 1024 * 1024, ge=1024)
    max_bytes_in_flight: int = Field(128 * 1024 * 1024, ge=1024)
    key_share: float = Field(0.25, gt=0, le=1)


class PassthroughConfig(_Strict):
    """The rest of the /v1 surface (``gateway.pipeline.passthrough``). upstream: where object paths (``/v1/files/...``,
    ``/v1/batches/...``) and bodies whose model no upstream lists go; None: the first standard-tier upstream of the
    ``openai`` dialect that serves any endpoint, else the first upstream that does; enabled: false answers 404 for
    everything but chat completions, the Responses API and the gateway's own paths; models_ttl: seconds the
    upstream's ``/v1/models`` list is cached for the gateway's; models_timeout: seconds to wait for that list."""

    enabled: bool = True
    upstream: str | None = None
    models_ttl: float = Field(60.0, ge=0)
    models_timeout: float = Field(2.0, gt=0)
    objects: ObjectsConfig = Field(default_factory=lambda: ObjectsConfig())


class ObjectsConfig(_Strict):
    """With gateway keys, which key made which object of the rest of the API (``gateway.tenancy.objects``): max_items:
    ids kept in each process (the least recently made go first; with shared state Redis keeps them all); ttl: seconds an
    id stays its key's (30 days: OpenAI's longest retention of batch and response objects)."""

    max_items: int = Field(100_000, ge=1)
    ttl: float = Field(30 * 86400.0, gt=0)


class EstimatesConfig(_Strict):
    """Live latency estimates per upstream and model (``gateway.observability.estimates``), read by deadline routing and
    hedging.

    window: seconds of traffic an estimate reflects (older samples age out; with none left the candidate is
    unmeasured); samples: the newest samples kept per upstream and model (and per route for completion lengths);
    explore: the share (0-1) of deadline-routed requests sent instead to a candidate predicted too slow or unmeasured
    that no other traffic measures (no sample in the last ``window / samples`` seconds), so that a tier that recovers
    is noticed (``tiergate_deadline_decisions_total{verdict="explore"}``); probe: seconds
    between re-measures of an unmeasured candidate (one request is sent to it, whatever its prediction would be).
    """

    window: float = Field(60.0, gt=0)
    samples: int = Field(64, ge=1, le=4096)
    explore: float = Field(0.05, ge=0, le=1)
    probe: float = Field(10.0, gt=0)


class StateConfig(_Strict):
    """State shared by replicas through Redis (``gateway.state.redis``): quota estimates with every replica's
    reservations, 429 cooldowns, breaker transitions and the Responses store. Off without a URL: each process keeps its
    own.

    redis_url: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS, ``unix://`` for a socket); the environment
    variable ``GATEWAY_REDIS_URL`` gives it instead, and wins (a password then stays out of the file, in a Secret;
    see :func:`load_config`); timeout: seconds the gateway waits for
    Redis on a request's path before it goes on with its local state (then it stops asking until Redis answers a
    ping again); retry: seconds between those pings; key_prefix: the prefix of every key and of the channel, so
    that several gateways may share one Redis.
    """

    redis_url: str | None = None
    timeout: float = Field(0.1, gt=0, le=10)
    retry: float = Field(1.0, gt=0, le=60)
    key_prefix: str = Field("tiergate", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not _redis_url(v):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return v


class KeyLimits(_Strict):
    """What one gateway key may spend (``gateway.tenancy.keys``; None: no limit). Minutes are fixed windows (the current
    UTC minute), days and months UTC calendar ones; tokens are the request's estimate (prompt bytes / 4 plus its
    ``max_tokens``) while it runs, then its usage; USD from its usage at the serving upstream's ``prices``, as
    ``tiergate_cost_usd_total``."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    usd_per_day: float | None = Field(None, gt=0)
    usd_per_month: float | None = Field(None, gt=0)


class KeyConfig(_Strict):
    """One gateway key (``auth.keys``).

    name: how metrics and the request log name it (never the key itself); sha256: the hex SHA-256 of the key
    (``tiergate keys add NAME`` makes a key and prints this line); tiers: the tiers its requests may use (a request
    for another is served by one of these, ``x-tiergate-fallback: key_tier``); metadata: defaults routing reads as if
    the client had sent them in ``metadata`` (the client's own win); limits: requests, tokens and USD it may spend
    (over them: 429); fast: its allowance on the fast tier (over it, its requests spill to the standard tier,
    ``x-tiergate-fallback: key_allowance``).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tiers: list[Tier] = Field(default_factory=lambda: list(TIERS), min_length=1)
    metadata: dict[str, str] = {}
    limits: KeyLimits = KeyLimits()
    fast: KeyLimits = KeyLimits()


class MetricsAccess(_Strict):
    """Who may read ``/metrics`` when gateway keys are on: it names every key and what each spent, which one tenant
    must not read of another. sha256: the hex SHA-256 of each scrape token (``tiergate keys add NAME --metrics``;
    Prometheus sends it as ``authorization: {credentials: ...}``): a scrape token reads ``/metrics`` and nothing else,
    and no gateway key reads ``/metrics``; public: anyone who reaches the port reads it (as without keys), for a port
    only the monitoring network reaches."""

    sha256: list[str] = []
    public: bool = False

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        if any(re.fullmatch(r"[0-9a-f]{64}", h) is None for h in v):
            raise ValueError("each entry is the hex SHA-256 of a scrape token (tiergate keys add NAME --metrics)")
        return v


class AuthConfig(_Strict):
    """Gateway keys (``gateway.tenancy.keys``): with this section every ``/v1`` request must carry one (``Authorization:
    Bearer`` or ``api-key``). keys: the keys; keys_file: a YAML file with more (a list of the same entries, e.g. a
    mounted Secret), read with the config (and again on ``SIGHUP``); metrics: who may read ``/metrics``
    (:class:`MetricsAccess`; by default a scrape token)."""

    keys: list[KeyConfig] = []
    keys_file: Path | None = None
    metrics: MetricsAccess = MetricsAccess()

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        for what in ("name", "sha256"):
            seen = [getattr(k, what) for k in self.keys]
            if len(set(seen)) < len(seen):
                raise ValueError(f"each key needs its own {what}")
        return self


REDIS_URL_VAR = "GATEWAY_REDIS_URL"


def _redis_url(url: str) -> bool:
    return urlsplit(url).scheme in ("redis", "rediss", "unix")


class GatewayConfig(_Strict):
    """The whole validated config file."""

    default_tier: Tier = "standard"
    fallback: bool = True
    max_attempts: int = Field(2, ge=1, le=10)
    upstreams: list[UpstreamConfig] = Field(min_length=1)
    aliases: dict[str, AliasConfig] = {}
    workloads: dict[str, Tier] = {
        "interactive": "fast",
        "agent": "fast",
        "batch": "standard",
        "eval": "standard",
        "background": "standard",
    }
    limits: Limits = Limits()
    passthrough: PassthroughConfig = PassthroughConfig()
    response_store: ResponseStore = ResponseStore()
    estimates: EstimatesConfig = EstimatesConfig()
    state: StateConfig = StateConfig()
    auth: AuthConfig | None = None
    long_prompt_tokens: int = Field(32768, ge=1)
    rules: list[RuleConfig] | None = None

    @model_validator(mode="after")
    def _cross_check(self) -> GatewayConfig:
        names = [u.name for u in self.upstreams]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"upstream names must be unique; repeated: {', '.join(dupes)}")
        tiers = {u.name: u.tier for u in self.upstreams}
        seen: dict[str, str] = {}
        for i, rule in enumerate(self.rules or []):
            where = f"rule {i + 1} {rule.name!r} (rules.{i})"  # numbered from 1, as check-config lists them
            up = rule.route.upstream
            if up is not None and up not in tiers:
                raise ValueError(f"{where}: route.upstream {up!r} is not a configured upstream")
            if up is not None and tiers[up] != rule.route.tier:
                raise ValueError(f"{where}: upstream {up!r} is on the {tiers[up]} tier, not {rule.route.tier}")
            key = rule.match.model_dump_json(exclude_none=True)
            if key in seen:
                raise ValueError(f"{where}: unreachable: {seen[key]} has the same conditions and comes first")
            if "{}" in seen:
                raise ValueError(f"{where}: unreachable: {seen['{}']} matches every request and comes first")
            seen[key] = where
        named = self.passthrough.upstream
        if named is not None and named not in tiers:
            raise ValueError(f"passthrough.upstream: {named!r} is not a configured upstream")
        served = {m for u in self.upstreams for m in u.models}
        for alias, target in self.aliases.items():
            if alias in served:
                raise ValueError(f"aliases.{alias}: the alias shadows a model an upstream serves")
            if target.model not in served:
                raise ValueError(f"aliases.{alias}.model: no upstream serves {target.model!r}")
            if target.tier and not any(target.model in u.models for u in self.upstreams if u.tier == target.tier):
                raise ValueError(f"aliases.{alias}: no {target.tier} upstream serves {target.model!r}")
        return self

    @model_validator(mode="after")
    def _keys_stay_here(self) -> GatewayConfig:
        passing = [u.name for u in self.upstreams if u.pass_client_key]
        if self.auth is not None and passing:
            raise ValueError(f"auth: with gateway keys the client's Authorization is its gateway key, which never "
                             f"reaches an upstream; pass_client_key is set on {', '.join(passing)}")
        return self

    @property
    def passthrough_upstream(self) -> UpstreamConfig | None:
        """Where object paths and unlisted models go (:class:`PassthroughConfig`), or None (passthrough is off)."""
        pt = self.passthrough
        if not pt.enabled:
            return None
        if pt.upstream is not None:
            return next(u for u in self.upstreams if u.name == pt.upstream)
        serving = [u for u in self.upstreams if u.endpoint_paths]
        return next((u for u in serving if u.tier == "standard" and u.dialect == "openai"),
                    serving[0] if serving else None)

    def model_names(self) -> list[str]:
        """Every client-facing model name: served models then aliases, sorted."""
        return sorted({m for u in self.upstreams for m in u.models} | set(self.aliases))


class LoadedConfig:
    """A validated config plus the upstream keys resolved from the environment.

    Attributes:
        path: the file it came from.
        config: the validated :class:`GatewayConfig`.
        keys: upstream name -> API key (absent when ``api_key_env`` is null).
        redis_url: where the shared state is (``GATEWAY_REDIS_URL``, else ``state.redis_url``), or None (each process
            keeps its own).
    """

    def __init__(self, path: Path, config: GatewayConfig, keys: dict[str, SecretStr],
                 redis_url: SecretStr | None = None) -> None:
        self.path = path
        self.config = config
        self.keys = keys
        self.redis_url = redis_url


def load_config(path: Path, environ: Mapping[str, str] | None = None, *, require_keys: bool = True) -> LoadedConfig:
    """Read, validate and resolve a config file.

    Args:
        path: YAML file.
        environ: where ``api_key_env`` variables are looked up (``gateway.config.settings.environ()``).
        require_keys: when true, a named key variable that is unset or empty is an error.

    Raises:
        ConfigError: the file is missing, is not YAML, fails validation, or a key is missing; the message
            names the file, the field and the problem.
    """
    raw = _read_yaml(path, path, "")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    _read_keys_file(path, raw)
    try:
        config = GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid config:\n{_describe(exc)}") from exc
    keys: dict[str, SecretStr] = {}
    env = environ or {}
    missing = []
    for upstream in config.upstreams:
        if upstream.api_key_env is None:
            continue
        value = env.get(upstream.api_key_env, "")
        if value:
            keys[upstream.name] = SecretStr(value)
        else:
            missing.append(f"  upstreams[{upstream.name}].api_key_env: environment variable {upstream.api_key_env} "
                           f"is not set (it holds the API key of upstream {upstream.name!r})")
    if missing and require_keys:
        raise ConfigError(f"{path}: missing API keys:\n" + "\n".join(missing))
    url = env.get(REDIS_URL_VAR) or config.state.redis_url  # the environment wins (12-factor), as for keys
    if url and not _redis_url(url):
        raise ConfigError(f"{path}: {REDIS_URL_VAR}: expected a redis://, rediss:// or unix:// URL (it says where "
                          "the replicas share state)")
    return LoadedConfig(path, config, keys, SecretStr(url) if url else None)


def _read_yaml(path: Path, where: Path, field: str) -> object:
    """The YAML document in ``where`` (the config file ``path`` itself, or a file its ``field`` names).

    Raises:
        ConfigError: it cannot be read or is not YAML; the message names the config file and the field.
    """
    what = "config file" if where == path else str(where)
    try:
        return yaml.safe_load(where.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: {field}cannot read {what}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {field}{'' if where == path else f'{where} is '}not valid YAML: {exc}") from exc


def _read_keys_file(path: Path, raw: dict[str, object]) -> None:
    """Add the entries of ``auth.keys_file`` (relative to the config file's folder) to ``auth.keys`` in ``raw``, so that
    they are validated with the rest (their field paths then count on from the file's own keys)."""
    auth = raw.get("auth")
    if not isinstance(auth, dict) or not auth.get("keys_file"):
        return
    where = path.parent / str(auth["keys_file"])
    extra = _read_yaml(path, where, "auth.keys_file: ")
    if not isinstance(extra, list):
        raise ConfigError(f"{path}: auth.keys_file: {where} must hold a list of keys")
    auth["keys"] = [*(auth.get("keys") or []), *extra]


def _describe(exc: ValidationError) -> str:
    """One line per error: the field path (``rules.2.route.tier``; a rule also by its number from 1, as
    ``tiergate check-config`` lists them) and the problem."""
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        where = ".".join(str(p) for p in loc) or "(top level)"
        if len(loc) > 1 and loc[0] == "rules" and isinstance(loc[1], int):
            where = f"rule {loc[1] + 1} ({where})"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)
