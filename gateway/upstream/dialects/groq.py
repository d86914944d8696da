"""The ``groq`` dialect: GroqCloud's OpenAI-compatible API, a fast tier. Facts (Groq's OpenAI-compatibility, rate-limit,
flex-processing and error docs; the ``groq_*`` fixtures): usage in ``x_groq.usage``; ``service_tier`` answers OpenAI's
own values 400; a full flex tier answers ``498 capacity_exceeded``, to retry later; the Responses API lacks
``previous_response_id`` (bridged)."""

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
    """OpenAI's rules; an OpenAI-only ``service_tier`` is removed, and a full flex tier is the upstream's trouble."""

    name = "groq"
    member = "x_groq"
    prompt_cache_key = False  # Groq's prompt cache is keyed by the prefix alone; the field is not in its API

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        tier = body.get("service_tier")
        if isinstance(tier, str) and tier in OPENAI_ONLY_TIERS:
            raw = remove_top_level(raw, b"service_tier")
            body = {k: v for k, v in body.items() if k != "service_tier"}
        return super().body(raw, body, upstream_model, ask_usage)

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        usage = value.get("usage") if isinstance(value, dict) else None
        return (usage if isinstance(usage, dict) else None), None

    def status_error(self, status: int, data: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
        """A 498 becomes a 503: retried on the next candidate, and by the SDKs."""
        err = super().status_error(status, data, headers)
        if status == CAPACITY_EXCEEDED:
            return UpstreamStatusError(503, err.message, error_type="server_error", param=None,
                                       code=err.code or "capacity_exceeded", headers=err.headers)
        return err
