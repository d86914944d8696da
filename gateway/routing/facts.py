"""What routing reads of a request (:class:`RequestFacts`) and what it decides (:class:`Decision`). Pure code, no
I/O: every fact comes from the body and headers passed in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.base import Tier
from gateway.config.routes import RouteConfig
from gateway.config.upstreams import UpstreamConfig

TIER_HEADER = "x-tiergate-tier"


BYTES_PER_TOKEN = 4  # OpenAI's rule of thumb for English text: ~4 characters per token


_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


_AUDIO_PARTS = frozenset({"input_audio", "audio"})


Bridgeable = Callable[[Mapping[str, Any]], "tuple[str, str, str] | None"]
Droppable = Callable[[Mapping[str, Any]], "tuple[str, ...]"]


class _lazy:  # noqa: N801 - a decorator, named like functools.cached_property
    """Compute an attribute on first use and store it on the instance: ``functools.cached_property`` without the lock
    it takes on every access in Python 3.11, which made it the costliest part of routing."""

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
    """What the gateway knows of the response a Responses request continues (``previous_response_id``).

    ``upstream``: made natively there, so only it can continue it (affinity); ``held``: made through the bridge, the
    gateway holds the conversation (``history``) and any upstream may continue it; neither: made elsewhere, only a
    native upstream might know it. ``session``: the agent session it was a step of."""

    response_id: str
    upstream: str | None = None
    held: bool = False
    history: tuple[dict[str, Any], ...] = ()
    session: str | None = None


class RequestFacts:
    """Each fact computed on first use. ``headers`` have lower-case names; ``size``: the body's length in bytes;
    ``bridgeable``: the Responses bridge's check behind :attr:`RequestFacts.unbridgeable`, passed in so that routing
    imports no translator (``droppable`` likewise, behind :attr:`RequestFacts.droppable_tools`); ``defaults``:
    ``metadata`` read as if the client had sent it, under what it did send (its gateway key's)."""

    def __init__(self, body: Mapping[str, Any], headers: Mapping[str, str], size: int = 0, *,
                 responses: bool = False, continuation: Continuation | None = None,
                 defaults: Mapping[str, str] | None = None, bridgeable: Bridgeable | None = None,
                 droppable: Droppable | None = None) -> None:
        self._bridgeable = bridgeable
        self._droppable = droppable
        self.defaults = defaults
        self.body = body
        self.headers = headers
        self.size = size
        self.model: str = body["model"]
        self.responses = responses
        self.continuation = continuation

    @_lazy
    def unbridgeable(self) -> tuple[str, str, str] | None:
        """(param, why, code) of what the bridge cannot serve (``gateway.responses.request.unbridgeable``)."""
        return self._bridgeable(self.body) if self.responses and self._bridgeable is not None else None

    @_lazy
    def droppable_tools(self) -> tuple[str, ...]:
        """The hosted tools offered, none forced, without which the bridge could serve it
        (``gateway.responses.request.droppable_tools``)."""
        return self._droppable(self.body) if self.responses and self._droppable is not None else ()

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
        """Request bytes / 4, rounded up: cheap and offline, no tokenizer on the hot path."""
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
    upstream: UpstreamConfig
    upstream_model: str


@dataclass(frozen=True, slots=True)
class Decision:
    """The route for one request. ``model`` is alias-resolved; ``fallback``: why the first candidate is not on the
    chosen tier (``x-tiergate-fallback``), or None; ``trace``: why each earlier rule did not match (explanations
    only); ``index``: the matching rule's 1-based position, 0 for the default; ``deadline``: the
    ``gateway.routing.deadline.Choice`` that ordered the candidates when the request had a latency budget."""

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
    dropped_tools: tuple[str, ...] = ()  # hosted tools a bridged upstream is served without (x-tiergate-tools-dropped)
