"""The client side of one request on the hot path: its id, metric labels and timing, how it is answered, and its
record (exactly once).

An :class:`Exchange` answers in one of three shapes, each at most once: an error in OpenAI's envelope, a whole JSON
body, or a stream whose status line and headers leave with its first bytes (nothing is committed before them, so
the request can still fail over). It records the request once, whatever happens after (it is the request's
:class:`~gateway.observability.recorder.Recorder`).

Also here: reading the request body with its limits (:func:`read_body`, :class:`BodyBudget`).
"""

from __future__ import annotations

from typing import Any

from starlette.types import Message, Receive, Scope, Send

from gateway.errors import (
    GatewayBusy,
    GatewayError,
    InvalidRequest,
    PayloadTooLarge,
    RateLimited,
    UnsupportedMediaType,
    error_body,
)
from gateway.observability.metrics import BILLABLE
from gateway.observability.recorder import Observers, Recorder
from gateway.responses.store import SocketStore
from gateway.routing.blame import Blame
from gateway.stream.relay import Relay
from gateway.tenancy.keys import Key
from gateway.tenancy.ledger import Hold
from gateway.upstream.attempt import Transport

JSON = b"application/json"
KEY_SCOPE = "tiergate.key"  # the ASGI scope entry that holds a request's authenticated gateway key
EVENT_STREAM = b"text/event-stream; charset=utf-8"
STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
CLOSE = (b"connection", b"close")
Headers = list[tuple[bytes, bytes]]


# the ASGI extension (``scope["extensions"]``) through which the gateway's server protocol tells a request that its
# client's connection was lost (``gateway.http.server.Hangup``)
HANGUP = "tiergate.hangup"


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class Exchange(Recorder):
    """One client request (see the module docstring): its record (:class:`Recorder`: labels, timing, the facts
    routing and the attempts learn) and how it is answered. Times are ``time.perf_counter()`` seconds.

    Attributes:
        answered: the status line went to the client (the request can no longer fail over).
        relay: the relay of the stream being answered, or None (its stats give TTFT, usage, ...).
        gone_at: when the client disconnected, or None. cut: the drain time ran out while it was in flight.
        hold: what it reserved against its key (``gateway.tenancy.ledger``), settled when it is recorded.
        blame: whom its request-shaped upstream failures are charged to (``gateway.routing.blame``).
        held, bodies: the request body bytes it holds in memory and their :class:`BodyBudget`.
        run, sessions: when it is a step of an agent session, the step (``gateway.pipeline.sessions.Run``) and the
            sessions it is added to once recorded; else None.
        via, memory: for a message of a WebSocket-mode socket, the transport its attempts use (its upstream sockets,
            ``gateway.upstream.websocket``) and the socket's store of the responses it made; else None.
    """

    __slots__ = ("answered", "relay", "gone_at", "cut", "task", "hold", "blame", "held", "bodies", "run", "sessions",
                 "via", "memory", "_send", "_start")
    key: Key | None  # the recorder's key, as the pipeline uses it (authenticated by the app: ``KEY_SCOPE``)

    def __init__(self, observers: Observers, send: Send, headers: dict[str, str], kind: str,
                 scope: Scope | None = None) -> None:
        super().__init__(observers, headers, kind, scope, (scope or {}).get(KEY_SCOPE))
        self.hold: Hold | None = None
        self.blame: Blame | None = None
        self.held = 0
        self.bodies: BodyBudget | None = None
        self.run: Any = None
        self.sessions: Any = None
        self.answered = False
        self.relay: Relay | None = None
        self.gone_at: float | None = None
        self.cut = False
        self.task: Any = None
        self.via: Transport | None = None
        self.memory: SocketStore | None = None
        self._send = send
        self._start: Message | None = None

    # answering

    async def error(self, exc: GatewayError, outcome: str, headers: Headers | None = None) -> None:
        """Record ``outcome`` and answer ``exc`` in OpenAI's envelope with its status and headers (no upstream's
        answer reached the client: no attempt is counted as answering)."""
        self.status = exc.status  # before the record: the log line names the status answered
        self.record(outcome)
        self._pending = None
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
        await self.whole(exc.status, exc.body(), [*(headers or [(b"x-request-id", self.rid.encode())]), *extra])

    async def whole(self, status: int, body: bytes, headers: Headers) -> None:
        """Answer a whole JSON ``body`` with ``status``."""
        self.status = status
        self._started()
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [*headers, (b"content-type", JSON), (b"content-length", b"%d" % len(body))]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def open_stream(self, headers: Headers, content_type: str) -> None:
        """Prepare a 200 event stream; its status line and ``headers`` leave with the first :meth:`write`. A
        ``content_type`` that is not ``text/event-stream`` (a mislabelled stream) is sent as one."""
        ctype = content_type.encode("latin-1")
        if not ctype.startswith(b"text/event-stream"):
            ctype = EVENT_STREAM
        self._start = {"type": "http.response.start", "status": 200,
                       "headers": [*headers, *STREAM_HEADERS, (b"content-type", ctype)]}
        self.status = 200

    def open_answer(self, status: int, headers: Headers) -> None:
        """Prepare an answer of any shape (a passthrough answer: its status, and ``headers`` as given); its status
        line leaves with the first :meth:`write` or :meth:`end_stream`."""
        self._start = {"type": "http.response.start", "status": status, "headers": headers}
        self.status = status

    async def write(self, data: bytes) -> None:
        """Send stream bytes (the status line first, once)."""
        if self._start is not None:
            await self._open()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self) -> None:
        """End the stream's body (its status line first, if nothing was written)."""
        if self._start is not None:
            await self._open()
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def end_stream_with_error(self, message: str, code: str) -> None:
        """End a started stream with one in-band error event (``{"error": ...}``; the SDK raises ``APIError``)."""
        await self.write(b"data: " + error_body(message, "server_error", None, code) + b"\n\n")
        await self.end_stream()

    async def _open(self) -> None:
        start, self._start = self._start, None
        assert start is not None
        self._started()
        self.answering()
        await self._send(start)

    def _started(self) -> None:
        self.answered = True
        self.answer_started()

    # recording

    def _released(self) -> None:
        if self.held and self.bodies is not None:
            self.bodies.release(self)

    def _settle(self, outcome: str, tokens: int | None, cost: float | None) -> None:
        """Settle the key's hold with the usage's ``tokens`` and ``cost``; without usage, a billable outcome keeps
        what it reserved, any other gives it back."""
        hold = self.hold
        if hold is not None:
            if tokens is None:
                tokens = int(hold.spend.tokens) if outcome in BILLABLE else 0
            hold.settle(tokens, cost if cost is not None else (hold.spend.usd if outcome in BILLABLE else 0.0),
                        self.tier)

    def _stepped(self, outcome: str, duration: float, usage: Any, cost: float | None) -> None:
        """Add the step to its session (``gateway.pipeline.sessions``): an answer an upstream made counts."""
        if self.run is not None:
            self.sessions.finished(self, self.run, duration, usage, cost, outcome in BILLABLE)

    def stream_figures(self) -> dict[str, Any]:
        """What the relay measured so far, as :meth:`Metrics.record` keywords (empty before any relay)."""
        if self.relay is None:
            return {}
        stats = self.relay.stats
        first, last = stats.t_first_token, stats.t_last_token
        return {"ttft": first - self.t0 if first is not None else None,
                "decode_time": last - first if first is not None and last is not None else None,
                "token_chunks": stats.token_chunks, "usage": stats.usage, "timings": stats.timings,
                "served_tier": stats.service_tier}

    def route_headers(self, tier: str, upstream: str, rule: str, fallback: str | None) -> Headers:
        """``x-request-id`` and the ``x-tiergate-*`` headers that say what served the request."""
        self.rule, self.fallback = rule, fallback
        out = [(b"x-request-id", self.rid.encode("latin-1")), (b"x-tiergate-tier", tier.encode()),
               (b"x-tiergate-upstream", upstream.encode()), (b"x-tiergate-rule", rule.encode())]
        if fallback:
            out.append((b"x-tiergate-fallback", fallback.encode()))
        return out


def headers_of(scope: Scope) -> dict[str, str]:
    """Request headers with lower-case names (ASGI already lower-cases them); the last value wins."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


class BodyBudget:
    """The request body bytes held in memory at once (JSON bodies are read whole to route on them): at most ``total``
    in all and ``total * key_share`` for one gateway key, so that no key's requests exhaust the process's memory for
    the others (``limits.max_bytes_in_flight``, ``limits.key_share``). A request holds its bytes from its first part
    until it is recorded (:meth:`Exchange.record` gives them back)."""

    __slots__ = ("total", "per_key", "used", "by_key")

    def __init__(self, total: int, key_share: float) -> None:
        self.total = total
        self.per_key = max(1, int(total * key_share))
        self.used = 0
        self.by_key: dict[str, int] = {}

    def take(self, ex: Exchange, n: int) -> None:
        """``ex`` reads ``n`` more body bytes.

        Raises:
            RateLimited: its gateway key holds its share already (429, ``retry-after``); GatewayBusy: the process holds
                ``total`` (503, ``retry-after``). Nothing is taken then.
        """
        self.hold(ex.key.name if ex.key is not None else None, n)
        ex.held += n
        ex.bodies = self

    def release(self, ex: Exchange) -> None:
        """``ex`` ended: what it held is free again."""
        n, ex.held = ex.held, 0
        self.free(ex.key.name if ex.key is not None else None, n)

    def hold(self, key: str | None, n: int) -> None:
        """``n`` more bytes held for the gateway key ``key`` (None: no keys), by a request or by a WebSocket message
        waiting in its socket's queue.

        Raises:
            RateLimited, GatewayBusy: as :meth:`take`; nothing is held then.
        """
        if self.used + n > self.total:
            raise GatewayBusy("The gateway holds as many request bytes as it may; retry the request.",
                              headers={"retry-after": "1"})
        if key is not None:
            mine = self.by_key.get(key, 0) + n
            if mine > self.per_key:
                raise RateLimited(f"The gateway key '{key}' has {self.per_key} request bytes in flight already; retry "
                                  "when some of its requests have ended.", code="request_bytes_in_flight",
                                  headers={"retry-after": "1"})
            self.by_key[key] = mine
        self.used += n

    def free(self, key: str | None, n: int) -> None:
        """``n`` bytes :meth:`hold` held for ``key`` are free again."""
        self.used -= n
        if key is not None:
            left = self.by_key.get(key, 0) - n
            if left > 0:
                self.by_key[key] = left
            else:
                self.by_key.pop(key, None)


async def read_body(headers: dict[str, str], receive: Receive, limit: int, *, json_only: bool = True,
                    hold: tuple[BodyBudget, Exchange] | None = None) -> bytes:
    """The request body, refusing bodies over ``limit`` bytes (413) and, with ``json_only`` (chat completions and
    the Responses API), non-JSON content types (415) and an empty body (400); without it (the passthrough), any
    body, an empty one included. ``hold``: the budget its bytes are held against, and the request holding them.

    Raises:
        UnsupportedMediaType, PayloadTooLarge, InvalidRequest (empty body); RateLimited, GatewayBusy: over
        :class:`BodyBudget`; ClientGone when the client leaves mid-body.
    """
    ctype = headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
    if json_only and ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaType(f"Unsupported content type {ctype!r}; send application/json.")
    declared = headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is over the {limit}-byte limit.")
    parts: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        part = message.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"The request body is over the {limit}-byte limit.")
            if hold is not None:
                hold[0].take(hold[1], len(part))
            parts.append(part)
        if not message.get("more_body", False):
            break
    if not parts and json_only:
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    return parts[0] if len(parts) == 1 else b"".join(parts)
