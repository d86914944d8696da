"""What a relayed stream is made of and what is measured of it: the body the relay reads (:class:`StreamBody`), the
write it answers with (:data:`Write`), when a chunk carries a token (:func:`has_token`: content, refusal, reasoning or
a tool-call delta, never a role-only chunk), the figures of one stream (:class:`StreamStats`: first and last token
times, token-bearing chunks, usage, the upstream's own timing, how it ended; what a Responses API event adds to them:
:func:`observe_response_event`), the token-bearing events of a stream
relayed untouched (:class:`EventTally`: the passthrough's), and what an upstream kind adds to OpenAI's chunks
(:class:`Extra`: its dialect's)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from orjson import JSONDecodeError, loads

from gateway.observability.usage import chat_usage
from gateway.stream.sse import EventTooLarge, SSEScanner

_TOKEN_KEYS = frozenset({"content", "refusal", "reasoning", "reasoning_content", "tool_calls", "function_call"})
_RESPONSE_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


Write = Callable[[bytes], Awaitable[None]]


def delta_has_token(delta: Any) -> bool:
    """Whether a chat-completions chunk's ``delta`` carries a token: non-empty content, refusal, reasoning
    (``reasoning`` or ``reasoning_content``) or a tool call; a role-only delta does not
    (docs/reference/wire.md#gateway-metrics)."""
    if type(delta) is not dict:
        return False
    if delta.get("content"):
        return True
    return any(value and key in _TOKEN_KEYS for key, value in delta.items())


def served_tier(answer: dict[str, Any]) -> str | None:
    """An answer's ``service_tier`` (a chunk's, a completion's or a Response's), or None (absent, or ``auto``: not
    decided yet)."""
    tier = answer.get("service_tier")  # bounded: it reaches the request log and a metric's label
    return tier[:32] if isinstance(tier, str) and tier != "auto" else None


def has_token(choices: Any) -> bool:
    """Whether some choice of a chunk's ``choices`` carries a token (:func:`delta_has_token`)."""
    return type(choices) is list and any(type(c) is dict and delta_has_token(c.get("delta")) for c in choices)


class Extra(Protocol):
    """What an upstream kind adds to OpenAI's chunks: the one top-level member in which its streams (and whole answers)
    report usage or timings of their own, and what that member's value says; and the usage that any kind's member
    reports, whatever the upstream's own kind (:meth:`vendor_usage`). The relay is given the upstream's dialect
    (``gateway.upstream.dialects.base.Dialect``) as one; without it, a stream is read as OpenAI's."""

    @property
    def member(self) -> str | None:
        """The member's name (each dialect's module names its own), or None: nothing beyond OpenAI's members."""
        ...

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        """What the member's ``value`` says: (usage in the chat shape, or None; the upstream's own seconds by phase
        (``queue``, ``prompt``, ``completion``, ``total``), or None). Never raises for an odd value."""
        ...

    def vendor_usage(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The usage, in the chat shape, that the member of any upstream kind reports in ``chunk`` (Groq's
        ``x_groq.usage`` in an upstream labelled ``openai``), or None. The relay asks only on the chunk that
        finishes the stream, when the stream has no usage yet: never on an ordinary token chunk. Never raises for an
        odd value."""
        ...


class StreamBody(Protocol):
    """What the relay reads: an upstream response body (``gateway.upstream.client.UpstreamResponse``, or a fake)."""

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises :class:`StreamInterrupted` when the body breaks or goes silent.
        Callable again after a cancelled iteration, going on where it stopped."""
        ...

    def watch_idle(self) -> None:
        """From now on, bound the upstream's silence by its idle timeout."""
        ...


class StreamStats:
    """What one relayed stream did. Times are ``time.perf_counter()`` seconds.

    Attributes:
        t_first_token / t_last_token: arrival of the first / last token-bearing chunk, or None.
        token_chunks: token-bearing chunks received.
        usage: the last ``usage`` object seen (OpenAI's usage chunk, or a finish chunk that carries one), else the
            usage its dialect's member reports, else the usage another kind's member reports on the finishing chunk
            (:class:`Extra`), or None.
        timings: the upstream's own seconds by phase, as its dialect's member reports them (:class:`Extra`), or
            None.
        done: the stream's end was sent to the client: ``[DONE]``, or a Responses API terminal event
            (``response.completed``, ``response.incomplete``, ``response.failed``).
        finished: every choice has its ``finish_reason`` (chat streams): the answer is complete.
        complete: the upstream body was read to its end (its connection can be reused).
        error: None on success; else ``upstream_error_event``, ``upstream_stream_interrupted``,
            ``upstream_idle_timeout`` or ``upstream_event_too_large``.
        response_id: a Responses API stream's response id (from ``response.created``), or None.
        error_event: the last in-band error event the upstream sent (its parsed data), or None.
        service_tier: the ``service_tier`` the upstream said it served (its chunks', or its Response's), or None.
        left_early: the client left before every choice finished (what the relay read on after it left, in
            ``Relay.tail``, is counted but never reached it: not a whole answer, whatever ``finished`` says).
    """

    __slots__ = ("t_first_token", "t_last_token", "token_chunks", "usage", "timings", "done", "finished",
                 "complete", "error", "response_id", "error_event", "service_tier", "left_early")

    def __init__(self) -> None:
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None
        self.token_chunks = 0
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, float] | None = None
        self.done = False
        self.finished = False
        self.complete = False
        self.error: str | None = None
        self.response_id: str | None = None
        self.error_event: dict[str, Any] | None = None
        self.service_tier: str | None = None
        self.left_early = False


def observe_response_event(stats: StreamStats, chunk: dict[str, Any], now: float) -> dict[str, Any] | None:
    """What one Responses API event (docs/reference/wire.md#responses-api-streams) adds to its stream's ``stats``
    (``now``: its arrival): a ``*.delta`` event carries output; the terminal event carries ``response.usage``;
    ``error`` and ``response.failed`` end the stream as an upstream error. Returns ``chunk`` when it is an error
    event that came before any token (it can still be answered with its status), else None."""
    etype = chunk.get("type")
    if not isinstance(etype, str):
        return None
    if etype.endswith(".delta"):
        stats.token_chunks += 1
        if stats.t_first_token is None:
            stats.t_first_token = now
        stats.t_last_token = now
    elif etype == "response.created":
        response = chunk.get("response")
        rid = response.get("id") if isinstance(response, dict) else None
        stats.response_id = rid if isinstance(rid, str) else None
    elif etype in _RESPONSE_TERMINAL:
        response = chunk.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict):
            stats.usage = chat_usage(usage)
        if isinstance(response, dict):
            stats.service_tier = served_tier(response) or stats.service_tier
        stats.done = True  # the Responses API's end of stream (no [DONE]): end here, as after [DONE]
    if etype in ("error", "response.failed"):
        stats.error = "upstream_error_event"
        stats.error_event = chunk
        if stats.t_first_token is None:
            return chunk
    return None


def event_has_token(chunk: Any) -> bool:
    """Whether one parsed event of any OpenAI stream carries output: a ``*.delta`` event (Responses API,
    ``transcript.text.delta``, ``speech.audio.delta``), or a chunk with a choice's non-empty ``text`` (legacy
    completions) or a token-bearing ``delta`` (chat completions: :func:`delta_has_token`)."""
    if type(chunk) is not dict:
        return False
    kind = chunk.get("type")
    if type(kind) is str:
        return kind.endswith(".delta")
    choices = chunk.get("choices")
    return type(choices) is list and any(
        type(c) is dict and (bool(c.get("text")) or delta_has_token(c.get("delta"))) for c in choices)


class EventTally:
    """The token-bearing events (:func:`event_has_token`) of an event stream relayed with its bytes untouched (a
    passthrough answer), counted as it is read, so that an answer without usage is charged at least what it relayed.

    Cheap by construction, and only on the passthrough's billed event streams (never on the chat relay's path): the
    scanner splits the reads and each data event is parsed once (orjson); measured, ~4 us an event of legacy
    completions on a loaded 2-core machine. Nothing is written. An event over ``max_event_bytes`` (a partial image's
    base64) counts as one and is skipped to its blank line, never held.

    Attributes:
        tokens: token-bearing events so far (each at least one token).
    """

    __slots__ = ("tokens", "_scanner", "_skipping")

    def __init__(self, max_event_bytes: int = 64 * 1024) -> None:
        self.tokens = 0
        self._scanner = SSEScanner(max_event_bytes)
        self._skipping = False  # inside an event over the limit: its rest is dropped up to its blank line

    def feed(self, data: bytes) -> None:
        """Count the events one read completes."""
        if self._skipping:
            end = data.find(b"\n\n")
            if end < 0:
                return
            self._skipping = False
            data = data[end + 2:]
        try:
            events = self._scanner.feed(data)
        except EventTooLarge:
            self.tokens += 1
            self._skipping = True
            return
        for _, payload, _ in events:
            if payload is None or payload.startswith(b"[DONE]"):
                continue
            try:
                chunk = loads(payload)
            except JSONDecodeError:
                continue
            if event_has_token(chunk):
                self.tokens += 1
