"""The gateway relays each SSE event the moment it arrives: no buffering between upstream and client.

An upstream written here (asyncio, HTTP/1.1, chunked ``text/event-stream``) records ``time.monotonic()`` as
it writes each event; the client, in the same process and on the same clock, records when each event
arrives through the real gateway process. An event must reach the client before the upstream writes the
next one; a gateway that held event *i* back until more bytes came would deliver it after event *i+1* was
written, and fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from conftest import Proc, atimely, default_config, free_port, sample, start_gateway

TIMEOUT = httpx.Timeout(5.0, connect=2.0)
DONE = b"data: [DONE]\n\n"


def chunk_event(i: int) -> bytes:
    """One OpenAI-style chat chunk carrying the token ``t<i>``."""
    return (b'data: {"id":"chatcmpl-unbuf","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"t%d"},"finish_reason":null}]}\n\n' % i)


# the finish chunk every upstream ends an answer with (a stream that ends without one was cut short)
FINISH = (b'data: {"id":"chatcmpl-unbuf","object":"chat.completion.chunk","created":1,"model":"m",'
          b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')


@dataclass
class Upstream:
    """An OpenAI-compatible upstream that answers every request with ``writes``, ``interval`` s apart.

    emits[k]: ``time.monotonic()`` just before write ``k`` went to the socket.
    """

    writes: list[bytes]
    interval: float
    linger: float = 0.0  # seconds between the last write and the end of the body
    emits: list[float] = field(default_factory=list)
    hung_up: bool = False  # the gateway closed the connection while the upstream lingered
    requests: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)  # type: ignore[arg-type]
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            self.requests += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            await writer.drain()
            for payload in self.writes:
                await asyncio.sleep(self.interval)
                self.emits.append(time.monotonic())
                writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                await writer.drain()
            if self.linger:
                with contextlib.suppress(TimeoutError):  # unless the gateway hangs up first
                    self.hung_up = await asyncio.wait_for(reader.read(), self.linger) == b""
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@dataclass
class Received:
    """What the client saw: the response, each raw read with its arrival time, and each event's arrival."""

    response: httpx.Response
    reads: list[tuple[float, bytes]]
    events: list[tuple[float, int, bytes]]  # (arrival time, index of the read that completed it, event bytes)
    t_end: float  # the response body ended

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.reads)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, int]]:
    """A gateway whose two tiers both point at 127.0.0.1:<port>, where each test starts its own upstream."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    cfg = default_config(url, url, fallback=False)
    for up in cfg["upstreams"]:
        up["dialect"] = "openai"
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("unbuffered"))
    yield proc, port
    proc.stop()


@contextlib.asynccontextmanager
async def serving(upstream: Upstream, port: int) -> AsyncIterator[None]:
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", port, reuse_address=True)
    try:
        yield
    finally:
        server.close()
        if upstream.tasks:  # let the answers finish (a lingering one ends when the gateway hangs up), briefly
            _, pending = await asyncio.wait(upstream.tasks, timeout=3)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await server.wait_closed()


async def relay_through(gateway: tuple[Proc, int], upstream: Upstream) -> Received:
    """Stream one request through the gateway to ``upstream``, timing every raw read and every event."""
    proc, port = gateway
    body = {"model": "gpt-5.6", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    reads: list[tuple[float, bytes]] = []
    events: list[tuple[float, int, bytes]] = []
    buf = b""
    async with serving(upstream, port), asyncio.timeout(8), httpx.AsyncClient(timeout=TIMEOUT) as client:
        url = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
        async with client.stream("POST", url, json=body) as resp:
            async for data in resp.aiter_raw():
                now = time.monotonic()
                reads.append((now, data))
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    events.append((now, len(reads) - 1, event + b"\n\n"))
            t_end = time.monotonic()
    assert buf == b""
    assert upstream.requests == 1
    return Received(resp, reads, events, t_end)


async def test_each_event_arrives_before_the_upstream_writes_the_next(gateway: tuple[Proc, int]) -> None:
    n = 25
    sent = [chunk_event(i) for i in range(n)]
    for _attempt in range(2):  # one retry absorbs a scheduler hiccup on a loaded machine; buffering is late each time
        upstream = Upstream([*sent, FINISH], interval=0.02)
        got = await relay_through(gateway, upstream)
        assert got.response.status_code == 200
        assert got.response.headers["x-tiergate-upstream"] == "emu-standard"
        assert got.body == b"".join(sent) + FINISH + DONE  # no [DONE] from the upstream; the gateway adds one
        assert len(upstream.emits) == n + 1
        assert [e for _, _, e in got.events[:n]] == sent
        arrivals = [t for t, _, _ in got.events[:n]]
        assert all(upstream.emits[i] <= arrivals[i] for i in range(n))
        late = [(i, round((arrivals[i] - upstream.emits[i + 1]) * 1000, 2)) for i in range(n - 1)
                if not arrivals[i] < upstream.emits[i + 1]]
        # one by one: the first n reads are the n events, each alone
        batched = [i for i, (_, data) in enumerate(got.reads[:n]) if data != sent[i]]
        if not late and not batched:
            break
    assert not late, f"(event, ms after the upstream wrote the next one): {late}"
    assert not batched, f"reads that did not hold exactly one event: {batched}"
    assert len({r for _, r, _ in got.events[:n]}) == n


async def test_stream_response_is_chunked_without_content_length(gateway: tuple[Proc, int]) -> None:
    got = await relay_through(gateway, Upstream([chunk_event(0), chunk_event(1), FINISH], interval=0.005))
    headers = got.response.headers
    assert "content-length" not in headers
    assert headers["transfer-encoding"] == "chunked"
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"


async def test_events_of_one_upstream_write_reach_the_client_in_one_read(gateway: tuple[Proc, int]) -> None:
    pairs = 6
    sent = [chunk_event(2 * k) + chunk_event(2 * k + 1) for k in range(pairs)]
    upstream = Upstream([*sent, FINISH], interval=0.03)
    got = await relay_through(gateway, upstream)

    assert got.body == b"".join(sent) + FINISH + DONE
    events = got.events[: 2 * pairs]
    for k in range(pairs):
        (_, read_a, _), (t_b, read_b, _) = events[2 * k], events[2 * k + 1]
        assert read_a == read_b, f"pair {k} was split across reads"
        assert got.reads[read_a][1] == sent[k], f"pair {k} did not arrive alone in its read"
        if k + 1 < pairs:
            assert t_b < upstream.emits[k + 1]


async def test_stream_ends_at_done_while_the_upstream_lingers(gateway: tuple[Proc, int]) -> None:
    # docs/reference/wire.md#errors-inside-a-stream: the gateway must end the body right after [DONE] (openai v1.x
    # drains the body to its end; curl and hand-written clients wait for it), even when the upstream keeps the
    # response open
    proc, _ = gateway
    sent = [chunk_event(0), chunk_event(1), DONE]

    async def attempt() -> tuple[float, float]:
        async with httpx.AsyncClient(timeout=5) as client:
            before = (await client.get(f"http://127.0.0.1:{proc.port}/metrics")).text
            upstream = Upstream(sent, interval=0.01, linger=1.5)
            got = await relay_through(gateway, upstream)
            assert got.body == b"".join(sent)
            t_done = got.events[-1][0]
            assert got.t_end < upstream.emits[-1] + upstream.linger  # not the upstream's end of body passed on
            # and it let go of the lingering upstream instead of holding the connection until the upstream ends
            assert upstream.hung_up
            after = (await client.get(f"http://127.0.0.1:{proc.port}/metrics")).text
        name = "tiergate_requests_total"
        assert sample(after, name, outcome="success") - sample(before, name, outcome="success") == 1
        assert sample(after, name) - sample(before, name) == 1
        # right after [DONE], well inside the linger (a stall of the machine spoils one try, not three)
        return got.t_end - t_done, upstream.linger / 3
    await atimely(attempt)


def test_a_chunk_written_straight_to_the_connection_is_framed_as_uvicorns_and_yields_to_its_path_when_it_must() -> None:
    """``gateway.http.server.ChunkedBody``: RFC 9112 §7.1 framing; a paused client, an unchunked, complete or gone
    response, or an empty piece goes through ASGI ``send`` (which waits for a paused client to drain)."""
    from types import SimpleNamespace

    from gateway.http.server import ChunkedBody

    written: list[bytes] = []
    flow = SimpleNamespace(write_paused=False)
    cycle = SimpleNamespace(chunked_encoding=True, response_complete=False, disconnected=False, flow=flow,
                            transport=SimpleNamespace(write=written.append))
    body = ChunkedBody()
    assert not body.write(b"data: x\n\n")  # no cycle yet
    body.cycle = cycle
    assert body.write(b"data: x\n\n") and written == [b"9\r\ndata: x\n\n\r\n"]
    for name, value in (("write_paused", True),):
        setattr(flow, name, value)
        assert not body.write(b"y")
        setattr(flow, name, False)
    for name, value in (("chunked_encoding", None), ("chunked_encoding", False), ("response_complete", True),
                        ("disconnected", True)):
        old = getattr(cycle, name)
        setattr(cycle, name, value)
        assert not body.write(b"y"), name
        setattr(cycle, name, old)
    assert not body.write(b"")
    assert written == [b"9\r\ndata: x\n\n\r\n"]
