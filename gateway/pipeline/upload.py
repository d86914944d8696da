"""A passthrough request's own parts: its exchange (:class:`PassExchange`: recorded in the passthrough's families, by
endpoint, with its bytes each way and the usage its answer reports), a body streamed upstream as the client sends it
(:class:`Upload`), the usage at the tail of an answer (:func:`tail_usage`, counted for what :func:`bills`), and the
helpers that read its body (:func:`passthrough_facts`) and shape its answers (:func:`closing`, :func:`with_model`)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from gateway.errors import (
    GatewayError,
    PayloadTooLarge,
)
from gateway.observability.metrics import BILLABLE
from gateway.observability.recorder import Observers
from gateway.pipeline.exchange import CLOSE, ClientGone, Exchange, Headers
from gateway.routing.facts import Candidate, RequestFacts
from gateway.stream.stats import EventTally
from gateway.wire.body import chat_usage, check_limits, check_service_tier, replace_top_level

# the endpoint label of the passthrough metrics (bounded): the first path here that the request's path is or is under,
# else "other" (a path is under "audio/speech", never under "speech": the order only matters for nested entries)
ENDPOINTS = ("embeddings", "completions", "moderations", "audio/speech", "audio/transcriptions", "audio/translations",
             "images/generations", "images/edits", "images/variations", "files", "uploads", "batches", "vector_stores",
             "fine_tuning", "responses", "chat/completions", "conversations", "assistants", "threads", "containers",
             "evals", "videos", "realtime", "models")


_USAGE = re.compile(rb'"usage"\s*:\s*\{')


USAGE_TAIL = 16 * 1024  # bytes of a JSON or SSE answer kept to read its usage from (it comes last)


def endpoint_label(path: str) -> str:
    """The metric label of ``path`` (under /v1, no leading slash): one of :data:`ENDPOINTS`, or ``other``."""
    for name in ENDPOINTS:
        if path == name or path.startswith(name + "/"):
            return name
    return "other"


def bills(endpoint: str, path: str) -> bool:
    """Whether a ``POST`` to ``path`` (under /v1) makes something billed by its usage, whose answer's usage is then
    counted: a collection endpoint itself (embeddings, legacy completions, audio, images, moderations, chat completions
    of a model only the passthrough upstream lists, and any path the gateway does not know), never an object under it
    (an update of a stored chat completion, a batch's cancel: their usage was counted when they were made, or is
    billed elsewhere)."""
    return endpoint == "other" or path == endpoint


def tail_usage(tail: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in the end of a JSON body or event stream (embeddings and legacy
    completions report it last: OpenAPI ``CreateEmbeddingResponse``, ``CreateCompletionResponse``), or None."""
    starts = [m.end() - 1 for m in _USAGE.finditer(tail)]
    if not starts:
        return None
    text = tail[starts[-1]:].decode("utf-8", "replace")
    try:
        usage, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


class PassExchange(Exchange):
    """An :class:`Exchange` of the passthrough surface: recorded in its own families (``endpoint`` label, bytes each
    way, usage when the answer reports one, else an estimate for an event stream that relayed tokens)."""

    __slots__ = ("endpoint", "path", "bytes_in", "bytes_out", "tail", "tally")

    def __init__(self, observers: Observers, send: Send, headers: dict[str, str], path: str,
                 scope: Scope | None = None) -> None:
        super().__init__(observers, send, headers, "passthrough", scope)
        self.path = path  # under /v1, no leading slash
        self.endpoint = endpoint_label(path)
        self.bytes_in = 0
        self.bytes_out = 0
        self.tail = b""  # the end of a JSON or SSE answer so far (its usage comes last)
        self.tally: EventTally | None = None  # a billed event stream's token-bearing events (gateway.pipeline.answers)

    def _emit(self, outcome: str, duration: float, kw: dict[str, Any]) -> float | None:
        """Write the record (:meth:`Metrics.record_passthrough`), with the usage at the end of the answer; an event
        stream without one that relayed tokens is charged its token-bearing events (each a token) plus the estimated
        prompt, marked ``estimated`` (as a chat stream without usage: ``Recorder.record``), so that leaving out
        ``stream_options.include_usage`` dodges neither a key's limits nor the cost. A client that left after an
        event stream's ``data: [DONE]`` (SDKs stop reading there) had the whole answer: a success."""
        if outcome == "client_disconnect" and self.tail.endswith(b"data: [DONE]\n\n"):
            outcome = "success"
        self.outcome = outcome  # the request log says what the metrics say
        found = tail_usage(self.tail) if self.tail else None
        usage = chat_usage(found) if found is not None else None  # Responses/audio token shapes too
        tally, estimated = self.tally, False
        if usage is None and tally is not None and tally.tokens and outcome in BILLABLE:
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": tally.tokens}
            estimated = kw["estimated"] = True
        kw["usage"] = usage
        return self._emit_passthrough(self.endpoint, outcome, duration, self.bytes_in, self.bytes_out, usage,
                                      estimated)


class Upload:
    """A request body streamed upstream as the client sends it, bounded by ``limit`` bytes; iterate it once.

    While a part is with the upstream's writer, ``window`` (set by the caller around the send) is due ``idle``
    seconds later: an upstream that stops reading the body fails the attempt, and a client that is slow to send is
    the client's timeout (``GATEWAY_BODY_TIMEOUT``), never the upstream's. A client that leaves mid-body ends the
    request, even when the upstream already answered (its writer would otherwise drain the rest unseen).

    Attributes:
        done: the body ended (its size so far is ``ex.bytes_in``); error: why it stopped early (:class:`ClientGone`: the
        client left; :class:`PayloadTooLarge`), or None; window: the send's deadline while it runs, or None.
    """

    def __init__(self, receive: Receive, limit: int, idle: float, ex: PassExchange,
                 on_end: Callable[[], None]) -> None:
        self.done = False
        self.error: ClientGone | GatewayError | None = None
        self.window: asyncio.Timeout | None = None
        self._receive = receive
        self._limit = limit
        self._idle = idle
        self._ex = ex
        self._on_end = on_end

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
                if not ex.recorded and ex.gone_at is None and ex.task is not None:
                    ex.gone_at = time.perf_counter()  # as Watch does: the request ends where it is
                    ex.task.cancel()
                raise self.error
            part = message.get("body", b"")
            if part:
                self._ex.bytes_in += len(part)
                if self._ex.bytes_in > self._limit:
                    self.error = PayloadTooLarge(f"The request body is over the {self._limit}-byte limit.")
                    raise self.error
                self._due(loop.time() + self._idle)  # the upstream's turn: it must take the part
                yield part
            if not message.get("more_body", False):
                self.done = True
                self._due(None)
                self._on_end()  # the client's next message can only be its disconnect: watch for it


def encoded(headers: dict[str, str]) -> bool:
    """Whether the request's body is content-encoded (gzip, deflate, ...): the gateway cannot read it as it is."""
    return headers.get("content-encoding", "identity").strip().lower() != "identity"


def parsed_json(raw: bytes, headers: dict[str, str]) -> Any:
    """A JSON body, parsed (None: not JSON, or content-encoded: the upstream's to judge)."""
    if encoded(headers):
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def passthrough_facts(raw: bytes | None, headers: dict[str, str]) -> RequestFacts | None:
    """Routing facts of a JSON body with a string ``model``, else None (it goes to the passthrough upstream; a body
    that is not JSON, or is content-encoded, is the upstream's to judge)."""
    if not raw or encoded(headers):
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return None
    check_limits(body)  # legacy completions have max_tokens too: routing and key limits read it
    check_service_tier(body)  # billed and logged by it, as on the hot path
    return RequestFacts(body, headers, len(raw))


def with_model(raw: bytes | None, facts: RequestFacts | None, cand: Candidate) -> bytes | None:
    """The client's bytes (None: no body), with the model id of ``cand`` when it differs (only the value's bytes
    change)."""
    if not raw:
        return None
    if facts is None or not cand.upstream_model or cand.upstream_model == facts.model:
        return raw
    return replace_top_level(raw, b"model", orjson.dumps(cand.upstream_model))


def closing(ex: PassExchange, raw: bytes | None, headers: Headers | None = None,
             upload: Upload | None = None) -> Headers:
    """The headers of an error answer; ``connection: close`` when the request body was not read to its end (its
    rest must never be read as the next request)."""
    out = headers if headers is not None else [(b"x-request-id", ex.rid.encode())]
    if raw is None and (upload is None or not upload.done):
        out.append(CLOSE)
    return out
