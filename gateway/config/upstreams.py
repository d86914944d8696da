"""One upstream of the config (``upstreams:``): where it is, which tier, its dialect, timeouts, health settings, models,
prices and what else of the API it serves."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Strict, Tier


class Timeouts(Strict):
    """Per-upstream timeouts in seconds.

    connect: TCP connect (and TLS) to the upstream; for chat and Responses requests the name lookup too.
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
        also how long the gateway reads on (counting tokens, sending nothing) for the usage when the client leaves
        after that; a client that leaves before the finish is read on for at most 1 s
        (``gateway.stream.relay.LEAVE_GRACE``).
    total: whole non-streaming request; streams have no total timeout.
    """

    connect: float = Field(5.0, gt=0)
    ttft: float | None = Field(None, gt=0)
    idle: float = Field(120.0, gt=0)
    finish_grace: float = Field(2.0, ge=0)
    total: float = Field(600.0, gt=0)


class HealthConfig(Strict):
    """Per-upstream health settings (``gateway.routing.health``); times in seconds.

    failures: consecutive failures that open the circuit breaker; open_seconds: how long it stays open before
    one probe is let through; cooldown_default / cooldown_max: rest after a 429 without / with a retry hint
    (the hint is capped); max_concurrent: requests in flight before new ones spill over (None: no limit);
    quota_reserve: remaining ``requests`` / ``tokens`` / ``uncached`` tokens to keep unused (spill over before
    going under);
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
    quota_reserve: dict[Literal["requests", "tokens", "uncached"], int] = {}


# OpenAI's service tiers (API reference, "Create a model response": ``service_tier``), slowest first: ``flex``; the
# standard processing of ``auto``, ``default`` and ``scale``; ``priority`` and its new name ``fast``; ``ultrafast``
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")
SPEED = {"flex": 0, "auto": 1, "default": 1, "scale": 1, "priority": 2, "fast": 2, "ultrafast": 3}
FAST_SERVICE_TIERS = frozenset({"priority", "fast", "ultrafast"})  # they ask for the fast tier


class PriceStep(Strict):
    """A provider's long-context price step: a request whose prompt is over ``above`` tokens costs these prices (USD
    per million tokens) for all its tokens (OpenAI prices its largest windows this way)."""

    above: int = Field(ge=1)
    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cached_input: float | None = Field(None, ge=0)


class Prices(Strict):
    """What an upstream charges, in USD per million tokens (``prompt_tokens`` includes the cached ones).

    cached_input: the price of cached prompt tokens; when absent they cost the ``input`` price. long_context: the
    price step of long prompts, or None. service_tiers: the prices of a request served at another ``service_tier``
    than the default (``priority``, ``fast``, ``ultrafast``, ``flex``, ...: what the upstream's answer says it served,
    else what the gateway asked), each with its own ``long_context`` if it has one.
    """

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cached_input: float | None = Field(None, ge=0)
    long_context: PriceStep | None = None
    service_tiers: dict[str, Prices] = {}

    @field_validator("service_tiers")
    @classmethod
    def _known_tiers(cls, value: dict[str, Prices]) -> dict[str, Prices]:
        unknown = sorted(set(value) - set(SERVICE_TIERS))
        if unknown:
            raise ValueError(f"unknown service tier(s) {', '.join(unknown)}: give {', '.join(SERVICE_TIERS)}")
        return value

    def per_token(self, service_tier: str | None = None, prompt_tokens: int = 0) -> tuple[float, float, float]:
        """(input, cached input, output) in USD per token, for a request served at ``service_tier`` (None, or one
        without prices of its own: the default's) with a prompt of ``prompt_tokens``."""
        priced = self.service_tiers.get(service_tier, self) if service_tier is not None else self
        step = priced.long_context
        if step is not None and prompt_tokens > step.above:
            return _per_token(step.input, step.cached_input, step.output)
        return _per_token(priced.input, priced.cached_input, priced.output)


def _per_token(input_: float, cached: float | None, output: float) -> tuple[float, float, float]:
    return input_ / 1e6, (input_ if cached is None else cached) / 1e6, output / 1e6


# The upstream dialects config accepts (each has its module: gateway.upstream.dialects.<name>) and the API surface
# each serves unless an upstream says otherwise: the Responses API (native or through the bridge) and the rest of /v1
# (paths under /v1; "*": all). Declared here because config is read, and routing decides, before any upstream exists.
Dialect = Literal["openai", "cerebras", "vllm", "groq"]
DIALECT_SURFACES: dict[str, tuple[Literal["native", "bridge", "none"], tuple[str, ...]]] = {
    "openai": ("native", ("*",)),  # OpenAI, Azure OpenAI, OpenRouter: the whole API
    "cerebras": ("bridge", ()),  # chat completions only
    "vllm": ("bridge", ("completions", "embeddings")),  # vLLM, SGLang, llama.cpp: Responses partial or missing
    "groq": ("bridge", ("audio", "files", "batches")),  # its Responses API is a beta without previous_response_id
}
# The service tiers each dialect's upstreams act on (a request sent with another is served, and billed, at the
# default tier unless the answer names one): OpenAI's own (API reference, "service_tier"); Groq's (its flex
# processing docs: on_demand, flex, performance, auto); none for Cerebras (its dialect drops the field: its tiers are
# a private preview, docs/reference/wire.md) and vLLM, which takes the field and ignores it
DIALECT_SERVICE_TIERS: dict[str, frozenset[str]] = {
    "openai": frozenset(SERVICE_TIERS), "groq": frozenset({"on_demand", "flex", "performance", "auto"}),
    "cerebras": frozenset(), "vllm": frozenset()}
# Seconds a prompt cache is believed warm after a request, by dialect, from each provider's documentation (the lower
# bound where it gives a range): OpenAI "typically clears caches within 5 to 10 minutes of inactivity"; Cerebras
# "guarantee[s] a Time-To-Live of 5 minutes"; Groq's cache "expires after 2 hours without use"; vLLM's prefix cache is
# evicted least recently used, with no time, so a busy server's five minutes are assumed (docs/sessions.md)
DIALECT_CACHE_TTL: dict[str, float] = {"openai": 300.0, "cerebras": 300.0, "vllm": 300.0, "groq": 7200.0}


class UpstreamConfig(Strict):
    """One upstream endpoint of a tier."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    tier: Tier
    base_url: str
    api_key_env: str | None = None
    dialect: Dialect = "openai"  # its behaviour: gateway.upstream.dialects.<name>
    # how it serves POST /v1/responses: natively, through the gateway's Responses <-> chat bridge, or not at all;
    # None: as its dialect does (DIALECT_SURFACES)
    responses: Literal["native", "bridge", "none"] | None = None
    # its Responses API offers WebSocket mode (``wss://.../v1/responses``: OpenAI's does): a client socket's messages
    # routed here go over one upstream socket held for that client socket; false: each as a streamed POST
    websocket: bool = False
    timeouts: Timeouts = Timeouts()
    models: dict[str, str] = Field(min_length=1)
    context_window: int | None = Field(None, ge=1)
    modalities: list[Literal["text", "image", "audio"]] = ["text", "image", "audio"]
    weight: int = Field(1, ge=1)
    # seconds its prompt cache is believed warm after a session's step (agent sessions keep a run here while it is);
    # None: its dialect's documented figure (DIALECT_CACHE_TTL); 0: it has no prompt cache
    cache_ttl: float | None = Field(None, ge=0)
    health: HealthConfig = HealthConfig()
    prices: Prices | None = None  # USD per million tokens of the models above; None: unpriced (no cost is recorded)
    # USD per million tokens by model name as the client sends it, for any model (embeddings, models only this
    # upstream lists, ...); overrides prices. A model priced by neither adds no cost (tiergate_unpriced_requests)
    model_prices: dict[str, Prices] = {}
    # the rest of the /v1 surface it serves (gateway.pipeline.passthrough): paths under /v1, each covering its sub-paths
    # ("audio" covers "audio/speech"), "*" for all; None: as its dialect does (DIALECT_SURFACES). Chat completions and
    # the Responses API are governed by models and responses.
    endpoints: list[str] | None = None
    # the OpenAI service tier this upstream *is* (``ultrafast``: the same model's fast tier on OpenAI's API): set on
    # every request on the way up, replacing the client's; None: the client's is forwarded (a fast one, priority, fast
    # or ultrafast, only where the request's gateway key may use the fast tier: gateway.admission)
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
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

    @model_validator(mode="after")
    def _socket_is_native(self) -> UpstreamConfig:
        if self.websocket and self.responses_mode != "native":
            raise ValueError(f"websocket: true needs the Responses API served natively; this upstream's is "
                             f"{self.responses_mode!r} (the bridge serves WebSocket mode over chat completions itself)")
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
        return DIALECT_SURFACES[self.dialect][1]

    def serves(self, path: str) -> bool:
        """Whether it serves ``path`` (under /v1, no leading slash: ``embeddings``, ``files/file-abc/content``)."""
        return any(mine == "*" or path == mine or path.startswith(mine + "/") for mine in self.endpoint_paths)

    def asks(self, client_tier: object, speed: bool = True) -> str | None:
        """The ``service_tier`` a request is sent with (the client's ``client_tier``, as parsed): this upstream's own,
        else the client's, but a fast one only where the request may have it (``speed``: its gateway key may use the
        fast tier) and, on a standard-tier upstream, where the upstream sells it (:meth:`honours`: OpenAI's priority
        processing, never a vLLM that would take the field and ignore it); None: none sent."""
        if self.service_tier is not None:
            return self.service_tier
        if not isinstance(client_tier, str):
            return None
        if client_tier in FAST_SERVICE_TIERS and (not speed or (self.tier == "standard" and
                                                               not self.honours(client_tier))):
            return None
        return client_tier

    def honours(self, service_tier: str | None) -> bool:
        """Whether this upstream acts on ``service_tier`` (its dialect's :data:`DIALECT_SERVICE_TIERS`): a request
        sent with one it does not is billed at the default tier unless its answer names another."""
        return service_tier is not None and service_tier in DIALECT_SERVICE_TIERS[self.dialect]

    @property
    def prompt_cache_ttl(self) -> float:
        """``cache_ttl``, or its default for the dialect (seconds)."""
        return self.cache_ttl if self.cache_ttl is not None else DIALECT_CACHE_TTL[self.dialect]

    @property
    def responses_mode(self) -> Literal["native", "bridge", "none"]:
        """``responses``, or its default for the dialect."""
        if self.responses is not None:
            return self.responses
        return DIALECT_SURFACES[self.dialect][0]

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
