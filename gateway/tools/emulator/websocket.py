"""The emulator's Responses API WebSocket mode: ``GET /v1/responses`` upgraded, in the OpenAI dialect only (the others
answer 404, as they answer ``POST /v1/responses``). ``websockets``' sans-I/O protocol frames; each ``response.create``
is answered as a streamed ``POST /v1/responses``, one event a text frame, one message at a time.

As OpenAI keeps the previous response in memory on the connection, a socket remembers its own responses, ``store:
false`` included (continued on that socket only). The handshake is recorded as a :class:`Received` with method ``GET``
(a script may answer it: an upstream without WebSocket mode), each message as ``WS``; the token budget and scripted
answers are HTTP's only.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from typing import Any, Protocol

import orjson
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol

from gateway.responses.request import input_items, listed_item
from gateway.tools.emulator.directives import directives
from gateway.tools.emulator.generation import Generation
from gateway.tools.emulator.plans import Received
from gateway.tools.emulator.responses import (
    final_response,
    foreign_compaction,
    orphan,
    response_events,
    warm_up_events,
    warmed_up,
)
from gateway.tools.emulator.schedule import Line, Schedule
from gateway.tools.emulator.shared import Emulator


class Upgraded(Line, Protocol):
    """The HTTP connection a socket is upgraded from; ``number``: 1, 2, ... in the order the connections opened."""

    emulator: Emulator
    number: int


def wants_socket(method: bytes, url: bytes, headers: dict[bytes, bytes]) -> bool:
    return (method == b"GET" and url.split(b"?", 1)[0].endswith(b"/responses")
            and headers.get(b"upgrade", b"").lower() == b"websocket")


def error_event(status: int, message: str, code: str | None, param: str | None = None,
                lane: str | None = None) -> dict[str, Any]:
    """An ``error`` server event (OpenAI's ``ResponseWsError``)."""
    etype = "invalid_request_error" if status < 500 else "server_error"
    event: dict[str, Any] = {"type": "error", "status": status,
                             "error": {"message": message, "type": etype, "param": param, "code": code}}
    if lane is not None:
        event["stream_id"] = lane
    return event


class EmulatorSocket:
    """Stands in for the connection a :class:`~gateway.tools.emulator.schedule.Schedule` writes to (a
    :class:`~gateway.tools.emulator.schedule.Line`)."""

    def __init__(self, proto: Upgraded, method: bytes, url: bytes, headers: dict[bytes, bytes]) -> None:
        self.proto = proto
        self.emulator = proto.emulator
        self.loop = proto.loop
        self.transport = proto.transport
        self.timer: asyncio.TimerHandle | None = None
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items()}
        self.conn = ServerProtocol(max_size=64 * 1024 * 1024)
        self.queue: deque[dict[str, Any]] = deque()
        self.lane: str | None = None  # the stream_id of the message being answered
        self.busy = False
        # the responses made on this socket, store: false included (module docstring), by id, newest last
        self.memory: OrderedDict[str, dict[str, Any]] = OrderedDict()
        head = [method + b" " + url + b" HTTP/1.1", *(k + b": " + v for k, v in headers.items())]
        self.conn.receive_data(b"\r\n".join(head) + b"\r\n\r\n")
        for event in self.conn.events_received():
            if isinstance(event, Request):
                self.conn.send_response(self.conn.accept(event))
        self.flush()

    def flush(self) -> None:
        """Closes the connection once the closing handshake is over."""
        if self.transport is None:
            return
        data = self.conn.data_to_send()
        if data:
            self.transport.write(b"".join(data))
        if self.conn.close_expected() or self.conn.state is State.CLOSED:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)
        for frame in self.conn.events_received():
            if isinstance(frame, Frame) and frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                self.message(bytes(frame.data))
        self.flush()

    def connection_lost(self) -> None:
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()

    def send(self, event: dict[str, Any] | bytes) -> None:
        if self.transport is None or self.conn.state is not State.OPEN:
            return
        self.conn.send_text(event if isinstance(event, bytes) else orjson.dumps(event))
        self.flush()

    def message(self, text: bytes) -> None:
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            self.send(error_event(400, "The message is not valid JSON.", "invalid_json"))
            return
        if not isinstance(event, dict):
            self.send(error_event(400, "A client event must be a JSON object with a 'type'.", "unknown_event_type",
                                  "type"))
            return
        if event.get("type") != "response.create":
            self.send(error_event(400, f"Unsupported client event {event.get('type')!r}.", "unknown_event_type",
                                  "type"))
            return
        self.queue.append(event)
        if not self.busy:
            self.next()

    def next(self) -> None:
        while self.queue and not self.busy and self.transport is not None:
            self.answer(self.queue.popleft())

    def answer(self, event: dict[str, Any]) -> None:
        lane = event.get("stream_id")
        self.lane = lane if isinstance(lane, str) else None
        body = {k: v for k, v in event.items() if k not in ("type", "stream_id")}
        body["stream"] = True
        raw = orjson.dumps(body)
        emu = self.emulator
        if emu.record:
            emu.requests.append(Received("WS", "/v1/responses", dict(self.headers), raw, time.monotonic(),
                                         self.proto.number))
        d = directives(raw)
        previous = body.get("previous_response_id")
        if "status" in d:
            status = int(d["status"])
            event = error_event(status, d.get("message", f"emulated {status}"), d.get("code"), lane=self.lane)
            if "retry_after_ms" in d:  # as OpenAI's error events carry the answer's headers
                event["error"]["headers"] = {"retry-after-ms": d["retry_after_ms"]}
            self.send(event)
            return
        if previous is not None and previous not in self.memory and previous not in emu.responses_made:
            self.send(error_event(400, f"Previous response with id '{previous}' not found.",
                                  "previous_response_not_found", "previous_response_id", self.lane))
            return
        refused = foreign_compaction(body) or orphan(body, self.memory, emu.responses_made)
        if refused is not None:
            err = refused["error"]
            self.send(error_event(400, err["message"], err["code"], err["param"], self.lane))
            return
        gen = Generation(emu, body, d, self.loop.time(), responses=True)
        warm_up = body.get("generate") is False
        events = warm_up_events(gen) if warm_up else response_events(gen)
        final = warmed_up(gen) if warm_up else final_response(gen)
        emu.made(final, self.memory)
        if body.get("store") is not False:
            emu.made(final, inputs=[listed_item(i) for i in input_items(body)])
        self.busy = True
        Schedule(self, events, d).start()

    # what Schedule writes through

    def write(self, payload: bytes, chunked: bool = True) -> None:
        """Each SSE event's ``data`` goes in one frame."""
        for part in payload.split(b"\n\n"):
            for line in part.split(b"\n"):
                if line.startswith(b"data: "):
                    data = line[6:]
                    if self.lane is not None:
                        data = b'{"stream_id":' + orjson.dumps(self.lane) + b"," + data[1:]
                    self.send(data)

    def end_chunked(self) -> None:
        """The next message's turn."""
        self.busy = False
        self.loop.call_soon(self.next)

    def reset(self) -> None:
        self.proto.reset()

    def close(self) -> None:
        self.proto.close()
