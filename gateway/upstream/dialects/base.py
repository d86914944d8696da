"""The dialect seam: what differs between upstream kinds, with the OpenAI API's behaviour as its default (modelled on
Envoy AI Gateway's ``internal/translator/``); no I/O, no state. Error bodies, rate-limit headers and a stream's end stay
general readers under it, so a mislabelled upstream still works: docs/architecture.md#general-readers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import GatewayError, UpstreamStatusError, event_error, upstream_error
from gateway.routing.ratelimits import Window, quota_report, retry_wait
from gateway.wire.body import openai_body


class Dialect:
    """One stateless instance serves every upstream of its kind. ``name`` is also the trace's ``gen_ai.provider.name``;
    ``member``: the top-level member its chunks add to OpenAI's, one at most (the relay looks in every parsed chunk)."""

    name: ClassVar[str] = "openai"
    member: ClassVar[str | None] = None
    vendors: ClassVar[tuple[Dialect, ...]] = ()  # set once by the package, when it has found the dialects
    # it takes ``prompt_cache_key`` (OpenAI API reference, "Create chat completion"): a session's steps get one made
    # from the session where the client sent none (``sessions.prompt_cache_key``)
    prompt_cache_key: ClassVar[bool] = True

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """Also asks for usage the client did not (``ask_usage``). Rules: docs/reference/wire.md#request-bodies."""
        return openai_body(raw, body, upstream_model, ask_usage)

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        """(usage in the chat shape, the upstream's own seconds by phase: ``queue``, ``prompt``, ``completion``,
        ``total``), each None when absent. Never raises for an odd value."""
        return None, None

    def vendor_usage(self, chunk: Mapping[str, Any]) -> dict[str, Any] | None:
        """Any dialect's member, so an upstream labelled with another dialect is still counted; asked on a stream's
        finishing chunk only (docs/architecture.md#general-readers)."""
        for vendor in self.vendors:
            value = chunk.get(vendor.member) if vendor.member is not None else None
            if value is not None:
                usage, _ = vendor.member_facts(value)
                if usage is not None:
                    return usage
        return None

    def answer_timings(self, headers: Mapping[str, str]) -> dict[str, float] | None:
        """``openai-processing-ms`` (OpenAI API reference, "Debugging requests") as ``total`` seconds."""
        value = headers.get("openai-processing-ms")
        try:
            seconds = float(value) / 1000.0 if value else math.nan
        except ValueError:
            return None
        return {"total": seconds} if math.isfinite(seconds) and seconds >= 0 else None

    def status_error(self, status: int, data: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
        """A 429 without a retry hint gets :meth:`retry_wait` as one: the SDKs wait on it."""
        err = upstream_error(status, data, headers)
        if err.status == 429 and "retry-after" not in err.headers and "retry-after-ms" not in err.headers:
            wait = self.retry_wait(headers)
            # both: the openai SDKs read retry-after-ms first, other clients retry-after
            if wait is not None and math.isfinite(wait):
                err.headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
                err.headers["retry-after"] = str(max(1, math.ceil(wait)))
        return err

    def cause(self, exc: GatewayError, upstream: UpstreamConfig, need_tokens: int) -> GatewayError:
        """What a failure means for this kind of upstream; ``need_tokens``: estimated prompt plus ``max_tokens``."""
        return exc

    def event_error(self, event: dict[str, Any]) -> UpstreamStatusError:
        return event_error(event)

    def quota_report(self, headers: Mapping[str, str]) -> dict[str, Window]:
        """The tightest window of each bucket (``gateway.routing.ratelimits.quota_report``)."""
        return quota_report(headers)

    def retry_wait(self, headers: Mapping[str, str]) -> float | None:
        """Seconds, or None: ``retry-after``, else the reset of the window it exhausted."""
        return retry_wait(headers)
