"""The load generator: an aiohttp client (run on uvloop) that records TTFT and every chunk's delay.

A streamed chunk's delay is its arrival time (``time.monotonic_ns()`` right after the read that completed
it returned) minus the send time the bench upstream stamped into its ``delta.content`` (``"t=<ns>"``). Both
clocks are the same CLOCK_MONOTONIC of one machine, so the difference needs no synchronisation. TTFT is
request start (just before ``session.post``) to the arrival of the first content chunk.

Every request has a hard timeout; every phase runner also takes a hard deadline. Failures are counted by
kind in :class:`Tally` and never stop a phase.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

STAMP = re.compile(rb'"content":"t=(\d+)"')
DONE = b"data: [DONE]"
# every target gets the bench's gateway key (``bench.run --variants keys``): only a keyed gateway reads it, so all
# targets parse the same request head
BENCH_KEY = "tg-bench-key-0123456789"
HEADERS = {"content-type": "application/json", "accept": "text/event-stream", "authorization": f"Bearer {BENCH_KEY}"}
JSON_HEADERS = {"content-type": "application/json", "accept": "application/json",
                "authorization": f"Bearer {BENCH_KEY}"}
_now = time.monotonic_ns


class Tally:
    """Raw figures of one phase against one target."""

    def __init__(self, *, keep_delays: bool = True) -> None:
        self.keep_delays = keep_delays
        self.ttft_ns: list[int] = []
        self.delays_ns: list[int] = []
        self.latency_ns: list[int] = []
        self.chunks = 0
        self.requests = 0
        self.ok = 0
        self.errors: Counter[str] = Counter()
        self.window: tuple[int, int] | None = None  # (lo, hi) ns: count chunks arriving inside it
        self.window_chunks = 0

    def error(self, kind: str) -> None:
        self.errors[kind] += 1

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def session(conns: int = 0) -> aiohttp.ClientSession:
    """One client session (keep-alive pool without a connection limit).

    Idle connections are dropped after 3 s, before uvicorn's 5 s keep-alive timeout closes them from the
    server side (reusing a connection the server is closing at that moment fails with a reset).
    """
    connector = aiohttp.TCPConnector(limit=conns, limit_per_host=0, keepalive_timeout=3, enable_cleanup_closed=False,
                                     ttl_dns_cache=None)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))


def chat_body(*, stream: bool, tokens: int = 1, tps: float = 750.0) -> bytes:
    """The request body; ``max_tokens`` and ``bench_tps`` steer the bench upstream (forwarded untouched)."""
    body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": "benchmark"}]}
    if stream:
        body.update(stream=True, max_tokens=tokens, bench_tps=tps)
    else:
        body["max_tokens"] = 1
    return orjson.dumps(body)


def _err_name(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout"
    return type(exc).__name__


async def one_stream(sess: aiohttp.ClientSession, url: str, tokens: int, tps: float, tally: Tally, *,
                     timeout: float, on_first: Callable[[], None] | None = None) -> None:
    """One streamed chat completion; records TTFT, chunk delays and errors into ``tally``.

    A stream is an error unless it answers 200 with exactly ``tokens`` content chunks and ``[DONE]``.
    Cancellation (the harness closing held streams) propagates and is not an error.
    """
    body = chat_body(stream=True, tokens=tokens, tps=tps)
    tally.requests += 1
    delays = tally.delays_ns
    keep = tally.keep_delays
    window = tally.window
    got = 0
    done = False
    first = True
    t0 = _now()
    try:
        async with sess.post(url, data=body, headers=HEADERS, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                await resp.read()
                tally.error(f"http_{resp.status}")
                return
            read = resp.content.readany
            tail = b""
            while True:
                data = await read()
                if not data:
                    break
                now = _now()
                buf = tail + data if tail else data
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    tail = buf
                    continue
                tail = buf[cut + 2:]
                stamps = STAMP.findall(buf, 0, cut)
                if stamps:
                    if first:
                        first = False
                        tally.ttft_ns.append(now - t0)
                        if on_first is not None:
                            on_first()
                    got += len(stamps)
                    if keep:
                        delays.extend([now - int(s) for s in stamps])
                    if window is not None and window[0] <= now <= window[1]:
                        tally.window_chunks += len(stamps)
                if not done and DONE in buf:
                    done = True
    except asyncio.CancelledError:
        tally.chunks += got
        raise
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        tally.chunks += got
        tally.error(_err_name(exc))
        return
    tally.chunks += got
    if got != tokens:
        tally.error("wrong_chunk_count")
    elif not done:
        tally.error("no_done")
    else:
        tally.ok += 1


async def one_request(sess: aiohttp.ClientSession, url: str, body: bytes, tally: Tally, *, timeout: float) -> None:
    """One non-streaming chat completion; records its latency and errors."""
    tally.requests += 1
    t0 = _now()
    try:
        async with sess.post(url, data=body, headers=JSON_HEADERS,
                             timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            data = await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        tally.error(_err_name(exc))
        return
    if status != 200:
        tally.error(f"http_{status}")
    elif b'"chat.completion"' not in data:
        tally.error("bad_body")
    else:
        tally.latency_ns.append(_now() - t0)
        tally.ok += 1


def stream_timeout(tokens: int, tps: float) -> float:
    """A generous hard per-stream timeout: 20x the nominal stream time plus 30 s."""
    return 30.0 + 20.0 * tokens / tps


async def _bounded(coro: Any, hard: float, tally: Tally) -> None:
    try:
        async with asyncio.timeout(hard):
            await coro
    except TimeoutError:
        tally.error("phase_timeout")


async def warmup(sess: aiohttp.ClientSession, url: str, *, streams: int, requests: int = 20) -> Tally:
    """Open ``streams`` short concurrent streams (warm connections) and send ``requests`` non-streaming ones."""
    tally = Tally(keep_delays=False)

    async def go() -> None:
        await asyncio.gather(*(one_stream(sess, url, 5, 5000.0, tally, timeout=30.0) for _ in range(streams)))
        body = chat_body(stream=False)
        for _ in range(requests):
            await one_request(sess, url, body, tally, timeout=10.0)

    await _bounded(go(), 60.0, tally)
    return tally


async def closed_loop_streams(sess: aiohttp.ClientSession, url: str, *, conc: int, tokens: int, tps: float,
                              duration: float, max_requests: int, stagger: float, keep_delays: bool = True,
                              hard: float | None = None) -> tuple[Tally, float]:
    """``conc`` workers each run streams back to back until ``duration`` seconds or ``max_requests`` in total.

    Each worker first sleeps a random part of ``stagger`` seconds so the streams' chunk schedules do not
    line up. Chunks arriving after the stagger and before the deadline count in ``window_chunks``.
    Returns the tally and the window length in seconds.
    """
    tally = Tally(keep_delays=keep_delays)
    start = _now()
    deadline = start + int(duration * 1e9)
    lo = start + int(min(stagger, duration / 2) * 1e9)
    tally.window = (lo, deadline)
    budget = [max_requests]
    per_timeout = stream_timeout(tokens, tps)
    rng = random.Random(conc)

    async def worker() -> None:
        if stagger > 0:
            await asyncio.sleep(rng.uniform(0, stagger))
        while _now() < deadline and budget[0] > 0:
            budget[0] -= 1
            await one_stream(sess, url, tokens, tps, tally, timeout=per_timeout)

    await _bounded(asyncio.gather(*(worker() for _ in range(conc))), hard or duration + per_timeout + 10, tally)
    return tally, (deadline - lo) / 1e9


async def closed_loop_requests(sess: aiohttp.ClientSession, url: str, *, conc: int, duration: float,
                               max_requests: int) -> tuple[Tally, float]:
    """``conc`` workers send non-streaming requests back to back for ``duration`` seconds (or ``max_requests``).

    Returns the tally and the elapsed seconds (until the last in-flight request finished).
    """
    tally = Tally(keep_delays=False)
    body = chat_body(stream=False)
    start = _now()
    deadline = start + int(duration * 1e9)
    budget = [max_requests]

    async def worker() -> None:
        while _now() < deadline and budget[0] > 0:
            budget[0] -= 1
            await one_request(sess, url, body, tally, timeout=10.0)

    await _bounded(asyncio.gather(*(worker() for _ in range(conc))), duration + 20.0, tally)
    return tally, (_now() - start) / 1e9


class HeldStreams:
    """Slow streams held open (for the RSS phase); :meth:`grow` opens more, :meth:`close` cancels them all."""

    def __init__(self, sess: aiohttp.ClientSession, url: str, *, tps: float, tokens: int) -> None:
        self.sess = sess
        self.url = url
        self.tps = tps
        self.tokens = tokens
        self.tally = Tally(keep_delays=False)
        self.tasks: list[asyncio.Task[None]] = []
        self.started = 0

    def _first(self) -> None:
        self.started += 1

    async def grow(self, total: int, *, batch: int = 64, timeout: float = 60.0) -> bool:
        """Open streams until ``total`` are open and have each received a first chunk; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.tasks) < total:
            n = min(batch, total - len(self.tasks))
            for _ in range(n):
                self.tasks.append(loop.create_task(one_stream(self.sess, self.url, self.tokens, self.tps, self.tally,
                                                              timeout=timeout + self.tokens / self.tps,
                                                              on_first=self._first)))
            while self.started < len(self.tasks):
                if loop.time() > deadline or all(t.done() for t in self.tasks[-n:]):
                    break
                await asyncio.sleep(0.01)
            if loop.time() > deadline:
                self.tally.error("open_timeout")
                return False
        return self.started >= total

    @property
    def open(self) -> int:
        return sum(1 for t in self.tasks if not t.done())

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
