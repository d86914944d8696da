"""The gateway's own time, measured live (docs/metrics.md#gateway-added-time), over real sockets: a stream is
observed once to its first byte and at one read in 16 from the read to its write done, by tier; the event loop's lag
is probed 40 times a second while requests are in flight, four times a second when idle."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.observability import looplag
from gateway.observability.looplag import IDLE_INTERVAL, INTERVAL
from gateway.stream.relay import SAMPLE_EVERY

from conftest import Stack, sample, scraped, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("added"))
    yield s
    s.stop()


def _stream(base: str, model: str, tokens: int) -> tuple[int, float]:
    """The reads the client saw (each a chunk the gateway wrote), and the seconds from the first to the last."""
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{base}/chat/completions", json={
            "model": model, "stream": True, "max_completion_tokens": tokens,
            "messages": [{"role": "user", "content": f"[[emulate tokens={tokens} tps=400]]"}]}) as resp:
        assert resp.status_code == 200
        times = [time.perf_counter() for _ in resp.iter_raw()]
        return len(times), times[-1] - times[0]


def test_a_stream_is_timed_to_its_first_byte_and_at_sampled_reads(stack: Stack, tmp_path: Path) -> None:
    before = scraped(stack.gateway.port)
    reads, took = _stream(stack.base_url, "gpt-5.6-sol-fast", 96)
    assert reads >= 2 * SAMPLE_EVERY  # 400 tokens/s: about one read per token
    after = scraped(stack.gateway.port)

    def count(phase: str, text: str) -> float:
        return sample(text, "tiergate_gateway_added_seconds_count", tier="fast", phase=phase)
    assert count("first_byte", after) - count("first_byte", before) == 1
    sampled = count("chunk", after) - count("chunk", before)
    assert reads // SAMPLE_EVERY - 2 <= sampled <= reads // SAMPLE_EVERY + 1, (reads, sampled)
    # what the gateway itself takes per read is well below the gap between reads the client saw, in the same run
    total = sample(after, "tiergate_gateway_added_seconds_sum", tier="fast", phase="chunk") - sample(
        before, "tiergate_gateway_added_seconds_sum", tier="fast", phase="chunk")
    assert 0 < total / sampled < 0.5 * took / (reads - 1)


def test_the_loop_lag_is_probed_while_requests_are_in_flight_and_rarely_when_idle(stack: Stack) -> None:
    """About 40 probes a second while a stream is in flight; an idle gateway is probed four times a second, so that
    the probe does not keep waking it (a loaded machine may stretch the intervals, hence the floor's slack)."""
    def count() -> float:
        return sample(scraped(stack.gateway.port), "tiergate_event_loop_lag_seconds_count", missing_ok=False)
    time.sleep(1.2)  # whatever the last test left in flight has ended, and the probe is on its idle interval
    first, t0 = count(), time.monotonic()
    time.sleep(2.0)
    idle = count() - first
    assert idle <= (time.monotonic() - t0) / IDLE_INTERVAL + 2, idle
    done: list[int] = []
    streaming = threading.Thread(target=lambda: done.append(_stream(stack.base_url, "gpt-5.6-sol-fast", 600)[0]))
    first = count()
    streaming.start()
    t0 = time.monotonic()
    streaming.join(timeout=30)  # 600 tokens at 400/s: ~1.5 s in flight
    busy = count() - first
    waited = time.monotonic() - t0
    assert done and busy >= 0.3 * (1.5 - IDLE_INTERVAL) / INTERVAL, (busy, waited)  # probed at the busy rate


async def _waits_behind_a_busy_loop(exact: bool, busy: float, seconds: float) -> list[float]:
    """The probe's waits while one callback after another holds the loop for ``busy`` seconds (a spin on the clock,
    so a loaded machine only lengthens it). ``exact=False``: the fallback probe, made ready from inside the loop."""
    waits: list[float] = []
    lag = looplag.LoopLag(waits.append, interval=busy * 0.8)
    loop = asyncio.get_running_loop()
    end = time.monotonic() + seconds

    def spin() -> None:
        until = time.monotonic() + busy
        while time.monotonic() < until:
            pass
        if time.monotonic() < end:
            loop.call_soon(spin)

    lag.start()
    assert lag.exact is exact
    loop.call_soon(spin)
    await asyncio.sleep(seconds + 4 * busy)
    lag.stop()
    return waits


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")
async def test_the_probe_counts_the_wait_from_the_moment_its_fd_became_readable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes that arrive while a callback runs wait for the rest of it, then for the callbacks made ready before
    theirs: on average 1.5 callbacks when each holds the loop alike. A probe that starts its clock when the loop
    first gets to it sees one (the fallback), and so did the probe before the timerfd: it showed 35-65 % of the
    benchmark's added p99 (docs/metrics.md#gateway-added-time)."""
    busy = 0.004
    exact = await _waits_behind_a_busy_loop(True, busy, 0.6)
    assert len(exact) >= 20, len(exact)
    assert statistics.mean(exact) >= 1.25 * busy, (statistics.mean(exact), busy)
    assert max(exact) >= 1.8 * busy  # some arrived early in a callback: nearly two whole callbacks
    monkeypatch.setattr(looplag, "_TimerFD", _no_timerfd)
    fallback = await _waits_behind_a_busy_loop(False, busy, 0.6)
    assert fallback and statistics.mean(fallback) < statistics.mean(exact)


def _no_timerfd() -> None:
    raise OSError("no timerfd")


async def test_a_rate_of_zero_turns_the_probe_off() -> None:
    """``GATEWAY_LOOP_LAG_RATE=0`` (create_app's ``loop_lag_rate``): no probe, nothing woken, nothing observed."""
    waits: list[float] = []
    lag = looplag.LoopLag(waits.append, interval=None)
    lag.start()
    await asyncio.sleep(0.05)
    lag.stop()
    assert not waits and not lag.exact
    on = looplag.LoopLag(waits.append, interval=0.002)
    on.start()
    await asyncio.sleep(0.05)
    on.stop()
    assert waits  # the same wait with a probe on observes


def test_the_first_byte_counts_from_the_request_read_whole(stack: Stack) -> None:
    """A client that sends its head, then its body half a second later: that half second is the client's, not the
    gateway's (its task starts at the head, so a clock started there would count it)."""
    body = json.dumps({"model": "gpt-5.6-sol-fast", "stream": True, "max_completion_tokens": 4,
                       "messages": [{"role": "user", "content": "[[emulate tokens=4 tps=400]]"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()

    def first_byte(text: str, what: str) -> float:
        return sample(text, f"tiergate_gateway_added_seconds_{what}", tier="fast", phase="first_byte")
    before = scraped(stack.gateway.port)
    with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.5)
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
    after = scraped(stack.gateway.port)
    assert first_byte(after, "count") - first_byte(before, "count") == 1
    assert first_byte(after, "sum") - first_byte(before, "sum") < 0.25


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")
async def test_a_timerfd_that_fails_to_arm_leaves_the_fallback_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    lag = looplag.LoopLag(waits.append, interval=0.002)
    lag.start()
    assert lag.exact

    def refuse(self: object, at_ns: int) -> None:
        raise OSError(22, "timerfd_settime")
    monkeypatch.setattr(looplag._TimerFD, "arm", refuse)
    await asyncio.sleep(0.05)
    seen, exact = len(waits), lag.exact
    await asyncio.sleep(0.05)
    lag.stop()
    assert not exact and len(waits) > seen


def test_a_pipelined_request_does_not_count_the_answers_ahead_of_it(stack: Stack) -> None:
    """HTTP/1.1 pipelining: the second request is read whole while the first still streams (0.4 s) and waits in the
    server's queue meanwhile; that wait is the first answer's, not the gateway's own time."""
    body = json.dumps({"model": "gpt-5.6-sol-fast", "stream": True, "max_completion_tokens": 40,
                       "messages": [{"role": "user", "content": "[[emulate tokens=40 tps=100]]"}]}).encode()
    one = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\n\r\n").encode() + body

    def first_byte(text: str, what: str) -> float:
        return sample(text, f"tiergate_gateway_added_seconds_{what}", tier="fast", phase="first_byte")
    before = scraped(stack.gateway.port)
    with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10) as sock:
        sock.sendall(one + one)  # both at once: the second is queued behind the first
        answer = b""
        while answer.count(b"data: [DONE]") < 2:
            chunk = sock.recv(65536)
            assert chunk, answer[-300:]
            answer += chunk
    after = scraped(stack.gateway.port)
    assert first_byte(after, "count") - first_byte(before, "count") == 2
    assert first_byte(after, "sum") - first_byte(before, "sum") < 0.2


@pytest.mark.parametrize("value", ["0.001", "2001", "-1", "abc"])
def test_a_bad_probe_rate_is_named_with_exit_2(value: str) -> None:
    """Below 0.01 a second the interval overflows the timer's arithmetic; above 2000 the probe is a load of its own."""
    import os
    import subprocess

    from conftest import ROOT
    run = subprocess.run([sys.executable, "-m", "gateway", "check-config", "config/demo.yaml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30, env={**os.environ, "GATEWAY_LOOP_LAG_RATE": value})
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("tiergate: invalid environment: GATEWAY_LOOP_LAG_RATE:"), run.stderr
