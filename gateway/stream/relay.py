"""Byte-exact SSE relay of chat-completions and Responses API streams, observed once per event.

Every complete event is forwarded, byte for byte, the moment its terminating blank line arrives; all the events of
one upstream read leave in one write. The relay edits only at event boundaries and only where the wire contract
(``docs/reference/wire.md``) requires it:

* exactly one ``data: [DONE]`` ends a successful chat stream (appended when the upstream sent none, the repeats
  dropped); none follows an error;
* the usage-only chunk (``"choices": []``) is dropped when the client did not ask for usage (whoever asked the
  upstream for it: the gateway, or an upstream that sends it unasked);
* an upstream failure after the first byte becomes one in-band error event in OpenAI's shape (``{"error": {...}}``,
  which the ``openai`` SDK raises as ``APIError``), with no ``[DONE]``, unless the upstream sent its own.

**The commit point.** Nothing is written until the first token-bearing event: the events before it (the role chunk,
``response.created``, keep-alive comments) carry no token, so holding them costs the client nothing, and until then
every failure can still be answered with a real HTTP status or failed over: an error event (its own status), a broken
or silent body, an oversized event, a body with no event at all, or no first token by the ``ttft`` deadline. Without a
``ttft`` the hold is bounded by the idle timeout and by :data:`HOLD_BYTES`: past either, what is held is sent and the
stream goes on committed (an upstream that keeps a client waiting with keep-alive comments for longer gets them
through); one quiet for over :data:`ALIVE_WITHIN` of the bound is left to the idle watch instead, whose end before the
first byte is a failover, not a 200 ending in an in-band error.

**The end.** A stream ends at ``[DONE]`` or a Responses API terminal event, at the upstream's EOF, or, once every
choice has its ``finish_reason``, after ``finish_grace`` seconds of waiting for the usage tail (the client's stream
then ends with ``[DONE]``; the upstream connection is closed). An EOF before every choice finished (or before a
Responses terminal event) is an interrupted stream, never a silent truncation. A client that leaves early gets at most
``finish_grace`` more seconds of reading, unsent, if every choice had finished, else :data:`LEAVE_GRACE` (``tail``).

**The common chunk without a parse** (``gateway.stream.template``): a read of events that fit the stream's template
is observed by comparing bytes; anything else goes through the scanner and a JSON parse, with the same result. The
figures fill a :class:`gateway.stream.stats.StreamStats`, from which the request is recorded once, at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from orjson import JSONDecodeError, loads

from gateway.errors import (
    EmptyStream,
    GatewayError,
    StreamInterrupted,
    UpstreamBadResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
    error_body,
    event_error,
)
from gateway.stream.sse import EventTooLarge, SSEEvent, SSEScanner
from gateway.stream.stats import (
    Extra,
    StreamBody,
    StreamStats,
    Write,
    delta_has_token,
    observe_response_event,
    served_tier,
)
from gateway.stream.template import Template

DONE = b"data: [DONE]\n\n"
DONE_GRACE = 0.02  # seconds to wait for the end of the upstream's body after its [DONE]
# seconds the upstream connection stays open after a client left before every choice finished: read, unsent, for the
# usage of the generation it cancelled (which runs, and is billed, until the close). The gateway's own bound
# (docs/routing.md#stream-end); design/wire-contract.md sets no figure. finish_grace is for finished streams.
LEAVE_GRACE = 1.0
HOLD_BYTES = 256 * 1024  # bytes of output held before the first token at most; past it the stream commits
ALIVE_WITHIN = 0.75  # at the hold's time bound, a stream heard from within this share of it is alive
_NO_MEMBER = "\x00"  # the member looked for when the dialect adds none: no chunk has it (a lookup, not a branch)


class Relay:
    """Relay one upstream SSE body to one client.

    Class attribute ``LEARN``: how many token chunks of a stream may be tried as its :class:`Template` (0: never);
    a read the template does not match goes the full way, and may teach a new one while tries are left.

    Args:
        strip_usage_chunk: drop the ``choices: []`` usage chunk (the client did not ask for usage).
        max_event_bytes: largest single upstream event; past it the stream ends with an in-band error.
        responses: the body is a Responses API event stream (ends at its terminal event, no ``[DONE]``).
        choices: the request's ``n``: the stream is finished when each choice has its ``finish_reason``.
        finish_grace: seconds to wait for the rest of a finished stream (see the module docstring).
        extra: what the upstream's kind adds to OpenAI's chunks (its dialect: :class:`Extra`), or None: OpenAI's.
    """

    LEARN = 8

    def __init__(self, *, strip_usage_chunk: bool, max_event_bytes: int, responses: bool = False, choices: int = 1,
                 finish_grace: float = 2.0, hold_seconds: float | None = None, extra: Extra | None = None) -> None:
        self.stats = StreamStats()
        member = extra.member if extra is not None else None
        self._extra = extra if member is not None else None  # what reads the member's value, when there is one
        self._member = member if member is not None else _NO_MEMBER
        self._vendors = extra  # reads any kind's member for usage, on a finishing chunk that brought none
        self._strip = strip_usage_chunk
        self._responses = responses
        self._scanner = SSEScanner(max_event_bytes)
        self._max_read = max_event_bytes  # a read past it goes the full way, where an event over the limit fails
        self._unfinished = set(range(max(1, choices)))  # choice indexes still without a finish_reason
        self._finish_grace = finish_grace
        self._hold_seconds = hold_seconds  # without a ttft deadline: the longest hold (the idle timeout)
        self._error_event: dict[str, Any] | None = None  # an error event that came before any token
        self._events = 0  # data events seen
        self._first: tuple[bytes, bool, AsyncIterator[bytes]] | None = None  # set by first()
        self._template: Template | None = None  # the stream's ordinary token chunk, once learned (_process)
        self._learn = self.LEARN  # tries left to learn it (again, when the chunks change shape: a tool call's first)

    async def run(self, body: StreamBody, write: Write, first_token_by: float | None = None) -> StreamStats:
        """Relay ``body`` to ``write`` until the stream ends (module docstring); returns the stats.

        Args:
            first_token_by: an ``asyncio`` loop time by which the first token must arrive, or None (then the hold
                ends, committing the stream, after ``hold_seconds`` or :data:`HOLD_BYTES`).

        Raises:
            Before anything was written, so that the caller can answer with a status or fail over:
            UpstreamTimeout (``upstream_ttft_timeout``, ``upstream_idle_timeout``), UpstreamUnavailable
            (``upstream_stream_interrupted``), UpstreamBadResponse (``upstream_event_too_large``), or the
            :class:`UpstreamStatusError` that an error event carries. After the first write, upstream trouble
            never raises (it becomes an in-band error event); exceptions from ``write`` and cancellation
            propagate.
        """
        await self.first(body, first_token_by)
        return await self.rest(write)

    async def first(self, body: StreamBody, first_token_by: float | None = None) -> None:
        """The first half of :meth:`run`: read until the first token (or the stream's end), writing nothing; then
        :meth:`rest` relays. Apart, so that two candidates can race to their first token (hedging).

        Raises:
            GatewayError: as :meth:`run`, before anything was written.
        """
        if first_token_by is None:
            body.watch_idle()
        held, ended, chunks = await self._hold(body, body.chunks(), first_token_by)
        body.watch_idle()
        self._first = (held, ended, chunks)

    async def release(self, write: Write) -> None:
        """Write what :meth:`first` held, now (the first token leaves in the caller's task; :meth:`rest` then does not
        write it again)."""
        assert self._first is not None, "first() comes before release()"
        held, ended, chunks = self._first
        if held:
            self._first = (b"", ended, chunks)
            await write(held)

    async def rest(self, write: Write) -> StreamStats:
        """The second half of :meth:`run`, after :meth:`first`: write what was held (unless :meth:`release` did),
        relay the rest, end."""
        stats = self.stats
        assert self._first is not None, "first() comes before rest()"
        held, ended, chunks = self._first
        if held:
            await write(held)
        if stats.done:
            await self._drain(chunks, DONE_GRACE)
            return stats
        if ended:
            await self._end(write)
            return stats
        try:
            if not stats.finished:
                async for chunk in chunks:
                    out = self._take(chunk)
                    if out:
                        await write(out)
                    if stats.done:
                        await self._drain(chunks, DONE_GRACE)
                        return stats
                    if stats.finished:
                        break
                else:
                    stats.complete = True
                    await self._end(write)
                    return stats
            await self._tail(chunks, write)
        except StreamInterrupted as exc:
            await self._broken(write, exc.code, exc.message)
        except EventTooLarge as exc:
            await self._broken(write, "upstream_event_too_large", str(exc))
        return stats

    async def tail(self, body: StreamBody) -> None:
        """The client left before the end: read on for at most ``finish_grace`` seconds if every choice had finished,
        else :data:`LEAVE_GRACE` (and ``finish_grace`` after a finish that comes meanwhile), writing nothing, counting
        token chunks and taking the usage if it comes (SDKs often ``break`` on ``finish_reason``; a long stream cut
        short is charged what the upstream sent meanwhile). Never raises for the upstream's trouble."""
        stats = self.stats
        if stats.usage is not None or stats.done or stats.complete:
            return
        finished = stats.finished
        try:
            async with asyncio.timeout(self._finish_grace if finished else LEAVE_GRACE) as bound:
                async for chunk in body.chunks():
                    self._take(chunk)
                    if stats.usage is not None or stats.done:
                        return
                    if stats.finished and not finished:  # finished after the leave: both bounds hold
                        finished, limit = True, asyncio.get_running_loop().time() + self._finish_grace
                        bound.reschedule(min(bound.when() or limit, limit))
                stats.complete = True
        except (TimeoutError, StreamInterrupted, EventTooLarge):
            pass

    async def _hold(self, body: StreamBody, chunks: AsyncIterator[bytes],
                    deadline: float | None) -> tuple[bytes, bool, AsyncIterator[bytes]]:
        """Read until the first token, the end, a failure or (without a ``deadline``) the hold's bound, writing nothing.

        Returns:
            (the held output, whether the upstream's body ended while held, the body's reads to go on with).

        Raises:
            GatewayError: see :meth:`run` (nothing was written).
        """
        stats = self.stats
        held: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        last = loop.time()  # when the upstream last sent something
        commit_at = None if deadline is not None or self._hold_seconds is None else last + self._hold_seconds
        try:
            while stats.t_first_token is None and not stats.done and not stats.finished and size <= HOLD_BYTES:
                try:
                    async with asyncio.timeout_at(deadline if deadline is not None else commit_at):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    stats.complete = True
                    self._check_held_end()
                    return b"".join(held), True, chunks
                except TimeoutError:
                    if deadline is not None:
                        raise
                    chunks = body.chunks()  # the cancelled read closed the iterator: a new one goes on from there
                    assert self._hold_seconds is not None and commit_at is not None
                    quiet = loop.time() - last
                    if held and quiet < ALIVE_WITHIN * self._hold_seconds:
                        break  # alive (keep-alives, role chunks) but no token for the idle timeout: commit
                    # quiet: the idle watch (between 1 and 1.25 idle timeouts after the last byte) ends it unsent
                    commit_at = loop.time() + self._hold_seconds / 4 if held else commit_at + self._hold_seconds
                    continue
                last = loop.time()
                out = self._take(chunk)
                if self._error_event is not None:
                    raise event_error(self._error_event)
                if out:
                    held.append(out)
                    size += len(out)
        except TimeoutError as exc:
            raise UpstreamTimeout("No first token from the upstream in time.", code="upstream_ttft_timeout") from exc
        except StreamInterrupted as exc:
            cls: type[GatewayError] = UpstreamTimeout if exc.code == "upstream_idle_timeout" else UpstreamUnavailable
            raise cls(exc.message + " (before its first token)", code=exc.code) from exc
        except EventTooLarge as exc:
            raise UpstreamBadResponse(str(exc), code="upstream_event_too_large") from exc
        return b"".join(held), False, chunks

    def _check_held_end(self) -> None:
        """The body ended before its first token: a failure (nothing was sent), unless the answer was complete.

        Raises:
            EmptyStream: it held no event; UpstreamUnavailable: it ended before every choice had finished.
        """
        if not self._events:
            raise EmptyStream("The upstream answered 200 with an empty event stream.")
        if not self.stats.finished:
            where = "inside an event" if self._scanner.pending else "before its answer was finished"
            raise UpstreamUnavailable(f"The upstream stream ended {where}, before its first token.",
                                      code="upstream_stream_interrupted")

    async def _tail(self, chunks: AsyncIterator[bytes], write: Write) -> None:
        """Every choice has finished: relay what follows for at most ``finish_grace`` seconds, then end."""
        stats = self.stats
        try:
            async with asyncio.timeout(self._finish_grace):
                async for chunk in chunks:
                    out = self._take(chunk)
                    if out:
                        await write(out)
                    if stats.done:
                        await self._drain(chunks, DONE_GRACE)
                        return
        except TimeoutError:
            pass  # the upstream went quiet after the finish: the answer is complete (stats.complete stays False)
        else:
            stats.complete = True
        await self._end(write)

    async def _end(self, write: Write) -> None:
        """The upstream's body ended (or went quiet after the finish) without ``[DONE]``: end the client's."""
        stats = self.stats
        if stats.error or stats.done:
            return  # the upstream's own error event ends it: nothing is added (never a second error)
        if not stats.finished or self._responses:
            # an end before every choice finished (or a Responses stream before its terminal event) truncates the
            # answer: say so (docs/reference/wire.md#errors-the-gateway-answers-itself: "never end silently")
            message = "inside an event" if self._scanner.pending else "before the answer was finished"
            await self._broken(write, "upstream_stream_interrupted", f"The upstream stream ended {message}.")
        else:
            stats.done = True  # also when a last partial event (a [DONE] without its blank line) is dropped
            await write(DONE)

    async def _broken(self, write: Write, code: str, message: str) -> None:
        """The upstream failed after the first byte: one in-band error event, unless the answer was already
        complete (every choice finished: end it as a success) or the upstream sent its own error event."""
        stats = self.stats
        if stats.finished and not stats.error:
            await self._end(write)
            return
        if stats.error:
            return
        stats.error = code
        await write(b"data: " + error_body(message, "server_error", None, code) + b"\n\n")

    async def _drain(self, chunks: AsyncIterator[bytes], grace: float) -> None:
        """Read and drop ``chunks`` until they end (``stats.complete``), fail, or ``grace`` seconds pass."""
        try:
            async with asyncio.timeout(grace):
                async for _ in chunks:
                    pass
            self.stats.complete = True
        except (TimeoutError, StreamInterrupted):
            pass

    def _take(self, chunk: bytes) -> bytes:
        """Observe one upstream read; return the bytes to forward. A read made only of the stream's :class:`Template`
        events is forwarded as it came; any other goes through the scanner and :meth:`_process`."""
        now = time.perf_counter()
        template = self._template
        if template is not None and len(chunk) <= self._max_read and self._scanner.idle:
            tokens = template.match(chunk)
            if tokens >= 0:
                if tokens:
                    stats = self.stats
                    stats.token_chunks += tokens
                    stats.t_last_token = now  # t_first_token is set: the template was learned from a token chunk
                return chunk
        return self._process(self._scanner.feed(chunk), now)

    def _process(self, events: list[SSEEvent], now: float) -> bytes:
        """Observe one read's events; return the bytes to forward (per event: its raw bytes, or nothing).

        Hot path: runs for every event. A chunk is parsed once with orjson; only chunks with a rarer key (a
        non-null ``usage``, ``error``, or the member the upstream's dialect adds: :class:`Extra`) or an ``event:``
        field take the complete look (:meth:`_observe`). Measured here: five dict lookups cost ~0.24 us, searching
        the event's bytes for the same keys ~2.9 us, orjson's parse ~1.7 us.
        """
        stats = self.stats
        member = self._member
        out: list[bytes] = []
        for raw, data, event in events:
            if stats.done:
                break  # nothing follows [DONE]; the SDK stops reading there
            if data is None:
                out.append(raw)  # keep-alive comment
                continue
            self._events += 1
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
                self._error_event = observe_response_event(stats, chunk, now) or self._error_event
            elif event is not None or chunk.get("usage") is not None or "error" in chunk or member in chunk:
                if not self._observe(chunk, event, now):
                    continue
            elif choices := chunk.get("choices"):
                stats.service_tier = stats.service_tier or served_tier(chunk)  # every chunk says it: read until known
                self._choices_seen(chunk, choices, now)
                # this read had a token, and not the first (learning costs ~4 us: never on the way to the first token)
                if self._learn and stats.t_last_token == now and stats.t_first_token != now:
                    self._learn -= 1  # bounded: a stream whose chunks keep changing shape stops trying
                    self._template = Template.learn(raw, data, chunk) or self._template
            out.append(raw)
        return b"".join(out)

    def _choices_seen(self, chunk: dict[str, Any], choices: Any, now: float) -> None:
        """Time a token-bearing chunk (:func:`delta_has_token` for some choice) and note each choice's
        ``finish_reason`` (``choices``: the chunk's)."""
        if type(choices) is not list:
            return
        token = False
        for choice in choices:
            if type(choice) is not dict:
                continue
            if not token:
                token = delta_has_token(choice.get("delta"))
            if choice.get("finish_reason"):  # null or "" (some upstreams) is not a finish
                index = choice.get("index", 0)
                self._unfinished.discard(index if type(index) is int else 0)
                if not self._unfinished:
                    stats = self.stats
                    stats.finished = True
                    if stats.usage is None and self._vendors is not None:  # any kind's member, on this chunk only
                        stats.usage = self._vendors.vendor_usage(chunk)  # (docs/architecture.md#general-readers)
        if token:
            stats = self.stats
            stats.token_chunks += 1
            if stats.t_first_token is None:
                stats.t_first_token = now
            stats.t_last_token = now

    def _observe(self, chunk: dict[str, Any], event: bytes | None, now: float) -> bool:
        """The complete look at a chat chunk; return False when the chunk must not be forwarded."""
        stats = self.stats
        if chunk.get("error") or event == b"error":  # the SDK raises only on a non-empty error
            stats.error = "upstream_error_event"
            stats.error_event = chunk
            if stats.t_first_token is None:
                self._error_event = chunk  # before any token: it can still be answered with its status
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            stats.usage = usage
        if self._extra is not None and (value := chunk.get(self._member)) is not None:
            reported, timings = self._extra.member_facts(value)
            if reported is not None and not isinstance(usage, dict):  # OpenAI's usage, where both are, counts
                stats.usage = reported
            if timings is not None:
                stats.timings = timings
        stats.service_tier = served_tier(chunk) or stats.service_tier  # the last chunk's word is the served tier
        choices = chunk.get("choices")
        if not choices:
            return not (self._strip and isinstance(usage, dict) and choices == [])
        self._choices_seen(chunk, choices, now)
        return True
