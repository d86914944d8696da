"""The HTTP client under upstream attempts: one pooled aiohttp session per process (tests play scripted bytes instead:
``gateway.tools.scripted``). Only this module, ``response`` and ``websocket`` beside it import aiohttp.

aiohttp rather than httpx on the hot path: measured here, a third of the CPU per relayed chunk and ~15x the
non-streaming requests/s (``bench/`` re-measures it)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import socket
import struct
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from pydantic import SecretStr
from yarl import URL

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import (
    UpstreamTimeout,
)
from gateway.upstream.attempt import Body
from gateway.upstream.headers import (
    SKIP_FORWARDED,
    USER_AGENT,
    forward_headers,
)
from gateway.upstream.response import AnswerWatch, UpstreamResponse, map_errors

LARGE_BODY = 256 * 1024  # bytes: a body held whole but larger than this goes in PIECE pieces, its writing watched


PIECE = 64 * 1024


# the pool: no limit on connections (each request in flight has its own; health.max_concurrent limits requests and
# spills over instead of queueing), idle connections kept 30 s, DNS cached 5 min
CONNECTOR_OPTIONS: dict[str, Any] = {"limit": 0, "limit_per_host": 0, "keepalive_timeout": 30, "ttl_dns_cache": 300,
                                     "enable_cleanup_closed": False}


# no session-wide skip_auto_headers: every request names its own User-Agent, and a session-wide skip sends each request
# down aiohttp's slow header path (a CIMultiDict made, sorted and merged per request: ~3 us)
SESSION_OPTIONS: dict[str, Any] = {"auto_decompress": True}


# the keep-alive race (the upstream closed a pooled connection just as a request went out on it) shows within a round
# trip: the closed socket's EOF or reset. A failure later than this means the upstream read the request and may have
# acted on it: a POST is then never sent again (RFC 9112 §9.3.1: retry only what is known not to have been processed)
STALE_RACE = 0.1  # seconds


_REUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("tiergate_connection_reused", default=False)


_TRANSPORT: contextvars.ContextVar[Any] = contextvars.ContextVar("tiergate_connection_transport", default=None)


_WATCH: contextvars.ContextVar[AnswerWatch | None] = contextvars.ContextVar("tiergate_answer_watch", default=None)


_STALE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


class _Connector(aiohttp.TCPConnector):
    """Notes whether the request's connection came from the pool, and its transport (which a failed send resets), in
    context variables: ``connect`` runs in the caller's task. Cost: one attribute test and two sets per request."""

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        _REUSED.set(getattr(proto, "tiergate_used", False))
        _TRANSPORT.set(proto.transport if proto is not None else None)
        if proto is not None:
            setattr(proto, "tiergate_used", True)  # noqa: B010 - ResponseHandler declares no such attribute
            watch = _WATCH.get()
            if watch is not None:
                watch.connected(proto)
        return conn


def _stale(exc: BaseException) -> bool:
    """A disconnect or reset before any response byte: the request was not processed (RFC 9112 §9.3.1)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in _STALE_ERRNOS


class UpstreamPool:
    """Every upstream's client state over one shared session, opened in the lifespan. ``keys``: upstream name -> key."""

    def __init__(self, upstreams: list[UpstreamConfig], keys: Mapping[str, SecretStr]) -> None:
        self._auth = {name: f"Bearer {key.get_secret_value()}" for name, key in keys.items()}
        # aiohttp times only the TCP connect; the rest is the request's AnswerWatch (send): non-streaming, total and
        # idle (silence) bound the answer; streams have no total, the status line's wait is bounded by idle or, with a
        # ttft, by the caller's first-token deadline alone (tests/test_faults.py::
        # test_ttft_above_idle_governs_until_the_first_token), and the body's silences are IdleWatch's (aiohttp's
        # sock_read re-arms a timer on every read and counts a slow client's unread bytes as the upstream's silence)
        self._timeouts = {u.name: aiohttp.ClientTimeout(total=None, sock_connect=u.timeouts.connect)
                          for u in upstreams}
        self._forward_timeouts = {u.name: aiohttp.ClientTimeout(total=None, sock_connect=u.timeouts.connect,
                                                                 sock_read=u.timeouts.idle) for u in upstreams}
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # never pools: the retry of a stale connection's request

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=_Connector(**CONNECTOR_OPTIONS), **SESSION_OPTIONS)
        self._fresh = aiohttp.ClientSession(connector=_Connector(force_close=True, limit=0),
                                            **SESSION_OPTIONS)

    async def stop(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    @staticmethod
    async def _request(session: aiohttp.ClientSession, method: str, url: str | URL, body: Body,
                       headers: dict[str, str], timeout: aiohttp.ClientTimeout, decode: bool | None,
                       skip: tuple[str, ...] | None, idle: float) -> aiohttp.ClientResponse:
        """A body over :data:`LARGE_BODY` may not fit the socket buffers: it goes in pieces, each due within ``idle``
        seconds (else UpstreamTimeout); on any failure the connection is reset (:func:`_abort`)."""
        _TRANSPORT.set(None)  # set by _Connector.connect for this request's connection
        try:
            assert isinstance(body, bytes) and idle is not None
            try:
                async with asyncio.timeout(None) as window:
                    return await session.request(method, url, data=_pieces(body, window, idle), headers=headers,
                                                 timeout=timeout, allow_redirects=False, auto_decompress=decode,
                                                 skip_auto_headers=skip)
            except TimeoutError as exc:
                if not window.expired():  # the answer's wait (AnswerWatch), not the body's
                    raise
                raise UpstreamTimeout(f"The upstream took no request body for {idle:g} s.") from exc
        except BaseException:
            _abort()
            raise

    @property
    def ready(self) -> bool:
        return self._session is not None and not self._session.closed

    async def send(self, upstream: UpstreamConfig, body: Body, *, stream: bool, request_id: str,
                   path: str = "/chat/completions", method: str = "POST",
                   forward: Mapping[str, str] | None = None, client_key: str | None = None,
                   trace: Mapping[str, str] | None = None) -> UpstreamResponse:
        """The open response at its status line, any status. A bytes ``body`` that met a stale pooled connection is sent
        once more on a new one (:meth:`_again`); an iterable one never twice. Raises UpstreamUnavailable (refused,
        reset or closed before the status line) or UpstreamTimeout."""
        assert self._session is not None, "UpstreamPool.start() was not called"
        headers, timeout = self._headers(upstream, body, stream, request_id, forward, client_key, trace)
        # a passthrough path is sent as the client encoded it (yarl would otherwise re-quote and normalise it)
        url: str | URL = upstream.base_url + path if forward is None else URL(upstream.base_url + path, encoded=True)
        skip = SKIP_FORWARDED if forward is not None else None  # no content type or accept of aiohttp's own making
        large = isinstance(body, bytes) and len(body) > LARGE_BODY
        retried = False
        loop = asyncio.get_running_loop()
        sent = loop.time()
        decode = None if forward is None else False  # a passthrough answer's bytes go to the client as they came
        watch = None
        if forward is None and not (stream and upstream.timeouts.ttft):  # ttft: the caller's deadline bounds it
            watch = AnswerWatch(None if stream else upstream.timeouts.total, upstream.timeouts.idle,
                                upstream.timeouts.connect)
        _WATCH.set(watch)
        try:
            with map_errors():
                try:
                    if large:
                        resp = await self._request(self._session, method, url, body, headers, timeout, decode, skip,
                                                   upstream.timeouts.idle)
                    else:  # inline: the hot path's one request (a coroutine between costs each of its resumptions)
                        _TRANSPORT.set(None)
                        try:
                            resp = await self._session.request(method, url, data=body, headers=headers,
                                                               timeout=timeout, allow_redirects=False,
                                                               auto_decompress=decode, skip_auto_headers=skip)
                        except BaseException:
                            _abort()
                            raise
                except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                    if not (isinstance(body, bytes) and _REUSED.get() and _stale(exc)
                            and loop.time() - sent < STALE_RACE):
                        raise
                    retried = True
                    resp = await self._again(method, url, body, headers, timeout, decode, skip)
        except BaseException as exc:
            if watch is not None:
                watch.stop()
                if isinstance(exc, asyncio.CancelledError):
                    _expired(watch, exc)
            raise
        if not stream:
            return UpstreamResponse(resp, stale_retried=retried, encoded=decode is False, watch=watch)
        if watch is not None:
            watch.stop()  # the body's silences are IdleWatch's, armed by the caller (watch_idle)
        return UpstreamResponse(resp, upstream.timeouts.idle, stale_retried=retried, encoded=decode is False)

    def _headers(self, upstream: UpstreamConfig, body: Body, stream: bool, request_id: str,
                 forward: Mapping[str, str] | None, client_key: str | None,
                 trace: Mapping[str, str] | None) -> tuple[dict[str, str], aiohttp.ClientTimeout]:
        """A passthrough request has no total timeout, only connect and silence: an upload of hundreds of MB or a long
        audio answer is bounded by its progress."""
        if forward is None:
            timeout = self._timeouts[upstream.name]
            headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else
                       "application/json", "Accept-Encoding": "identity", "User-Agent": USER_AGENT,
                       "X-Client-Request-Id": request_id}
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
        if isinstance(body, bytes) and len(body) > LARGE_BODY:
            headers["Content-Length"] = str(len(body))  # sent in pieces, never chunked
        return headers, timeout

    async def _again(self, method: str, url: str | URL, body: Body, headers: dict[str, str],
                     timeout: aiohttp.ClientTimeout, decode: bool | None,
                     skip: tuple[str, ...] | None) -> aiohttp.ClientResponse:
        assert self._fresh is not None
        _TRANSPORT.set(None)
        return await self._fresh.request(method, url, data=body, headers=headers, timeout=timeout,
                                         allow_redirects=False, auto_decompress=decode, skip_auto_headers=skip)

    async def open_socket(self, upstream: UpstreamConfig, *, request_id: str, client_key: str | None = None,
                          trace: Mapping[str, str] | None = None,
                          max_msg_size: int = 8 * 1024 * 1024) -> aiohttp.ClientWebSocketResponse[bool]:
        """Text frames are read as bytes: relayed as they came, never re-encoded. Raises aiohttp.WSServerHandshakeError
        (another ``status``), else aiohttp.ClientError, OSError or TimeoutError (unreachable in time)."""
        assert self._session is not None, "UpstreamPool.start() was not called"
        _WATCH.set(None)  # the socket's connection is no earlier request's to watch (_Connector.connect)
        headers = {"User-Agent": USER_AGENT, "X-Client-Request-Id": request_id}
        auth = client_key if upstream.pass_client_key else self._auth.get(upstream.name)
        if auth:
            headers["Authorization"] = auth
        if trace:
            headers.update(trace)
        async with asyncio.timeout(upstream.timeouts.connect):
            return await self._session.ws_connect(upstream.base_url + "/responses", headers=headers, autoping=True,
                                                  max_msg_size=max_msg_size, compress=0, decode_text=False,
                                                  timeout=aiohttp.ClientWSTimeout(ws_close=2.0))


async def _pieces(data: bytes, window: asyncio.Timeout, idle: float) -> AsyncIterator[bytes]:
    """While the body goes out, the request's silence (AnswerWatch) counts from its last piece."""
    loop, watch = asyncio.get_running_loop(), _WATCH.get()
    for at in range(0, len(data), PIECE):
        now = loop.time()
        window.reschedule(now + idle)
        if watch is not None:
            watch.quiet_since = now
        yield data[at:at + PIECE]
    window.reschedule(None)  # all of it is with the upstream: the wait for the answer is AnswerWatch's or ttft's
    if watch is not None:
        watch.quiet_since = loop.time()


def _expired(watch: AnswerWatch, exc: asyncio.CancelledError) -> None:
    """Raises UpstreamTimeout when the cancel was ``watch``'s own (no connection within the connect or total timeout);
    a cancel of someone else's (the client left, the drain ran out) is left to go on."""
    task = asyncio.current_task()
    if watch.expired is not None and task is not None and task.uncancel() == 0:
        raise UpstreamTimeout(f"The upstream did not answer in time ({watch.expired}).") from exc


def _abort() -> None:
    """A reset, not a close: a close waits for the rest of an unsent body, which an upstream that stopped reading
    never takes, and holds the socket and its buffer meanwhile."""
    transport = _TRANSPORT.get()
    if transport is None:
        return
    _TRANSPORT.set(None)
    sock = transport.get_extra_info("socket")
    if sock is not None:  # a reset, not a FIN behind what the kernel still holds to send
        with contextlib.suppress(OSError, ValueError):  # ValueError: uvloop's socket is already gone (fd -1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
