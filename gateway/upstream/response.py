"""An open upstream answer as the relay and the attempt read it, the idle watch on a streamed body, and aiohttp's errors
as the gateway's (:class:`map_errors`). Nothing here parses a body it relays."""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncGenerator
from typing import Any, Literal

import aiohttp

from gateway.errors import (
    GatewayError,
    StreamInterrupted,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.upstream.attempt import ERROR_BODY_LIMIT
from gateway.upstream.headers import (
    _FIELD_VALUE,
    ENTITY_HEADERS,
    pass_headers,
)


class UpstreamResponse:
    """End it with :meth:`release` (read whole: pooled) or :meth:`close` (anything else: never pooled half-read).
    ``stale_retried``: sent again after a stale pooled connection (:meth:`UpstreamPool.send`)."""

    __slots__ = ("_resp", "_idle", "_watch", "status", "headers", "content_type", "consumed", "stale_retried",
                 "_encoded")

    def __init__(self, resp: aiohttp.ClientResponse, idle: float | None = None, stale_retried: bool = False,
                 encoded: bool = False, watch: AnswerWatch | None = None) -> None:
        """``watch``: what bounds a whole answer's body (its request's :class:`AnswerWatch`), stopped at the end."""
        self._resp = resp
        self._encoded = encoded  # its body is read as it came, content-encoding and all (a passthrough answer)
        self._idle = idle
        self._watch: IdleWatch | AnswerWatch | None = watch
        if watch is not None:
            watch.content = resp.content
        self.status = resp.status
        self.headers = pass_headers(resp.headers)
        self.content_type = resp.headers.get("content-type", "")
        self.consumed = 0
        self.stale_retried = stale_retried

    def entity_headers(self) -> list[tuple[bytes, bytes]]:
        """True of the bytes relayed: a passthrough body is never decoded, so ``content-encoding`` stays right."""
        return [(k.lower(), v) for k, v in self._resp.raw_headers
                if k.lower() in ENTITY_HEADERS and _FIELD_VALUE.fullmatch(v)]

    def watch_idle(self) -> None:
        """Not armed by itself: before a stream's first token its ``ttft`` deadline may be what bounds the wait."""
        if self._idle and self._watch is None:
            self._watch = IdleWatch(self._resp.content, self._idle, self)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """One item per socket read, never re-chunked; after a cancelled iteration, a new one goes on from there. Raises
        StreamInterrupted: reset, truncated, or silent for the idle timeout once :meth:`watch_idle` was called."""
        read = self._resp.content.readany
        try:
            while True:
                data = await read()
                if not data:
                    return
                self.consumed += len(data)
                yield data
        except TimeoutError as exc:
            raise StreamInterrupted("upstream_idle_timeout", "The upstream stopped sending before the end.") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise StreamInterrupted("upstream_stream_interrupted",
                                    f"The upstream connection ended mid-stream ({type(exc).__name__}).") from exc

    async def read(self) -> bytes:
        with map_errors():
            return await self._resp.read()

    async def read_error(self, limit: int = ERROR_BODY_LIMIT) -> bytes:
        """At most ``limit`` bytes (past it the connection is closed), decoded even from a passthrough answer, whose
        other bodies are relayed as they came. Only silence is bounded, never the total time, so a slow but live error
        body still yields the upstream's words. Raises UpstreamTimeout (silent for the idle timeout) or
        UpstreamUnavailable (the connection broke)."""
        parts: list[bytes] = []
        size = 0
        self.watch_idle()
        try:
            async with contextlib.aclosing(self.chunks()) as chunks:
                async for data in chunks:
                    parts.append(data)
                    size += len(data)
                    if size >= limit:
                        self.close()
                        break
        except StreamInterrupted as exc:
            if exc.code == "upstream_idle_timeout":
                raise UpstreamTimeout("The upstream stopped sending its error answer.") from exc
            raise UpstreamUnavailable(exc.message) from exc
        data = b"".join(parts)[:limit]
        encoding = self._resp.headers.get("content-encoding", "").strip().lower()
        if self._encoded and encoding in ("gzip", "x-gzip", "deflate"):
            return decoded(data, encoding, limit)
        return data

    def release(self) -> None:
        self._stop_watch()
        self._resp.release()

    def close(self) -> None:
        self._stop_watch()
        self._resp.close()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None


class IdleWatch:
    """Fails a streamed body after ``idle`` seconds of silence, caught within ``1.25 * idle``. aiohttp's ``sock_read``
    re-arms a loop timer on every read (2.8 us, ~7 % of the gateway's CPU per relayed chunk at 32 streams); this timer
    fires every ``idle / 4`` and compares byte counts. Bytes received but not yet read (a slow client) are not
    silence."""

    __slots__ = ("content", "idle", "step", "seen", "quiet_since", "reader", "handle", "loop")

    def __init__(self, content: aiohttp.StreamReader, idle: float, reader: UpstreamResponse) -> None:
        self.loop = asyncio.get_running_loop()
        self.content = content
        self.idle = idle
        self.step = idle / 4
        self.seen = content.total_bytes
        self.quiet_since = self.loop.time()
        self.reader = reader
        self.handle: asyncio.TimerHandle | None = self.loop.call_at(self.quiet_since + self.step, self._check)

    def _check(self) -> None:
        self.handle = None
        content = self.content
        if content.is_eof():
            return  # the body is complete; the reader ends on its own
        now = self.loop.time()
        total = content.total_bytes
        if total != self.seen or self.reader.consumed < total:
            self.seen = total
            self.quiet_since = now
        elif now - self.quiet_since >= self.idle:
            content.set_exception(TimeoutError(f"no bytes from the upstream for {self.idle:g} s"))
            return
        self.handle = self.loop.call_at(min(now + self.step, self.quiet_since + self.idle), self._check)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class AnswerWatch:
    """Bounds one upstream request from its send to its answer's end: ``total`` seconds in all (None: unbounded),
    from the send, connecting included; ``connect`` seconds to have a connection, name lookup included (aiohttp's
    ``sock_connect`` times only the TCP connect); and ``idle`` seconds of silence, from the connection on. One loop
    timer, checked every ``idle / 4`` (silence caught within ``1.25 * idle``, the total on time). aiohttp's own
    ``total`` and ``sock_read`` cost ~10 us of CPU per non-streaming request (measured: ``bench.layers``' client rows):
    a TimerHandle and a TimerContext per request, a timer re-armed on every socket read. With a connection it fails
    the request the way aiohttp's read timeout does (``ResponseHandler._on_read_timeout``): a ``SocketTimeoutError``
    (a TimeoutError, :class:`map_errors`' UpstreamTimeout) set on the connection's protocol, which the wait for the
    status line raises, and on the body's reader; before one (a name lookup that hangs) it cancels the sending task,
    which raises UpstreamTimeout (``expired``). :meth:`connected` is called when the connection is had
    (``gateway.upstream.client``), ``content`` set when the answer's head arrived (:class:`UpstreamResponse`); bytes
    received but not yet read are not silence."""

    __slots__ = ("loop", "total_by", "connect_by", "idle", "step", "quiet_since", "seen", "proto", "content",
                 "handle", "task", "expired")

    def __init__(self, total: float | None, idle: float, connect: float | None = None) -> None:
        self.loop = loop = asyncio.get_running_loop()
        now = loop.time()
        self.total_by = None if total is None else now + total
        self.connect_by = None if connect is None else now + connect  # name lookup included (sock_connect is not)
        self.idle = idle
        self.step = idle / 4
        self.quiet_since = now
        self.seen = 0
        self.proto: Any = None
        self.content: aiohttp.StreamReader | None = None
        self.task = asyncio.current_task()
        self.expired: BaseException | None = None
        self.handle: asyncio.TimerHandle | None = loop.call_at(self._next(now), self._check)

    def connected(self, proto: Any) -> None:
        self.proto = proto
        self.quiet_since = self.loop.time()

    def _next(self, now: float) -> float:
        if self.proto is None:
            due = now + self.step if self.connect_by is None else min(now + self.step, self.connect_by)
        else:
            due = min(now + self.step, self.quiet_since + self.idle)
        return due if self.total_by is None else min(due, self.total_by)

    def _check(self) -> None:
        self.handle = None
        now, content = self.loop.time(), self.content
        if content is not None:
            if content.is_eof():
                return
            if content.total_bytes != self.seen:
                self.seen, self.quiet_since = content.total_bytes, now
        if self.total_by is not None and now >= self.total_by:
            return self._fail("The upstream did not answer within its total timeout.")
        if self.proto is None and self.content is None and self.connect_by is not None and now >= self.connect_by:
            return self._fail("No connection to the upstream within its connect timeout.")
        if self.proto is not None and now - self.quiet_since >= self.idle:
            return self._fail(f"No bytes from the upstream for {self.idle:g} s.")
        self.handle = self.loop.call_at(self._next(now), self._check)

    def _fail(self, message: str) -> None:
        exc = aiohttp.SocketTimeoutError(message)
        if self.proto is None and self.content is None:  # still connecting: the request's own task is stopped
            self.expired = exc
            if self.task is not None:
                self.task.cancel()
            return
        if self.proto is not None:
            self.proto.set_exception(exc)
        if self.content is not None:
            self.content.set_exception(exc)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class map_errors:  # noqa: N801 - used as a context manager, named like one
    """Translate aiohttp/socket exceptions raised before the body into :mod:`gateway.errors` classes."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> Literal[False]:
        if exc is None or isinstance(exc, GatewayError | asyncio.CancelledError):
            return False
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            raise UpstreamTimeout("The upstream did not answer in time.") from exc
        if isinstance(exc, aiohttp.ClientError | OSError):
            raise UpstreamUnavailable(f"The upstream could not be reached ({type(exc).__name__}).") from exc
        return False


def decoded(data: bytes, encoding: str, limit: int) -> bytes:
    """A passthrough answer is read as it came (RFC 9110 §8.4), so its error body may be compressed; ``limit`` bounds
    the expansion. As it came if it does not decode."""
    wbits = 16 + zlib.MAX_WBITS if "gzip" in encoding else zlib.MAX_WBITS
    try:
        return zlib.decompressobj(wbits).decompress(data, limit)
    except zlib.error:
        if encoding == "deflate":  # servers send raw deflate as often as the zlib stream RFC 9110 names
            with contextlib.suppress(zlib.error):
                return zlib.decompressobj(-zlib.MAX_WBITS).decompress(data, limit)
        return data
