"""The dialect seam: what differs between upstream kinds, as one interface (:class:`Dialect`) with the OpenAI API's
behaviour as its default, and one module per dialect beside this one that overrides what its upstreams do otherwise.

A dialect answers, for one attempt: the request bytes to send (:meth:`Dialect.body`: fields it rejects dropped,
whether the usage chunk may be asked for), what an error answer or an error event means (:meth:`Dialect.status_error`,
:meth:`Dialect.event_error`), how long a 429 asks to wait (:meth:`Dialect.retry_wait`), and, as declarations the
docs and the emulator read, where its usage and timing sit and how its streams end. Which API surface it serves by
default (the Responses API natively or through the bridge, the rest of ``/v1``) is declared with its name in
``gateway.config.upstreams`` (config is read before any upstream exists). Chosen per upstream by ``dialect:``
(:func:`gateway.upstream.dialects.of`).

Envoy AI Gateway's ``internal/translator/`` (one interface, one file per provider) is the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import GatewayError, UpstreamStatusError, event_error, upstream_error
from gateway.routing.ratelimits import retry_wait
from gateway.wire.body import dumps, loads_exact, needs_exact, openai_body


class Dialect:
    """An upstream kind (module docstring). Instances hold no state: one per dialect serves every upstream of it.

    Attributes:
        name: as ``dialect:`` names it, and the trace's ``gen_ai.provider.name``.
        drop: top-level request fields its API rejects (an unknown property answered 4xx): removed, and the body
            re-serialised (others' bytes are kept as the client sent them).
        asks_usage: it accepts ``stream_options.include_usage``: the gateway asks a stream for its usage chunk when
            the client did not (and strips it from the client's stream), so every stream is counted.
        usage_at: where a stream's usage sits (``usage`` of the last chunk, or ``x_groq.usage``); the relay reads
            each known place (``gateway.stream.relay``), so this is what the docs and the emulator say.
        ends_with_done: its chat streams end with ``data: [DONE]`` (else the gateway adds it for the client).
    """

    name: ClassVar[str] = "openai"
    drop: ClassVar[frozenset[str]] = frozenset()
    asks_usage: ClassVar[bool] = True
    usage_at: ClassVar[str] = "usage"
    ends_with_done: ClassVar[bool] = True

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """The bytes of one attempt's request: the client's ``raw`` (``body`` parsed) for ``upstream_model``, with
        ``stream_options.include_usage: true`` when ``ask_usage`` and the dialect accepts it; :attr:`drop` fields
        removed. Rules: docs/reference/wire.md#request-bodies."""
        ask_usage = ask_usage and self.asks_usage
        if self.drop and any(k in body for k in self.drop):
            return self._dropped(raw, body, upstream_model, ask_usage)
        return openai_body(raw, body, upstream_model, ask_usage)

    def _dropped(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """``body`` without :attr:`drop`, for ``upstream_model``, re-serialised (an integer past 64 bits exact)."""
        if needs_exact(raw):
            body = loads_exact(raw)
        out = {k: v for k, v in body.items() if k not in self.drop}
        out["model"] = upstream_model
        if body.get("stream") is not True:
            out.pop("stream_options", None)
        elif ask_usage:
            options = out.get("stream_options")
            out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return dumps(out)

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

    def retry_wait(self, headers: Mapping[str, str]) -> float | None:
        """Seconds a 429's headers ask to wait (``retry-after``, else the reset of the window it exhausted), or
        None (``gateway.routing.ratelimits.retry_wait``)."""
        return retry_wait(headers)
