"""The record of a passthrough request: its own families (by endpoint, bytes each way) and its usage, read at the
answer's tail or, for an event stream that relayed tokens, estimated from its token-bearing events, so that leaving out
``stream_options.include_usage`` dodges neither a key's limits nor the cost."""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from gateway.observability.metrics import BILLABLE
from gateway.observability.recorder import Observers, Recorder, Subject
from gateway.observability.usage import chat_usage

USAGE_TAIL = 16 * 1024  # bytes of a JSON or SSE answer kept to read its usage from (it comes last)
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_TIER = re.compile(rb'"service_tier"\s*:\s*"([a-z_]{1,32})"')


def tail_usage(tail: bytes) -> dict[str, Any] | None:
    """The last ``"usage"`` object: embeddings and legacy completions report it last (OpenAPI
    ``CreateEmbeddingResponse``, ``CreateCompletionResponse``)."""
    starts = [m.end() - 1 for m in _USAGE.finditer(tail)]
    if not starts:
        return None
    text = tail[starts[-1]:].decode("utf-8", "replace")
    try:
        usage, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


class Tally(Protocol):
    """:class:`~gateway.stream.stats.EventTally` is one."""

    tokens: int

    def feed(self, data: bytes) -> None: ...


class PassRecorder(Recorder):
    """``endpoint``: its metric label (``gateway.wire.routes``)."""

    __slots__ = ("endpoint", "keep", "bytes_in", "bytes_out", "tail", "tally")

    def __init__(self, observers: Observers, request: Subject, endpoint: str) -> None:
        super().__init__(observers, request)
        self.endpoint = endpoint
        self.keep = False  # its answer's tail is kept for the usage (a POST that makes something billed by it)
        self.bytes_in = 0
        self.bytes_out = 0
        self.tail = b""  # the end of a billed JSON or SSE answer so far (its usage comes last)
        self.tally: Tally | None = None

    def received(self, n: int) -> None:
        self.bytes_in += n

    def relaying(self, keep: bool, tally: Tally | None) -> None:
        """``keep``: its tail is kept for the usage; ``tally``: counts its token-bearing events."""
        self.keep, self.tally = keep, tally

    def relayed(self, data: bytes) -> None:
        """Counted before it is written: what arrived counts, the client gone or not."""
        self.bytes_out += len(data)
        if self.keep:
            self.tail = (self.tail + data)[-USAGE_TAIL:]
            if self.tally is not None:
                self.tally.feed(data)

    def _emit(self, outcome: str, duration: float, kw: dict[str, Any]) -> float | None:
        """Billed at the ``service_tier`` the answer names, else the one it was sent with (where honoured). A client
        that left after an event stream's ``data: [DONE]`` (SDKs stop reading there) had the whole answer: a success."""
        if outcome == "client_disconnect" and self.tail.endswith(b"data: [DONE]\n\n"):
            outcome = "success"
        self.outcome = outcome  # the request log says what the metrics say
        found = tail_usage(self.tail) if self.tail else None
        usage = chat_usage(found) if found is not None else None  # Responses/audio token shapes too
        tally, estimated = self.tally, False
        if usage is None and tally is not None and tally.tokens and outcome in BILLABLE:
            usage = {"prompt_tokens": self.request.prompt_tokens, "completion_tokens": tally.tokens}
            estimated = kw["estimated"] = True
        kw["usage"] = usage
        echoed = _TIER.findall(self.tail) if self.tail else None
        if echoed:
            kw["service_tier"] = echoed[-1].decode()
        return self._metrics.record_passthrough(
            endpoint=self.endpoint, tier=self.tier, upstream=self.upstream, model=self.model, outcome=outcome,
            duration=duration, bytes_in=self.bytes_in, bytes_out=self.bytes_out, usage=usage, estimated=estimated,
            service_tier=kw.get("service_tier"))
