"""What a relayed stream is made of and what is measured of it: the body the relay reads, when a chunk carries a token,
and the figures of one stream. Apart from the relay: the passthrough, the Responses bridge and the load test read them
too."""

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
    """A role-only delta is no token (docs/reference/wire.md#gateway-metrics): TTFT is timed from the first content,
    refusal, reasoning or tool-call delta."""
    if type(delta) is not dict:
        return False
    if delta.get("content"):
        return True
    return any(value and key in _TOKEN_KEYS for key, value in delta.items())


def served_tier(answer: dict[str, Any]) -> str | None:
    """``auto`` is None: not decided yet."""
    tier = answer.get("service_tier")  # bounded: it reaches the request log and a metric's label
    return tier[:32] if isinstance(tier, str) and tier != "auto" else None


def has_token(choices: Any) -> bool:
    return type(choices) is list and any(type(c) is dict and delta_has_token(c.get("delta")) for c in choices)


class Extra(Protocol):
    """What an upstream kind adds to OpenAI's chunks: the one top-level member in which it reports usage or timings of
    its own. The relay is given the upstream's dialect (``gateway.upstream.dialects.base.Dialect``) as one."""

    @property
    def member(self) -> str | None:
        """None: nothing beyond OpenAI's members."""
        ...

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        """(usage in the chat shape, the upstream's own seconds by phase), each or None; never raises."""
        ...

    def vendor_usage(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Any kind's member (Groq's ``x_groq.usage`` behind an upstream labelled ``openai``), asked only on the chunk
        that finishes a stream still without usage; never raises."""
        ...


class StreamBody(Protocol):
    def chunks(self) -> AsyncIterator[bytes]:
        """Raises :class:`StreamInterrupted` when the body breaks or goes silent. Callable again after a cancelled
        iteration, going on where it stopped."""
        ...

    def watch_idle(self) -> None:
        ...


class StreamStats:
    """Times are ``time.perf_counter()`` seconds. ``complete``: the upstream body was read to its end (its connection
    can be reused); ``left_early``: the client left before every choice finished, so what was read on after it never
    reached it: not a whole answer, whatever ``finished`` says."""

    __slots__ = ("t_first_token", "t_last_token", "token_chunks", "usage", "timings", "done", "finished",
                 "complete", "error", "response_id", "error_event", "service_tier", "left_early", "model",
                 "added", "t_first_written")

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
        self.model: str | None = None  # as the usage chunk (or the terminal Response) names it
        self.added: list[float] = []  # seconds from an upstream read to its write done, sampled (Relay.rest)
        self.t_first_written: float | None = None  # when the write of the first token was done


def observe_response_event(stats: StreamStats, chunk: dict[str, Any], now: float) -> dict[str, Any] | None:
    """One Responses API event (docs/reference/wire.md#responses-api-streams). Returns ``chunk`` when it is an error
    event before any token, which can still be answered with its status."""
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
            model = response.get("model")
            stats.model = model if isinstance(model, str) else stats.model
        stats.done = True  # the Responses API's end of stream (no [DONE]): end here, as after [DONE]
    if etype in ("error", "response.failed"):
        stats.error = "upstream_error_event"
        stats.error_event = chunk
        if stats.t_first_token is None:
            return chunk
    return None


def event_has_token(chunk: Any) -> bool:
    """Any OpenAI stream: a ``*.delta`` event, a legacy completion's non-empty ``text``, or a chat ``delta`` with a
    token."""
    if type(chunk) is not dict:
        return False
    kind = chunk.get("type")
    if type(kind) is str:
        return kind.endswith(".delta")
    choices = chunk.get("choices")
    return type(choices) is list and any(
        type(c) is dict and (bool(c.get("text")) or delta_has_token(c.get("delta"))) for c in choices)


class EventTally:
    """The token-bearing events of a stream relayed with its bytes untouched (a passthrough answer), so that an answer
    without usage is charged at least what it relayed. Only on the passthrough's billed event streams, never on the chat
    relay's path: measured ~4 us an event on a loaded 2-core machine. An event over ``max_event_bytes`` (a partial
    image's base64) counts as one and is skipped to its blank line, never held."""

    __slots__ = ("tokens", "_scanner", "_skipping")

    def __init__(self, max_event_bytes: int = 64 * 1024) -> None:
        self.tokens = 0
        self._scanner = SSEScanner(max_event_bytes)
        self._skipping = False  # inside an event over the limit: its rest is dropped up to its blank line

    def feed(self, data: bytes) -> None:
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
