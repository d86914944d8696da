"""The YAML config: upstreams per tier, model maps, aliases and routing defaults, validated at start-up.

Shape (see ``config/gateway.yaml`` for a commented example)::

    default_tier: standard            # fast | standard
    upstreams:
      - name: cerebras                # unique, used in headers and metric labels
        tier: fast
        base_url: https://api.cerebras.ai/v1
        api_key_env: CEREBRAS_API_KEY # name of the env var holding the key; null = no key
        dialect: cerebras             # one of gateway.config.upstreams.Dialect (gateway.upstream.dialects)
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

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config.auth import AuthConfig
from gateway.config.base import Strict, Tier
from gateway.config.routes import AliasConfig, RuleConfig
from gateway.config.scheduling import SchedulingConfig
from gateway.config.sessions import SessionsConfig
from gateway.config.upstreams import UpstreamConfig


class ResponseStore(Strict):
    """Bounds of the gateway's store of bridged Responses API responses (``store: true``, the API's default), kept so
    that ``previous_response_id`` can continue them and ``GET``/``DELETE /v1/responses/{id}`` reach them. In memory,
    per process (``gateway.responses.store``); with shared state Redis holds as much of every replica's records
    together, one key its share (``gateway.state.store``). max_items: responses kept; max_bytes: the memory they may
    take (their JSON bytes, which is how they are held, plus 256 bytes each); ttl: seconds a response is kept after it
    was made or last continued; key_share: the share of both bounds one gateway key may hold (``auth:``). The oldest go
    first (a key over its share: its own oldest). The default 64 MiB fits the shipped container limit (512 MiB) beside
    the process (~85 MiB) and hundreds of streams."""

    max_items: int = Field(10_000, ge=1)
    max_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    ttl: float = Field(3600.0, gt=0)
    key_share: float = Field(0.25, gt=0, le=1)


class AnswersConfig(Strict):
    """What the gateway adds to an answer so that the client's own trackers (LiteLLM's cost callbacks, Langfuse) can
    name and price it (docs/metrics.md#cost-in-answers). model: ``upstream`` names the model as the upstream did (the
    answer untouched, the default), ``requested`` as the client asked for it (an alias such as ``gpt-5.6-sol-fast``),
    in whole answers and in every chunk of a stream; cost: ``header`` sends the USD the gateway computed as
    ``x-tiergate-cost-usd`` and LiteLLM's ``x-litellm-response-cost`` on whole answers (the default), ``usage`` also
    writes it as ``usage.cost`` in whole answers and in a stream's final usage chunk where the client asked for usage,
    as OpenRouter does, ``off`` neither. Unpriced answers carry no cost."""

    model: Literal["upstream", "requested"] = "upstream"
    cost: Literal["off", "header", "usage"] = "header"


class WebSocketLimits(Strict):
    """Bounds of the Responses API's WebSocket mode (``GET /v1/responses`` upgraded; docs: WebSocket mode).

    max_message_bytes: one client message (a ``response.create`` with its input); a larger one closes the socket with
    1009 (message too big), the limit in the close reason (enforced by the server protocol as it reads: a change takes
    a restart); idle: seconds a socket may stay open with nothing in flight and no message from its client, then it is
    closed with 1000 and the reason ``idle_timeout``; sockets_per_key: sockets one gateway key may hold open at once
    (without ``auth:``, every client together; counted per process), past it the handshake is answered 429
    ``websocket_connection_limit_reached``; in_flight: ``response.create`` messages of one socket queued or being
    served at once (across its ``stream_id`` lanes), past it the message is answered with an ``error`` event (429
    ``too_many_requests_in_flight``); memory_bytes: what one socket keeps of the responses it made so that
    ``previous_response_id`` continues them even with ``store: false`` (their JSON bytes; the oldest go first);
    memory_bytes_total: what all sockets of a process keep so, of which one gateway key's sockets hold at most
    ``limits.key_share`` (past its share, the key's largest socket drops its oldest responses; past the total, the
    largest socket of the key that keeps the most does)."""

    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    idle: float = Field(300.0, gt=0)
    sockets_per_key: int = Field(64, ge=1)
    in_flight: int = Field(16, ge=1)
    memory_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    memory_bytes_total: int = Field(64 * 1024 * 1024, ge=1024)


class Limits(Strict):
    """Size limits in bytes. max_request_bytes: a JSON request body (chat completions, Responses, and the JSON
    bodies of the other endpoints, which are read whole to route on their ``model``); max_event_bytes: one SSE
    event; max_passthrough_bytes: any other body (file uploads, audio), streamed to the upstream as it arrives and
    never held whole (OpenAI's own file limit is 512 MB); max_bytes_in_flight: the JSON request bodies held in memory
    at once, in all (past it, 503 ``gateway_busy``); key_share: the share of that one gateway key may hold (past it,
    429 ``request_bytes_in_flight``); websocket: the WebSocket mode's bounds. The defaults fit the shipped
    container limit (512 MiB) with the process, the response store and hundreds of streams."""

    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_event_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_passthrough_bytes: int = Field(1024 * 1024 * 1024, ge=1024)
    max_bytes_in_flight: int = Field(128 * 1024 * 1024, ge=1024)
    key_share: float = Field(0.25, gt=0, le=1)
    websocket: WebSocketLimits = WebSocketLimits()


class PassthroughConfig(Strict):
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


class ObjectsConfig(Strict):
    """With gateway keys, which key made which object of the rest of the API (``gateway.tenancy.objects``): max_items:
    ids kept in each process (the least recently made go first; with shared state Redis keeps them all); ttl: seconds an
    id stays its key's (30 days: OpenAI's longest retention of batch and response objects)."""

    max_items: int = Field(100_000, ge=1)
    ttl: float = Field(30 * 86400.0, gt=0)


class EstimatesConfig(Strict):
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


class StateConfig(Strict):
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
        if v is not None and not is_redis_url(v):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return v


def is_redis_url(url: str) -> bool:
    """Whether ``url`` is one redis-py connects to: ``redis://``, ``rediss://`` (TLS) or ``unix://``."""
    return urlsplit(url).scheme in ("redis", "rediss", "unix")


class GatewayConfig(Strict):
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
    answers: AnswersConfig = AnswersConfig()
    estimates: EstimatesConfig = EstimatesConfig()
    state: StateConfig = StateConfig()
    auth: AuthConfig | None = None
    sessions: SessionsConfig = SessionsConfig()
    long_prompt_tokens: int = Field(32768, ge=1)
    rules: list[RuleConfig] | None = None
    scheduling: SchedulingConfig | None = None

    @model_validator(mode="after")
    def _classes_known(self) -> GatewayConfig:
        named = [(k.name, k.priority_class) for k in (self.auth.keys if self.auth is not None else [])
                 if k.priority_class is not None]
        if named and self.scheduling is None:
            raise ValueError(f"auth.keys: {named[0][0]!r} names class {named[0][1]!r}, but there is no scheduling:")
        for name, cls in named:
            if self.scheduling is not None and cls not in [c.name for c in self.scheduling.classes]:
                raise ValueError(f"auth.keys: {name!r} names class {cls!r}, which scheduling.classes does not have")
        return self

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
