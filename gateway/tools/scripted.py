"""A :class:`gateway.upstream.attempt.Transport` that plays the emulator's scripted :class:`Plan` objects in-process,
without sockets: for tests that drive the ASGI app by hand (as Starlette's own tests do) and for ``bench.layers``,
which measures the gateway's own CPU with the I/O taken away. It keeps the upstream client's contract
(``gateway.upstream.response.UpstreamResponse``: the headers a client may see, the ``idle`` bound,
``StreamInterrupted`` on a cut or a silence, a ``drop`` failing as an unreachable upstream); the socket level is the
emulator's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import StreamInterrupted, UpstreamTimeout, UpstreamUnavailable
from gateway.tools.emulator.plans import Plan, Received
from gateway.upstream.attempt import ERROR_BODY_LIMIT, Body
from gateway.upstream.headers import ENTITY_HEADERS, pass_headers


class ScriptedAnswer:
    """One upstream answer played from a :class:`Plan` (``gateway.upstream.attempt.Answer``'s interface)."""

    stale_retried = False

    def __init__(self, plan: Plan, idle: float) -> None:
        self.plan = plan
        self.status = plan.status
        self.headers = pass_headers(plan.headers)
        self.content_type = plan.headers.get("content-type", "")
        self.released = False
        self.closed = False
        self._idle = idle
        self._watching = False
        self._next = 0  # the next part to play
        loop = asyncio.get_running_loop()
        self._last = loop.time()  # when the last part arrived (or the status line)
        self._due: list[float] = []  # when each part arrives, as on a wire: on a schedule from the status line
        at = self._last
        for delay, _ in plan.parts:
            at += delay
            self._due.append(at)

    def entity_headers(self) -> list[tuple[bytes, bytes]]:
        return [(k.encode(), v.encode()) for k, v in self.plan.headers.items() if k.encode() in ENTITY_HEADERS]

    def watch_idle(self) -> None:
        self._watching = True

    async def chunks(self) -> AsyncIterator[bytes]:
        """Resumable after a cancelled iteration. Raises StreamInterrupted on ``eof`` or ``reset``, or on silence
        past ``idle`` once watched (as :class:`gateway.upstream.response.IdleWatch` would)."""
        parts = self.plan.parts
        while self._next < len(parts):
            await self._until(self._due[self._next])
            self._last = asyncio.get_running_loop().time()
            part = parts[self._next][1]
            self._next += 1
            yield part
        if self.plan.end in ("eof", "reset"):
            raise StreamInterrupted("upstream_stream_interrupted", "The upstream connection ended mid-stream.")
        if self.plan.end == "stall":
            await self._until(float("inf"))

    async def _until(self, due: float) -> None:
        loop = asyncio.get_running_loop()
        silent_until = self._last + self._idle if self._watching else float("inf")
        if due <= silent_until:
            await asyncio.sleep(max(0.0, min(due, loop.time() + 3600) - loop.time()))
            return
        await asyncio.sleep(max(0.0, silent_until - loop.time()))
        raise StreamInterrupted("upstream_idle_timeout", "The upstream stopped sending before the end.")

    async def read(self) -> bytes:
        """Raises UpstreamUnavailable on a cut."""
        try:
            return b"".join([part async for part in self.chunks()])
        except StreamInterrupted as exc:
            raise UpstreamUnavailable(exc.message) from exc

    async def read_error(self, limit: int = ERROR_BODY_LIMIT) -> bytes:
        return (await self.read())[:limit]

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


class ScriptedTransport:
    """``record`` is off for the benchmark: it measures the gateway, not this."""

    def __init__(self, handler: Callable[[Received], Plan], record: bool = True) -> None:
        self.handler = handler
        self.record = record
        self.requests: list[Received] = []
        self.answers: list[ScriptedAnswer] = []
        self._open = False

    @property
    def ready(self) -> bool:
        return self._open

    async def start(self) -> None:
        self._open = True

    async def stop(self) -> None:
        self._open = False

    async def send(self, upstream: UpstreamConfig, body: Body, *, stream: bool, request_id: str,
                   path: str = "/chat/completions", method: str = "POST",
                   forward: Mapping[str, str] | None = None, client_key: str | None = None,
                   trace: Mapping[str, str] | None = None) -> ScriptedAnswer:
        """Up to the status line. Raises UpstreamUnavailable (a drop) or UpstreamTimeout (a status line later than
        ``idle``; not for streams with a ``ttft``, whose deadline the caller holds)."""
        if body is None:
            body = b""
        elif not isinstance(body, bytes):
            body = b"".join([part async for part in body])
        headers = {"x-client-request-id": request_id}
        if forward or client_key:  # a passthrough request, or the client's own key: what would cross
            headers = {**(forward or {}), **headers, **({"authorization": client_key} if client_key else {})}
        if trace:
            headers.update(trace)
        received = Received(method, upstream.base_url + path, headers, body, time.monotonic())
        if self.record:
            self.requests.append(received)
        plan = self.handler(received)
        if plan.drop:
            raise UpstreamUnavailable("The upstream could not be reached (ServerDisconnectedError).")
        bounded = not (stream and upstream.timeouts.ttft)
        if bounded and plan.head_delay > upstream.timeouts.idle:
            await asyncio.sleep(upstream.timeouts.idle)
            raise UpstreamTimeout("The upstream did not answer in time.")
        await asyncio.sleep(plan.head_delay)
        answer = ScriptedAnswer(plan, upstream.timeouts.idle)
        if self.record:
            self.answers.append(answer)
        return answer
