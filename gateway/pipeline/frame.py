"""The frame every request runs in, whatever its entrance: what tells it its client left (:class:`Watch`), the
requests in flight, a clean end however its story ends (never a stack trace, never two answers:
:meth:`Frame.serving`), and the drain. The story runs inside ``async with frame.serving(...)`` in the entrance's own
coroutine: a wrapper coroutine between the task and the story costs every resumption (measured: ~1.5 us of own CPU
per plain request)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType
from typing import Any

from starlette.types import Receive, Scope

from gateway.errors import GatewayDraining, GatewayError
from gateway.pipeline.exchange import BODY, CLOSE, HANGUP, Exchange

log = logging.getLogger("tiergate")
_NO_EXTENSIONS: dict[str, Any] = {}
DRAINING = "The gateway is shutting down; retry the request."


class Watch:
    """Cancels the request's task (``ex.task``) when its client leaves, noting when (``ex.gone_at``). Under the
    gateway's own server protocol the ``tiergate.hangup`` ASGI extension calls :meth:`left`
    (``gateway.http.server.Hangup``); under any other server a task per request awaits ``http.disconnect``."""

    __slots__ = ("ex", "receive", "task", "hangup")

    def __init__(self, ex: Exchange, receive: Receive, scope: Scope) -> None:
        self.ex = ex
        self.receive = receive
        self.task: asyncio.Task[None] | None = None
        extensions = scope.get("extensions", _NO_EXTENSIONS)
        self.hangup = ex.hangup = extensions.get(HANGUP)
        ex.direct = extensions.get(BODY)

    def start(self) -> None:
        """Once; from then on ``receive`` is the watch's."""
        if self.hangup is not None:
            self.hangup.watch(self.left)
        elif self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            # stopped: the request is over. Ending without the exception matters: a task cancelled keeps its
            # CancelledError, whose traceback holds this frame, this watch and its task, a cycle that only the
            # garbage collector frees. Measured (bench.trace): those cycles, ~15 objects a request, made the gen-0
            # collections that most of the slowest 1 % of TTFTs had inside them (0.25-0.4 ms each).
            return
        self.left()

    def left(self) -> None:
        self.ex.gone_at = time.perf_counter()
        self.ex.task.cancel()

    def stop(self) -> None:
        if self.hangup is not None:
            self.hangup.watch(None)
        elif self.task is not None:
            self.task.cancel()


class Frame:
    """Requests in flight (``active``; the hot endpoint adds and discards its own inline), and the drain."""

    def __init__(self) -> None:
        self.draining = False
        self.active: set[Exchange] = set()
        self._drain_deadline = float("inf")  # loop time

    def in_flight(self) -> int:
        return len(self.active)

    def drain_over(self) -> bool:
        """A request that arrives now is answered 503."""
        return self.draining and asyncio.get_running_loop().time() >= self._drain_deadline

    async def too_late(self, ex: Exchange) -> bool:
        """The drain ran out before the body was complete: answered 503, its connection closed."""
        if not self.drain_over():
            return False
        await ex.error(GatewayDraining(DRAINING, headers={"retry-after": "1"}), "gateway_draining",
                       [(b"x-request-id", ex.rid.encode()), CLOSE])
        return True

    def serving(self, ex: Exchange, scope: Scope, watch: Watch | None = None, watch_now: bool = True,
                also: set[Exchange] | None = None) -> Serving:
        """``watch`` None: the entrance tells the request its client left (a WebSocket-mode socket); ``watch_now``
        false: the story starts the watch once a body streaming upstream has ended (until then ``receive`` is the
        body's); ``also``: its socket's requests in flight."""
        return Serving(self, ex, scope, watch, watch_now, also)

    async def interrupted(self, ex: Exchange) -> bool:
        """False when the cancel is someone else's: the caller re-raises it."""
        if ex.gone_at is None and not ex.cut:
            return False
        ex.task.uncancel()
        await (self._left(ex) if ex.gone_at is not None else self._cut_off(ex))
        return True

    async def crashed(self, ex: Exchange, scope: Scope) -> None:
        """Logged, and answered like the rest of the app: never with a stack trace, never twice."""
        log.exception("unhandled error on %s %s", scope["method"], scope["path"])
        if not ex.answered:
            ex.rec.answered(500)
        ex.record("gateway_error")
        if not ex.answered:
            with contextlib.suppress(RuntimeError):  # uvicorn refuses a second status line: nothing to add
                await ex.error(GatewayError("The gateway had an internal error; it has been logged."), "gateway_error")

    async def _left(self, ex: Exchange) -> None:
        """A client that had the whole answer (every choice finished: SDK loops often ``break`` on ``finish_reason``)
        is a success, one whose stream had failed a ``stream_error``, else a ``client_disconnect``; the duration ends
        when it left."""
        stats = ex.relay.stats if ex.relay is not None else None
        outcome = ("client_disconnect" if stats is None else "stream_error" if stats.error else
                   "success" if stats.finished and not stats.left_early else "client_disconnect")
        ex.record(outcome, ended=ex.gone_at, **ex.stream_figures())

    # shutting down

    def begin_drain(self, timeout: float) -> None:
        """``/readyz`` fails from now; after ``timeout`` seconds a request still in flight ends, a started stream
        with an in-band ``gateway_draining`` event, anything else with a 503. Call on the loop's thread."""
        if self.draining:
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        self._drain_deadline = loop.time() + timeout
        loop.call_later(timeout, self._cut_all)

    def _cut_all(self) -> None:
        for ex in list(self.active):
            if ex.task is not None and not ex.rec.recorded:
                ex.cut = True
                ex.task.cancel()

    async def _cut_off(self, ex: Exchange) -> None:
        message = "The gateway is shutting down and its drain time ran out; retry the request."
        with contextlib.suppress(Exception):  # the client may be gone too: nothing more to tell it
            if ex.answered and ex.request.stream:
                await ex.end_stream_with_error(message, "gateway_draining")
            elif not ex.answered:
                await ex.error(GatewayDraining(message, headers={"retry-after": "1"}), "gateway_draining",
                               [(b"x-request-id", ex.rid.encode()), CLOSE])
        ex.record("gateway_draining", **ex.stream_figures())


class Serving:
    """See :meth:`Frame.serving`: a cancel by the client leaving or the drain ends the request cleanly (anyone else's
    goes on), a bug is answered once; the request always leaves the in-flight sets."""

    __slots__ = ("frame", "ex", "scope", "watch", "watch_now", "also")

    def __init__(self, frame: Frame, ex: Exchange, scope: Scope, watch: Watch | None, watch_now: bool,
                 also: set[Exchange] | None) -> None:
        self.frame, self.ex, self.scope = frame, ex, scope
        self.watch, self.watch_now, self.also = watch, watch_now, also

    async def __aenter__(self) -> Exchange:
        ex = self.ex
        ex.task = asyncio.current_task()
        if self.watch is not None and self.watch_now:
            self.watch.start()
        self.frame.active.add(ex)
        if self.also is not None:
            self.also.add(ex)
        return ex

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        ex = self.ex
        try:
            if kind is None:
                return False
            if issubclass(kind, asyncio.CancelledError):
                return await self.frame.interrupted(ex)
            if issubclass(kind, Exception):
                await self.frame.crashed(ex, self.scope)
                return True
            return False
        finally:
            self.frame.active.discard(ex)
            if self.also is not None:
                self.also.discard(ex)
            if self.watch is not None:
                self.watch.stop()
            ex.rec.end_trace()
