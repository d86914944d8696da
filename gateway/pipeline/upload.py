"""A passthrough request's own parts: a body streamed upstream as the client sends it (:class:`Upload`), and the
helpers that shape its body and its answers (:func:`with_model`, :func:`closing`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.types import Receive

from gateway.admission.body import ClientGone, MultipartGuard
from gateway.errors import GatewayError, PayloadTooLarge
from gateway.observability.passthrough import PassRecorder
from gateway.pipeline.exchange import CLOSE, Exchange, Headers
from gateway.routing.facts import Candidate, RequestFacts
from gateway.wire.body import replace_top_level, with_service_tier


class Upload:
    """Iterate once. While a part is with the upstream's writer, ``window`` (set by the caller around the send) is
    due ``idle`` seconds later: an upstream that stops reading the body fails the attempt, while a slow client is the
    client's timeout (``GATEWAY_BODY_TIMEOUT``). A client that leaves mid-body ends the request even when the
    upstream already answered (its writer would otherwise drain the rest unseen)."""

    def __init__(self, receive: Receive, limit: int, idle: float, ex: Exchange,
                 on_end: Callable[[], None], guard: MultipartGuard | None = None) -> None:
        self.done = False
        self.error: ClientGone | GatewayError | None = None
        self.window: asyncio.Timeout | None = None
        self._receive = receive
        self._limit = limit
        self._idle = idle
        self._ex = ex
        rec = ex.rec
        assert isinstance(rec, PassRecorder)
        self._rec = rec
        self._on_end = on_end
        self._guard = guard  # with gateway keys, a multipart body's field names are checked as it streams

    def _due(self, when: float | None) -> None:
        if self.window is not None and not self.window.expired():
            self.window.reschedule(when)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        while not self.done:
            self._due(None)  # the client's turn
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.error = ClientGone()
                ex = self._ex
                if not ex.rec.recorded and ex.gone_at is None and ex.task is not None:
                    ex.gone_at = time.perf_counter()  # as Watch does: the request ends where it is
                    ex.task.cancel()
                raise self.error
            part = message.get("body", b"")
            if part:
                self._rec.received(len(part))
                if self._rec.bytes_in > self._limit:
                    self.error = PayloadTooLarge(f"The request body is over the {self._limit}-byte limit.")
                    raise self.error
                if self._guard is not None:
                    try:
                        self._guard.feed(part)
                    except GatewayError as exc:
                        self.error = exc
                        raise
                self._due(loop.time() + self._idle)  # the upstream's turn: it must take the part
                yield part
            if not message.get("more_body", False):
                self.done = True
                self._due(None)
                self._on_end()  # the client's next message can only be its disconnect: watch for it


def with_model(ex: Exchange, raw: bytes | None, facts: RequestFacts | None, cand: Candidate) -> bytes | None:
    """The client's bytes with ``cand``'s model id and the ``service_tier`` the attempt is sent with
    (``UpstreamConfig.asks``) in place of the client's, only those values' bytes changed; the tier sent is told to
    the recorder, which bills it without an echo."""
    if not raw:
        return None
    if facts is None:
        return raw
    up = cand.upstream
    asked = up.asks(facts.service_tier, ex.request.speed_dropped is None)
    ex.rec.sent_with(asked, up.honours(asked))
    if asked != facts.service_tier:
        raw, _ = with_service_tier(raw, facts.body, asked)
    if not cand.upstream_model or cand.upstream_model == facts.model:
        return raw
    return replace_top_level(raw, b"model", orjson.dumps(cand.upstream_model))


def closing(ex: Exchange, raw: bytes | None, headers: Headers | None = None,
             upload: Upload | None = None) -> Headers:
    """``connection: close`` when the body was not read to its end: its rest must never be read as the next request."""
    out = headers if headers is not None else [(b"x-request-id", ex.rid.encode())]
    if raw is None and (upload is None or not upload.done):
        out.append(CLOSE)
    return out
