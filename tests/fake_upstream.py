"""A scripted fake upstream on a loopback port, in a background thread, for conformance and fault tests.

Each request is answered by a :class:`Plan`: status, headers, and body parts written one write each after a
delay; then the response ends cleanly (chunked terminator), the connection is reset, or it stalls. Every
request received (method, path, headers, body) is recorded with its arrival time.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools


@dataclass
class Plan:
    """How to answer one request.

    head_delay: seconds before the status line; parts: (delay in seconds before the write, bytes);
    end: ``ok`` (chunked terminator), ``eof`` (close without terminator), ``reset`` (TCP RST) or ``stall``
    (keep silent); chunked: use chunked transfer encoding (else Content-Length over the joined parts);
    drop: close the connection at once without answering (what a server does to a keep-alive connection it
    timed out just as a request arrived).
    """

    status: int = 200
    headers: dict[str, str] = field(
        default_factory=lambda: {"content-type": "text/event-stream; charset=utf-8"})
    parts: list[tuple[float, bytes]] = field(default_factory=list)
    end: str = "ok"
    chunked: bool = True
    head_delay: float = 0.0
    drop: bool = False


@dataclass
class Received:
    """One request as the fake upstream saw it; ``connection``: which connection (1, 2, ... in the order opened)
    it came on."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    connection: int = 0


class FakeUpstream:
    """Start with ``FakeUpstream(handler)``; ``handler(received) -> Plan``; ``stop()`` when done."""

    def __init__(self, handler: Callable[[Received], Plan]) -> None:
        self.handler = handler
        self.requests: list[Received] = []
        self.opened = 0
        self.closed_at: list[float] = []
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("fake upstream did not start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(self.loop.create_server(lambda: _Proto(self), "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(server.wait_closed())
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class _Proto(asyncio.Protocol):
    def __init__(self, owner: FakeUpstream) -> None:
        self.owner = owner
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.owner.opened += 1
        self.number = self.owner.opened

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.closed_at.append(time.monotonic())
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        req = Received(self.parser.get_method().decode(), self._url.decode(), self._headers, b"".join(self._body),
                       time.monotonic(), self.number)
        self._url, self._headers, self._body = b"", {}, []
        self.owner.requests.append(req)
        self.task = asyncio.get_running_loop().create_task(self._answer(self.owner.handler(req)))

    async def _answer(self, plan: Plan) -> None:
        if plan.drop:
            if self.transport is not None:
                self.transport.close()
            return
        if plan.head_delay:
            await asyncio.sleep(plan.head_delay)
        head = [f"HTTP/1.1 {plan.status} X"] + [f"{k}: {v}" for k, v in plan.headers.items()]
        if plan.chunked:
            head.append("transfer-encoding: chunked")
        else:
            head.append(f"content-length: {sum(len(p) for _, p in plan.parts)}")
        self._write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        for delay, part in plan.parts:
            if delay:
                await asyncio.sleep(delay)
            self._write(b"%x\r\n%s\r\n" % (len(part), part) if plan.chunked else part)
        if plan.end == "ok":
            if plan.chunked:
                self._write(b"0\r\n\r\n")
        elif plan.end == "eof" and self.transport is not None:
            self.transport.close()
        elif plan.end == "reset" and self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
        elif plan.end == "stall":
            await asyncio.sleep(3600)

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


def sse(*chunks: bytes | str, done: bool = True) -> bytes:
    """``data: <chunk>\\n\\n`` for each chunk, plus ``data: [DONE]\\n\\n``."""
    out = b"".join(b"data: " + (c.encode() if isinstance(c, str) else c) + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chunk(content: str | None = None, *, role: bool = False, finish: str | None = None, usage: bool = False) -> str:
    """A compact OpenAI chat-completions chunk as JSON text."""
    import orjson

    if usage:
        return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}).decode()
    delta: dict[str, object] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).decode()
