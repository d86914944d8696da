"""WebSocket mode toward the upstreams of one client socket: a streamed Responses request to a ``websocket: true``
upstream goes as a ``response.create`` frame over one upstream socket, one response at a time; anything else, and all
toward an upstream that refused the upgrade (:data:`NO_SOCKETS`), over HTTP. Events and close codes: OpenAI API
reference, "Responses WebSocket events"."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, runtime_checkable

import aiohttp
import orjson

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import StreamInterrupted, UpstreamTimeout, UpstreamUnavailable
from gateway.observability import logs
from gateway.upstream.attempt import Answer, Body, Transport

TERMINAL = frozenset({b"response.completed", b"response.incomplete", b"response.failed", b"error"})
NO_SOCKETS = frozenset({400, 404, 405, 426})  # a handshake refused so: the upstream has no WebSocket mode
CLOSE_WAIT = 2.0  # seconds an abandoned upstream socket is given to close


@runtime_checkable
class Opener(Protocol):
    """What opens an upstream socket (:meth:`gateway.upstream.client.UpstreamPool.open_socket`)."""

    async def open_socket(self, upstream: UpstreamConfig, *, request_id: str, client_key: str | None = None,
                          trace: Mapping[str, str] | None = None,
                          max_msg_size: int = ...) -> aiohttp.ClientWebSocketResponse[bool]: ...


def event_type(data: bytes) -> bytes | None:
    """Read from the bytes when the event begins with its ``type`` (OpenAI's and the gateway's do): most are not
    parsed."""
    if data.startswith(b'{"type":"'):
        end = data.find(b'"', 9)
        return data[9:end] if end > 0 else None
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    kind = parsed.get("type") if isinstance(parsed, dict) else None
    return kind.encode() if isinstance(kind, str) else None


class _Socket:
    __slots__ = ("ws", "lock")

    def __init__(self, ws: aiohttp.ClientWebSocketResponse[bool]) -> None:
        self.ws = ws
        self.lock = asyncio.Lock()


class UpstreamSockets:
    """``max_event_bytes``: the largest upstream frame taken (``limits.max_event_bytes``)."""

    def __init__(self, pool: Transport, max_event_bytes: int) -> None:
        self.pool = pool
        self.max_event_bytes = max_event_bytes
        self._sockets: dict[str, _Socket] = {}
        self._http: set[str] = set()  # upstreams that refused the upgrade: HTTP for this client socket
        self._closing: set[asyncio.Task[Any]] = set()

    @property
    def ready(self) -> bool:
        return self.pool.ready

    async def start(self) -> None:
        """Nothing to start: the pool is the gateway's."""

    async def stop(self) -> None:
        sockets, self._sockets = list(self._sockets.values()), {}
        for sock in sockets:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_WAIT):
                    await sock.ws.close()
        for task in list(self._closing):
            with contextlib.suppress(BaseException):
                await task

    async def send(self, upstream: UpstreamConfig, body: Body, *, stream: bool, request_id: str,
                   path: str = "/chat/completions", method: str = "POST",
                   forward: Mapping[str, str] | None = None, client_key: str | None = None,
                   trace: Mapping[str, str] | None = None) -> Answer:
        """Raises UpstreamUnavailable or UpstreamTimeout: the socket could not be opened or the frame sent."""
        opener = self.pool if isinstance(self.pool, Opener) else None
        if (opener is None or not upstream.websocket or not stream or path != "/responses" or forward is not None
                or upstream.name in self._http or not isinstance(body, bytes)):
            return await self.pool.send(upstream, body, stream=stream, request_id=request_id, path=path,
                                        method=method, forward=forward, client_key=client_key, trace=trace)
        frame = orjson.dumps({"type": "response.create",
                              **{k: v for k, v in orjson.loads(body).items() if k != "stream"}}).decode()
        for _ in range(2):  # a socket the upstream closed while it sat idle is opened again, once
            sock = self._sockets.get(upstream.name)
            reused = sock is not None and not sock.ws.closed
            if sock is None or not reused:
                try:
                    sock = await self._open(opener, upstream, request_id, client_key, trace)
                except aiohttp.WSServerHandshakeError as exc:
                    if exc.status not in NO_SOCKETS:
                        return SocketAnswer.refused(exc.status, "The upstream refused the WebSocket handshake.")
                    self._http.add(upstream.name)
                    logs.event("upstream_websocket_refused", "warning", upstream=upstream.name, status=exc.status)
                    return await self.pool.send(upstream, body, stream=stream, request_id=request_id, path=path,
                                                client_key=client_key, trace=trace)
            assert sock is not None
            await sock.lock.acquire()  # released by the answer's end (SocketAnswer.release / close)
            answer = SocketAnswer(self, upstream.name, sock, upstream.timeouts.idle)
            try:
                if sock.ws.closed:  # closed while this message waited for the one before it
                    raise UpstreamUnavailable("The upstream socket closed.")
                try:
                    await sock.ws.send_str(frame)
                except (aiohttp.ClientError, OSError, RuntimeError) as exc:
                    raise UpstreamUnavailable(f"The upstream socket failed ({type(exc).__name__}).") from exc
                await answer.begin()
                return answer
            except UpstreamUnavailable:
                answer.close()
                if not reused:
                    raise
            except BaseException:
                answer.close()
                raise
        raise UpstreamUnavailable("The upstream socket closed.")  # pragma: no cover - the loop returns or raises

    async def _open(self, opener: Opener, upstream: UpstreamConfig, request_id: str, client_key: str | None,
                    trace: Mapping[str, str] | None) -> _Socket:
        try:
            ws = await opener.open_socket(upstream, request_id=request_id, client_key=client_key, trace=trace,
                                          max_msg_size=self.max_event_bytes)
        except aiohttp.WSServerHandshakeError:
            raise
        except TimeoutError as exc:
            raise UpstreamTimeout("The upstream did not accept the WebSocket connection in time.") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnavailable(f"The upstream's WebSocket could not be opened ({type(exc).__name__}).") from exc
        sock = self._sockets[upstream.name] = _Socket(ws)
        return sock

    def abandon(self, name: str, sock: _Socket) -> None:
        """Abandoned before its terminal event: closing its socket is the only way to stop that response."""
        if self._sockets.get(name) is sock:
            del self._sockets[name]
        if not sock.ws.closed:
            task = asyncio.get_running_loop().create_task(_close(sock.ws))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


async def _close(ws: aiohttp.ClientWebSocketResponse[bool]) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_WAIT):
            await ws.close()


class SocketAnswer:
    """One response over an upstream socket, read as a streamed HTTP answer so that the relay and the attempt treat it
    as any stream: status 200, or a first ``error`` event's ``status`` with its error as the body; then each frame as
    one ``data:`` event, until the terminal one."""

    __slots__ = ("_owner", "_name", "_sock", "_idle", "_watch", "_first", "_error", "done", "status", "headers",
                 "content_type", "stale_retried")

    def __init__(self, owner: UpstreamSockets | None, name: str, sock: _Socket | None, idle: float) -> None:
        self._owner = owner
        self._name = name
        self._sock = sock
        self._idle = idle
        self._watch = False
        self._first: bytes | None = None
        self._error = b""
        self.done = False
        self.status = 200
        self.headers: dict[str, str] = {}
        self.content_type = "text/event-stream"
        self.stale_retried = False

    @classmethod
    def refused(cls, status: int, message: str) -> SocketAnswer:
        """A handshake refused with 401, 403, 429 or 5xx: judged as that status."""
        answer = cls(None, "", None, 0.0)
        answer.status, answer.done, answer.content_type = status, True, "application/json"
        answer._error = orjson.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                                "code": None}})
        return answer

    async def begin(self) -> None:
        """Raises UpstreamUnavailable or UpstreamTimeout: closed, or silent for the idle timeout, before a frame."""
        try:
            data = await self._next(self._idle)  # bounded by the attempt's first-token deadline too
        except StreamInterrupted as exc:
            kind = UpstreamTimeout if exc.code == "upstream_idle_timeout" else UpstreamUnavailable
            raise kind(exc.message) from exc
        if event_type(data) == b"error":
            event = orjson.loads(data)
            err = event.get("error") if isinstance(event.get("error"), dict) else {}
            status = event.get("status")
            self.status = status if isinstance(status, int) and 400 <= status < 600 else 500
            given = err.get("headers")
            self.headers = {k.lower(): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
            self._error = orjson.dumps({"error": {k: v for k, v in err.items() if k != "headers"}})
            self.content_type = "application/json"
            self.done = True
            return
        self._first = data

    async def _next(self, timeout: float | None) -> bytes:
        assert self._sock is not None
        try:
            msg = await self._sock.ws.receive(timeout)
        except TimeoutError as exc:
            raise StreamInterrupted("upstream_idle_timeout", "The upstream socket sent nothing in time.") from exc
        if msg.type is aiohttp.WSMsgType.TEXT:
            return msg.data.encode() if isinstance(msg.data, str) else bytes(msg.data)
        if msg.type is aiohttp.WSMsgType.BINARY:
            return bytes(msg.data)
        raise StreamInterrupted("upstream_stream_interrupted",
                                f"The upstream socket closed mid-response ({msg.type.name}, {msg.data}).")

    async def chunks(self) -> AsyncIterator[bytes]:
        """Raises StreamInterrupted: closed, or silent for the idle timeout once :meth:`watch_idle` was called."""
        while not self.done:
            first, self._first = self._first, None
            data = first if first is not None else await self._next(self._idle if self._watch else None)
            if event_type(data) in TERMINAL:
                self.done = True
            yield b"data: " + data + b"\n\n"

    def entity_headers(self) -> list[tuple[bytes, bytes]]:
        return []

    def watch_idle(self) -> None:
        self._watch = True

    async def read(self) -> bytes:
        return self._error

    async def read_error(self, limit: int = 64 * 1024) -> bytes:
        return self._error[:limit]

    def release(self) -> None:
        self._free()

    def close(self) -> None:
        if not self.done and self._owner is not None and self._sock is not None:
            self._owner.abandon(self._name, self._sock)
        self._free()

    def _free(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None and sock.lock.locked():
            sock.lock.release()
