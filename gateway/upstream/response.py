"""An open upstream answer as the relay and the attempt read it (:class:`UpstreamResponse`: status, filtered headers,
the body as reads, released or closed once), the idle watch on a streamed body (:class:`IdleWatch`: silence between
reads past ``timeouts.idle`` is a broken stream, caught within 1.25 x idle), and aiohttp's errors as the gateway's
(:class:`map_errors`)."""

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
    """An open upstream response: status, filtered headers, and the body as reads.

    Always end it with :meth:`release` (fully read: the connection returns to the pool) or
    :meth:`close` (anything else: the connection is closed, never pooled half-read).

    Attributes:
        consumed: body bytes the reader has taken so far.
        stale_retried: the first attempt went out on a pooled connection the upstream had closed, and was sent
            again on a new one (:meth:`UpstreamPool.send`).
    An error body is read decoded (:meth:`read_error`) whether or not the rest is read as it came (``encoded``).
    """

    __slots__ = ("_resp", "_idle", "_watch", "status", "headers", "content_type", "consumed", "stale_retried",
                 "_encoded")

    def __init__(self, resp: aiohttp.ClientResponse, idle: float | None = None, stale_retried: bool = False,
                 encoded: bool = False) -> None:
        self._resp = resp
        self._encoded = encoded  # its body is read as it came, content-encoding and all (a passthrough answer)
        self._idle = idle
        self._watch: IdleWatch | None = None
        self.status = resp.status
        self.headers = pass_headers(resp.headers)
        self.content_type = resp.headers.get("content-type", "")
        self.consumed = 0
        self.stale_retried = stale_retried

    def entity_headers(self) -> list[tuple[bytes, bytes]]:
        """The upstream's own headers that describe a passthrough answer's body (:data:`ENTITY_HEADERS`), as the bytes
        they came in; a value that is no valid field value (RFC 9110 §5.5) is dropped. The body of a passthrough
        answer is not decoded (``UpstreamPool.send``), so ``content-encoding`` and ``content-length`` stay true."""
        return [(k.lower(), v) for k, v in self._resp.raw_headers
                if k.lower() in ENTITY_HEADERS and _FIELD_VALUE.fullmatch(v)]

    def watch_idle(self) -> None:
        """From now on, fail the body after the upstream's idle timeout of silence (:class:`IdleWatch`; streams).

        Not armed by itself: before a stream's first token its ``ttft`` deadline may be what bounds the wait.
        Calling it again does nothing.
        """
        if self._idle and self._watch is None:
            self._watch = IdleWatch(self._resp.content, self._idle, self)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """Yield body bytes as they arrive (one item per socket read, never re-chunked). It may be called again
        after an iteration was cancelled: it goes on where the last one stopped.

        Raises:
            StreamInterrupted: reset, truncated chunked body, or no new bytes for the idle timeout once
                :meth:`watch_idle` was called.
        """
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
        """Read the whole body (a non-streaming answer).

        Raises:
            UpstreamTimeout: the total or idle timeout passed; UpstreamUnavailable: the connection broke.
        """
        with map_errors():
            return await self._resp.read()

    async def read_error(self, limit: int = ERROR_BODY_LIMIT) -> bytes:
        """Read an error answer's body, at most ``limit`` bytes; past it the rest is dropped and the connection
        closed. Silence is bounded as for the request's body (``sock_read`` or :class:`IdleWatch`), never the
        total time, so a slow but live error body still yields the upstream's status and message.

        Raises:
            UpstreamTimeout: silence for the idle timeout; UpstreamUnavailable: the connection broke.
        """
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
        """Return a fully read connection to the pool (aiohttp closes it instead when the body is not complete)."""
        self._stop_watch()
        self._resp.release()

    def close(self) -> None:
        """Close the connection now (client gone, error, or body not fully read)."""
        self._stop_watch()
        self._resp.close()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None


class IdleWatch:
    """Fail a streamed body with ``TimeoutError`` once the upstream has sent nothing new for ``idle`` seconds.

    aiohttp's ``sock_read`` timeout does this by cancelling and re-arming a loop timer on every socket read
    (2.8 us a read, timeit here; ~7 % of the gateway's CPU per relayed chunk at 32 streams). This timer
    fires every ``idle / 4`` seconds instead and compares byte counts, so a read costs one addition, and a
    silence ends the stream after between ``idle`` and ``1.25 * idle`` seconds (never before ``idle``).
    Bytes that arrived but are not read yet (the client is slow to take them) are not silence.

    Args:
        content: the response's ``aiohttp.StreamReader`` (``total_bytes``: bytes received so far).
        idle: seconds of silence allowed.
        reader: what reads ``content``; its ``consumed`` counts the bytes taken.
    """

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
        """Cancel the timer (the body ended, failed, or the request is over)."""
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
    """An error body that came compressed (``gzip`` or ``deflate``: a passthrough answer is read as it came, RFC 9110
    §8.4), decoded to at most ``limit`` bytes (a small body cannot expand past it); as it came if it does not
    decode (the upstream's words are then read as they are)."""
    wbits = 16 + zlib.MAX_WBITS if "gzip" in encoding else zlib.MAX_WBITS
    try:
        return zlib.decompressobj(wbits).decompress(data, limit)
    except zlib.error:
        if encoding == "deflate":  # servers send raw deflate as often as the zlib stream RFC 9110 names
            with contextlib.suppress(zlib.error):
                return zlib.decompressobj(-zlib.MAX_WBITS).decompress(data, limit)
        return data
