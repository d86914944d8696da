"""The streamed body's idle timeout (``gateway.upstream.response.IdleWatch``): silence from the upstream ends the stream
after between ``idle`` and ``1.25 * idle`` seconds; bytes that keep coming, or that arrived and wait to be read
(a slow client), never do; a body that ended is never failed afterwards. The same for a whole answer and for the wait
for any status line (``AnswerWatch``, in place of aiohttp's ``sock_read`` and ``total``), and a whole answer's
``total`` on time however its bytes come.

Real HTTP over loopback: the gateway's ``UpstreamPool`` (aiohttp) against the emulator playing scripted plans, reading
with ``UpstreamResponse.chunks()`` the way the relay does. The end-to-end cases (a stalled upstream gives the
client an in-band ``upstream_idle_timeout``) are in test_conformance.py and test_failover.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import StreamInterrupted, UpstreamTimeout
from gateway.tools.emulator import EmulatorThread, Plan, Received
from gateway.upstream.attempt import ERROR_BODY_LIMIT
from gateway.upstream.client import UpstreamPool
from gateway.upstream.response import UpstreamResponse

from conftest import LoopLag

IDLE = 0.3
# seconds from the idle watch's timer to the reader's exception (a few loop turns); a stall of the machine on top of it
# is measured in the test (conftest.LoopLag), so a watch that ticked every idle instead of every idle / 4 (up to
# 2 * IDLE) still fails
REACT = 0.03
PLANS: dict[str, Plan] = {
    # one event, then silence far past the idle timeout
    "silence": Plan(parts=[(0, b"data: 1\n\n"), (5.0, b"data: 2\n\n")]),
    # an event every 0.4 idle for 4 idle periods: never idle
    "trickle": Plan(parts=[(0 if i == 0 else IDLE * 0.4, b"data: %d\n\n" % i) for i in range(10)]),
    # two events at once, then silence
    "two_then_silence": Plan(parts=[(0, b"data: a\n\n"), (0.01, b"data: b\n\n"), (5.0, b"data: c\n\n")]),
    # a complete body
    "done": Plan(parts=[(0, b"data: a\n\n"), (0.01, b"data: [DONE]\n\n")]),
    # error answers to a stream request: a body that takes longer than idle but is never silent that long
    "error_trickle": Plan(status=500, headers={"content-type": "application/json"},
                          parts=[(0 if i == 0 else IDLE * 0.4, b" " * 8) for i in range(8)]
                          + [(0, b'{"error": {"message": "overloaded"}}')]),
    # ... one that stalls after its first bytes
    "error_stall": Plan(status=500, headers={"content-type": "application/json"},
                        parts=[(0, b'{"error": '), (5.0, b'{"message": "late"}}')]),
    # ... and one far larger than anyone needs for a message
    "error_huge": Plan(status=500, headers={"content-type": "application/json"},
                       parts=[(0, b"x" * 65536) for _ in range(16)]),
    # whole answers: no status line for far past the idle timeout; a body that trickles for 3 idle periods, never
    # silent for long; one that stalls after its first bytes
    "late_head": Plan(headers={"content-type": "application/json"}, head_delay=5.0, parts=[(0, b"{}")]),
    "whole_trickle": Plan(headers={"content-type": "application/json"},
                          parts=[(0 if i == 0 else IDLE * 0.4, b" " * 8) for i in range(8)] + [(0, b"{}")]),
    "whole_stall": Plan(headers={"content-type": "application/json"}, parts=[(0, b'{"id": '), (5.0, b'"x"}')]),
}


def _handler(req: Received) -> Plan:
    return PLANS[req.headers["x-client-request-id"]]


@pytest.fixture(scope="module")
def fake() -> Iterator[EmulatorThread]:
    up = EmulatorThread(_handler)
    yield up
    up.stop()


@contextlib.asynccontextmanager
async def _started(base_url: str, **timeouts: float) -> AsyncIterator[tuple[UpstreamPool, UpstreamConfig]]:
    """A pool for one upstream at ``base_url``: idle IDLE, connect 5 s and total 10 s unless ``timeouts`` say."""
    cfg = UpstreamConfig.model_validate({"name": "fake", "tier": "fast", "base_url": base_url, "api_key_env": None,
                                         "models": {"m": "m"},
                                         "timeouts": {"connect": 5, "idle": IDLE, "total": 10, **timeouts}})
    p = UpstreamPool([cfg], {})
    await p.start()
    try:
        yield p, cfg
    finally:
        await p.stop()


@pytest.fixture(params=[10.0], ids=["total10"])
async def pool(fake: EmulatorThread,
               request: pytest.FixtureRequest) -> AsyncIterator[tuple[UpstreamPool, UpstreamConfig]]:
    async with _started(fake.base_url, connect=1, total=request.param) as started:
        yield started


async def _open(pool: tuple[UpstreamPool, UpstreamConfig], plan: str) -> tuple[UpstreamResponse, AsyncIterator[bytes]]:
    p, cfg = pool
    resp = await p.send(cfg, b'{"model":"m","stream":true}', stream=True, request_id=plan)
    assert resp.status == 200
    resp.watch_idle()  # as the relay does (at once, or after the first token when a ttft deadline bounds it)
    return resp, resp.chunks()


async def _error(pool: tuple[UpstreamPool, UpstreamConfig], plan: str) -> UpstreamResponse:
    p, cfg = pool
    resp = await p.send(cfg, b'{"model":"m","stream":true}', stream=True, request_id=plan)
    assert resp.status == 500
    return resp


async def _next_event(chunks: AsyncIterator[bytes]) -> bytes:
    return await asyncio.wait_for(anext(chunks), 5)


async def test_silence_ends_the_stream_after_the_idle_timeout(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    resp, chunks = await _open(pool, "silence")
    assert await _next_event(chunks) == b"data: 1\n\n"
    async with LoopLag() as lag:
        t0 = time.monotonic()
        with pytest.raises(StreamInterrupted) as info:
            await _next_event(chunks)
        waited = time.monotonic() - t0
    resp.close()
    assert info.value.code == "upstream_idle_timeout"
    assert IDLE * 0.9 <= waited <= IDLE * 1.25 + REACT + lag.seconds, (waited, lag.seconds)


async def test_bytes_that_keep_coming_are_not_silence(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    resp, chunks = await _open(pool, "trickle")
    got = b"".join([c async for c in chunks])
    resp.release()
    assert got == b"".join(b"data: %d\n\n" % i for i in range(10))


async def test_unread_bytes_are_not_silence(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    resp, chunks = await _open(pool, "two_then_silence")
    got = await _next_event(chunks)
    await asyncio.sleep(IDLE * 3)  # the relay is busy with a slow client while the upstream is quiet
    while got != b"data: a\n\ndata: b\n\n":  # what arrived meanwhile is read, not failed
        got += await _next_event(chunks)
    with pytest.raises(StreamInterrupted) as info:  # and the silence after it is still caught
        await asyncio.wait_for(anext(chunks), IDLE * 1.25 + 1)
    resp.close()
    assert info.value.code == "upstream_idle_timeout"


async def test_a_finished_body_read_late_is_not_failed(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    resp, chunks = await _open(pool, "done")
    got = await _next_event(chunks)
    await asyncio.sleep(IDLE * 3)
    got += b"".join([c async for c in chunks])
    resp.release()
    assert got == b"data: a\n\ndata: [DONE]\n\n"


async def test_a_slow_error_body_is_read_whole(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    resp = await _error(pool, "error_trickle")  # ~3 x idle in all, never idle long: the message survives
    body = await resp.read_error()
    resp.release()
    assert body.endswith(b'{"error": {"message": "overloaded"}}')


async def test_a_stalled_error_body_ends_after_the_idle_timeout(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    resp = await _error(pool, "error_stall")
    async with LoopLag() as lag:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await asyncio.wait_for(resp.read_error(), 5)
        waited = time.monotonic() - t0
    resp.close()
    assert IDLE * 0.9 <= waited <= IDLE * 1.25 + REACT + lag.seconds, (waited, lag.seconds)


async def test_an_error_body_is_cut_at_its_limit(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    resp = await _error(pool, "error_huge")  # 1 MiB sent; 64 KiB kept
    body = await resp.read_error()
    resp.close()
    assert body == b"x" * ERROR_BODY_LIMIT


async def _whole(pool: tuple[UpstreamPool, UpstreamConfig], plan: str, stream: bool = False) -> bytes:
    p, cfg = pool
    resp = await p.send(cfg, b'{"model":"m"}', stream=stream, request_id=plan)
    try:
        return await resp.read()
    finally:
        resp.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_no_status_line_ends_the_request_after_the_idle_timeout(pool: tuple[UpstreamPool, UpstreamConfig],
                                                                      stream: bool) -> None:
    async with LoopLag() as lag:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await asyncio.wait_for(_whole(pool, "late_head", stream), 5)
        waited = time.monotonic() - t0
    assert IDLE * 0.9 <= waited <= IDLE * 1.25 + REACT + lag.seconds, (waited, lag.seconds)


async def test_a_whole_answer_that_keeps_coming_is_read_whole(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    t0 = time.monotonic()
    assert await _whole(pool, "whole_trickle") == b" " * 64 + b"{}"
    assert time.monotonic() - t0 >= IDLE * 2.5  # it did take longer than the idle timeout


async def test_a_stalled_whole_answer_ends_after_the_idle_timeout(pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    p, cfg = pool
    resp = await p.send(cfg, b'{"model":"m"}', stream=False, request_id="whole_stall")
    async with LoopLag() as lag:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await asyncio.wait_for(resp.read(), 5)
        waited = time.monotonic() - t0
    resp.close()
    assert IDLE * 0.9 <= waited <= IDLE * 1.25 + REACT + lag.seconds, (waited, lag.seconds)


TOTAL = IDLE * 2


@pytest.mark.parametrize("pool", [TOTAL], ids=["total"], indirect=True)
async def test_the_total_timeout_ends_a_whole_answer_on_time_however_its_bytes_come(
        pool: tuple[UpstreamPool, UpstreamConfig]) -> None:
    async with LoopLag() as lag:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):  # never silent for long, but 3 idle periods in all: past the total
            await asyncio.wait_for(_whole(pool, "whole_trickle"), 5)
        waited = time.monotonic() - t0
    assert TOTAL * 0.95 <= waited <= TOTAL + REACT + lag.seconds, (waited, lag.seconds)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_silence_counts_from_the_connection_not_from_its_setup(
        fake: EmulatorThread, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """A connect that takes longer than the idle timeout (``timeouts.connect`` bounds it), then a prompt answer: served,
    as under aiohttp's ``sock_read``, whose clock started with the request."""
    import aiohttp

    setup = aiohttp.TCPConnector._create_direct_connection

    async def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(IDLE * 1.5)
        return await setup(self, *args, **kwargs)

    monkeypatch.setattr(aiohttp.TCPConnector, "_create_direct_connection", slow)
    async with _started(fake.base_url) as started:
        got = await asyncio.wait_for(_whole(started, "whole_trickle" if not stream else "done", stream), 5)
    assert got.endswith(b"{}") if not stream else got == b"data: a\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True], ids=["whole-total", "stream-connect"])
async def test_a_name_lookup_that_hangs_is_bounded(fake: EmulatorThread, monkeypatch: pytest.MonkeyPatch,
                                                   stream: bool) -> None:
    """aiohttp's ``sock_connect`` does not time the name lookup: a whole answer's ``total`` does (as aiohttp's own
    total did), and ``connect`` does for any request, a stream's too."""
    import aiohttp

    async def hang(self: Any, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(30)

    monkeypatch.setattr(aiohttp.TCPConnector, "_resolve_host", hang)
    async with _started(fake.base_url.replace("127.0.0.1", "localhost"), connect=TOTAL if stream else 5,
                        total=TOTAL) as started, LoopLag() as lag:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await asyncio.wait_for(_whole(started, "done", stream), 5)
        waited = time.monotonic() - t0
    assert TOTAL * 0.95 <= waited <= TOTAL + REACT + lag.seconds, (waited, lag.seconds)
    assert asyncio.current_task().cancelling() == 0  # the watch's cancel was taken back
