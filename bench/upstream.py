"""A lean loopback upstream for the benchmark: OpenAI-dialect chat completions, timestamped chunks.

``python -m bench.upstream [--host 127.0.0.1] [--port 0]`` prints ``READY <port>`` once it listens.

It is a bare asyncio protocol over httptools' C parser (run on uvloop) with one loop timer per open
stream, so that it costs a few microseconds per chunk and stays out of the way of what is measured.

``POST /v1/chat/completions`` (body parsed with orjson; ``max_completion_tokens`` counts as ``max_tokens``):

* ``stream: true``: ``max_tokens`` content chunks (default 16) at ``bench_tps`` chunks per second (default
  750; a top-level field the gateway forwards untouched), the first one at once. Each chunk is a valid
  OpenAI ``chat.completion.chunk`` whose ``delta.content`` is ``"t=<time.monotonic_ns() at send>"``, so the
  client computes each chunk's delay as arrival minus stamp on the same clock. Chunks that fall due
  together (timer granularity is ~1 ms) go out in one write, each with its own stamp. Then a finish
  chunk, a ``"choices": []`` usage chunk when ``stream_options.include_usage`` is true, and
  ``data: [DONE]``. The first chunk also carries ``"role": "assistant"``.
* otherwise: a small ``chat.completion`` JSON body at once.

For ``bench.passthrough``: ``POST /v1/embeddings`` answers one base64 embedding of ``dimensions`` floats (default
1536) with usage; ``POST /v1/audio/speech`` answers ``bench_bytes`` binary bytes (default 1 MiB) in 64 KiB writes,
chunked; ``POST /v1/files`` reads its body (any content type) and answers its size as JSON.

``GET /healthz`` answers 200. The connection is HTTP/1.1 keep-alive, one request at a time.

``--ratelimit-headers``: every chat completion answer carries OpenAI's ``x-ratelimit-*`` headers (a budget that never
runs out), as OpenAI's own answers do, so that the gateway's quota bookkeeping (with ``state.redis_url``, its Redis
round trips) is measured too (``bench.run --redis``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import resource
import signal
import struct
import sys
import time

import httptools
import orjson

_now_ns = time.monotonic_ns
_HEAD_STREAM = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"transfer-encoding: chunked\r\nx-request-id: bench\r\n\r\n"]
_EXTRA = [b""]  # headers every answer adds (--ratelimit-headers)
_CREATED = int(time.time())
_RATELIMIT = (b"x-ratelimit-limit-requests: 100000000\r\nx-ratelimit-remaining-requests: 99999999\r\n"
              b"x-ratelimit-reset-requests: 1ms\r\nx-ratelimit-limit-tokens: 100000000000\r\n"
              b"x-ratelimit-remaining-tokens: 99999999999\r\nx-ratelimit-reset-tokens: 6m0s\r\n")


def _chunk(model: bytes, delta: bytes, finish: bytes = b"null") -> bytes:
    return (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":%d,"model":"%s",'
            b'"choices":[{"index":0,"delta":{%s},"finish_reason":%s}]}\n\n' % (_CREATED, model, delta, finish))


class _Stream:
    """One streaming answer: ``n`` stamped content chunks on an absolute schedule ``t0 + i / tps``."""

    __slots__ = ("proto", "n", "i", "tps", "t0", "prefix", "suffix", "first_prefix", "tail", "handle")

    def __init__(self, proto: UpstreamProtocol, model: bytes, n: int, tps: float, usage: bool) -> None:
        self.proto = proto
        self.n = n
        self.i = 0
        self.tps = tps
        self.t0 = proto.loop.time()
        first, _, rest = _chunk(model, b'"role":"assistant","content":"t=\x00"').partition(b"\x00")
        self.first_prefix = first
        self.prefix, _, self.suffix = _chunk(model, b'"content":"t=\x00"').partition(b"\x00")
        assert rest == self.suffix
        tail = _chunk(model, b"", b'"stop"')
        if usage:
            tail += (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":%d,"model":"%s",'
                     b'"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}}\n\n'
                     % (_CREATED, model, n, n + 8))
        self.tail = tail + b"data: [DONE]\n\n"
        self.handle: asyncio.TimerHandle | None = None

    def tick(self) -> None:
        self.handle = None
        proto = self.proto
        transport = proto.transport
        if transport is None:
            return
        now = proto.loop.time() + 0.0005
        parts = []
        i, n = self.i, self.n
        while i < n and self.t0 + i / self.tps <= now:
            stamp = b"%d" % _now_ns()
            parts.append((self.first_prefix if i == 0 else self.prefix) + stamp + self.suffix)
            i += 1
        self.i = i
        if i >= n:
            parts.append(self.tail)
        payload = b"".join(parts)
        out = b"%x\r\n%s\r\n" % (len(payload), payload)
        if i >= n:
            transport.write(out + b"0\r\n\r\n")
            proto.stream = None
        else:
            transport.write(out)
            self.handle = proto.loop.call_at(self.t0 + i / self.tps, self.tick)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class UpstreamProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.stream: _Stream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._reply(400, b'{"error":{"message":"bad request","type":"invalid_request_error"}}')
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        raw, self.body = b"".join(self.body), []
        method = self.parser.get_method()
        if method == b"GET" and url.startswith(b"/healthz"):
            self._reply(200, b'{"status":"ok"}')
            return
        if method != b"POST" or not url.split(b"?", 1)[0].endswith(b"/chat/completions"):
            path = url.split(b"?", 1)[0]  # checked after chat completions: the instrument's chat path is unchanged
            if method == b"POST" and path.endswith((b"/embeddings", b"/audio/speech", b"/files")):
                self._surface(path, raw)
                return
            self._reply(404, b'{"error":{"message":"Unknown request URL","type":"invalid_request_error",'
                             b'"param":null,"code":"unknown_url"}}')
            return
        try:
            body = orjson.loads(raw)
            model = str(body.get("model", "bench")).encode()
            tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            tps = float(body.get("bench_tps") or 750.0)
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            self._reply(400, b'{"error":{"message":"bad body","type":"invalid_request_error"}}')
            return
        if body.get("stream") is True:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            if self.transport is None:
                return
            self.transport.write(_HEAD_STREAM[0])
            self.stream = _Stream(self, model, max(1, tokens), max(tps, 0.001), usage)
            self.stream.tick()
            return
        self._reply(200, orjson.dumps({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": _CREATED, "model": model.decode(),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok", "refusal": None},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
        }))

    def _surface(self, path: bytes, raw: bytes) -> None:
        """The passthrough endpoints of the module docstring."""
        if path.endswith(b"/files"):
            self._reply(200, b'{"object":"file","bytes":%d}' % len(raw))
            return
        body = orjson.loads(raw)
        if path.endswith(b"/embeddings"):
            dims = int(body.get("dimensions") or 1536)
            vec = base64.b64encode(struct.pack(f"<{dims}f", *([0.01] * dims)))
            self._reply(200, b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":"%s"}],'
                             b'"model":"bench","usage":{"prompt_tokens":8,"total_tokens":8}}' % vec)
            return
        size = int(body.get("bench_bytes") or 1 << 20)
        if self.transport is None:
            return
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: audio/mpeg\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"\xff" * 65536
        for at in range(0, size, 65536):
            part = piece[:min(65536, size - at)]
            self.transport.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.transport.write(b"0\r\n\r\n")

    def _reply(self, status: int, body: bytes) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"x-request-id: bench\r\n%s\r\n%s" % (status, b"OK" if status == 200 else b"Error",
                                                                      len(body), _EXTRA[0], body))


async def _serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(UpstreamProtocol, host, port, reuse_address=True, backlog=4096)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.upstream", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as READY <port>)")
    p.add_argument("--ratelimit-headers", action="store_true", help="OpenAI's x-ratelimit-* headers on every answer")
    args = p.parse_args(argv)
    if args.ratelimit_headers:
        _EXTRA[0] = _RATELIMIT
        _HEAD_STREAM[0] = _HEAD_STREAM[0][:-2] + _RATELIMIT + b"\r\n"
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        p.error("the bench upstream listens on loopback only")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    uvloop.run(_serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
