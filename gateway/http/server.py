"""uvicorn's httptools protocol with the limits a public-facing gateway needs on its client side. uvicorn bounds neither
a request head's size nor the time a client takes to send it, and httptools buffers a long header line in more than
linear time: measured, one 50 MB header stalled every other request for 2.4 s, and a client that sent nothing (or half a
head or body) held its connection forever. So this protocol answers in OpenAI's error envelope:

* ``431`` and closes once a request head grows past ``max_head_bytes``, before httptools sees it;
* closes a connection whose head is not complete ``head_timeout`` seconds after it opened or the head began, and ``408``
  when a JSON body takes over ``body_timeout`` seconds (any other body: when it sends nothing for that long);
* ``400`` for a request httptools cannot parse or whose body ended early, never inside a response under way.

At shutdown an idle connection stays open ``drain_idle_grace`` seconds (:meth:`GuardedHttpToolsProtocol.shutdown`).
:func:`configure` sets the limits in every serving process; :func:`drain_on_exit` tells the app when shutdown starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.supervisors.multiprocess import Multiprocess

from gateway.config.settings import Settings
from gateway.errors import error_body
from gateway.pipeline.exchange import BODY, HANGUP
from gateway.wire.body import is_json_type

_JSON_BY_DEFAULT = frozenset({b"/v1/chat/completions", b"/v1/responses"})


class Hangup:
    """The ``tiergate.hangup`` ASGI extension: the server calls the callback given to :meth:`watch` once, on the
    loop, when the client's connection is lost before the response was complete (at once if it already was;
    ``watch(None)`` stops). An app then needs no task per request awaiting ``http.disconnect`` (measured: ~10 us of
    CPU per request)."""

    __slots__ = ("callback", "gone", "received")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.gone = False
        # time.perf_counter() when the request was read whole, in the I/O callback that read its last byte: the
        # gateway's own time to first byte counts from there (the wait for its task to start is the gateway's)
        self.received: float | None = None

    def watch(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback
        if self.gone and callback is not None:
            self.fire()

    def fire(self) -> None:
        self.gone = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class ChunkedBody:
    """The ``tiergate.body`` ASGI extension: a piece of a started ``transfer-encoding: chunked`` response body written
    straight to the connection, framed as uvicorn frames it (RFC 9112 §7.1), instead of an ``http.response.body``
    message through the ASGI ``send``: measured, that coroutine and its checks were ~1 us of the ~14 us of CPU per
    relayed chunk. :meth:`write` returns False whenever uvicorn's own path must take the piece instead: the
    response not started or not chunked (``HEAD``, a ``content-length``), complete, the client gone, or its writes
    paused (``send`` then waits for them to drain: a slow client holds the relay, not the gateway's memory)."""

    __slots__ = ("cycle",)

    def __init__(self) -> None:
        self.cycle: Any = None  # uvicorn's RequestResponseCycle of the request, once made

    def write(self, data: bytes) -> bool:
        cycle = self.cycle
        if (cycle is None or cycle.chunked_encoding is not True or cycle.response_complete or cycle.disconnected
                or cycle.flow.write_paused or not data):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True


class _Flow(FlowControl):
    """uvicorn's flow control, telling the protocol when it pauses and resumes reading the client."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedHttpToolsProtocol) -> None:
        super().__init__(transport)
        self._protocol = protocol

    def pause_reading(self) -> None:
        if not self.read_paused:
            super().pause_reading()
            self._protocol.reading(paused=True)

    def resume_reading(self) -> None:
        if self.read_paused:
            super().resume_reading()
            self._protocol.reading(paused=False)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """The module docstring's limits, set by :func:`configure`: ``max_head_bytes`` in bytes, the others in seconds."""

    max_head_bytes = 64 * 1024  # request line plus headers; nginx's large_client_header_buffers is 4 x 8 KiB
    head_timeout = 30.0
    body_timeout = 120.0
    drain_idle_grace = 5.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport, self)
        self._in_head = True
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None  # the loop timer; it fires no later than _due
        self._due: float | None = None  # loop time when the head or body deadline passes; None: none armed
        self._answer: tuple[int, str, str] | None = None  # what the deadline answers (None: just close)
        self._by_progress = False
        self._slow: tuple[int, str, str] = (408, "", "")
        self._draining = False  # shutdown began: every request from now on is the connection's last
        self._grace: asyncio.TimerHandle | None = None
        self._arm(self.head_timeout, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._grace is not None:
            self._grace.cancel()
        cycle = self.cycle  # the one uvicorn marks disconnected
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            _hangup(cycle)

    def data_received(self, data: bytes) -> None:
        if self._by_progress and not self._in_head:  # a streamed body's bytes: its silence timer starts again
            self._arm(self.body_timeout, self._slow)
        if self._in_head:
            if self._head_bytes == 0 and self._due is None:
                self._arm(self.head_timeout, None)  # a new head starts: the keep-alive idle time is over
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, "request_header_too_large",
                             f"The request line and headers are over {self.max_head_bytes} bytes.")
                return
        super().data_received(data)

    def eof_received(self) -> None:
        if not self._in_head:  # the client ended its side inside a body: the body can never be complete
            self._refuse(400, "incomplete_body", "The request body ended before its declared length.")

    def on_headers_complete(self) -> None:
        self._in_head = False
        # a JSON body (chat, Responses, the JSON of the rest of /v1) must arrive whole within body_timeout; any other
        # (a file upload of hundreds of MB, streamed upstream as it arrives) within body_timeout of its last byte
        ctype = None
        for name, value in self.headers:
            if name == b"content-type":
                ctype = value
        # no content type: JSON on the two hot endpoints (read_body's default), a stream anywhere else (passthrough's)
        if ctype == b"application/json":  # the SDKs' own: no parsing on the hot path
            self._by_progress = False
        else:
            self._by_progress = (not is_json_type(ctype.decode("latin-1")) if ctype is not None
                                 else self.url.split(b"?", 1)[0] not in _JSON_BY_DEFAULT)
        if self._by_progress:
            self._slow = (408, "request_timeout", f"The request body sent nothing for {self.body_timeout:g} s.")
            self._arm(self.body_timeout, self._slow)
        else:
            self._arm(self.body_timeout, (408, "request_timeout",
                                          f"The request body took over {self.body_timeout:g} s."))
        hangup, body = Hangup(), ChunkedBody()
        extensions = self.scope.get("extensions")
        ours: dict[str, Any] = {HANGUP: hangup, BODY: body}
        self.scope["extensions"] = {**extensions, **ours} if extensions else ours
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:
            self.cycle.tiergate_hangup = hangup  # type: ignore[attr-defined]
            body.cycle = self.cycle
            if self._draining:  # its response says connection: close, and the connection closes after it
                self.cycle.keep_alive = False

    def reading(self, paused: bool) -> None:
        """Paused reading means the app (or the upstream behind it) takes no more of the body: that silence is not
        the client's, so the silence timer stops until reading resumes."""
        if self._by_progress and not self._in_head:
            if paused:
                self._disarm()
            else:
                self._arm(self.body_timeout, self._slow)

    def on_message_complete(self) -> None:
        self._by_progress = False
        # the request is read: what follows is the next request's head (pipelined, or after this response), so
        # it is counted against the head limit from here, never while the rest of a body is still arriving
        # (an early answer to an unread body left those bytes to be counted as a head:
        # tests/test_faults.py::test_an_early_answer_to_an_unread_body_is_the_only_answer)
        self._disarm()
        self._in_head = True
        self._head_bytes = 0
        cycle = self.cycle
        # a pipelined request waits in uvicorn's queue for the answers ahead of it: that wait is theirs, not the
        # gateway's, so its own time then counts from its task's start (the app's, as without this protocol)
        if cycle is not None and not self.pipeline:
            hangup = getattr(cycle, "tiergate_hangup", None)
            if hangup is not None:
                hangup.received = time.perf_counter()
        super().on_message_complete()
        # a body over uvicorn's high-water mark pauses reading until the app's receive() resumes it; an app that
        # watches by Hangup calls receive() no more once the body is in, so reading resumes here: a client that
        # leaves is then still seen (connection_lost). A pipelined request behind this one keeps it paused.
        if self.flow.read_paused and not self.pipeline and self.cycle is not None and not self.cycle.response_complete:
            self.flow.resume_reading()

    def handle_websocket_upgrade(self) -> None:
        """The connection is the WebSocket protocol's from here: this one's deadlines and drain grace end, or they
        would write an HTTP answer into the socket's frames."""
        self._cancel()
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        super().handle_websocket_upgrade()

    def shutdown(self) -> None:
        """A request under way is the connection's last (uvicorn's rule). uvicorn closed idle connections at once,
        losing a request a load balancer sent meanwhile; here one stays open ``drain_idle_grace`` seconds and a
        request on it is answered with ``connection: close``."""
        self._draining = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
        elif self.drain_idle_grace <= 0:
            self.transport.close()
        else:
            self._grace = self.loop.call_later(self.drain_idle_grace, self._close_if_idle)

    def _close_if_idle(self) -> None:
        """Unless a request came (it closes after its response) or a head is arriving (the head deadline closes it)."""
        self._grace = None
        cycle = self.cycle
        if (cycle is None or cycle.response_complete) and self._head_bytes == 0 and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Conflicting ``Content-Length`` and ``Transfer-Encoding``, a bad chunk size...: OpenAI's envelope instead
        of uvicorn's plain text."""
        self._refuse(400, "invalid_http_request", f"{msg} The connection is closed.")

    # The deadline is lazy: arming and disarming set when it passes (``_due``) and what it answers; one loop timer per
    # connection fires no later than that and, when the deadline moved on meanwhile, waits again. A request arms and
    # disarms it three times; with a loop timer made and cancelled each time, that was ~4 us of CPU per request.
    def _arm(self, seconds: float, answer: tuple[int, str, str] | None) -> None:
        due = self.loop.time() + seconds
        self._due, self._answer = due, answer
        if self._deadline is None or self._deadline.when() > due:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_at(due, self._expire)

    def _disarm(self) -> None:
        self._due = None

    def _cancel(self) -> None:
        self._due = None
        if self._deadline is not None:  # the connection is gone: its timer must not keep it alive
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        due = self._due
        if due is None:
            return
        # armed again since this timer was set; within 1 ms it has passed: uvloop's timers and clock count whole
        # milliseconds, and waiting for less than one would spin through call_soon until its clock ticks
        if self.loop.time() < due - 0.001:
            self._deadline = self.loop.call_at(due, self._expire)
            return
        self._due = None
        if self.transport is None or self.transport.is_closing():
            return
        if self._answer is None:
            self.transport.close()  # a head that never came
        else:
            self._refuse(*self._answer)

    def _refuse(self, status: int, code: str, message: str) -> None:
        """One request, one response: with a response already under way (an early answer, a pipelined request behind
        a stream) nothing is written, and the connection closes once it ends."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            cycle.keep_alive = False
            if cycle.response_complete:
                self.transport.close()
            else:
                self.flow.pause_reading()
            return
        body = error_body(message, "invalid_request_error", None, code)
        reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
            _hangup(cycle)


class GuardedWebSocketsProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol under the gateway's drain: uvicorn closed every socket at shutdown with 1012,
    cutting responses in flight; here an accepted socket is left to the app's drain
    (:meth:`gateway.http.socket.SocketSession.drain`). A client whose write buffer is past the high-water mark
    (uvloop's 64 KiB) is not read until it drains, so the pongs uvicorn writes straight to the transport are bounded
    too: one socket pinging and never reading grew the process 115 MB in 18 s; now it holds the mark and one read's
    pongs (under 256,000 B)."""

    def shutdown(self) -> None:
        if self.handshake_complete and self.initial_response is None and not self.close_sent:
            return  # the app's drain closes it once what is in flight has finished
        super().shutdown()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._stuck = self.loop.call_later(self.close_timeout, self._check_stuck, False)

    def _check_stuck(self, closing: bool) -> None:
        """uvloop's ``close()`` waits for the flush, forever for a client that never reads: a socket still closing
        ``close_timeout`` (10 s) later and not flushed is aborted."""
        if closing and self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self._stuck = self.loop.call_later(self.close_timeout, self._check_stuck, self.transport.is_closing())

    def connection_lost(self, exc: Exception | None) -> None:
        self._stuck.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self.read_paused:  # uvicorn's own pause (the app's queue is not empty) holds
            self.transport.resume_reading()

    async def receive(self) -> Any:
        message = await super().receive()  # it resumes reading once the app's queue is empty: not while ours is full
        if not self.writable.is_set():
            self.transport.pause_reading()
        return message

    def handle_ping(self) -> None:  # reading resumed for the close handshake (uvicorn's send()) stops again here
        super().handle_ping()
        if not self.writable.is_set():
            self.transport.pause_reading()


def _hangup(cycle: Any) -> None:
    """``cycle``: a uvicorn ``RequestResponseCycle``."""
    hangup = getattr(cycle, "tiergate_hangup", None)
    if hangup is not None:
        hangup.fire()


def drain_on_exit(app: Any, timeout: float) -> None:
    """uvicorn stops accepting on SIGTERM or SIGINT, then cancels what is left after ``timeout_graceful_shutdown``;
    the app alone cannot tell that shutdown began. Call from the app factory (``factory=True``): uvicorn's handlers
    are installed by then in every process. Outside the main thread it does nothing."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        if not callable(prev):
            continue

        def handler(signum: int, frame: FrameType | None, prev: Callable[[int, FrameType | None], Any] = prev) -> None:
            loop.call_soon_threadsafe(app.begin_drain, timeout)
            prev(signum, frame)

        with contextlib.suppress(ValueError):  # signal.signal works only in the main thread
            signal.signal(sig, handler)


def reload_on_hup(app: Any) -> None:
    """A config change without a restart (:meth:`gateway.app.HotPath.reload`); call it like :func:`drain_on_exit`.
    With ``--workers N`` SIGHUP goes to uvicorn's supervisor instead, which replaces each worker
    (``Multiprocess.restart_all``)."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Any]] = set()

    def start() -> None:
        task = loop.create_task(app.reload())
        tasks.add(task)  # held until done: a task nobody references may be collected mid-run
        task.add_done_callback(tasks.discard)

    def handler(signum: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(start)

    with contextlib.suppress(ValueError):  # signal.signal works only in the main thread
        signal.signal(signal.SIGHUP, handler)


class Supervisor(Multiprocess):
    """uvicorn's ``Multiprocess`` (0.54) that stops accepting as soon as it stops, as a single process does. The
    workers share one listening socket, which the kernel keeps listening while any copy is open; uvicorn's supervisor
    closed its own only after every worker exited, so through a whole drain new connections, health probes included,
    hung in a backlog nobody read and were reset at the end (reset 7.7 s after SIGTERM with an 8 s
    ``GATEWAY_DRAIN_TIMEOUT``). Here it closes its copy at SIGTERM (uvicorn polls every 0.5 s) and each worker its
    own as its shutdown begins; a reload (SIGHUP) keeps the sockets for the new workers."""

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()


def uvicorn_options(host: str, port: int, log_level: str, settings: Settings,
                    ws_max_size: int = 16 * 1024 * 1024) -> dict[str, Any]:
    """``uvicorn.Config`` keywords: uvloop, the guarded protocols, no access log or proxy-header middleware on the
    hot path. ``ws_max_size``: bytes (``limits.websocket.max_message_bytes``)."""
    return {"host": host, "port": port, "loop": "uvloop", "http": GuardedHttpToolsProtocol, "log_level": log_level,
            "ws": GuardedWebSocketsProtocol, "ws_max_size": ws_max_size,
            "access_log": False, "lifespan": "on", "server_header": False, "date_header": False,
            "proxy_headers": False,  # the gateway reads no client address; saves a middleware per request
            "timeout_keep_alive": settings.keepalive_timeout,
            # the app ends what is left at drain_timeout itself (in-band error events); uvicorn's own cut-off
            # comes later, for anything that still did not end
            "timeout_graceful_shutdown": settings.drain_timeout + 5}


def configure(settings: Settings) -> None:
    GuardedHttpToolsProtocol.max_head_bytes = settings.max_head_bytes
    GuardedHttpToolsProtocol.head_timeout = settings.head_timeout
    GuardedHttpToolsProtocol.body_timeout = settings.body_timeout
    # past the drain's end nothing is served any more: no reason to keep a connection open for requests
    GuardedHttpToolsProtocol.drain_idle_grace = min(settings.drain_idle_grace, settings.drain_timeout)
