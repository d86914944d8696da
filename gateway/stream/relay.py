"""Byte-exact SSE relay of chat-completions and Responses API streams, observed once per event. Events leave byte for
byte as their blank line arrives, edited only at event boundaries and only where the wire contract requires it
(docs/reference/wire.md#sse-framing): one ``[DONE]``, the usage chunk the client did not ask for dropped, one in-band
error event for a failure after the first byte.

Nothing is written before the first token (docs/routing.md#failover): the events before it carry none, so holding them
costs the client nothing, and until then every failure can still be answered with a real status or failed over. How a
stream ends: docs/routing.md#stream-end."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from orjson import JSONDecodeError, dumps, loads

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
_MODEL = re.compile(rb'"model"\s*:\s*"(?:[^"\\]|\\.)*"')  # a chunk's model member (a string's quotes are escaped)
Price = Callable[[dict[str, Any], str | None], float | None]  # (usage, served tier) -> USD, None: unpriced
DONE_GRACE = 0.02  # seconds to wait for the end of the upstream's body after its [DONE]
# seconds the upstream connection stays open after a client left before every choice finished: read, unsent, for the
# usage of the generation it cancelled (which runs, and is billed, until the close). The gateway's own bound
# (docs/routing.md#stream-end). finish_grace is for finished streams.
LEAVE_GRACE = 1.0
SAMPLE_EVERY = 16  # one upstream read in this many is timed to its write (StreamStats.added)
MAX_SAMPLES = 256  # per stream: a long stream's samples stay bounded
HOLD_BYTES = 256 * 1024  # bytes of output held before the first token at most; past it the stream commits
ALIVE_WITHIN = 0.75  # at the hold's time bound, a stream heard from within this share of it is alive
_NO_MEMBER = "\x00"  # the member looked for when the dialect adds none: no chunk has it (a lookup, not a branch)


WriteNow = Callable[[bytes], bool]


def _awaited(data: bytes) -> bool:
    """The ``write_now`` of a relay without one: every piece goes through ``write``."""
    return False


class Relay:
    """``LEARN``: how many token chunks of a stream may be tried as its :class:`Template` (0: never); ``choices``: the
    request's ``n``; ``finish_grace``: seconds to wait for the usage tail of a finished stream; ``hold_seconds``:
    without a ttft deadline, the longest hold before the first token (the idle timeout)."""

    LEARN = 8

    def __init__(self, *, strip_usage_chunk: bool, max_event_bytes: int, responses: bool = False, choices: int = 1,
                 finish_grace: float = 2.0, hold_seconds: float | None = None, extra: Extra | None = None,
                 rename: str | None = None, price: Price | None = None) -> None:
        """``rename``: the model name the client asked for, put in place of the upstream's in every chunk
        (``answers.model: requested``); ``price``: the USD of a usage, written as ``usage.cost`` into the usage chunk
        the client gets (``answers.cost: usage``). Both off by default: the relay is then byte for byte."""
        self.stats = StreamStats()
        self._rename = None if rename is None else b'"model":' + dumps(rename)
        self._price = price
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
        """``first_token_by``: an ``asyncio`` loop time, or None: then the hold ends at ``hold_seconds`` or
        :data:`HOLD_BYTES`. Raises a GatewayError only before anything was written, so that the caller can answer with a
        status or fail over; after the first write, upstream trouble becomes an in-band error event."""
        await self.first(body, first_token_by)
        return await self.rest(write)

    async def first(self, body: StreamBody, first_token_by: float | None = None) -> None:
        """Apart from :meth:`rest` so that two candidates can race to their first token (hedging). Raises as
        :meth:`run`, before anything was written."""
        if first_token_by is None:
            body.watch_idle()
        held, ended, chunks = await self._hold(body, body.chunks(), first_token_by)
        body.watch_idle()
        self._first = (held, ended, chunks)

    async def release(self, write: Write) -> None:
        """Lets the first token leave in the caller's task; :meth:`rest` then does not write it again."""
        assert self._first is not None, "first() comes before release()"
        held, ended, chunks = self._first
        if held:
            self._first = (b"", ended, chunks)
            await write(held)
            self.stats.t_first_written = time.perf_counter()

    async def rest(self, write: Write, write_now: WriteNow | None = None) -> StreamStats:
        """``write_now``: writes a piece at once and returns True, or returns False and ``write`` is awaited instead
        (``gateway.pipeline.exchange.Exchange.write_now``): no coroutine per relayed chunk."""
        stats = self.stats
        assert self._first is not None, "first() comes before rest()"
        held, ended, chunks = self._first
        if held:
            await write(held)
            stats.t_first_written = time.perf_counter()
        if stats.done:
            await self._drain(chunks, DONE_GRACE)
            return stats
        if ended:
            await self._end(write)
            return stats
        try:
            if not stats.finished and await self._relay(chunks, write, write_now or _awaited):
                return stats
            await self._tail(chunks, write)
        except StreamInterrupted as exc:
            await self._broken(write, exc.code, exc.message)
        except EventTooLarge as exc:
            await self._broken(write, "upstream_event_too_large", str(exc))
        return stats

    async def _relay(self, chunks: AsyncIterator[bytes], write: Write, write_now: WriteNow) -> bool:
        """Every read until the answer finished (False: its tail follows) or the stream ended (True). One read in
        :data:`SAMPLE_EVERY` is timed from the read to its write done (``StreamStats.added``): two clock reads, on a
        sixteenth of the reads."""
        stats = self.stats
        sample, added = SAMPLE_EVERY, stats.added
        async for chunk in chunks:
            sample -= 1
            if sample:
                out = self._take(chunk)
                if out and not write_now(out):
                    await write(out)
            else:
                sample, t0 = SAMPLE_EVERY, time.perf_counter()
                out = self._take(chunk)
                if out:
                    if not write_now(out):
                        await write(out)
                    if len(added) < MAX_SAMPLES:
                        added.append(time.perf_counter() - t0)
            if stats.done:
                await self._drain(chunks, DONE_GRACE)
                return True
            if stats.finished:
                return False
        stats.complete = True
        await self._end(write)
        return True

    async def tail(self, body: StreamBody) -> None:
        """The client left: read on, unsent, for at most ``finish_grace`` seconds if every choice had finished, else
        :data:`LEAVE_GRACE`, so that the usage (and the tokens meanwhile) are still charged: SDKs often ``break`` on
        ``finish_reason``. Never raises for the upstream's trouble."""
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
        """Returns (the held output, whether the body ended while held, the reads to go on with). Without a ``deadline``
        a stream still heard from commits at the hold's bound; a quiet one is left to the idle watch, whose end before
        the first byte is a failover, not a 200 ending in an in-band error."""
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
        """Raises EmptyStream (no event at all) or UpstreamUnavailable (ended before every choice finished): nothing was
        sent yet, so the caller may still fail over."""
        if not self._events:
            raise EmptyStream("The upstream answered 200 with an empty event stream.")
        if not self.stats.finished:
            where = "inside an event" if self._scanner.pending else "before its answer was finished"
            raise UpstreamUnavailable(f"The upstream stream ended {where}, before its first token.",
                                      code="upstream_stream_interrupted")

    async def _tail(self, chunks: AsyncIterator[bytes], write: Write) -> None:
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
        """One in-band error event, unless the answer was complete (then it ends as a success) or the upstream sent its
        own."""
        stats = self.stats
        if stats.finished and not stats.error:
            await self._end(write)
            return
        if stats.error:
            return
        stats.error = code
        await write(b"data: " + error_body(message, "server_error", None, code) + b"\n\n")

    async def _drain(self, chunks: AsyncIterator[bytes], grace: float) -> None:
        try:
            async with asyncio.timeout(grace):
                async for _ in chunks:
                    pass
            self.stats.complete = True
        except (TimeoutError, StreamInterrupted):
            pass

    def _take(self, chunk: bytes) -> bytes:
        """A read made only of the stream's :class:`Template` events is forwarded as it came, without a scan or
        parse."""
        now = time.perf_counter()
        template = self._template
        if template is not None and len(chunk) <= self._max_read and self._scanner.idle:
            tokens = template.match(chunk)
            if tokens >= 0:
                if tokens:
                    stats = self.stats
                    stats.token_chunks += tokens
                    stats.t_last_token = now  # t_first_token is set: the template was learned from a token chunk
                return chunk if self._rename is None else self._named(chunk)
        out = self._process(self._scanner.feed(chunk), now)
        return out if self._rename is None else self._named(out)

    def _named(self, out: bytes) -> bytes:
        """``out`` with the client's model name for every ``"model": "..."`` member the upstream wrote (whatever it
        named, empty or changing mid-stream); inside a JSON string the quotes are escaped, so content never matches."""
        assert self._rename is not None
        return _MODEL.sub(self._rename, out) if b'"model"' in out else out

    def _process(self, events: list[SSEEvent], now: float) -> bytes:
        """Hot path, every event: one orjson parse; only chunks with a rarer key (a non-null ``usage``, ``error``, the
        dialect's member) or an ``event:`` field take :meth:`_observe`. Measured here: five dict lookups ~0.24 us, a
        byte search for the same keys ~2.9 us, orjson's parse ~1.7 us."""
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
                kept = self._rare(chunk, event, now, raw, data)
                if kept is None:
                    continue
                raw = kept
            elif choices := chunk.get("choices"):
                stats.service_tier = stats.service_tier or served_tier(chunk)  # every chunk says it: read until known
                self._choices_seen(chunk, choices, now)
                # this read had a token, and not the first (learning costs ~4 us: never on the way to the first token)
                if self._learn and stats.t_last_token == now and stats.t_first_token != now:
                    self._learn -= 1  # bounded: a stream whose chunks keep changing shape stops trying
                    self._template = Template.learn(raw, data, chunk) or self._template
            out.append(raw)
        return b"".join(out)

    def _rare(self, chunk: dict[str, Any], event: bytes | None, now: float, raw: bytes, data: bytes) -> bytes | None:
        """A chunk with a rarer key: None when it must not be forwarded, else its bytes (priced, with ``price``)."""
        if not self._observe(chunk, event, now):
            return None
        if self._price is not None and isinstance(usage := chunk.get("usage"), dict):
            return self._priced(raw, data, chunk, usage)
        return raw

    def _priced(self, raw: bytes, data: bytes, chunk: dict[str, Any], usage: dict[str, Any]) -> bytes:
        """The usage chunk with the cost the gateway computed as ``usage.cost`` (OpenRouter's field); as it came when
        unpriced, or when its data is split over several ``data:`` lines."""
        assert self._price is not None
        cost = self._price(usage, self.stats.service_tier)
        if cost is None or data not in raw:
            return raw
        priced = {**chunk, "usage": {**usage, "cost": round(cost, 12)}}
        return raw.replace(data, dumps(priced), 1)

    def _choices_seen(self, chunk: dict[str, Any], choices: Any, now: float) -> None:
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
        """Returns False when the chunk must not be forwarded."""
        stats = self.stats
        if chunk.get("error") or event == b"error":  # the SDK raises only on a non-empty error
            stats.error = "upstream_error_event"
            stats.error_event = chunk
            if stats.t_first_token is None:
                self._error_event = chunk  # before any token: it can still be answered with its status
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            stats.usage = usage
            model = chunk.get("model")  # read once, from the usage chunk: the model the answer names
            stats.model = model if isinstance(model, str) else stats.model
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
