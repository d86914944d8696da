"""The dialect seam: what differs between upstream kinds, as one interface (:class:`Dialect`) with the OpenAI API's
behaviour as its default, and one module per dialect beside this one that overrides what its upstreams do otherwise.

A dialect answers, for one attempt: the request bytes to send (:meth:`Dialect.body`: fields it rejects dropped or
rewritten); the member its chunks and whole answers add to OpenAI's, and the usage or timings it holds
(:attr:`Dialect.member`, :meth:`Dialect.member_facts`: the relay is handed the dialect for that; the usage any
dialect's member holds is read whatever the upstream's dialect, :meth:`Dialect.vendor_usage`), and the timings a
whole answer's headers report (:meth:`Dialect.answer_timings`); what an error answer or an error event means
(:meth:`Dialect.status_error`, :meth:`Dialect.event_error`) and what a failure means for it (:meth:`Dialect.cause`);
what its rate-limit headers report (:meth:`Dialect.quota_report`) and how long a 429 asks to wait
(:meth:`Dialect.retry_wait`). Which API surface it serves by default (the Responses API natively or through the bridge,
the rest of ``/v1``) is declared with its name in ``gateway.config.upstreams`` (config is read before any upstream
exists). Chosen per upstream by ``dialect:`` (:func:`gateway.upstream.dialects.of`).

Three readers stay general on purpose, with this interface over them so that a dialect can still override: error
bodies and error events (``gateway.errors``), rate-limit headers (``gateway.routing.ratelimits``) and a stream's end
(the relay adds a missing ``[DONE]`` for any upstream). Why: docs/architecture.md#general-readers.

Envoy AI Gateway's ``internal/translator/`` (one interface, one file per provider) is the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import GatewayError, UpstreamStatusError, event_error, upstream_error
from gateway.routing.ratelimits import Window, quota_report, retry_wait
from gateway.wire.body import openai_body


class Dialect:
    """An upstream kind (module docstring). Instances hold no state: one per dialect serves every upstream of it.

    Attributes:
        name: as ``dialect:`` names it, and the trace's ``gen_ai.provider.name``; prompt_cache_key: it takes one.
        member: the top-level member its chunks (and whole answers) add to OpenAI's to report usage or timings of
            their own (read by :meth:`member_facts`), or None: OpenAI's members only. The relay looks for it in every
            chunk it parses, so a dialect names one member at most; for usage, every dialect's member is read on a
            stream's finishing chunk whatever the upstream's own dialect (:meth:`vendor_usage`).
        vendors: every dialect that names a member, as the package found them (``gateway.upstream.dialects``).
    """

    name: ClassVar[str] = "openai"
    member: ClassVar[str | None] = None
    vendors: ClassVar[tuple[Dialect, ...]] = ()  # set once by the package, when it has found the dialects
    # whether it takes ``prompt_cache_key`` (OpenAI API reference, "Create chat completion" and "Create a model
    # response": a key that routes requests sharing a prefix to the same cache); an agent session's steps are sent
    # one made from the session where the client sent none (``sessions.prompt_cache_key``)
    prompt_cache_key: ClassVar[bool] = True

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """The bytes of one attempt's request: the client's ``raw`` (``body`` parsed) for ``upstream_model``, with
        ``stream_options.include_usage: true`` when ``ask_usage`` (the client did not ask, the gateway does, so that
        every stream is counted). Rules: docs/reference/wire.md#request-bodies."""
        return openai_body(raw, body, upstream_model, ask_usage)

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        """What :attr:`member`'s ``value`` says: (usage in the chat shape, or None; the upstream's own seconds by
        phase, ``queue``, ``prompt``, ``completion`` or ``total``, or None). OpenAI adds no member: (None, None).
        Never raises for an odd value."""
        return None, None

    def vendor_usage(self, chunk: Mapping[str, Any]) -> dict[str, Any] | None:
        """The usage that the member of any dialect (:attr:`vendors`) reports in ``chunk``, the first found, or None:
        an upstream labelled with another dialect than its own (Groq's OpenAI-compatible API declared ``openai``, a
        llama.cpp server left at the default) is still counted by what its server reports. Costs a dictionary lookup a
        dialect, and the relay asks on a stream's finishing chunk only (docs/architecture.md#general-readers). Never
        raises."""
        for vendor in self.vendors:
            value = chunk.get(vendor.member) if vendor.member is not None else None
            if value is not None:
                usage, _ = vendor.member_facts(value)
                if usage is not None:
                    return usage
        return None

    def answer_timings(self, headers: Mapping[str, str]) -> dict[str, float] | None:
        """The upstream's own seconds for a whole (non-streaming) answer, from its headers: OpenAI's
        ``openai-processing-ms`` (its processing time in milliseconds; OpenAI API reference, "Debugging requests") as
        ``total``; None without a readable one."""
        value = headers.get("openai-processing-ms")
        try:
            seconds = float(value) / 1000.0 if value else math.nan
        except ValueError:
            return None
        return {"total": seconds} if math.isfinite(seconds) and seconds >= 0 else None

    def status_error(self, status: int, data: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
        """An error answer (``status``, up to 64 KiB of its body ``data``) in OpenAI's envelope, with a 429's wait
        (:meth:`retry_wait`) as ``retry-after-ms`` and ``retry-after`` when it gave neither (the SDKs wait on them)."""
        err = upstream_error(status, data, headers)
        if err.status == 429 and "retry-after" not in err.headers and "retry-after-ms" not in err.headers:
            wait = self.retry_wait(headers)
            # both: the openai SDKs read retry-after-ms first, other clients retry-after
            if wait is not None and math.isfinite(wait):
                err.headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
                err.headers["retry-after"] = str(max(1, math.ceil(wait)))
        return err

    def cause(self, exc: GatewayError, upstream: UpstreamConfig, need_tokens: int) -> GatewayError:
        """What a failed attempt's ``exc`` means for this kind of upstream, given the request's estimated
        ``need_tokens`` (prompt plus ``max_tokens``): ``exc`` itself unless a dialect knows better."""
        return exc

    def event_error(self, event: dict[str, Any]) -> UpstreamStatusError:
        """The error an SSE error event (or a JSON error body answering a stream request) carries, with the status it
        names (``gateway.errors.event_error``)."""
        return event_error(event)

    def quota_report(self, headers: Mapping[str, str]) -> dict[str, Window]:
        """The tightest window of each kind an answer's rate-limit headers report, ``{"requests" | "tokens":
        (remaining, seconds to its reset)}``, for the upstream's quota estimate
        (``gateway.routing.ratelimits.quota_report``)."""
        return quota_report(headers)

    def retry_wait(self, headers: Mapping[str, str]) -> float | None:
        """Seconds a 429's headers ask to wait (``retry-after``, else the reset of the window it exhausted), or
        None (``gateway.routing.ratelimits.retry_wait``)."""
        return retry_wait(headers)
