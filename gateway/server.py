"""uvicorn's httptools protocol with the limits a public-facing gateway needs on its client side.

uvicorn bounds neither the size of a request head nor the time a client may take to send it, and httptools
buffers a long header line in a way that costs more than linear time: measured here, one request with a
50 MB header stalled every other request on the event loop for 2.4 s, and a client that sends nothing (or
half a head, or half a body) held its connection forever. This protocol:

* answers ``431`` (OpenAI's error envelope) and closes when a request head grows past ``max_head_bytes``,
  before httptools sees the bytes;
* closes a connection whose request head is not complete ``head_timeout`` seconds after the connection
  opened or the previous response ended (uvicorn's keep-alive timeout covers idle time between requests;
  this covers the first request and slow heads), and answers ``408`` when a request body takes longer than
  ``body_timeout`` seconds.

The three limits come from the process settings (``GATEWAY_self.max_head_bytes``, ``GATEWAY_self.head_timeout``,
``GATEWAY_self.body_timeout``) through :func:`configure`, called in every process that serves.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import error_body
from gateway.settings import Settings


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` plus a request-head size limit and head/body read deadlines (module docstring).

    Class attributes (set by :func:`configure`): max_head_bytes (bytes), head_timeout and body_timeout (seconds).
    """

    max_head_bytes = 64 * 1024  # request line plus headers; nginx's large_client_header_buffers is 4 x 8 KiB
    head_timeout = 30.0
    body_timeout = 120.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = True
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._arm(self.head_timeout, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, "request_header_too_large",
                             f"The request line and headers are over {self.max_head_bytes} bytes.")
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.body_timeout, (408, "request_timeout", f"The request body took over {self.body_timeout:g} s."))
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._arm(self.head_timeout, None)  # uvicorn's shorter keep-alive timeout closes an idle connection first
        super().on_response_complete()

    def _arm(self, seconds: float, answer: tuple[int, str, str] | None) -> None:
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(seconds, self._expire, answer)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, answer: tuple[int, str, str] | None) -> None:
        self._deadline = None
        if self.transport is None or self.transport.is_closing():
            return
        if answer is None or (self.cycle is not None and self.cycle.response_started):
            self.transport.close()  # a head that never came, or a response already under way
        else:
            self._refuse(*answer)

    def _refuse(self, status: int, code: str, message: str) -> None:
        body = error_body(message, "invalid_request_error", None, code)
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()


def configure(settings: Settings) -> None:
    """Set the limits of :class:`GuardedHttpToolsProtocol` for this process from ``settings``."""
    GuardedHttpToolsProtocol.max_head_bytes = settings.max_head_bytes
    GuardedHttpToolsProtocol.head_timeout = settings.head_timeout
    GuardedHttpToolsProtocol.body_timeout = settings.body_timeout
