"""The client side of one request: how it is answered, and what it holds while in flight. An :class:`Exchange`
answers at most once: an error in OpenAI's envelope, a whole JSON body, or a stream whose status line and headers
leave with its first bytes (nothing is committed before, so the request can still fail over). Its parts are each
written by one package: ``request`` by admission, ``reserved`` by its reservations (settled here), ``rec`` by
``gateway.observability.recorder``."""

from __future__ import annotations

from typing import Any

from starlette.types import Message, Send

from gateway.admission.body import BodyBudget
from gateway.admission.request import Request
from gateway.admission.reserve import Reserved
from gateway.errors import GatewayError, error_body
from gateway.observability.recorder import Observers, Recorded, Recorder
from gateway.responses.store import SocketStore
from gateway.routing.blame import Blame
from gateway.stream.relay import Relay
from gateway.upstream.attempt import Transport

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream; charset=utf-8"
STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
CLOSE = (b"connection", b"close")
Headers = list[tuple[bytes, bytes]]

# the ASGI extension (``scope["extensions"]``) through which the gateway's server protocol tells a request that its
# client's connection was lost (``gateway.http.server.Hangup``)
HANGUP = "tiergate.hangup"
# and through which it writes a streamed body's pieces straight to the connection (``gateway.http.server.ChunkedBody``)
BODY = "tiergate.body"


class Exchange:
    """Times are ``time.perf_counter()`` seconds. ``answered``: the status line went out, so it can no longer fail
    over; ``cut``: the drain ran out while in flight; ``via``, ``memory``: a WebSocket-mode message's transport (its
    upstream sockets) and its socket's response store, else None."""

    __slots__ = ("request", "rec", "reserved", "answered", "relay", "gone_at", "cut", "task", "blame", "via",
                 "memory", "hangup", "direct", "_send", "_start")

    def __init__(self, rec: Recorder, send: Send, bodies: BodyBudget) -> None:
        self.rec = rec
        self.request: Request = rec.request  # type: ignore[assignment]
        self.reserved = Reserved(bodies, self.request.key)
        self.answered = False
        self.relay: Relay | None = None
        self.gone_at: float | None = None
        self.cut = False
        self.task: Any = None
        self.blame: Blame | None = None
        self.via: Transport | None = None
        self.memory: SocketStore | None = None
        self.hangup: Any = None  # gateway.http.server.Hangup under the gateway's own server (frame.Watch sets it)
        self.direct: Any = None  # gateway.http.server.ChunkedBody under it (frame.Watch sets it)
        self._send = send
        self._start: Message | None = None

    @classmethod
    def of(cls, observers: Observers, request: Request, send: Send, bodies: BodyBudget) -> Exchange:
        """Recorded in the chat and Responses families."""
        return cls(Recorder(observers, request), send, bodies)

    @property
    def rid(self) -> str:
        return self.request.rid

    def record(self, outcome: str, *, ended: float | None = None, **kw: Any) -> Recorded | None:
        """Once (later calls do nothing and return None), settling what it holds."""
        done = self.rec.record(outcome, ended=ended, **kw)
        if done is not None:
            self.reserved.settle(self.rec, done)
        return done

    # answering

    async def error(self, exc: GatewayError, outcome: str, headers: Headers | None = None) -> None:
        """``exc`` in OpenAI's envelope; no attempt is counted as answering."""
        self.rec.answered(exc.status)  # before the record: the log line names the status answered
        self.record(outcome)
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
        await self.whole(exc.status, exc.body(), [*(headers or [(b"x-request-id", self.rid.encode())]), *extra],
                         attempt=False)

    async def whole(self, status: int, body: bytes, headers: Headers, attempt: bool = True) -> None:
        """``attempt``: an upstream's answer, its attempts counted."""
        self._started(status, attempt)
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [*headers, (b"content-type", JSON), (b"content-length", b"%d" % len(body))]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def open_stream(self, headers: Headers, content_type: str) -> None:
        """The status line and ``headers`` leave with the first :meth:`write`; a mislabelled stream is sent as
        ``text/event-stream``."""
        ctype = content_type.encode("latin-1")
        if not ctype.startswith(b"text/event-stream"):
            ctype = EVENT_STREAM
        self._start = {"type": "http.response.start", "status": 200,
                       "headers": [*headers, *STREAM_HEADERS, (b"content-type", ctype)]}
        self.rec.answered(200)

    def open_answer(self, status: int, headers: Headers) -> None:
        """A passthrough answer, ``headers`` as given; it leaves with the first :meth:`write` or :meth:`end_stream`."""
        self._start = {"type": "http.response.start", "status": status, "headers": headers}
        self.rec.answered(status)

    async def write(self, data: bytes) -> None:
        if self._start is not None:
            await self._open()
        elif self.direct is not None and self.direct.write(data):
            return
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def write_now(self, data: bytes) -> bool:
        """:meth:`write` without a coroutine, when the connection takes ``data`` at once; False: await :meth:`write`."""
        direct = self.direct
        return self._start is None and direct is not None and direct.write(data)

    async def end_stream(self) -> None:
        if self._start is not None:
            await self._open()
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def end_stream_with_error(self, message: str, code: str) -> None:
        """One in-band error event (``{"error": ...}``), on which the SDK raises ``APIError``."""
        await self.write(b"data: " + error_body(message, "server_error", None, code) + b"\n\n")
        await self.end_stream()

    async def _open(self) -> None:
        start, self._start = self._start, None
        assert start is not None
        self._started(start["status"], True)
        self.rec.answering()
        await self._send(start)

    def _started(self, status: int, attempt: bool) -> None:
        self.answered = True
        self.rec.answered(status)
        if attempt:
            self.rec.answer_started()

    def stream_figures(self) -> dict[str, Any]:
        """As :meth:`Metrics.record` keywords (empty before any relay)."""
        if self.relay is None:
            return {}
        stats = self.relay.stats
        first, last = stats.t_first_token, stats.t_last_token
        sent, written = self.rec.first_sent_at, stats.t_first_written
        # the gateway's own part of the time to first byte: from the request read whole (by the server's protocol,
        # so the wait for the request's task to start counts; else from the app's start) until its first upstream
        # request left (a failed attempt's wait is the upstream's), and from the first token's read to its write done
        # (metrics' gateway_added_seconds)
        received = self.hangup.received if self.hangup is not None else None
        start = received if received is not None else self.rec.t0
        added = (sent - start) + (written - first) if first is not None and written is not None and \
            sent is not None else None
        return {"ttft": first - self.rec.t0 if first is not None else None,
                "decode_time": last - first if first is not None and last is not None else None,
                "token_chunks": stats.token_chunks, "usage": stats.usage, "timings": stats.timings,
                "served_tier": stats.service_tier, "first_byte_added": added, "chunk_added": stats.added}

    def route_headers(self, tier: str, upstream: str, rule: str, fallback: str | None) -> Headers:
        self.rec.routed(rule, fallback)
        out = [(b"x-request-id", self.rid.encode("latin-1")), (b"x-tiergate-tier", tier.encode()),
               (b"x-tiergate-upstream", upstream.encode()), (b"x-tiergate-rule", rule.encode())]
        if fallback:
            out.append((b"x-tiergate-fallback", fallback.encode()))
        if self.request.speed_dropped is not None:  # the fast service_tier asked was not sent: the key may not
            out.append((b"x-tiergate-service-tier-dropped", self.request.speed_dropped.encode()))
        return out
