"""First-token hedging over real sockets, with scripted upstreams (byte-exact plans): a fast candidate that stalls
before its first token loses to the standard one, whose stream is relayed byte for byte while the stalled connection
is closed within 100 ms; a fast candidate that answers in time wins and the hedge never starts; a hedge that started
and lost is cancelled; every outcome is counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.tools.emulator import EmulatorThread, Plan

from conftest import Proc, chunk, round_trip, sample, sse, start_gateway, timely

STREAM = sse(chunk(role=True), chunk("Hello"), chunk(" there"), chunk(finish="stop"), chunk(usage=True))
HEDGE_AFTER = 0.2  # seconds


def stream_plan(first_token_after: float, end: str = "ok") -> Plan:
    """The role chunk at once, then the rest (its first token) after ``first_token_after`` seconds; ``stall``: the
    role chunk and then silence, the connection kept open."""
    role, rest = STREAM.split(b"\n\n", 1)
    if end == "stall":
        return Plan(parts=[(0, role + b"\n\n")], end="stall")
    return Plan(parts=[(0, role + b"\n\n"), (first_token_after, rest)])


@pytest.fixture(scope="module")
def ups() -> Iterator[dict[str, EmulatorThread]]:
    up = {"fast": EmulatorThread(), "standard": EmulatorThread()}
    yield up
    for u in up.values():
        u.stop()


@pytest.fixture(scope="module")
def gw(ups: dict[str, EmulatorThread], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    timeouts = {"connect": 1, "ttft": 5, "idle": 5, "total": 10}
    cfg: dict[str, Any] = {
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": ups["fast"].base_url, "timeouts": timeouts,
             "models": {"m": "m", "m2": "m2"}, "prices": {"input": 2.0, "output": 8.0}},
            {"name": "std", "tier": "standard", "base_url": ups["standard"].base_url, "timeouts": timeouts,
             "models": {"m": "m", "m2": "m2"}, "prices": {"input": 1.0, "output": 4.0}},
        ],
        "rules": [{"name": "agent", "match": {"metadata": {"workload": ["agent"]}},
                   "route": {"tier": "fast", "hedge": HEDGE_AFTER}}],
    }
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("hedging"))
    yield proc
    proc.stop()


def _reset(ups: dict[str, EmulatorThread], fast: Plan, standard: Plan) -> None:
    for up, plan in ((ups["fast"], fast), (ups["standard"], standard)):
        up.requests.clear()
        up.closed_at.clear()
        up.handler = (lambda p: lambda req: p)(plan)


def _ask(gw: Proc, model: str = "m") -> tuple[httpx.Response, bytes, float | None]:
    """Stream one agent request; returns the response, its body bytes, and when (``time.monotonic()``) the first
    token-bearing line arrived."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "metadata": {"workload": "agent"}, "messages": [{"role": "user", "content": "hi"}]}
    data, first = b"", None
    with httpx.stream("POST", f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=body, timeout=10) as r:
        for piece in r.iter_raw():
            data += piece
            if first is None and b"Hello" in data:
                first = time.monotonic()
    return r, data, first


def _hedges(gw: Proc, outcome: str) -> float:
    return sample(httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text, "tiergate_hedges_total",
                  outcome=outcome)


def test_a_stalled_fast_candidate_loses_to_the_hedge(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    def attempt() -> tuple[float, float]:
        _reset(ups, fast=stream_plan(0, end="stall"), standard=stream_plan(0.05))
        won = _hedges(gw, "won")
        floor = round_trip(gw.port)
        r, data, first = _ask(gw)
        assert r.status_code == 200
        assert r.headers["x-tiergate-upstream"] == "std" and r.headers["x-tiergate-fallback"] == "hedge"
        assert data == STREAM  # byte-equal to the standard upstream's stream: one answer, never a mix
        assert len(ups["fast"].requests) == 1 and len(ups["standard"].requests) == 1
        # the hedge started after the delay, not before
        assert ups["standard"].requests[0].at - ups["fast"].requests[0].at >= HEDGE_AFTER * 0.9
        _closed(ups["fast"])
        assert first is not None and ups["fast"].closed_at, "the stalled connection stayed open"
        assert _hedges(gw, "won") == won + 1
        # the stalled upstream's connection was closed within 100 ms (over the loopback floor) of the winner's first
        # token; uncancelled, it would stay open for its idle timeout (5 s)
        return ups["fast"].closed_at[0] - first, 0.1 + floor
    timely(attempt)
    text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    assert sample(text, "tiergate_hedge_cost_usd_total", upstream="fast", missing_ok=False) > 0
    assert sample(text, "tiergate_fallbacks_total", reason="hedge", to_tier="standard", missing_ok=False) >= 1
    assert sample(text, "tiergate_requests_total", upstream="std", outcome="success", missing_ok=False) >= 1


def _closed(up: EmulatorThread) -> None:
    """Wait (bounded) until a connection to ``up`` was closed."""
    deadline = time.monotonic() + 2
    while not up.closed_at and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_fast_candidate_that_answers_in_time_never_starts_the_hedge(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    _reset(ups, fast=stream_plan(0.02), standard=stream_plan(0))
    counts = [_hedges(gw, o) for o in ("won", "lost", "cancelled")]
    r, data, _ = _ask(gw)
    assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "fast"
    assert "x-tiergate-fallback" not in r.headers
    assert data == STREAM
    time.sleep(HEDGE_AFTER + 0.1)
    assert ups["standard"].requests == []  # never started
    assert [_hedges(gw, o) for o in ("won", "lost", "cancelled")] == counts


def test_a_hedge_that_started_loses_to_a_late_first_token_and_is_cancelled(gw: Proc,
                                                                           ups: dict[str, EmulatorThread]) -> None:
    def attempt() -> tuple[float, float]:
        _reset(ups, fast=stream_plan(HEDGE_AFTER + 0.1), standard=stream_plan(1.0))
        lost = _hedges(gw, "lost")
        floor = round_trip(gw.port)
        r, data, first = _ask(gw)
        assert r.headers["x-tiergate-upstream"] == "fast" and data == STREAM
        assert len(ups["standard"].requests) == 1  # it started ...
        _closed(ups["standard"])
        assert first is not None and ups["standard"].closed_at, "the hedge's connection stayed open"
        assert _hedges(gw, "lost") == lost + 1  # ... and was cancelled as soon as the fast tier's first token came:
        # within 100 ms over the loopback floor (uncancelled, it would run to its own first token, 0.7 s later)
        return ups["standard"].closed_at[0] - first, 0.1 + floor
    timely(attempt)


def test_a_failure_before_the_delay_fails_over_at_once(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    err = Plan(status=503, headers={"content-type": "application/json"}, chunked=False,
               parts=[(0, b'{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}')])

    def attempt() -> tuple[float, float]:
        _reset(ups, fast=err, standard=stream_plan(0))
        r, data, _ = _ask(gw)
        assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "std" and data == STREAM
        assert r.headers["x-tiergate-fallback"] == "upstream_5xx"
        # no waiting for the hedge delay, whose timer started before the fast request reached its upstream: a gateway
        # that waited could not send the failover sooner than HEDGE_AFTER after that arrival, less one hop
        return ups["standard"].requests[0].at - ups["fast"].requests[0].at, HEDGE_AFTER / 2
    timely(attempt)


def test_both_failing_is_one_error_answer(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    def err(status: int, delay: float) -> Plan:
        return Plan(status=status, headers={"content-type": "application/json"}, chunked=False, head_delay=delay,
                    parts=[(0, b'{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}')])
    _reset(ups, fast=err(500, HEDGE_AFTER + 0.15), standard=err(503, 0))  # the hedge fails first, then the fast one
    cancelled = _hedges(gw, "cancelled")
    r, data, _ = _ask(gw)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert data.startswith(b'{"error"') and data.count(b'"error"') == 1
    assert r.headers["x-should-retry"] == "false"  # two upstreams were tried
    assert _hedges(gw, "cancelled") == cancelled + 1


def test_a_client_that_leaves_during_the_race_cancels_both(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    _reset(ups, fast=stream_plan(0, end="stall"), standard=stream_plan(0, end="stall"))
    cancelled = _hedges(gw, "cancelled")
    body: dict[str, Any] = {"model": "m", "stream": True, "metadata": {"workload": "agent"},
                            "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=body, timeout=HEDGE_AFTER + 0.3)
    deadline = time.monotonic() + 3
    while (len(ups["fast"].closed_at) < 1 or len(ups["standard"].closed_at) < 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ups["fast"].closed_at and ups["standard"].closed_at  # both upstream connections closed
    assert _hedges(gw, "cancelled") == cancelled + 1
    text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    assert sample(text, "tiergate_requests_total", outcome="client_disconnect", missing_ok=False) >= 1


def test_a_client_that_leaves_after_the_hedges_finish_chunk_still_gets_its_usage_counted(
        gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """SDK loops break on finish_reason; the usage chunk that follows is read for finish_grace (Relay.tail) in the
    winning racer's task too: the cancel that the client's leaving sends reaches it once, and the request waits."""
    finish = STREAM.index(b"data: " + chunk(usage=True).encode())
    head, usage = STREAM[:finish], STREAM[finish:]
    role, rest = head.split(b"\n\n", 1)
    _reset(ups, fast=stream_plan(0, end="stall"),
           standard=Plan(parts=[(0, role + b"\n\n"), (0.02, rest), (0.4, usage)]))
    before = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "metadata": {"workload": "agent"},
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=body, timeout=10) as r:
        seen = b""
        for piece in r.iter_raw():
            seen += piece
            if b'"finish_reason":"stop"' in seen:
                break  # and close
    assert r.headers["x-tiergate-upstream"] == "std"
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        after = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
        got = (sample(after, "tiergate_tokens_total", upstream="std", token_type="output")
               - sample(before, "tiergate_tokens_total", upstream="std", token_type="output"))
        if got:
            break
        time.sleep(0.05)
    assert got == 3  # the usage chunk's completion_tokens
    assert (sample(after, "tiergate_requests_total", upstream="std", outcome="success")
            - sample(before, "tiergate_requests_total", upstream="std", outcome="success")) == 1


def test_a_hedge_that_lost_just_after_it_started_teaches_its_estimate_nothing(
        gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """The fast tier answers 50 ms after the hedge started: the hedge waited 50 ms, which says nothing of its TTFT
    (the standard tier's is 1 s); it must not become a 50 ms sample that deadline routing would trust."""
    _reset(ups, fast=stream_plan(HEDGE_AFTER + 0.05), standard=stream_plan(1.0))
    r, _, _ = _ask(gw, model="m2")
    assert r.headers["x-tiergate-upstream"] == "fast" and len(ups["standard"].requests) == 1
    snap = httpx.get(f"http://127.0.0.1:{gw.port}/v1/tiergate/estimates", timeout=5).json()
    by = {(e["upstream"], e["model"]): e for e in snap["latency"]}
    assert by[("fast", "m2")]["measured"]
    assert ("std", "m2") not in by  # no sample: still unmeasured


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, dict[str, EmulatorThread]]]:
    """Two fast upstreams (f2 takes one request at a time) and a standard one; agent requests hedge after 0.2 s;
    ``x-hold: f2`` pins a request to f2 without hedging."""
    up = {name: EmulatorThread() for name in ("f1", "f2", "s")}
    timeouts = {"connect": 1, "ttft": 5, "idle": 5, "total": 10}
    cfg: dict[str, Any] = {
        "max_attempts": 3,
        "upstreams": [
            {"name": "f1", "tier": "fast", "base_url": up["f1"].base_url, "timeouts": timeouts, "models": {"m": "m"}},
            {"name": "f2", "tier": "fast", "base_url": up["f2"].base_url, "timeouts": timeouts, "models": {"m": "m"},
             "health": {"max_concurrent": 1}},
            {"name": "s", "tier": "standard", "base_url": up["s"].base_url, "timeouts": timeouts,
             "models": {"m": "m"}},
        ],
        "rules": [{"name": "hold", "match": {"headers": {"x-hold": "f2"}},
                   "route": {"tier": "fast", "upstream": "f2", "fallback": False}},
                  {"name": "agent", "match": {"metadata": {"workload": ["agent"]}},
                   "route": {"tier": "fast", "hedge": HEDGE_AFTER}}],
    }
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("hedging3"))
    yield proc, up
    proc.stop()
    for u in up.values():
        u.stop()


def _set(up: dict[str, EmulatorThread], **plans: Plan) -> None:
    for name, plan in plans.items():
        up[name].requests.clear()
        up[name].handler = (lambda p: lambda req: p)(plan)


def test_when_both_racers_fail_the_failover_goes_on_to_the_third(three: tuple[Proc, dict[str, EmulatorThread]]
                                                                ) -> None:
    gw, up = three
    err = Plan(status=503, headers={"content-type": "application/json"}, chunked=False,
               parts=[(0, b'{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}')])
    _set(up, f1=err, f2=err, s=stream_plan(0))
    r, data, _ = _ask(gw)
    assert r.status_code == 200 and data == STREAM
    assert r.headers["x-tiergate-upstream"] == "s" and r.headers["x-tiergate-fallback"] == "upstream_5xx"
    assert [len(up[n].requests) for n in ("f1", "f2", "s")] == [1, 1, 1]


def test_when_every_candidate_fails_the_error_names_the_last(three: tuple[Proc, dict[str, EmulatorThread]]) -> None:
    gw, up = three

    def err(delay: float) -> Plan:
        return Plan(status=503, headers={"content-type": "application/json"}, chunked=False, head_delay=delay,
                    parts=[(0, b'{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}')])
    _set(up, f1=err(0), f2=err(0.05), s=err(0))
    r, data, _ = _ask(gw)
    assert r.status_code == 503 and r.headers["x-tiergate-upstream"] == "s" and data.count(b'"error"') == 1


def test_no_hedge_goes_to_an_upstream_at_its_concurrency_limit(three: tuple[Proc, dict[str, EmulatorThread]]) -> None:
    gw, up = three
    _set(up, f1=stream_plan(0.5), f2=stream_plan(1.2), s=stream_plan(0))
    before = _hedges(gw, "won") + _hedges(gw, "lost")
    holder = threading.Thread(target=lambda: httpx.post(
        f"http://127.0.0.1:{gw.port}/v1/chat/completions", headers={"x-hold": "f2"}, timeout=10,
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hold"}]}))
    got: list[tuple[httpx.Response, bytes, float | None]] = []
    asker = threading.Thread(target=lambda: got.append(_ask(gw)))
    asker.start()  # planned now, while f2 is free: its candidates are f1, f2, s
    time.sleep(HEDGE_AFTER / 2)
    holder.start()  # f2 is at its limit by the time the hedge would start
    asker.join(5)
    holder.join(5)
    r, data, _ = got[0]  # f1 answered at 0.5 s; no hedge was started, to f2 (busy) or anyone
    assert r.headers["x-tiergate-upstream"] == "f1" and data == STREAM
    assert len(up["f2"].requests) == 1 and up["s"].requests == []
    assert _hedges(gw, "won") + _hedges(gw, "lost") == before
