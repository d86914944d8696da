"""Byte-exact SSE relay of chat-completions streams, observed once per event.

Every complete event is forwarded, byte for byte, the moment its terminating blank line arrives; all the
events of one upstream read leave in one write. The relay edits only at event boundaries and only where
the wire contract requires it:

* exactly one ``data: [DONE]`` ends a successful stream (appended when the upstream sent none, the
  repeats dropped); none follows an error;
* the usage-only chunk (``"choices": []``) is dropped when the gateway, not the client, asked for usage;
* an upstream failure after the first byte becomes one in-band error event in OpenAI's shape
  (``{"error": {...}}``, which the ``openai`` SDK raises as ``APIError``), with no ``[DONE]``.

While relaying it fills a :class:`StreamStats`: arrival times of the first and last token-bearing chunk
(content, refusal, reasoning or tool-call delta; not a role-only chunk), usage wherever the dialect puts
it, Cerebras ``time_info``, and how the stream ended. Metrics are recorded from it once, at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from orjson import JSONDecodeError, loads

from gateway.errors import error_body
from gateway.sse import EventTooLarge, SSEEvent, SSEScanner
from gateway.upstream import StreamInterrupted
from gateway.wire import chat_usage

DONE = b"data: [DONE]\n\n"


class FirstTokenTimeout(Exception):
    """No token-bearing event arrived before the first-token deadline; nothing was written to the client."""

DONE_GRACE = 0.02  # seconds to wait for the end of the upstream's body after its [DONE]
_RESPONSE_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_TOKEN_KEYS = frozenset({"content", "refusal", "reasoning", "reasoning_content", "tool_calls", "function_call"})


class StreamStats:
    """What one relayed stream did. Times are ``time.perf_counter()`` seconds.

    Attributes:
        t_first_token / t_last_token: arrival of the first / last token-bearing chunk, or None.
        token_chunks: token-bearing chunks received.
        usage: the last ``usage`` object seen (OpenAI/Azure usage chunk, Cerebras finish chunk,
            ``x_groq.usage``, or llama.cpp ``timings`` mapped to prompt/completion tokens), or None.
        time_info: Cerebras' ``time_info`` (seconds), or None.
        done: the stream's end was sent to the client: ``[DONE]``, or a Responses API terminal event
            (``response.completed``, ``response.incomplete``, ``response.failed``).
        error: None on success; else ``upstream_error_event``, ``upstream_stream_interrupted``,
            ``upstream_idle_timeout`` or ``upstream_event_too_large``.
    """

    __slots__ = ("t_first_token", "t_last_token", "token_chunks", "usage", "time_info", "done", "error")

    def __init__(self) -> None:
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None
        self.token_chunks = 0
        self.usage: dict[str, Any] | None = None
        self.time_info: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None


class Relay:
    """Relay one upstream SSE body to one client.

    Args:
        strip_usage_chunk: drop the ``choices: []`` usage chunk (the gateway asked for usage, the client did not).
        append_done: end a clean stream with ``data: [DONE]`` (chat completions: yes).
        max_event_bytes: largest single upstream event; past it the stream ends with an in-band error.
    """

    def __init__(self, *, strip_usage_chunk: bool, append_done: bool = True, max_event_bytes: int,
                 responses: bool = False) -> None:
        self.stats = StreamStats()
        self._strip = strip_usage_chunk
        self._responses = responses
        self._append_done = append_done and not responses  # Responses API streams end with their terminal event
        self._scanner = SSEScanner(max_event_bytes)

    async def run(self, chunks: AsyncIterator[bytes], write: Callable[[bytes], Awaitable[None]],
                  first_token_by: float | None = None) -> StreamStats:
        """Read ``chunks`` to the end or to ``[DONE]``, writing each batch of complete events with ``write``.

        It returns right after the batch holding ``[DONE]`` (or a Responses API terminal event) was written
        (``stats.done``), so that the
        client's body ends there (wire contract §3.3) even when the upstream keeps its response open; what
        follows ``[DONE]`` is read and dropped for at most :data:`DONE_GRACE` seconds first, so that an
        upstream whose body ends at once leaves a fully read, reusable connection.

        With ``first_token_by`` (an ``asyncio`` loop time), nothing is written until the first token-bearing
        event (or the end of the stream): the events before it are held and leave together with it, so the
        caller can still fail over when the deadline passes first.

        Raises:
            FirstTokenTimeout: ``first_token_by`` passed before the first token; nothing was written.
            Exceptions from ``write`` and cancellation propagate; upstream trouble never raises (it becomes
            an in-band error event).
        """
        stats = self.stats
        clock = time.perf_counter
        if first_token_by is not None:
            chunks = await self._hold(chunks, write, first_token_by)
        try:
            async for chunk in chunks:
                now = clock()
                out = self._process(self._scanner.feed(chunk), now)
                if out:
                    await write(out)
                if stats.done:
                    await _drain(chunks, DONE_GRACE)
                    return stats
        except StreamInterrupted as exc:
            await self._fail(write, exc.code, exc.message)
            return stats
        except EventTooLarge as exc:
            await self._fail(write, "upstream_event_too_large", str(exc))
            return stats
        if stats.error or stats.done:
            return stats
        if self._scanner.pending:
            await self._fail(write, "upstream_stream_interrupted", "The upstream stream ended inside an event.")
        elif self._append_done:
            stats.done = True
            await write(DONE)
        return stats

    async def _hold(self, chunks: AsyncIterator[bytes], write: Callable[[bytes], Awaitable[None]],
                    deadline: float) -> AsyncIterator[bytes]:
        """Read until the first token (or the end, or an error), holding the output; write it all at once.

        Returns the rest of ``chunks`` for :meth:`run` to go on with; when the upstream failed while held
        (broken stream, oversized event), an iterator that raises that failure at once, so that :meth:`run`
        ends the stream the same way it would have after the first byte.
        """
        stats = self.stats
        held: list[bytes] = []
        it = aiter(chunks)
        try:
            while stats.t_first_token is None and not stats.done and not stats.error:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await anext(it)
                except StopAsyncIteration:
                    break
                except TimeoutError as exc:
                    raise FirstTokenTimeout() from exc
                out = self._process(self._scanner.feed(chunk), time.perf_counter())
                if out:
                    held.append(out)
        except (StreamInterrupted, EventTooLarge) as exc:
            await self._flush(held, write)
            return _failing(exc)
        await self._flush(held, write)
        return it

    @staticmethod
    async def _flush(held: list[bytes], write: Callable[[bytes], Awaitable[None]]) -> None:
        if held:
            await write(b"".join(held))

    async def _fail(self, write: Callable[[bytes], Awaitable[None]], code: str, message: str) -> None:
        self.stats.error = code
        await write(b"data: " + error_body(message, "server_error", None, code) + b"\n\n")

    def _process(self, events: list[SSEEvent], now: float) -> bytes:
        """Observe one read's events; return the bytes to forward (per event: its raw bytes, or nothing).

        Hot path: runs for every event. A chunk is parsed once with orjson; only chunks with a rarer key (a
        non-null ``usage``, ``error``, ``x_groq``, ``timings``, ``time_info``) or an ``event:`` field take the
        complete look (:meth:`_observe`). Measured here: five dict lookups cost ~0.24 us, searching the
        event's bytes for the same keys ~2.9 us, orjson's parse ~1.7 us.
        """
        stats = self.stats
        out: list[bytes] = []
        for raw, data, event in events:
            if stats.done:
                break  # nothing follows [DONE]; the SDK stops reading there
            if data is None:
                out.append(raw)  # keep-alive comment
                continue
            if data.startswith(b"[DONE]"):
                stats.done = True
                out.append(raw)
                continue
            try:
                chunk = loads(data)
            except JSONDecodeError:
                out.append(raw)
                continue
            if type(chunk) is not dict:
                out.append(raw)
                continue
            if self._responses:
                self._observe_response_event(chunk, now)
            elif (event is not None or chunk.get("usage") is not None or "error" in chunk or "x_groq" in chunk
                  or "timings" in chunk or "time_info" in chunk):
                if not self._observe(chunk, event, now):
                    continue
            elif (choices := chunk.get("choices")) and _has_token(choices):
                stats.token_chunks += 1
                if stats.t_first_token is None:
                    stats.t_first_token = now
                stats.t_last_token = now
            out.append(raw)
        return b"".join(out)

    def _observe_response_event(self, chunk: dict[str, Any], now: float) -> None:
        """Responses API events (wire contract §5): a ``*.delta`` event carries output; the terminal event
        carries ``response.usage``; ``error`` and ``response.failed`` end the stream as an upstream error."""
        stats = self.stats
        etype = chunk.get("type")
        if not isinstance(etype, str):
            return
        if etype.endswith(".delta"):
            stats.token_chunks += 1
            if stats.t_first_token is None:
                stats.t_first_token = now
            stats.t_last_token = now
        elif etype in _RESPONSE_TERMINAL:
            response = chunk.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            if isinstance(usage, dict):
                stats.usage = chat_usage(usage)
            stats.done = True  # the Responses API's end of stream (no [DONE]): end here, as after [DONE]
        if etype in ("error", "response.failed"):
            stats.error = "upstream_error_event"

    def _observe(self, chunk: dict[str, Any], event: bytes | None, now: float) -> bool:
        """The complete look at a chat chunk; return False when the chunk must not be forwarded."""
        stats = self.stats
        if chunk.get("error") or event == b"error":  # the SDK raises only on a non-empty error
            stats.error = "upstream_error_event"
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            stats.usage = usage
        else:
            extra = chunk.get("x_groq")
            if isinstance(extra, dict) and isinstance(extra.get("usage"), dict):
                stats.usage = extra["usage"]
            timings = chunk.get("timings")
            if isinstance(timings, dict) and "predicted_n" in timings:
                stats.usage = {"prompt_tokens": timings.get("prompt_n", 0), "completion_tokens": timings["predicted_n"]}
        time_info = chunk.get("time_info")
        if isinstance(time_info, dict):
            stats.time_info = time_info
        choices = chunk.get("choices")
        if not choices:
            return not (self._strip and isinstance(usage, dict) and choices == [])
        if _has_token(choices):
            stats.token_chunks += 1
            if stats.t_first_token is None:
                stats.t_first_token = now
            stats.t_last_token = now
        return True


async def _failing(exc: StreamInterrupted | EventTooLarge) -> AsyncIterator[bytes]:
    """An iterator that raises ``exc`` at once (hands a failure seen while holding over to :meth:`Relay.run`)."""
    raise exc
    yield b""  # pragma: no cover - makes this an async generator


async def _drain(chunks: AsyncIterator[bytes], grace: float) -> None:
    """Read and drop ``chunks`` until they end, fail, or ``grace`` seconds pass (the caller then closes)."""
    try:
        async with asyncio.timeout(grace):
            async for _ in chunks:
                pass
    except (TimeoutError, StreamInterrupted):
        pass


def _has_token(choices: Any) -> bool:
    """True when some choice's delta carries a token: non-empty content, refusal, reasoning or tool call."""
    if type(choices) is not list:
        return False
    for choice in choices:
        delta = choice.get("delta") if type(choice) is dict else None
        if type(delta) is dict:
            if delta.get("content"):
                return True
            for key, value in delta.items():
                if value and key in _TOKEN_KEYS:
                    return True
    return False
