"""Upstream attempts and the HTTP client under them: one pooled aiohttp session per process, outbound header rules,
error mapping.

An :class:`Attempt` is one try of one upstream, from sending the request to the end of its answer, with one owner
(``async with``): it holds the upstream's concurrency slot, the open answer and the first-token deadline, and its
exit is the only place the answer is released (read to its end) or closed (anything else), the slot given back and
the upstream's health told the verdict. The client under it is a :class:`Transport`: :class:`UpstreamPool`
(aiohttp) in production, or a fake that plays scripted bytes in tests (``gateway.tools.scripted``).

aiohttp is used for upstream I/O on the hot path instead of httpx: measured on this machine it costs a
third of the CPU per relayed chunk and serves ~15x the non-streaming requests/s (issue 2's table;
``bench/`` re-measures it). This is the only module that imports aiohttp or catches its exceptions.

Headers sent upstream are built, not copied: ``Authorization`` carries the upstream's own key (never the
client's), ``Accept-Encoding: identity`` keeps ``Content-Encoding`` and the body in agreement, and no
client credential, cookie or hop-by-hop header crosses. Headers returned to the client pass an
allowlist (:data:`RESPONSE_HEADER_ALLOW`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import math
import re
import socket
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import Any, Literal, Protocol

import aiohttp
import orjson
from pydantic import SecretStr
from yarl import URL

from gateway import __version__
from gateway.config.upstreams import UpstreamConfig
from gateway.errors import (
    GatewayError,
    StreamInterrupted,
    UpstreamAuthFailed,
    UpstreamBadResponse,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    event_error,
    upstream_error,
)
from gateway.observability import logs, tracing
from gateway.routing.blame import Blame, request_shaped
from gateway.routing.ratelimits import retry_wait

RESPONSE_HEADER_ALLOW = ("openai-processing-ms", "retry-after", "retry-after-ms", "x-should-retry")
RESPONSE_HEADER_PREFIX_ALLOW = ("x-ratelimit-",)
# a passthrough answer's own headers a client needs besides those: what its body is. Its bytes are relayed as they
# came (not decoded), so content-encoding and content-length stay true of them
ENTITY_HEADERS = (b"content-type", b"content-disposition", b"content-encoding", b"content-length", b"content-range",
                  b"accept-ranges", b"openai-version")
# the client headers a passthrough request carries upstream (what its body is, what it accepts, the beta it opts
# into, its idempotency key); everything else (its key, cookies, hop-by-hop headers, organisation and project
# ids that belong to another account) stays behind
FORWARD_HEADERS = ("content-type", "content-length", "content-encoding", "accept", "openai-beta", "idempotency-key",
                   "range")
Body = bytes | AsyncIterable[bytes] | None  # None: no body (a GET)
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # RFC 9110 §5.5: no control character but tab
USER_AGENT = f"tiergate/{__version__}"
ERROR_BODY_LIMIT = 64 * 1024  # bytes of an upstream error answer kept for its message; the rest is dropped
LARGE_BODY = 256 * 1024  # bytes: a body held whole but larger than this goes in PIECE pieces, its writing watched
PIECE = 64 * 1024
SKIP_FORWARDED = ("User-Agent", "Content-Type", "Accept")  # aiohttp adds none of these to a passthrough request


# a streamed answer labelled with one of these is not an event stream; any other label (text/plain, none, ...) on a
# 200 to a stream request is relayed as one (issue 10 case 6: mislabelled streams)
NOT_A_STREAM = ("application/json", "text/html")


class Answer(Protocol):
    """An open upstream answer, as :class:`UpstreamResponse` gives it (``headers``: the ones a client may see)."""

    status: int
    headers: dict[str, str]
    content_type: str
    stale_retried: bool

    def chunks(self) -> AsyncIterator[bytes]: ...
    def entity_headers(self) -> list[tuple[bytes, bytes]]: ...
    def watch_idle(self) -> None: ...
    async def read(self) -> bytes: ...
    async def read_error(self, limit: int = ...) -> bytes: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


class Transport(Protocol):
    """What sends a request upstream and waits for its status line (:meth:`UpstreamPool.send`)."""

    @property
    def ready(self) -> bool: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def send(self, upstream: UpstreamConfig, body: Body, *, stream: bool, request_id: str,
                   path: str = "/chat/completions", method: str = "POST",
                   forward: Mapping[str, str] | None = None, client_key: str | None = None,
                   trace: Mapping[str, str] | None = None) -> Answer: ...


class Verdicts(Protocol):
    """What an attempt tells an upstream's health (:class:`gateway.routing.health.UpstreamHealth`, or
    :data:`gateway.routing.health.UNTRACKED`)."""

    def start(self, now: float, need_tokens: int) -> Any: ...
    def finish(self) -> None: ...
    def observe_headers(self, headers: Mapping[str, str], now: float, mark: Any = None) -> None: ...
    def settle(self, exc: GatewayError | None, now: float, need_tokens: int = 0,
               source: str | None = None) -> None: ...
    def retract(self, source: str) -> None: ...


class Attempt:
    """One try of one upstream (module docstring); use it as ``async with Attempt(...) as attempt``.

    Args:
        transport: the client; upstream: the upstream to try; health: its health, told the verdict on exit;
        clock: the health clock (``Health.clock``, seconds); need_tokens: the request's estimated prompt plus
        ``max_tokens`` (charged to the quota estimate); stream: the request streams (a first-token deadline
        of ``upstream.timeouts.ttft`` then applies, status line included); request_id: sent as
        ``X-Client-Request-Id``; path: under the upstream's base URL (with its query string); method: the HTTP
        method; forward: for a passthrough request, the client's headers (:data:`FORWARD_HEADERS` cross; any 2xx
        is then an answer, and the upstream's timeouts bound connect and silence, never the whole exchange);
        client_key: the client's ``Authorization`` value, sent instead of the upstream's key when the upstream
        says ``pass_client_key`` (else ignored: the client's key never reaches an upstream); span / trace: the
        attempt's trace span and the W3C Trace Context headers sent upstream (``gateway.observability.tracing``), or
        None; blame: whom a request-shaped failure is charged to (``gateway.routing.health.Blame``; None: nobody, the
        upstream alone).

    Attributes:
        answer: the open answer after :meth:`send`, else None.
        first_token_by: the first-token deadline (an ``asyncio`` loop time), or None.
        sent_at: when :meth:`send` began (``time.perf_counter()`` seconds; the start of the attempt's own TTFT).
    """

    def __init__(self, transport: Transport, upstream: UpstreamConfig, health: Verdicts,
                 clock: Callable[[], float], *, need_tokens: int, stream: bool, request_id: str,
                 path: str, method: str = "POST", forward: Mapping[str, str] | None = None,
                 client_key: str | None = None, span: Any = None, trace: Mapping[str, str] | None = None,
                 blame: Blame | None = None) -> None:
        self.upstream = upstream
        self.blame = blame
        self.span = span  # the attempt's trace span (gateway.observability.tracing), or None
        self._trace = trace
        self._error: BaseException | None = None
        self.health = health
        self.answer: Answer | None = None
        self.first_token_by: float | None = None
        self.sent_at: float | None = None
        self._transport = transport
        self._clock = clock
        self._need = need_tokens
        self._stream = stream
        self._rid = request_id
        self._path = path
        self._method = method
        self._forward = forward
        self._client_key = client_key if upstream.pass_client_key else None
        self._complete = False
        self._verdict = False
        self._mark: Any = None

    async def __aenter__(self) -> Attempt:
        self._mark = self.health.start(self._clock(), self._need)
        ttft = self.upstream.timeouts.ttft if self._stream else None
        if ttft:
            self.first_token_by = asyncio.get_running_loop().time() + ttft
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if isinstance(exc, GatewayError):
            self.failed(exc)
        if self.span is not None:
            tracing.end_attempt(self.span, exc or self._error)
        answer, self.answer = self.answer, None
        if answer is not None:
            if self._complete:
                answer.release()
            else:
                answer.close()  # never pooled half-read
        self.health.finish()

    async def send(self, body: Body) -> Answer:
        """Send the request and wait for a 200 (a passthrough request: any 2xx), bounded by the first-token deadline
        when there is one.

        Raises:
            UpstreamTimeout (``upstream_ttft_timeout``), UpstreamUnavailable: no status line; UpstreamStatusError:
                the upstream answered another status (its error body read and normalised); UpstreamAuthFailed: that
                status was a 401 or 403 to the gateway's own key (:meth:`failed`); the stream checks of
                :meth:`stream_answer` do not apply yet.
        """
        self.sent_at = time.perf_counter()
        try:
            async with asyncio.timeout_at(self.first_token_by):
                answer = self.answer = await self._transport.send(
                    self.upstream, body, stream=self._stream, request_id=self._rid, path=self._path,
                    method=self._method, forward=self._forward, client_key=self._client_key, trace=self._trace)
        except TimeoutError as err:
            raise UpstreamTimeout(f"No first token from the upstream within {self.upstream.timeouts.ttft:g} s.",
                                  code="upstream_ttft_timeout") from err
        self.health.observe_headers(answer.headers, self._clock(), self._mark)
        if answer.status != 200 and not (self._forward is not None and 200 <= answer.status < 300):
            if 300 <= answer.status < 400:  # a redirect to the upstream's own hosts, or a 304 to a request never
                # made conditional: nothing a client of the gateway can follow or use
                raise UpstreamBadResponse(f"The upstream answered {answer.status}, which the gateway does not relay.")
            raise self._judged(await self._status_error(answer))
        if self._stream and answer.content_type.split(";", 1)[0].strip().lower() in NOT_A_STREAM:
            raise self._judged(await self._not_a_stream(answer))
        return answer

    def ok(self) -> None:
        """The attempt worked (its answer reached the client whole, or its stream ran to its end)."""
        if not self._verdict:
            self._verdict = True
            self.health.settle(None, self._clock())

    def failed(self, exc: GatewayError) -> GatewayError:
        """The attempt failed with ``exc`` (told to the upstream's health once); returns the error to answer, fail over
        and count by: ``exc``, or, when it is a 401 or 403 the upstream gave the gateway's own key (an error event of a
        200 stream included), an :class:`UpstreamAuthFailed` (logged here)."""
        exc = self._judged(exc)
        self._error = exc
        if not self._verdict:
            self._verdict = True
            blame = self.blame
            if blame is not None and request_shaped(exc):
                source = blame.who()
                self.health.settle(exc, self._clock(), self._need, source)
                blame.charged.append((self.upstream.name, self.health, source))  # what the request may take back
            else:
                self.health.settle(exc, self._clock(), self._need)
        return exc

    def done(self) -> None:
        """The answer was read to its end: on exit its connection goes back to the pool."""
        self._complete = True

    def void(self) -> None:
        """The attempt ended for a reason that is not the upstream's (the client left mid-upload, or its body
        was over the limit): no verdict is told to its health."""
        self._verdict = True

    def _judged(self, exc: GatewayError) -> GatewayError:
        """Whose fault ``exc`` is: a 401 or 403 from an upstream that got the gateway's own key says that key is wrong
        or lacks access, so it becomes :class:`UpstreamAuthFailed` (502; failover; a breaker failure, as every request
        will fail the same way until an operator fixes the key), logged once as ``upstream_auth_failed`` with the
        upstream's words, keys masked (``logs.redact``). From a ``pass_client_key`` upstream it was the client's own
        key: kept, and relayed."""
        if not isinstance(exc, UpstreamStatusError) or not exc.credential_refused or self.upstream.pass_client_key:
            return exc
        up = self.upstream
        logs.event("upstream_auth_failed", "warning", request_id=self._rid, upstream=up.name, tier=up.tier,
                   path=self._path.split("?", 1)[0], status=exc.status, type=logs.redact(exc.error_type, 100),
                   code=None if exc.code is None else logs.redact(exc.code, 100), message=logs.redact(exc.message))
        refused = UpstreamAuthFailed(up.name, exc.status, exc.code)
        refused.__cause__ = exc
        return refused

    async def _read_error(self, answer: Answer) -> tuple[bytes, bool]:
        """Up to 64 KiB of an error body, bounded by the first-token deadline; (bytes, whether read to the end)."""
        try:
            async with asyncio.timeout_at(self.first_token_by):
                return await answer.read_error(), True
        except (GatewayError, TimeoutError):
            return b"", False

    async def _status_error(self, answer: Answer) -> UpstreamStatusError:
        """The upstream's non-200 answer as an error to relay or fail over on, with its status and headers even when
        its body does not arrive (stalls, breaks, or outlasts the first-token deadline): the status line already
        said what happened. A 429 without a retry hint gets ``retry-after`` from the reset of the window it
        exhausted (``health.retry_wait``)."""
        data, whole = await self._read_error(answer)
        self._complete = whole
        err = upstream_error(answer.status, data, answer.headers)
        if err.status == 429 and "retry-after" not in err.headers and "retry-after-ms" not in err.headers:
            wait = retry_wait(answer.headers)
            if wait is not None:
                err.headers["retry-after"] = str(max(1, math.ceil(wait)))
        return err

    async def _not_a_stream(self, answer: Answer) -> GatewayError:
        """A stream request answered 200 with a JSON (or HTML) body: the error it holds, with the status it names
        (some upstreams answer an error this way), or :class:`UpstreamBadResponse`."""
        data, _ = await self._read_error(answer)
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("error"):
            return event_error(parsed)
        return UpstreamBadResponse("The upstream answered a stream request without an event stream.")


class UpstreamResponse:
    """An open upstream response: status, filtered headers, and the body as reads.

    Always end it with :meth:`release` (fully read: the connection returns to the pool) or
    :meth:`close` (anything else: the connection is closed, never pooled half-read).

    Attributes:
        consumed: body bytes the reader has taken so far.
        stale_retried: the first attempt went out on a pooled connection the upstream had closed, and was sent
            again on a new one (:meth:`UpstreamPool.send`).
    """

    __slots__ = ("_resp", "_idle", "_watch", "status", "headers", "content_type", "consumed", "stale_retried")

    def __init__(self, resp: aiohttp.ClientResponse, idle: float | None = None, stale_retried: bool = False) -> None:
        self._resp = resp
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
        return b"".join(parts)[:limit]

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


# the pool: no limit on connections (each request in flight has its own; health.max_concurrent limits requests and
# spills over instead of queueing), idle connections kept 30 s, DNS cached 5 min
CONNECTOR_OPTIONS: dict[str, Any] = {"limit": 0, "limit_per_host": 0, "keepalive_timeout": 30, "ttl_dns_cache": 300,
                                     "enable_cleanup_closed": False}
SESSION_OPTIONS: dict[str, Any] = {"auto_decompress": True, "skip_auto_headers": ("User-Agent",)}
# the keep-alive race (the upstream closed a pooled connection just as a request went out on it) shows within a round
# trip: the closed socket's EOF or reset. A failure later than this means the upstream read the request and may have
# acted on it: a POST is then never sent again (RFC 9112 §9.3.1: retry only what is known not to have been processed)
STALE_RACE = 0.1  # seconds
_REUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("tiergate_connection_reused", default=False)
_TRANSPORT: contextvars.ContextVar[Any] = contextvars.ContextVar("tiergate_connection_transport", default=None)
_STALE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, noting for the request being sent whether its connection came from the pool.

    The note is a context variable: ``connect`` runs inside the caller's ``session.post`` in the caller's task,
    so :meth:`UpstreamPool.send` reads it right after a failure; so is the connection's transport, which a cancelled
    passthrough send aborts. Cost: one attribute test and two context-variable sets per request.
    """

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        _REUSED.set(getattr(proto, "tiergate_used", False))
        _TRANSPORT.set(proto.transport if proto is not None else None)
        if proto is not None:
            setattr(proto, "tiergate_used", True)  # noqa: B010 - ResponseHandler declares no such attribute
        return conn


def _stale(exc: BaseException) -> bool:
    """The failure of a request sent on a pooled connection that the upstream had closed while it sat idle: the
    upstream disconnected, or reset, before any response byte (RFC 9112 §9.3.1: such a request was not processed)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in _STALE_ERRNOS


class UpstreamPool:
    """Every upstream's client state over one shared aiohttp session (keep-alive pool, created in lifespan).

    Args:
        upstreams: configured upstreams; keys: upstream name -> API key.
    """

    def __init__(self, upstreams: list[UpstreamConfig], keys: Mapping[str, SecretStr]) -> None:
        self._auth = {name: f"Bearer {key.get_secret_value()}" for name, key in keys.items()}
        # non-streaming: total and sock_read (silence) bound the answer. Streams: no total; the status line's
        # wait is bounded by sock_read = idle, or, with a ttft, by the caller's first-token deadline alone (ttft
        # governs until the first token, issue 10 case 4); after the status line send() turns sock_read off and
        # the body's silences are IdleWatch's (sock_read re-arms a timer on every read and counts a slow client's
        # unread bytes as the upstream's silence)
        self._timeouts = {(u.name, stream): aiohttp.ClientTimeout(
            total=None if stream else u.timeouts.total, sock_connect=u.timeouts.connect,
            sock_read=None if stream and u.timeouts.ttft else u.timeouts.idle)
            for u in upstreams for stream in (True, False)}
        self._forward_timeouts = {u.name: aiohttp.ClientTimeout(total=None, sock_connect=u.timeouts.connect,
                                                                 sock_read=u.timeouts.idle) for u in upstreams}
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # never pools: the retry of a stale connection's request

    async def start(self) -> None:
        """Open the shared session; call once from the app's lifespan."""
        self._session = aiohttp.ClientSession(connector=_Connector(**CONNECTOR_OPTIONS), **SESSION_OPTIONS)
        self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                            **SESSION_OPTIONS)

    async def stop(self) -> None:
        """Close the sessions and every pooled connection."""
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    @staticmethod
    async def _request(session: aiohttp.ClientSession, method: str, url: str | URL, body: Body,
                       headers: dict[str, str], timeout: aiohttp.ClientTimeout, decode: bool | None,
                       skip: tuple[str, ...] | None, idle: float) -> aiohttp.ClientResponse:
        """One ``session.request`` of a body held whole but larger than :data:`LARGE_BODY` (it may not fit the socket
        buffers): in pieces, each due at the upstream within ``idle`` seconds; on any failure its connection is reset
        (:func:`_abort`).

        Raises:
            UpstreamTimeout: the upstream took no part of the body for ``idle`` s; aiohttp's errors otherwise.
        """
        _TRANSPORT.set(None)  # set by _Connector.connect for this request's connection
        try:
            assert isinstance(body, bytes) and idle is not None
            try:
                async with asyncio.timeout(None) as window:
                    return await session.request(method, url, data=_pieces(body, window, idle), headers=headers,
                                                 timeout=timeout, allow_redirects=False, auto_decompress=decode,
                                                 skip_auto_headers=skip)
            except TimeoutError as exc:
                raise UpstreamTimeout(f"The upstream took no request body for {idle:g} s.") from exc
        except BaseException:
            _abort()
            raise

    @property
    def ready(self) -> bool:
        """True while the session is open."""
        return self._session is not None and not self._session.closed

    async def send(self, upstream: UpstreamConfig, body: Body, *, stream: bool, request_id: str,
                   path: str = "/chat/completions", method: str = "POST",
                   forward: Mapping[str, str] | None = None, client_key: str | None = None,
                   trace: Mapping[str, str] | None = None) -> UpstreamResponse:
        """Send ``body`` to the upstream's ``path`` (under its base URL, query string included) and wait for the
        status line.

        ``client_key``: the client's ``Authorization`` value, sent instead of the upstream's key (the caller gives it
        only for a ``pass_client_key`` upstream). ``forward``: a passthrough request's client headers; those in
        :data:`FORWARD_HEADERS` are sent, and the timeouts are
        connect and silence (``timeouts.idle`` between reads once the body is sent), never a total: an upload of
        hundreds of MB or a long audio answer is bounded by its progress. An iterable ``body`` is streamed as it
        comes (with the client's ``content-length`` when it gave one, else chunked) and is never sent twice.

        A request that went out on a pooled connection the upstream had already closed (it fails with a
        disconnect or reset before any response byte, within :data:`STALE_RACE` of being sent) is sent once more, on
        a connection opened for it (another pooled one may be just as stale), as HTTP clients do for this race (RFC
        9112 §9.3.1); ``stale_retried`` on the response says so.

        Returns:
            The open response (any status).

        Raises:
            UpstreamUnavailable: connect refused/reset or closed before the status line.
            UpstreamTimeout: no status line within the idle timeout (or connect timeout passed).
        """
        assert self._session is not None, "UpstreamPool.start() was not called"
        if forward is None:
            timeout = self._timeouts[upstream.name, stream]
            headers = {
                "Content-Type": "application/json",
                "Accept": "text/event-stream" if stream else "application/json",
                "Accept-Encoding": "identity",
                "User-Agent": USER_AGENT,
                "X-Client-Request-Id": request_id,
            }
        else:
            timeout = self._forward_timeouts[upstream.name]
            headers = forward_headers(forward, request_id)
            if isinstance(body, bytes):  # a body held whole may have changed (its model): aiohttp counts it
                headers.pop("content-length", None)
        auth = client_key if upstream.pass_client_key else self._auth.get(upstream.name)
        if auth:
            headers["Authorization"] = auth
        if trace:
            headers.update(trace)  # W3C Trace Context: the attempt's span (gateway.observability.tracing)
        # a passthrough path is sent as the client encoded it (yarl would otherwise re-quote and normalise it)
        url: str | URL = upstream.base_url + path if forward is None else URL(upstream.base_url + path, encoded=True)
        skip = SKIP_FORWARDED if forward is not None else None  # no content type or accept of aiohttp's own making
        large = isinstance(body, bytes) and len(body) > LARGE_BODY
        if large and isinstance(body, bytes):
            headers["Content-Length"] = str(len(body))  # sent in pieces, never chunked
        retried = False
        loop = asyncio.get_running_loop()
        sent = loop.time()
        decode = None if forward is None else False  # a passthrough answer's bytes go to the client as they came
        with map_errors():
            try:
                if large:
                    resp = await self._request(self._session, method, url, body, headers, timeout, decode, skip,
                                               upstream.timeouts.idle)
                else:  # inline: the hot path's one request (a coroutine between costs each of its resumptions)
                    _TRANSPORT.set(None)
                    try:
                        resp = await self._session.request(method, url, data=body, headers=headers, timeout=timeout,
                                                           allow_redirects=False, auto_decompress=decode,
                                                           skip_auto_headers=skip)
                    except BaseException:
                        _abort()
                        raise
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                if not (isinstance(body, bytes) and _REUSED.get() and _stale(exc) and loop.time() - sent < STALE_RACE):
                    raise
                retried = True
                assert self._fresh is not None
                _TRANSPORT.set(None)
                resp = await self._fresh.request(method, url, data=body, headers=headers, timeout=timeout,
                                                 allow_redirects=False, auto_decompress=decode, skip_auto_headers=skip)
        if not stream:
            return UpstreamResponse(resp, stale_retried=retried)
        conn = resp.connection
        if conn is not None and conn.protocol is not None:
            conn.protocol.read_timeout = None  # aiohttp's ResponseHandler: no sock_read for the body...
            conn.protocol.start_timeout()  # ...and the timer armed by the status line's read is cancelled
        return UpstreamResponse(resp, upstream.timeouts.idle, stale_retried=retried)


async def _pieces(data: bytes, window: asyncio.Timeout, idle: float) -> AsyncIterator[bytes]:
    """``data`` in :data:`PIECE` pieces, each due at the upstream ``idle`` seconds after it is handed over."""
    loop = asyncio.get_running_loop()
    for at in range(0, len(data), PIECE):
        window.reschedule(loop.time() + idle)
        yield data[at:at + PIECE]
    window.reschedule(None)  # all of it is with the upstream: the wait for the answer is sock_read's or ttft's


def _abort() -> None:
    """Reset the connection the failed request went out on: a close would wait for the rest of an unsent body, which
    an upstream that stopped reading never takes, and hold the socket and its buffer meanwhile."""
    transport = _TRANSPORT.get()
    if transport is None:
        return
    _TRANSPORT.set(None)
    sock = transport.get_extra_info("socket")
    if sock is not None:  # a reset, not a FIN behind what the kernel still holds to send
        with contextlib.suppress(OSError, ValueError):  # ValueError: uvloop's socket is already gone (fd -1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


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


def field_value(value: str) -> bytes | None:
    """An upstream header value as the bytes it came in (aiohttp decodes them UTF-8 with surrogate escapes), or None
    when it is no valid field value (RFC 9110 §5.5): such a header is dropped, never a broken answer."""
    data = value.encode("utf-8", "surrogateescape")
    return data if _FIELD_VALUE.fullmatch(data) else None


def forward_headers(client: Mapping[str, str], request_id: str) -> dict[str, str]:
    """The headers of a passthrough request to an upstream, from the client's (lower-case names): those in
    :data:`FORWARD_HEADERS`, then the gateway's own (identity encoding, user agent, request id). The caller adds
    ``Authorization``."""
    out = {name: client[name] for name in FORWARD_HEADERS if name in client}
    out.update({"Accept-Encoding": "identity", "User-Agent": USER_AGENT, "X-Client-Request-Id": request_id})
    return out


def pass_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The upstream response headers a client may see (lower-case names): rate limits, retry hints, timing."""
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low in RESPONSE_HEADER_ALLOW or low.startswith(RESPONSE_HEADER_PREFIX_ALLOW):
            out[low] = value
    return out
