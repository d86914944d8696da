"""One try of one upstream, with one owner: its exit is the only place the answer is released or closed, the concurrency
slot given back and the upstream's health told the verdict. Also the contracts it works over: :class:`Transport`,
:class:`Answer`, :class:`Verdicts`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import Any, Protocol

import orjson

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import (
    GatewayError,
    UpstreamAuthFailed,
    UpstreamBadResponse,
    UpstreamStatusError,
    UpstreamTimeout,
)
from gateway.observability.recorder import Recorder
from gateway.routing.blame import Blame, request_shaped
from gateway.routing.ratelimits import Window
from gateway.upstream import dialects

Body = bytes | AsyncIterable[bytes] | None  # None: no body (a GET)


ERROR_BODY_LIMIT = 64 * 1024  # bytes of an upstream error answer kept for its message; the rest is dropped


# a streamed answer labelled with one of these is not an event stream; any other label (text/plain, none, ...) on a
# 200 to a stream request is relayed as one (test_faults.py::test_a_mislabelled_stream_is_relayed_as_an_event_stream)
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
    def observe_report(self, report: dict[str, Window], now: float, mark: Any = None) -> None: ...
    def settle(self, exc: GatewayError | None, now: float, need_tokens: int = 0,
               source: str | None = None) -> None: ...
    def retract(self, source: str) -> None: ...


class Attempt:
    """``async with Attempt(...) as attempt``. ``clock``: the health clock (seconds); ``need_tokens``: estimated prompt
    plus ``max_tokens``; ``stream``: a first-token deadline of ``timeouts.ttft`` then applies, status line included;
    ``forward``: a passthrough request's client headers (any 2xx is then an answer); ``client_key``: sent only to a
    ``pass_client_key`` upstream; ``blame``: whom a request-shaped failure is charged to (None: the upstream alone)."""

    def __init__(self, transport: Transport, upstream: UpstreamConfig, health: Verdicts,
                 clock: Callable[[], float], *, need_tokens: int, stream: bool, request_id: str,
                 path: str, method: str = "POST", forward: Mapping[str, str] | None = None,
                 client_key: str | None = None, span: Any = None, trace: Mapping[str, str] | None = None,
                 blame: Blame | None = None, recorder: Recorder | None = None) -> None:
        self.upstream = upstream
        self.recorder = recorder
        self.dialect = dialects.of(upstream)  # what its answers and errors mean
        self.blame = blame
        self.span = span  # the attempt's trace span (gateway.observability.tracing), or None
        self._trace = trace
        self._error: BaseException | None = None
        self.health = health
        self.answer: Answer | None = None
        self.first_token_by: float | None = None  # an asyncio loop time
        self.sent_at: float | None = None  # time.perf_counter() seconds: the start of the attempt's own TTFT
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
        if self.recorder is not None:
            self.recorder.attempt_ended(self.span, exc or self._error)
        answer, self.answer = self.answer, None
        if answer is not None:
            if self._complete:
                answer.release()
            else:
                answer.close()  # never pooled half-read
        self.health.finish()

    async def send(self, body: Body) -> Answer:
        """Bounded by the first-token deadline when there is one; a stream's first token is checked later, in the relay.
        Raises UpstreamTimeout or UpstreamUnavailable (no status line), UpstreamStatusError (not a 200, or for a
        passthrough not a 2xx), UpstreamAuthFailed (a 401 or 403 to the gateway's own key), UpstreamBadResponse (a 3xx,
        or JSON or HTML holding no error to a stream request)."""
        self.sent_at = time.perf_counter()
        sending = self._transport.send(self.upstream, body, stream=self._stream, request_id=self._rid, path=self._path,
                                       method=self._method, forward=self._forward, client_key=self._client_key,
                                       trace=self._trace)
        if self.first_token_by is None:  # no asyncio.timeout(None) to enter and leave: 1.5 us a request, measured
            answer = self.answer = await sending
        else:
            try:
                async with asyncio.timeout_at(self.first_token_by):
                    answer = self.answer = await sending
            except TimeoutError as err:
                raise UpstreamTimeout(f"No first token from the upstream within {self.upstream.timeouts.ttft:g} s.",
                                      code="upstream_ttft_timeout") from err
        self.health.observe_report(self.dialect.quota_report(answer.headers), self._clock(), self._mark)
        if answer.status != 200 and not (self._forward is not None and 200 <= answer.status < 300):
            if 300 <= answer.status < 400:  # a redirect to the upstream's own hosts, or a 304 to a request never
                # made conditional: nothing a client of the gateway can follow or use
                raise UpstreamBadResponse(f"The upstream answered {answer.status}, which the gateway does not relay.")
            raise self._judged(await self._status_error(answer))
        if self._stream and answer.content_type.split(";", 1)[0].strip().lower() in NOT_A_STREAM:
            raise self._judged(await self._not_a_stream(answer))
        return answer

    def ok(self) -> None:
        """Its answer reached the client whole, or its stream ran to its end."""
        if not self._verdict:
            self._verdict = True
            self.health.settle(None, self._clock())

    def failed(self, exc: GatewayError) -> GatewayError:
        """Told to the health once. Returns the error to answer, fail over and count by: ``exc`` as the dialect reads
        it (:meth:`~gateway.upstream.dialects.base.Dialect.cause`), then judged (:meth:`_judged`)."""
        exc = self._judged(self.dialect.cause(exc, self.upstream, self._need))
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
        self._complete = True

    def void(self) -> None:
        """Not the upstream's doing (the client left mid-upload, or its body was over the limit): no verdict."""
        self._verdict = True

    def _judged(self, exc: GatewayError) -> GatewayError:
        """A 401 or 403 to the gateway's own key says that key is wrong: :class:`UpstreamAuthFailed` (502, failover, and
        a breaker failure, since every request fails the same way until an operator fixes it), logged with keys
        masked. From a ``pass_client_key`` upstream it was the client's own key: relayed."""
        if not isinstance(exc, UpstreamStatusError) or not exc.credential_refused or self.upstream.pass_client_key:
            return exc
        up = self.upstream
        if self.recorder is not None:
            self.recorder.upstream_refused_key(up.tier, up.name, self._path.split("?", 1)[0], exc)
        refused = UpstreamAuthFailed(up.name, exc.status, exc.code)
        refused.__cause__ = exc
        return refused

    async def _read_error(self, answer: Answer) -> tuple[bytes, bool]:
        try:
            async with asyncio.timeout_at(self.first_token_by):
                return await answer.read_error(), True
        except (GatewayError, TimeoutError):
            return b"", False

    async def _status_error(self, answer: Answer) -> UpstreamStatusError:
        """Its status and headers even when its body stalls or breaks: the status line said what happened."""
        data, whole = await self._read_error(answer)
        self._complete = whole
        return self.dialect.status_error(answer.status, data, answer.headers)

    async def _not_a_stream(self, answer: Answer) -> GatewayError:
        """Some upstreams answer a stream request's error as a 200 JSON body naming its status."""
        data, _ = await self._read_error(answer)
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("error"):
            return self.dialect.event_error(parsed)
        return UpstreamBadResponse("The upstream answered a stream request without an event stream.")
