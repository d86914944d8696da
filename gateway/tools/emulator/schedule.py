"""Timed writes on one connection with loop timers (:class:`Schedule`), and what they write through (:class:`Line`):
an HTTP connection (``gateway.tools.emulator.connection``) or one upgraded to a WebSocket
(``gateway.tools.emulator.websocket``)."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Line(Protocol):
    """What a :class:`Schedule` writes through: its loop, its one pending timer, its transport (None once closed)."""

    loop: asyncio.AbstractEventLoop
    timer: asyncio.TimerHandle | None
    transport: asyncio.Transport | None

    def write(self, payload: bytes, chunked: bool = True) -> None:
        """Write one payload (as one HTTP chunk when ``chunked``)."""

    def end_chunked(self) -> None:
        """The answer ended well (the chunked terminator)."""

    def reset(self) -> None:
        """Close with a TCP RST."""

    def close(self) -> None:
        """Close the connection."""


class Schedule:
    """``items``: (loop time, bytes) in time order; ``d``: the request's ``drop_after`` / ``stall_after`` directives;
    ``end`` after the last payload: ``ok`` (the chunked terminator, connection kept), ``eof`` (close inside the
    body), ``reset`` or ``stall`` (silence, connection kept); ``head``: a status line and headers written first
    (scripted plans); ``coalesce``: payloads due at one tick go in one write (generated streams)."""

    def __init__(self, proto: Line, items: list[tuple[float, bytes]], d: dict[str, str],
                 end: str = "ok", head: tuple[float, bytes] | None = None, chunked: bool = True,
                 coalesce: bool = True) -> None:
        self.proto = proto
        self.items = items
        self.i = 0
        self.end = end
        self.head = head
        self.chunked = chunked
        self.coalesce = coalesce
        self.drop_after = int(d["drop_after"]) if "drop_after" in d else None
        self.stall_after = int(d["stall_after"]) if "stall_after" in d else None

    def start(self) -> None:
        if self.head is not None:
            self.proto.timer = self.proto.loop.call_at(self.head[0], self._write_head)
        else:
            self._next()

    def _write_head(self) -> None:
        assert self.head is not None
        if self.proto.transport is not None:
            self.proto.transport.write(self.head[1])
        self._next()

    def _next(self) -> None:
        if self.i < len(self.items):
            self.proto.timer = self.proto.loop.call_at(self.items[self.i][0], self._tick)
        else:
            self._finish()

    def _tick(self) -> None:
        now = self.proto.loop.time()
        parts: list[bytes] = []
        while self.i < len(self.items) and self.items[self.i][0] <= now + 0.0002:
            if self.i in (self.drop_after, self.stall_after):
                self.proto.write(b"".join(parts))
                if self.i == self.drop_after:
                    self.proto.reset()
                return
            parts.append(self.items[self.i][1])
            self.i += 1
            if not self.coalesce:
                break
        self.proto.write(b"".join(parts), self.chunked)
        self._next()

    def _finish(self) -> None:
        if self.end == "ok":
            if self.chunked:
                self.proto.end_chunked()
        elif self.end == "eof":
            self.proto.close()
        elif self.end == "reset":
            self.proto.reset()
