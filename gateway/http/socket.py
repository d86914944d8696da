"""The Responses API's WebSocket mode, one client socket at a time (docs/websocket.md; OpenAI API reference, "Responses
WebSocket events"). Each ``response.create`` is served as the streamed ``POST /v1/responses`` it stands for: the third
entrance onto the one admission sequence (``gateway.admission.sequence``) and the pipeline behind it, routed per
message, through an :class:`~gateway.pipeline.exchange.Exchange` whose ASGI ``send`` is :class:`Frames`. Its attempts go
through the socket's :class:`~gateway.upstream.websocket.UpstreamSockets`, and what it makes is kept in the socket's
:class:`~gateway.responses.store.SocketStore`, so that ``previous_response_id`` continues it even with ``store: false``.

Messages of one lane (``stream_id``) are served in order, lanes side by side, at most ``limits.websocket.in_flight``
queued or served at once. The socket ends when the client leaves (what is in flight is cancelled), after
``limits.websocket.idle`` seconds with nothing in flight (1000), or at the drain (1001, once what is in flight
finished).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson
from starlette.types import Message, Receive, Scope, Send

from gateway.admission.body import BodyBudget, check_nesting, too_large
from gateway.admission.request import KEY_SCOPE, arrive, headers_of
from gateway.admission.sequence import Refused
from gateway.errors import GatewayDraining, GatewayError, InvalidRequest, RateLimited, Unauthorized
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.gateway import Gateway
from gateway.responses.store import MemoryResponseStore, SocketStore
from gateway.stream.sse import SSEScanner
from gateway.upstream.websocket import UpstreamSockets
from gateway.wire.body import dumps, loads

log = logging.getLogger("tiergate")

# close codes (RFC 6455 §7.4.1)
NORMAL, GOING_AWAY, POLICY, TOO_BIG, SERVER_ERROR = 1000, 1001, 1008, 1009, 1011
MEMORY_ITEMS = 10_000  # responses a socket keeps at most (its bytes are bounded by limits.websocket.memory_bytes)


def error_event(status: int, body: bytes, lane: bytes | None, headers: dict[str, str] | None = None) -> bytes:
    """OpenAI's ``ResponseWsError`` from an error answer's status and envelope; ``headers`` (a ``retry-after``) go in
    ``error.headers``."""
    try:
        err = loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    if not isinstance(err, dict):
        err = {"message": body.decode("utf-8", "replace")[:500] or f"HTTP {status}", "type": "server_error",
               "param": None, "code": None}
    if headers:
        err = {**err, "headers": headers}
    return with_lane(dumps({"type": "error", "status": status, "error": err}), lane)


def with_lane(data: bytes, lane: bytes | None) -> bytes:
    """``lane``: its JSON string, spliced in first."""
    return data if lane is None else b'{"stream_id":' + lane + b"," + data[1:]


class Frames:
    """A 200's SSE events become frames, any other status one ``error`` event; a stream's in-band ``{"error": ...}``
    event (the drain's, a broken relay's) becomes an ``error`` event."""

    __slots__ = ("socket", "lane", "status", "scanner", "held", "headers")

    def __init__(self, socket: SocketSession, lane: bytes | None, max_event_bytes: int) -> None:
        self.socket = socket
        self.lane = lane
        self.status = 0
        self.scanner = SSEScanner(max_event_bytes)
        self.held: list[bytes] = []
        self.headers: dict[str, str] = {}

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.status != 200:
                self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in message.get("headers", ())
                                if k in (b"retry-after", b"retry-after-ms", b"x-should-retry")}
            return
        body = message.get("body", b"")
        if self.status != 200:
            self.held.append(body)
            if not message.get("more_body", False):
                await self.socket.send_frame(error_event(self.status, b"".join(self.held), self.lane, self.headers))
            return
        if not body:
            return
        # the relay writes whole events: one ``data:`` line each, after an ``event:`` line or not, is cut out of the
        # bytes (measured: 2.1 -> ~1.2 us an event); anything else goes through the scanner
        if self.scanner.idle and body.endswith(b"\n\n"):
            datas = []
            for part in body[:-2].split(b"\n\n"):
                data = _data_line(part)
                if data is None:
                    break
                datas.append(data)
            else:
                for data in datas:
                    await self.socket.send_frame(self.event(data))
                return
        for _, data, _ in self.scanner.feed(body):
            if data is not None and not data.startswith(b"[DONE]"):
                await self.socket.send_frame(self.event(data))

    def event(self, data: bytes) -> bytes:
        if not data.startswith(b'{"type":'):
            try:
                parsed = loads(data)
            except ValueError:  # not JSON: relayed as it came, as the SSE relay does
                parsed = None
            if isinstance(parsed, dict) and "type" not in parsed and isinstance(parsed.get("error"), dict):
                data = dumps({"type": "error", "error": parsed["error"]})
        return with_lane(data, self.lane)


def _data_line(event: bytes) -> bytes | None:
    if event.startswith(b"event: "):
        cut = event.find(b"\n")
        event = event[cut + 1:] if cut > 0 else b""
    if not event.startswith(b"data: ") or b"\n" in event or event.startswith(b"data: [DONE]"):
        return None
    return event[6:]


class Queued(NamedTuple):
    """Kept as its bytes (a parsed message takes ~10x its bytes; it is parsed again when served), held against the
    body budget until it starts."""

    text: str | bytes
    held: int
    bodies: BodyBudget


class Lane:
    """The messages of one ``stream_id`` waiting to be served, and the task serving them in order."""

    __slots__ = ("id", "wire", "queue", "task")

    def __init__(self, lane_id: str | None) -> None:
        self.id = lane_id
        self.wire = dumps(lane_id) if lane_id is not None else None
        self.queue: deque[Queued] = deque()
        self.task: asyncio.Task[None] | None = None


class SocketSession:
    """``current``: the gateway serving new requests now (a reload swaps it; each message is served by the one
    current when it starts); ``owner``: its gateway key's name."""

    def __init__(self, current: Callable[[], Gateway], scope: Scope, receive: Receive, send: Send,
                 owner: str | None = None) -> None:
        self.current = current
        self.scope = scope
        self.receive = receive
        self._send = send
        # each message is a request of its own: its own request id, never the handshake's
        self.headers = {k: v for k, v in headers_of(scope["headers"]).items() if k != "x-request-id"}
        gateway = current()
        limits = gateway.config.limits.websocket
        self.limits = limits
        self.memory = SocketStore(MemoryResponseStore(MEMORY_ITEMS, limits.memory_bytes,
                                                      gateway.config.response_store.ttl), gateway.store,
                                  gateway.socket_memory, owner)
        self.owner = owner
        self.via = UpstreamSockets(gateway.transport, gateway.config.limits.max_event_bytes)
        self.via_of: Gateway = gateway
        self.lanes: dict[str | None, Lane] = {}
        self.pending = 0  # messages queued or being served
        self.active: set[Exchange] = set()
        self.gone = False  # the client closed or left
        self.closed: tuple[int, str] | None = None  # the close the gateway sent
        self.draining = False
        self.too_big = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake: asyncio.Timeout | None = None  # the reader's wait: idle timeout, drain

    # the reader

    async def run(self) -> str:
        """Returns why it ended (a ``tiergate_websocket_closes_total`` reason)."""
        try:
            while not self.gone and self.closed is None:
                try:
                    async with asyncio.timeout(None) as wake:
                        self._wake = wake
                        self._rearm()
                        message = await self.receive()
                except TimeoutError:
                    if self.pending == 0:  # idle, or drained: nothing in flight
                        await self.close(GOING_AWAY if self.draining else NORMAL,
                                         "gateway_draining" if self.draining else "idle_timeout")
                    continue
                finally:
                    self._wake = None
                kind = message["type"]
                if kind == "websocket.disconnect":
                    self.too_big = message.get("code") == TOO_BIG  # the server protocol refused a message
                    self.left()
                elif kind == "websocket.receive":
                    await self.on_message(message.get("text") or message.get("bytes") or b"")
        finally:
            await self.end()
        return ("too_big" if self.too_big else "client") if self.closed is None else self.reason

    @property
    def reason(self) -> str:
        code, said = self.closed or (NORMAL, "")
        return {GOING_AWAY: "drain", POLICY: "unauthorized", TOO_BIG: "too_big"}.get(
            code, "idle" if said == "idle_timeout" else "error" if code == SERVER_ERROR else "client")

    def _rearm(self) -> None:
        """``limits.websocket.idle`` while nothing is in flight (now, once drained); no timeout while something is."""
        wake = self._wake
        if wake is None:
            return
        loop = asyncio.get_running_loop()
        if self.pending:
            wake.reschedule(None)
        else:
            wake.reschedule(loop.time() if self.draining else loop.time() + self.limits.idle)

    async def on_message(self, text: str | bytes) -> None:
        """A ``response.create`` is queued on its lane; anything else is answered here."""
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            return await self.refuse(InvalidRequest("The message is not valid JSON.", code="invalid_json"), None)
        if not isinstance(event, dict) or "type" not in event:  # null, [], 5, {}: JSON, but no client event
            return await self.refuse(InvalidRequest("A client event must be a JSON object with a 'type': send "
                                                    "response.create.", param="type", code="unknown_event_type"), None)
        kind = event.get("type")
        if kind == "response.steer":
            return await self.steer_failed(event)
        if kind != "response.create":
            return await self.refuse(InvalidRequest(f"Unknown client event type {str(kind)[:60]!r}: send "
                                                    "response.create.", param="type", code="unknown_event_type"), None)
        lane_id = event.get("stream_id")
        if lane_id is not None and not isinstance(lane_id, str):
            return await self.refuse(InvalidRequest("Invalid 'stream_id': expected a string.", param="stream_id",
                                                    code="invalid_type"), None)
        wire = dumps(lane_id) if lane_id is not None else None
        if self.draining:
            return await self.refuse(GatewayDraining("The gateway is shutting down; reconnect and send it again.",
                                                     headers={"retry-after": "1"}), wire)
        if self.pending >= self.limits.in_flight:
            return await self.refuse(RateLimited(f"This socket has {self.pending} responses queued or in flight, its "
                                                 f"limit (limits.websocket.in_flight); wait for one to end.",
                                                 code="too_many_requests_in_flight"), wire)
        if event.get("background") is True:
            return await self.refuse(InvalidRequest("background is not supported in WebSocket mode.",
                                                    param="background", code="unsupported_parameter"), wire)
        # what the queued message takes in memory: a str's size is its characters times 1, 2 or 4 bytes
        bodies, held = self.current().bodies, sys.getsizeof(text) if isinstance(text, str) else len(text)
        try:
            bodies.hold(self.owner, held)  # queued messages count as the bodies in flight they will be
        except GatewayError as exc:
            return await self.refuse(exc, wire)
        lane = self.lanes.get(lane_id)
        if lane is None:
            lane = self.lanes[lane_id] = Lane(lane_id)
        lane.queue.append(Queued(text, held, bodies))
        self.pending += 1
        self._rearm()
        if lane.task is None:
            lane.task = asyncio.get_running_loop().create_task(self.serve_lane(lane))

    async def refuse(self, exc: GatewayError, lane: bytes | None) -> None:
        """Not a request: not recorded."""
        await self.send_frame(error_event(exc.status, exc.body(), lane, exc.headers or None))

    async def steer_failed(self, event: dict[str, Any]) -> None:
        """The gateway does not steer: the input comes back so that the client can carry it into its next
        ``response.create``."""
        await self.send_frame(dumps({
            "type": "response.steer.failed", "sequence_number": 0,
            "error": {"code": "steering_not_supported", "type": "invalid_request_error",
                      "message": "The gateway does not steer responses; send the input in the next response.create."},
            "steer": {"input": event.get("input", ""), "previous_response_id": event.get("previous_response_id", "")}}))

    # serving

    async def serve_lane(self, lane: Lane) -> None:
        try:
            while lane.queue and not self.gone and self.closed is None:
                queued = lane.queue.popleft()
                queued.bodies.free(self.owner, queued.held)  # serving it takes its bytes again (serve)
                event = orjson.loads(queued.text)
                try:
                    if self.draining:  # queued before the drain began, not started: the client sends it again
                        await self.refuse(GatewayDraining("The gateway is shutting down; reconnect and send it "
                                                          "again.", headers={"retry-after": "1"}), lane.wire)
                    else:
                        await self.serve(event, lane.wire)
                finally:
                    self.pending -= 1
                    self._rearm()
        finally:
            lane.task = None
            if not lane.queue and self.lanes.get(lane.id) is lane:
                del self.lanes[lane.id]

    async def serve(self, event: dict[str, Any], lane: bytes | None) -> None:
        """Held to the same limits as over HTTP, then admitted and served as the HTTP entrance does
        (``gateway.http.entrances.hot``)."""
        gw = self.current()
        scope = {"type": "http", "method": "WS", "path": "/v1/responses", "headers": self.scope["headers"]}
        if gw.keys is not None:
            try:
                scope[KEY_SCOPE] = gw.keys.authenticate(self.scope["headers"])
            except Unauthorized as exc:  # a reload removed its key: nothing more is served on this socket
                await self.refuse(exc, lane)
                return await self.close(POLICY, "the gateway key is no longer valid")
        ex = Exchange.of(gw.observers, arrive(scope, "responses", self.headers, "WS"),
                         Frames(self, lane, gw.config.limits.max_event_bytes), gw.bodies)
        ex.via, ex.memory = self.transport_of(gw), self.memory
        limit = gw.config.limits.max_request_bytes
        try:
            check_nesting(event)  # before it is written again: the same depth as a body over HTTP
            raw = dumps({**{k: v for k, v in event.items() if k not in ("type", "stream_id")}, "stream": True})
            if len(raw) > limit:  # and the same size
                raise too_large(limit)
            ex.reserved.body.take(len(raw))
        except GatewayError as exc:
            return await ex.error(exc, "client_error")
        frame = gw.frame
        if frame.draining and await frame.too_late(ex):
            return
        ex.rec.trace("chat")
        async with frame.serving(ex, scope, also=self.active):
            try:
                admitted = await gw.admission.admit(ex, raw)
            except Refused as refused:
                return await ex.error(refused.error, refused.outcome)
            await gw.chat.serve(ex, admitted)

    def transport_of(self, gateway: Gateway) -> UpstreamSockets:
        """A reload made a new gateway: the old one's upstream sockets are closed."""
        if gateway is not self.via_of:
            old, self.via, self.via_of = self.via, UpstreamSockets(gateway.transport,
                                                                   gateway.config.limits.max_event_bytes), gateway
            task = asyncio.get_running_loop().create_task(old.stop())
            self._tasks.add(task)  # held until done: a task nobody references may be collected mid-run
            task.add_done_callback(self._tasks.discard)
        return self.via

    # the socket's end

    async def send_frame(self, data: bytes) -> None:
        """A client already gone is not written to (its requests are being cancelled)."""
        if self.gone or self.closed is not None:
            return
        try:
            await self._send({"type": "websocket.send", "text": data.decode()})
        except OSError:  # uvicorn's ClientDisconnected: the client left between its last frame and this one
            self.left()

    def left(self) -> None:
        """Each response's upstream is closed by its attempt's end."""
        if self.gone:
            return
        self.gone = True
        now = time.perf_counter()
        for ex in list(self.active):
            if ex.task is not None and not ex.rec.recorded:
                ex.gone_at = now
                ex.task.cancel()

    def drain(self) -> None:
        """Messages not yet started are answered ``gateway_draining``; responses in flight finish; then 1001."""
        if not self.draining:
            self.draining = True
            self._rearm()

    async def close(self, code: int, reason: str) -> None:
        if self.closed is not None or self.gone:
            return
        self.closed = (code, reason)
        with contextlib.suppress(OSError, RuntimeError):
            await self._send({"type": "websocket.close", "code": code, "reason": reason})

    async def end(self) -> None:
        """Cancel what its lanes serve, as if its client left, wait for them, and close its upstream sockets."""
        self.left()
        for task in [lane.task for lane in self.lanes.values() if lane.task is not None] + list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for lane in self.lanes.values():  # what was never started gives its bytes back
            while lane.queue:
                queued = lane.queue.popleft()
                queued.bodies.free(self.owner, queued.held)
        self.memory.close()
        await self.via.stop()
