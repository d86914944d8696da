"""The ``groq`` dialect: GroqCloud's OpenAI-compatible API (``https://api.groq.com/openai/v1``), a fast tier.

Facts (Groq's OpenAI-compatibility, rate-limit, flex-processing and error docs; the recorded ``groq_*`` fixtures):
the last chunk of a stream carries ``x_groq.usage`` (and ``usage`` when ``stream_options.include_usage`` asks); a
failure inside a stream is an ``error`` event whose error holds ``status_code`` (``tool_use_failed`` is 400, the
request's); rate-limit headers ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` with durations such as
``2m59.56s`` and a ``retry-after`` in seconds on a 429; ``service_tier`` takes Groq's own values (``on_demand``,
``flex``, ``performance``, ``auto``) and answers OpenAI's others (``default``, ``priority``, ``fast``,
``ultrafast``, ``scale``) with 400, so those are dropped (the gateway's routing has read them already; any other
value reaches Groq as sent); its flex tier answers ``498 capacity_exceeded`` when full, which Groq says to retry
later: a 503 to the gateway (the next candidate, else the client retries); the Responses API is a beta without
``previous_response_id``, so it is served through the bridge; ``/v1/audio``, ``/v1/files`` and ``/v1/batches`` by
the passthrough.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import UpstreamStatusError
from gateway.upstream.dialects.base import Dialect
from gateway.wire.body import remove_top_level

# OpenAI's service tiers, which Groq answers 400 (its own: on_demand, flex, performance, auto)
OPENAI_ONLY_TIERS = frozenset({"default", "priority", "fast", "ultrafast", "scale"})
CAPACITY_EXCEEDED = 498  # Groq's flex tier is full (its flex-processing docs: retry later)


class Groq(Dialect):
    """GroqCloud: OpenAI's rules, but an OpenAI-only ``service_tier`` is removed (its bytes only), and a full flex
    tier is the upstream's trouble, not the client's."""

    name = "groq"
    member = "x_groq"
    prompt_cache_key = False  # Groq's prompt cache is keyed by the prefix alone; the field is not in its API

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """As OpenAI's, without a ``service_tier`` only OpenAI knows."""
        tier = body.get("service_tier")
        if isinstance(tier, str) and tier in OPENAI_ONLY_TIERS:
            raw = remove_top_level(raw, b"service_tier")
            body = {k: v for k, v in body.items() if k != "service_tier"}
        return super().body(raw, body, upstream_model, ask_usage)

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        """``x_groq.usage`` (chat shape): a stream's last chunk carries it, asked for or not; counted where OpenAI's
        ``usage`` is missing. Its timing fields are not read."""
        usage = value.get("usage") if isinstance(value, dict) else None
        return (usage if isinstance(usage, dict) else None), None

    def status_error(self, status: int, data: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
        """As OpenAI's; ``498 capacity_exceeded`` becomes a 503 (retried elsewhere, and by the SDKs), Groq's words
        kept."""
        err = super().status_error(status, data, headers)
        if status == CAPACITY_EXCEEDED:
            return UpstreamStatusError(503, err.message, error_type="server_error", param=None,
                                       code=err.code or "capacity_exceeded", headers=err.headers)
        return err
