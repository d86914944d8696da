"""Every fault that other gateways' and SDKs' bug reports describe, ended cleanly.

Each test is written as the input that triggers the fault and what a correct gateway does, over real loopback
sockets against the emulator playing byte-exact scripted plans (it answers each request by its top-level ``x_case``;
both dialects forward that field untouched). The HTTP-surface cases use raw sockets and a strict HTTP/1.1
client (``h11``); the lifecycle cases run ``tiergate`` processes and signal them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import openai
import orjson
import pytest

from gateway.tools.emulator import EmulatorThread, Plan, Received

from conftest import ROOT, Proc, chunk, emulator, free_port, on_time, round_trip, sample, sse, start_gateway, timely

CASES: dict[str, Plan | list[Plan]] = {}
SEEN: dict[str, int] = {}
JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "x"}]
# cases fail upstreams on purpose, one after the other: no breaker opens and a 429 leaves no cooldown behind,
# unless a test asks for it on a gateway of its own
HEALTH = {"failures": 1000, "cooldown_default": 0}
JSON_OK = Plan(headers=JSON, parts=[(0, b'{"id":"x","object":"chat.completion","choices":[]}')], chunked=False)


def _handler(req: Received) -> Plan:
    try:
        case = json.loads(req.body).get("x_case", "")  # the standard library reads lone surrogates (case 14)
    except ValueError:
        case = ""
    plan = CASES.get(case, Plan(parts=[(0, sse(chunk(role=True), chunk("ok"), chunk(finish="stop")))]))
    if isinstance(plan, list):  # one plan per request of the case, in order (the last one repeats)
        i = SEEN.get(case, 0)
        SEEN[case] = i + 1
        return plan[min(i, len(plan) - 1)]
    return plan


IDLE, GRACE = 0.5, 0.3  # the gateways' idle timeout and finish_grace, seconds


def _config(fake: EmulatorThread, **top: Any) -> dict[str, Any]:
    timeouts = {"connect": 1, "idle": IDLE, "total": 5, "finish_grace": GRACE}
    cfg: dict[str, Any] = {
        "max_attempts": 2,
        "upstreams": [
            {"name": "f-fast", "tier": "fast", "base_url": fake.base_url, "dialect": "cerebras", "timeouts": timeouts,
             "prices": {"input": 1.0, "output": 2.0}, "health": HEALTH, "models": {"m": "m-fast"}},
            {"name": "f-std", "tier": "standard", "base_url": fake.base_url, "dialect": "openai", "timeouts": timeouts,
             "prices": {"input": 1.0, "output": 2.0}, "health": HEALTH, "models": {"m": "m-std"}},
        ],
        "aliases": {"m-fast": {"model": "m", "tier": "fast"}},
    }
    cfg.update(top)
    return cfg


@pytest.fixture(scope="module")
def fake() -> Iterator[EmulatorThread]:
    up = EmulatorThread(_handler)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def gw(fake: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc, _ = start_gateway(_config(fake), tmp_path_factory.mktemp("faults"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gw_ttft(fake: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """The same gateway with first-token deadlines (as the shipped configs have) and no fallback."""
    cfg = _config(fake, fallback=False)
    for up in cfg["upstreams"]:
        up["timeouts"] = {**up["timeouts"], "ttft": 2.0}
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("faults-ttft"))
    yield proc
    proc.stop()


def _url(gw: Proc) -> str:
    return f"http://127.0.0.1:{gw.port}/v1"


def _post(gw: Proc, case: str, *, stream: bool = True, model: str = "m", path: str = "/chat/completions",
          **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "stream": stream, "x_case": case, **extra}
    body.setdefault("input" if path == "/responses" else "messages", MESSAGES)
    return httpx.post(_url(gw) + path, json=body, timeout=10)


def _client(gw: Proc, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(gw), api_key="unused", max_retries=retries)


def _metrics(gw: Proc) -> str:
    return httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text


def _grew(before: str, after: str, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def _errors(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for ev in _events(raw):
        data = ev.split(b"data: ", 1)[-1]
        if data.startswith(b"{") and "error" in (parsed := orjson.loads(data)):
            out.append(parsed)
    return out


# ---- commit point and stream ends ---------------------------------------------------------------------------

ERROR_FIRST = {
    # case 1 as reported: `event: error` with an integer code, then [DONE]
    "event_error_code": (b'event: error\ndata: {"error":{"message":"invalid request","type":"invalid_request_error",'
                         b'"code":400}}\n\ndata: [DONE]\n\n', 400, "invalid_request_error", openai.BadRequestError),
    # a plain data event with an error object and a status_code (Groq's shape)
    "status_code": (sse('{"error":{"message":"tool call validation failed","type":"invalid_request_error",'
                        '"code":"tool_use_failed","status_code":400}}', done=False), 400, "invalid_request_error",
                    openai.BadRequestError),
    # no number: the status comes from the type
    "rate_type": (sse('{"error":{"message":"slow down","type":"rate_limit_error","param":null,"code":null}}'), 429,
                  "rate_limit_error", openai.RateLimitError),
}


@pytest.mark.parametrize("ttft", [False, True])
@pytest.mark.parametrize("shape", sorted(ERROR_FIRST))
def test_error_as_the_first_event_is_a_real_http_error(fake: EmulatorThread, gw: Proc, gw_ttft: Proc, shape: str,
                                                        ttft: bool) -> None:
    """Case 1: nothing reached the client yet, so the error event becomes a status, with or without a ttft."""
    body, status, etype, sdk_error = ERROR_FIRST[shape]
    CASES["err_first_" + shape] = Plan(parts=[(0, sse(chunk(role=True), done=False) + body)])
    proxy = gw_ttft if ttft else gw
    resp = _post(proxy, "err_first_" + shape, model="m-fast")
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["type"] == etype and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(sdk_error):
        list(_client(proxy).chat.completions.create(model="m-fast", messages=MESSAGES, stream=True,
                                                    extra_body={"x_case": "err_first_" + shape}))


def test_error_event_with_a_server_status_fails_over(fake: EmulatorThread, gw: Proc) -> None:
    """Case 1, failover: an error event that carries a 5xx before any token is a failure of that upstream."""
    CASES["err_first_500"] = [
        Plan(parts=[(0, sse('{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}'))]),
        Plan(parts=[(0, sse(chunk(role=True), chunk("ok"), chunk(finish="stop")))])]
    SEEN.pop("err_first_500", None)
    resp = _post(gw, "err_first_500", model="m-fast")
    assert resp.status_code == 200 and resp.headers["x-tiergate-tier"] == "standard"
    assert resp.headers["x-tiergate-fallback"] == "upstream_5xx"


def test_responses_error_event_first_is_a_real_http_error(fake: EmulatorThread, gw: Proc) -> None:
    """Case 1, the Responses API's own error shape (``{"type": "error", "code", "message"}``)."""
    CASES["resp_err_first"] = Plan(parts=[(0, b'event: response.created\ndata: {"type":"response.created",'
                                              b'"sequence_number":0,"response":{"id":"r","status":"in_progress"}}\n\n'
                                              b'event: error\ndata: {"type":"error","code":"rate_limit_exceeded",'
                                              b'"message":"Rate limit reached","param":null,"sequence_number":1}\n\n')])
    resp = _post(gw, "resp_err_first", path="/responses")
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert resp.json()["error"]["message"] == "Rate limit reached"


def test_done_while_the_first_token_is_held_ends_the_stream(fake: EmulatorThread, gw_ttft: Proc) -> None:
    """Case 2: a stream with no token that sends [DONE] and keeps its connection open ends at [DONE]."""
    CASES["done_held"] = Plan(parts=[(0, sse(chunk(role=True), chunk(finish="stop")))], end="stall")

    def attempt() -> tuple[float, float]:
        before = _metrics(gw_ttft)
        t0 = time.monotonic()
        resp = _post(gw_ttft, "done_held")
        took = time.monotonic() - t0
        assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n") and not _errors(resp.content)
        after = _metrics(gw_ttft)
        assert _grew(before, after, "tiergate_requests_total", outcome="success") == 1
        assert _grew(before, after, "tiergate_requests_total", outcome="stream_error") == 0
        # ended at [DONE]: a gateway that missed it would end the stream after finish_grace (0.3 s), the idle timeout
        # (0.5 s) or the ttft (2 s), each counted from the bytes' arrival, after t0: none can be under finish_grace
        return took, GRACE
    timely(attempt)


def test_silence_after_every_finish_reason_ends_with_done(fake: EmulatorThread, gw: Proc) -> None:
    """Case 3: every choice finished, then nothing on an open connection: [DONE] after ``finish_grace``."""
    CASES["silent_finish"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), chunk(finish="stop"), done=False))],
                                  end="stall")

    def attempt() -> tuple[float, float]:
        closed = len(fake.closed_at)
        before = _metrics(gw)
        t0 = time.monotonic()
        resp = _post(gw, "silent_finish")
        took = time.monotonic() - t0
        assert took >= GRACE  # it waited finish_grace for the usage tail
        assert resp.content == sse(chunk(role=True), chunk("a"), chunk(finish="stop"))  # ends with [DONE]
        after = _metrics(gw)
        assert _grew(before, after, "tiergate_requests_total", tier="standard", outcome="success") == 1
        assert _grew(before, after, "tiergate_upstream_errors_total") == 0
        deadline = time.monotonic() + 2
        while len(fake.closed_at) == closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fake.closed_at) > closed  # the upstream's open connection was closed, not pooled
        # finish_grace, not the idle timeout: the idle watch never ends a stream before IDLE of silence after the
        # last byte, which came after t0, so a gateway without the grace cannot be under IDLE
        return took, IDLE
    timely(attempt)


def test_ttft_above_idle_governs_until_the_first_token(fake: EmulatorThread, tmp_path: Path) -> None:
    """Case 4: with idle 0.4 and ttft 3, an upstream that thinks 1 s (headers late, then the first token late)
    succeeds; afterwards idle applies between events."""
    cfg = _config(fake, fallback=False)
    for up in cfg["upstreams"]:
        up["timeouts"] = {**up["timeouts"], "idle": 0.4, "ttft": 3.0}
    proc, _ = start_gateway(cfg, tmp_path)
    try:
        CASES["think_head"] = Plan(head_delay=1.0, parts=[(0, sse(chunk(role=True), chunk("a"), chunk(finish="stop")))])
        CASES["think_token"] = Plan(parts=[(0, sse(chunk(role=True), done=False)),
                                           (1.0, sse(chunk("a"), chunk(finish="stop")))])
        CASES["stall_later"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), done=False)),
                                           (2.0, sse(chunk("b"), chunk(finish="stop")))])
        for case in ("think_head", "think_token"):
            resp = _post(proc, case)
            assert resp.status_code == 200 and not _errors(resp.content), (case, resp.text)
            assert resp.content.endswith(b"data: [DONE]\n\n")
        resp = _post(proc, "stall_later")  # once tokens flow, 0.4 s of silence ends it in band
        assert _errors(resp.content)[-1]["error"]["code"] == "upstream_idle_timeout"
    finally:
        proc.stop()


def test_partial_output_then_the_upstreams_error_then_fin_gives_one_error(fake: EmulatorThread, gw: Proc) -> None:
    """Case 5: the upstream's own error event, then its connection closes mid-body: one error, no [DONE]."""
    err = '{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}'
    CASES["err_fin"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), err, done=False))], end="eof")
    resp = _post(gw, "err_fin")
    assert resp.status_code == 200
    assert [e["error"]["message"] for e in _errors(resp.content)] == ["overloaded"]
    assert b"[DONE]" not in resp.content


def test_a_mislabelled_stream_is_relayed_as_an_event_stream(fake: EmulatorThread, gw: Proc) -> None:
    """Case 6: ``200 text/plain`` with an SSE body, to a stream request."""
    events = sse(chunk(role=True), chunk("pl"), chunk("ain"), chunk(finish="stop"))
    CASES["text_plain"] = Plan(headers={"content-type": "text/plain; charset=utf-8"}, parts=[(0, events)])
    resp = _post(gw, "text_plain")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert resp.content == events
    got = list(_client(gw).chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                   extra_body={"x_case": "text_plain"}))
    assert "".join(c.choices[0].delta.content or "" for c in got) == "plain"


# ---- accounting ---------------------------------------------------------------------------------------------


def test_client_leaving_after_the_finish_chunk_still_counts_the_usage(fake: EmulatorThread, gw: Proc) -> None:
    """Case 7: the client breaks on ``finish_reason``; the usage chunk comes 200 ms later and is counted."""
    CASES["leave_after_finish"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), chunk(finish="stop"),
                                                      done=False)),
                                              (0.2, sse(chunk(usage=True)))])
    before = _metrics(gw)
    body = orjson.dumps({"model": "m", "stream": True, "x_case": "leave_after_finish", "messages": MESSAGES})
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b'"finish_reason":"stop"' not in got:
            got += sock.recv(65536)
    time.sleep(0.4)
    after = _metrics(gw)
    assert _grew(before, after, "tiergate_tokens_total", tier="standard", token_type="output") == 3
    assert _grew(before, after, "tiergate_cost_usd_total", tier="standard") > 0
    assert _grew(before, after, "tiergate_requests_total", tier="standard", outcome="success") == 1
    assert _grew(before, after, "tiergate_requests_total", outcome="client_disconnect") == 0


def test_client_leaving_before_the_finish_still_counts_the_usage_that_follows_within_a_second(
        fake: EmulatorThread, gw: Proc) -> None:
    """Case 7b: the client leaves after its first token, before any finish_reason; the upstream goes on generating
    and sends its finish and usage 0.4 s or more after the leave: counted as reported, not estimated. A leave before
    the finish is read on for up to 1 s (LEAVE_GRACE), not for ``finish_grace`` (0.3 s on this gateway), which is
    a finished stream's wait for its usage tail."""
    ticks = [(0.05, sse(chunk("b"), done=False)) for _ in range(10)]  # the upstream generating meanwhile
    parts = [(0.0, sse(chunk(role=True), chunk("a"), done=False)), *ticks,
             (0.05, sse(chunk(finish="stop"), chunk(usage=True)))]
    usage_at = sum(delay for delay, _ in parts)  # 0.55 s after the first token
    CASES["leave_before_finish"] = Plan(parts=parts)
    body = orjson.dumps({"model": "m", "stream": True, "x_case": "leave_before_finish", "messages": MESSAGES})

    def attempt() -> list[str]:
        before = _metrics(gw)
        n = len(fake.requests)
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while b'"a"' not in got:
                got += sock.recv(65536)
            t_close = time.monotonic()
        lead = fake.requests[n].at + usage_at - t_close  # how long after the leave the usage left the upstream
        deadline = time.monotonic() + 3
        while not _grew(before, after := _metrics(gw), "tiergate_requests_total", tier="standard"):
            assert time.monotonic() < deadline, "the request the client left was never recorded"
            time.sleep(0.02)
        assert _grew(before, after, "tiergate_requests_total", tier="standard", outcome="client_disconnect") == 1
        if lead < 0.4:  # the leave came late on a busy machine: the case says nothing, run it again
            return [f"the usage left the upstream only {lead:.3f} s after the leave"]
        assert _grew(before, after, "tiergate_tokens_total", tier="standard", token_type="output",
                     usage="reported") == 3
        assert _grew(before, after, "tiergate_usage_estimated_total", tier="standard") == 0
        return []
    on_time(attempt)


def test_a_stream_that_finishes_after_the_client_left_waits_finish_grace_for_its_usage(
        fake: EmulatorThread, gw: Proc) -> None:
    """Case 7c: the client leaves after its first token; the finish comes 0.1 s later and then no usage, only
    keep-alives: the upstream is closed ``finish_grace`` (0.3 s) after the finish, not at the 1 s a leave before the
    finish may take at most (both bounds hold)."""
    pings = [(0.05, b": ping\n\n") for _ in range(60)]  # 3 s of keep-alives: the 0.5 s idle timeout stays quiet
    finish_at = 0.1
    CASES["finish_after_leave"] = Plan(parts=[(0.0, sse(chunk(role=True), chunk("a"), done=False)),
                                              (finish_at, sse(chunk(finish="stop"), done=False)), *pings])
    body = orjson.dumps({"model": "m", "stream": True, "x_case": "finish_after_leave", "messages": MESSAGES})

    def attempt() -> tuple[float, float]:
        floor = round_trip(gw.port)
        closed = len(fake.closed_at)
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while b'"a"' not in got:
                got += sock.recv(65536)
            t_close = time.monotonic()
        deadline = time.monotonic() + 3
        while len(fake.closed_at) == closed:
            assert time.monotonic() < deadline, "the upstream connection was never closed"
            time.sleep(0.002)
        # the finish left the upstream at most finish_at after the leave; a relay that kept the 1 s takes 1 s
        return fake.closed_at[-1] - t_close, finish_at + GRACE + 0.1 + floor
    timely(attempt)


def test_usage_on_an_error_chunk_is_counted(fake: EmulatorThread, gw: Proc) -> None:
    """Case 8: OpenRouter's final chunk carries ``error``, ``finish_reason: "error"`` and ``usage``."""
    last = orjson.loads(chunk(finish="error"))
    last["error"] = {"code": 502, "message": "Provider disconnected"}
    last["usage"] = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    CASES["usage_on_error"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), orjson.dumps(last)))])
    before = _metrics(gw)
    resp = _post(gw, "usage_on_error")
    assert [e["error"]["message"] for e in _errors(resp.content)] == ["Provider disconnected"]
    after = _metrics(gw)
    assert _grew(before, after, "tiergate_requests_total", tier="standard", outcome="stream_error") == 1
    assert _grew(before, after, "tiergate_tokens_total", tier="standard", token_type="output") == 4
    assert _grew(before, after, "tiergate_tokens_total", tier="standard", token_type="input") == 7
    assert _grew(before, after, "tiergate_cost_usd_total", tier="standard") == pytest.approx((7 * 1 + 4 * 2) / 1e6)


# ---- errors and rate limits ---------------------------------------------------------------------------------

QUOTA = b'{"error":{"message":"You exceeded your current quota, please check your plan and billing details.",' \
        b'"type":"insufficient_quota","param":null,"code":"insufficient_quota"}}'


def test_exhausted_quota_goes_to_the_other_tier_and_rests_long(fake: EmulatorThread, tmp_path: Path) -> None:
    """Case 9: a 429 that says the quota is exhausted is not a rate limit: the other tier serves, and the
    upstream is not asked again for ``exhausted_cooldown`` (not the retry hint's 0.1 s)."""
    proc, _ = start_gateway(_config(fake), tmp_path)
    try:
        CASES["quota"] = [Plan(status=429, headers={**JSON, "retry-after-ms": "100"}, parts=[(0, QUOTA)],
                               chunked=False),
                          Plan(parts=[(0, sse(chunk(role=True), chunk("ok"), chunk(finish="stop")))])]
        SEEN.pop("quota", None)
        resp = _post(proc, "quota", model="m-fast")
        assert resp.status_code == 200 and resp.headers["x-tiergate-fallback"] == "upstream_429"
        time.sleep(0.2)
        n = len(fake.requests)
        resp = _post(proc, "quota", model="m-fast")
        assert resp.headers["x-tiergate-fallback"] == "spillover_cooldown"
        assert [orjson.loads(r.body)["model"] for r in fake.requests[n:]] == ["m-std"]
    finally:
        proc.stop()


def test_exhausted_quota_tells_the_sdk_not_to_retry(fake: EmulatorThread, tmp_path: Path) -> None:
    """Case 9: with no other candidate, the client gets the 429 with ``x-should-retry: false``; later requests
    get 429 ``insufficient_quota`` from the gateway itself, not a 503."""
    cfg = _config(fake, fallback=False)
    for up in cfg["upstreams"]:
        up["health"] = {}
    proc, _ = start_gateway(cfg, tmp_path)
    try:
        CASES["quota_alone"] = Plan(status=429, headers=JSON, parts=[(0, QUOTA)], chunked=False)
        n = len(fake.requests)
        with pytest.raises(openai.RateLimitError) as info:
            _client(proc, retries=2).chat.completions.create(model="m", messages=MESSAGES,
                                                             extra_body={"x_case": "quota_alone"})
        assert info.value.code == "insufficient_quota"
        assert info.value.response.headers["x-should-retry"] == "false"
        assert len(fake.requests) == n + 1  # the SDK did not retry
        again = _post(proc, "quota_alone", stream=False)
        assert again.status_code == 429 and again.json()["error"]["code"] == "insufficient_quota"
        assert again.headers["x-should-retry"] == "false" and len(fake.requests) == n + 1
    finally:
        proc.stop()


LLAMACPP_OVERFLOW = (b'{"error":{"code":500,"message":"request (9120 tokens) exceeds the available context size '
                     b'(8192 tokens)","type":"server_error"}}')


def test_context_overflow_reported_as_500_is_a_400_and_goes_to_the_other_tier(fake: EmulatorThread,
                                                                              tmp_path: Path) -> None:
    """Case 10: llama.cpp's 500 for a prompt over the window is the request's fault: 400 context_length_exceeded,
    no breaker failure (``failures: 1`` here), and the other tier, whose window may be larger, may serve it."""
    cfg = _config(fake)
    cfg["upstreams"][0]["health"] = {"failures": 1}
    proc, _ = start_gateway(cfg, tmp_path)
    alone, _ = start_gateway({**cfg, "fallback": False}, tmp_path)
    try:
        CASES["overflow"] = [Plan(status=500, headers=JSON, parts=[(0, LLAMACPP_OVERFLOW)], chunked=False),
                             Plan(parts=[(0, sse(chunk(role=True), chunk("ok"), chunk(finish="stop")))])]
        SEEN.pop("overflow", None)
        resp = _post(proc, "overflow", model="m-fast")
        assert resp.status_code == 200 and resp.headers["x-tiergate-tier"] == "standard"
        assert resp.headers["x-tiergate-fallback"] == "context_length"
        CASES["overflow"] = Plan(status=500, headers=JSON, parts=[(0, LLAMACPP_OVERFLOW)], chunked=False)
        resp = _post(alone, "overflow", model="m-fast")
        assert resp.status_code == 400
        assert resp.json()["error"] == {"message": "request (9120 tokens) exceeds the available context size "
                                                   "(8192 tokens)", "type": "invalid_request_error",
                                        "param": "messages", "code": "context_length_exceeded"}
        for p in (proc, alone):  # no breaker opened (one failure would have opened it)
            assert sample(_metrics(p), "tiergate_upstream_state", missing_ok=False, upstream="f-fast",
                          state="closed") == 1
    finally:
        proc.stop()
        alone.stop()


@pytest.mark.parametrize(("status", "body", "message", "etype"), [
    (500, b'{"status_code":500,"error":{"message":"server error, please retry","type":"server_error","param":"",'
          b'"code":"","id":""}}', "server error, please retry", "server_error"),  # Cerebras
    (404, b'{"detail":"Not Found"}', "Not Found", "invalid_request_error"),  # FastAPI-style servers
    (503, b'{"error":{"type":"server_error"}}', '{"error":{"type":"server_error"}}', "server_error"),
])
def test_upstream_error_envelopes_keep_their_words_and_null_empty_fields(fake: EmulatorThread, tmp_path: Path,
                                                                         status: int, body: bytes, message: str,
                                                                         etype: str) -> None:
    """Case 11: empty ``param``/``code`` become null; a body without a string ``message`` keeps its own words."""
    proc, _ = start_gateway(_config(fake, fallback=False), tmp_path)
    try:
        CASES[f"envelope_{status}"] = Plan(status=status, headers=JSON, parts=[(0, body)], chunked=False)
        resp = _post(proc, f"envelope_{status}", stream=False)
        assert resp.status_code == status
        assert resp.json() == {"error": {"message": message, "type": etype, "param": None, "code": None}}
    finally:
        proc.stop()


def test_a_reset_of_zero_does_not_spill_over_for_a_minute(fake: EmulatorThread, tmp_path: Path) -> None:
    """Case 12: ``x-ratelimit-reset-requests: 0s`` means the window is already new, not "60 s"."""
    proc, _ = start_gateway(_config(fake), tmp_path)
    try:
        CASES["reset0"] = Plan(headers={**JSON, "x-ratelimit-remaining-requests": "0",
                                        "x-ratelimit-reset-requests": "0s"}, parts=JSON_OK.parts, chunked=False)
        first = _post(proc, "reset0", stream=False, model="m-fast")
        time.sleep(0.01)
        second = _post(proc, "reset0", stream=False, model="m-fast")
        assert first.headers["x-tiergate-tier"] == second.headers["x-tiergate-tier"] == "fast"
        assert "x-tiergate-fallback" not in second.headers
    finally:
        proc.stop()


def test_a_429_with_only_reset_headers_cools_down_and_says_when(fake: EmulatorThread, tmp_path: Path) -> None:
    """Case 21: Cerebras' 429 with ``x-ratelimit-reset-tokens-minute`` (float seconds) and no retry-after."""
    cfg = _config(fake, fallback=False)
    for up in cfg["upstreams"]:
        up["health"] = {}
    proc, _ = start_gateway(cfg, tmp_path)
    try:
        CASES["reset_429"] = Plan(status=429, headers={
            **JSON, "x-ratelimit-remaining-tokens-minute": "0", "x-ratelimit-reset-tokens-minute": "2.5",
            "x-ratelimit-remaining-requests-day": "14000", "x-ratelimit-reset-requests-day": "50000.1"},
            parts=[(0, b'{"message":"Tokens per minute limit exceeded","type":"too_many_tokens_error",'
                       b'"param":"quota","code":"token_quota_exceeded"}')], chunked=False)
        n = len(fake.requests)
        resp = _post(proc, "reset_429", stream=False, model="m-fast")
        assert resp.status_code == 429 and resp.headers["retry-after"] == "3"
        again = _post(proc, "reset_429", stream=False, model="m-fast")  # the upstream rests: not asked again
        assert again.status_code == 429 and again.json()["error"]["code"] == "rate_limit_exceeded"
        assert again.headers["retry-after"] in ("2", "3") and len(fake.requests) == n + 1
    finally:
        proc.stop()


# ---- the HTTP surface ---------------------------------------------------------------------------------------


def _read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            out += data
    return out


def _responses(raw: bytes) -> list[h11.Response]:
    """Every response on one connection's bytes, parsed by a strict HTTP/1.1 client."""
    conn = h11.Connection(h11.CLIENT)
    out: list[h11.Response] = []
    conn.receive_data(raw)
    while True:
        # the client side must have "sent" a request for h11 to parse a response: pretend each was sent
        if conn.our_state in (h11.IDLE, h11.DONE) and conn.their_state in (h11.IDLE, h11.DONE):
            if conn.our_state is h11.DONE:
                conn.start_next_cycle()
            conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
            conn.send(h11.EndOfMessage())
        event = conn.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return out
        if isinstance(event, h11.Response):
            out.append(event)
        if isinstance(event, h11.ConnectionClosed):
            return out


def test_an_early_answer_to_an_unread_body_is_the_only_answer(tmp_path: Path, fake: EmulatorThread) -> None:
    """Case 13: a 2 MB body over the 1 MiB limit gets one 413, and the connection closes; the rest of the body is
    never read as a second request (which used to get a 431 on the same connection)."""
    proc, _ = start_gateway(_config(fake, limits={"max_request_bytes": 1048576}), tmp_path)
    try:
        body = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 2_000_000 + b'"}]}'
        with socket.create_connection(("127.0.0.1", proc.port), timeout=5) as sock:
            def push() -> None:
                with contextlib.suppress(OSError):
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                                 b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            sender = threading.Thread(target=push)
            sender.start()
            raw = _read_until_closed(sock)
            sender.join(5)
        assert raw.count(b"HTTP/1.1 ") == 1, raw[:300]
        answers = _responses(raw)
        assert [r.status_code for r in answers] == [413]
        assert (b"connection", b"close") in answers[0].headers
    finally:
        proc.stop()


def _exchange(port: int, data: bytes, *, half_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return _read_until_closed(sock, timeout=3)


def _request(body: bytes, *extra: bytes) -> bytes:
    head = [b"POST /v1/chat/completions HTTP/1.1", b"host: x", b"content-type: application/json", *extra]
    if not any(h.lower().startswith((b"content-length", b"transfer-encoding")) for h in extra):
        head.append(b"content-length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


OK_BODY = orjson.dumps({"model": "m", "x_case": "", "messages": MESSAGES, "stream": True})


def test_pipelined_requests_get_one_answer_each_in_order(gw: Proc) -> None:
    """Case 13: two requests in one write; the last says ``connection: close`` so the server ends the exchange."""
    second = orjson.dumps({"model": "nope", "messages": MESSAGES})
    raw = _exchange(gw.port, _request(OK_BODY) + _request(second, b"connection: close"))
    assert [r.status_code for r in _responses(raw)] == [200, 404]


def test_expect_100_continue(gw: Proc) -> None:
    """Case 13: ``Expect: 100-continue`` gets 100 then the answer; a body declared over the limit gets the 413
    without a 100 (the client never sends it) and the connection closes."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        head = _request(OK_BODY, b"expect: 100-continue", b"connection: close")
        sock.sendall(head[: -len(OK_BODY)])
        sock.settimeout(3)
        assert sock.recv(100).startswith(b"HTTP/1.1 100 ")
        sock.sendall(OK_BODY)
        assert [r.status_code for r in _responses(_read_until_closed(sock))] == [200]
    raw = _exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"expect: 100-continue\r\ncontent-length: 999999999\r\n\r\n")
    assert b"100 Continue" not in raw and [r.status_code for r in _responses(raw)] == [413]


def test_conflicting_length_headers_and_a_body_that_ends_early(gw: Proc) -> None:
    """Case 13: ``Content-Length`` with ``Transfer-Encoding`` (a request-smuggling shape), and a body cut short
    by the client's half-close: one 400 each, in OpenAI's envelope, and the connection closes."""
    raw = _exchange(gw.port, _request(b"5\r\nhello\r\n0\r\n\r\n", b"content-length: 12", b"transfer-encoding: chunked"))
    answers = _responses(raw)
    assert [r.status_code for r in answers] == [400] and raw.count(b"HTTP/1.1 ") == 1
    assert orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    raw = _exchange(gw.port, _request(OK_BODY[:20], b"content-length: %d" % len(OK_BODY)), half_close=True)
    assert [r.status_code for r in _responses(raw)] == [400] and raw.count(b"HTTP/1.1 ") == 1
    assert orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "incomplete_body"


def test_a_lone_surrogate_escape_is_forwarded_as_sent(fake: EmulatorThread, gw: Proc) -> None:
    """Case 14: ``"\\ud83d"`` alone is valid JSON text; it reaches both dialects (OpenAI: the client's bytes)."""
    raw = (b'{"model": "m", "x_case": "", "messages": [{"role": "user", "content": "Emoji \xf0\x9f\x98\x8a and '
           b'escaped \\ud83d"}]}')
    CASES["json_ok"] = JSON_OK
    raw = raw.replace(b'"x_case": ""', b'"x_case": "json_ok"')
    for tier in ("standard", "fast"):
        resp = httpx.post(_url(gw) + "/chat/completions", content=raw, timeout=5,
                          headers={"content-type": "application/json", "x-tiergate-tier": tier})
        assert resp.status_code == 200, resp.text
        sent = fake.requests[-1].body
        if tier == "standard":
            assert sent == raw.replace(b'"model": "m"', b'"model": "m-std"')
        else:
            forwarded = json.loads(sent)  # re-serialised for Cerebras (fields dropped): the same string, escaped
            assert forwarded["model"] == "m-fast"
            assert forwarded["messages"][0]["content"] == "Emoji \U0001f60a and escaped \ud83d"


# ---- lifecycle ----------------------------------------------------------------------------------------------


def _stream_in_thread(url: str, body: dict[str, Any], out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            chunks = []
            with httpx.stream("POST", url + "/chat/completions", json=body, timeout=30) as resp:
                for data in resp.iter_raw():
                    chunks.append(data)
            out["body"] = b"".join(chunks)
        except httpx.HTTPError as exc:
            out["error"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _sigterm_during_stream(tmp_path: Path, tokens: int, env: dict[str, str]) -> tuple[dict[str, Any], float, Proc]:
    up = emulator("standard", tmp_path, tps=50, ttft=0.05)
    port = free_port()
    cfg = {"upstreams": [{"name": "std", "tier": "standard", "base_url": f"http://127.0.0.1:{up.port}/v1",
                          "timeouts": {"connect": 2, "idle": 5}, "models": {"m": "m"}}]}
    path = tmp_path / "drain.yaml"
    path.write_text(orjson.dumps(cfg).decode())
    proc = Proc(["serve", "--config", str(path), "--port", str(port), "--log-level", "warning"], port,
                tmp_path / "drain.log", env=env)
    out: dict[str, Any] = {}
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"[[emulate tokens={tokens}]]"}]}
    thread = _stream_in_thread(f"http://127.0.0.1:{port}/v1", body, out)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    thread.join(30)
    took = time.monotonic() - t0
    proc.popen.wait(30)
    proc.stop()
    up.stop()
    return out, took, proc


def test_sigterm_drains_a_long_stream_to_its_end(tmp_path: Path) -> None:
    """Case 15: SIGTERM 0.5 s into a 6.5 s stream (325 tokens at 50 tokens/s): the stream runs to its end (uvicorn
    alone cut it 5 s after the signal), then the process exits."""
    out, took, proc = _sigterm_during_stream(tmp_path, 325, {})
    assert "error" not in out, out
    assert out["body"].endswith(b"data: [DONE]\n\n") and not _errors(out["body"])
    assert out["body"].count(b'"content"') >= 325 and took > 5.0
    assert proc.popen.returncode is not None


def test_drain_timeout_ends_what_is_left_in_band(tmp_path: Path) -> None:
    """Case 15: with ``GATEWAY_DRAIN_TIMEOUT=1`` a stream still running 1 s after SIGTERM ends with an in-band
    ``gateway_draining`` error event, not a cut connection."""
    out, took, _ = _sigterm_during_stream(tmp_path, 300, {"GATEWAY_DRAIN_TIMEOUT": "1"})
    assert "error" not in out, out
    assert [e["error"]["code"] for e in _errors(out["body"])] == ["gateway_draining"]
    assert 0.9 < took < 3.0 and b"[DONE]" not in out["body"]


async def test_readyz_fails_once_draining(fake: EmulatorThread, tmp_path: Path) -> None:
    """Case 15: readiness fails at the drain's first step (in-process: with the signal the listener closes too)."""
    from gateway.app import create_app
    from gateway.config.load import load_config

    path = tmp_path / "ready.yaml"
    path.write_text(orjson.dumps(_config(fake)).decode())
    app = create_app(load_config(path, {}))
    await app.gateway.transport.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            assert (await client.get("/readyz")).status_code == 200
            app.begin_drain(30.0)
            resp = await client.get("/readyz")
            assert resp.status_code == 503 and resp.json() == {"status": "draining"}
            assert (await client.get("/healthz")).status_code == 200  # the process is still up
    finally:
        await app.gateway.transport.stop()


def test_demo_port_check_ignores_time_wait_sockets() -> None:
    """Case 16: the port a stopped demo used (its connections now in TIME_WAIT) counts as free."""
    from gateway.cli import _require_free

    port = free_port()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end of the connection stays in TIME_WAIT
        client.close()
    _require_free("127.0.0.1", port, "a test")  # raised "already in use" before


def test_an_emulator_started_by_the_demo_ends_when_the_demo_is_killed(tmp_path: Path) -> None:
    """Case 16: SIGKILL of the demo leaves no emulator holding its port (``--exit-with-parent``)."""
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-m', 'gateway', 'emulate', '--port', '{port}', '--exit-with-parent'])\n"
        "time.sleep(60)\n")], cwd=ROOT)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            time.sleep(0.05)
        else:
            pytest.fail("the emulator never listened")
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            except OSError:
                return  # the emulator is gone and its port free
            time.sleep(0.05)
        pytest.fail("the emulator outlived the process that started it")
    finally:
        parent.kill()


def test_serve_names_every_missing_key_and_counts_rules_from_one(tmp_path: Path) -> None:
    """Case 16: ``serve`` with two keys missing names both; a bad rule is numbered as ``check-config`` lists it."""
    base = {"upstreams": [
        {"name": "a", "tier": "fast", "base_url": "http://127.0.0.1:1/v1", "api_key_env": "TG_KEY_A",
         "models": {"m": "m"}},
        {"name": "b", "tier": "standard", "base_url": "http://127.0.0.1:1/v1", "api_key_env": "TG_KEY_B",
         "models": {"m": "m"}}]}
    path = tmp_path / "keys.yaml"
    path.write_text(orjson.dumps(base).decode())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TG_KEY_")}
    run = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "TG_KEY_A" in run.stderr and "TG_KEY_B" in run.stderr
    base["rules"] = [{"name": "ok", "route": {"tier": "fast"}, "match": {"stream": True}},
                     {"name": "broken", "route": {"tier": "medium"}}]
    path.write_text(orjson.dumps(base).decode())
    run = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "rule 2 (rules.1.route.tier)" in run.stderr


# ---- connections --------------------------------------------------------------------------------------------


def test_an_idle_client_connection_outlives_common_client_pools(gw: Proc) -> None:
    """Case 17: a connection reused 5.5 s after its last answer (httpx pools keep them 5 s) still serves."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        for i in range(2):
            if i:
                time.sleep(5.5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            sock.settimeout(3)
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                data = sock.recv(65536)
                assert data, f"request {i + 1}: the gateway closed the connection"
                answer += data
            assert answer.startswith(b"HTTP/1.1 200 "), (i, answer)


def test_keepalive_timeout_is_configurable(fake: EmulatorThread, tmp_path: Path) -> None:
    """Case 17: ``GATEWAY_KEEPALIVE_TIMEOUT`` closes an idle client connection after that long."""
    proc, _ = start_gateway(_config(fake), tmp_path, env={"GATEWAY_KEEPALIVE_TIMEOUT": "0.3"})
    try:
        with socket.create_connection(("127.0.0.1", proc.port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            t0 = time.monotonic()
            raw = _read_until_closed(sock)
            assert raw.startswith(b"HTTP/1.1 200 ") and 0.25 < time.monotonic() - t0 < 2.0
    finally:
        proc.stop()


def test_a_stale_pooled_upstream_connection_is_retried_once_on_a_new_one(fake: EmulatorThread, gw: Proc) -> None:
    """Case 18: the upstream closed a pooled keep-alive connection just as the next request went out on it: that
    request is sent again on a new connection (and counted), never a 502. A fresh connection failing the same
    way is not retried: the upstream may have processed it."""
    CASES["stale"] = [JSON_OK, Plan(drop=True), JSON_OK]
    SEEN.pop("stale", None)
    before = _metrics(gw)
    with httpx.Client(timeout=5) as client:
        for _ in range(2):  # the second request goes out on the pooled connection, which the upstream drops
            body = {"model": "m", "x_case": "stale", "messages": MESSAGES}
            resp = client.post(_url(gw) + "/chat/completions", json=body, headers={"x-tiergate-tier": "standard"})
            assert resp.status_code == 200, resp.text
    stale = [r for r in fake.requests if b'"x_case":"stale"' in r.body]
    assert len(stale) == 3 and stale[1].connection == stale[0].connection != stale[2].connection
    assert _grew(before, _metrics(gw), "tiergate_upstream_errors_total", reason="stale_connection") == 1
    CASES["fresh_drop"] = Plan(drop=True)
    # a pooled connection the upstream drops only after holding the request 0.3 s (the idle timeout is 0.5 s): it
    # may have acted on it
    CASES["late_drop"] = [JSON_OK, Plan(drop=True, head_delay=0.3)]
    SEEN.pop("late_drop", None)
    cfg_alone = _config(fake, fallback=False)
    proc, _ = start_gateway(cfg_alone, Path(gw.log).parent)
    try:
        n = len(fake.requests)
        resp = _post(proc, "fresh_drop", stream=False)
        assert resp.status_code == 502 and len(fake.requests) == n + 1
        with httpx.Client(timeout=5) as client:
            statuses = [client.post(_url(proc) + "/chat/completions", json={"model": "m", "x_case": "late_drop",
                                                                          "messages": MESSAGES}).status_code
                        for _ in range(2)]
        assert statuses == [200, 502]
        assert len([r for r in fake.requests if b'"x_case":"late_drop"' in r.body]) == 2  # never sent twice
    finally:
        proc.stop()


def test_a_stale_connection_is_counted_when_the_stream_then_fails_before_its_first_token(
        fake: EmulatorThread, gw_ttft: Proc) -> None:
    """The retry on a new connection answered its status line, then no token came: the stale connection is still
    counted (it was once counted only with the first token)."""
    stream_ok = Plan(parts=[(0, sse(chunk(role=True), chunk("ok"), chunk(finish="stop")))])
    stall = Plan(parts=[(0, sse(chunk(role=True), done=False)), (5.0, sse(chunk("late")))])
    CASES["stale_stream"] = [stream_ok, Plan(drop=True), stall]
    SEEN.pop("stale_stream", None)
    before = _metrics(gw_ttft)
    with httpx.Client(timeout=10) as client:
        statuses = [client.post(_url(gw_ttft) + "/chat/completions", headers={"x-tiergate-tier": "standard"},
                                json={"model": "m", "x_case": "stale_stream", "stream": True,
                                      "messages": MESSAGES}).status_code for _ in range(2)]
    assert statuses == [200, 504]
    assert _grew(before, _metrics(gw_ttft), "tiergate_upstream_errors_total", reason="stale_connection") == 1


def test_unrequested_usage_chunk_is_dropped_for_every_dialect(fake: EmulatorThread, gw: Proc) -> None:
    """Case 19: a Cerebras-dialect upstream that sends its own ``choices: []`` usage chunk: the client, which did
    not ask for usage, never sees it (clients index ``choices[0]``), and its usage is still counted."""
    events = [chunk(role=True), chunk("a"), chunk(finish="stop"), chunk(usage=True)]
    CASES["cb_usage"] = Plan(parts=[(0, sse(*events, done=False))])
    before = _metrics(gw)
    resp = _post(gw, "cb_usage", model="m-fast")
    assert resp.headers["x-tiergate-upstream"] == "f-fast"
    assert resp.content == sse(*events[:3])
    assert _grew(before, _metrics(gw), "tiergate_tokens_total", tier="fast", token_type="output") == 3


@pytest.mark.parametrize("model", ["m", "m-fast"])
def test_stream_options_on_a_request_that_does_not_stream_are_dropped(fake: EmulatorThread, gw: Proc,
                                                                      model: str) -> None:
    """Case 19: ``stream_options`` with ``stream: false`` means nothing; strict upstreams answer it with 400."""
    CASES["so"] = JSON_OK
    resp = _post(gw, "so", stream=False, model=model, stream_options={"include_usage": True})
    assert resp.status_code == 200
    assert "stream_options" not in orjson.loads(fake.requests[-1].body)


def test_done_without_its_blank_line_at_eof_ends_well_formed(fake: EmulatorThread, gw: Proc) -> None:
    """Case 20: ``data: [DONE]`` with no blank line, then EOF, after every choice finished."""
    CASES["done_eof"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), chunk(finish="stop"), done=False)
                                     + b"data: [DONE]")])
    before = _metrics(gw)
    resp = _post(gw, "done_eof")
    assert resp.content == sse(chunk(role=True), chunk("a"), chunk(finish="stop"))
    assert _grew(before, _metrics(gw), "tiergate_requests_total", outcome="success") == 1


# ---- found by review: each failed before its fix -------------------------------------------------------------


def test_keep_alives_without_a_token_commit_the_stream_after_the_idle_timeout(fake: EmulatorThread, gw: Proc) -> None:
    """The hold before the first token is bounded: an upstream that sends only keep-alive comments (and its role
    chunk) for longer than ``idle`` has them relayed from then on; one that sends far more than the hold's byte
    bound is committed at once (the gateway held 325 MB for one such stream)."""
    comments = [(0.1, b": keep-alive\n\n") for _ in range(12)]
    CASES["keepalive"] = Plan(parts=[(0, sse(chunk(role=True), done=False)), *comments,
                                     (0, sse(chunk("late"), chunk(finish="stop")))])
    n = len(fake.requests)
    t0 = time.monotonic()
    with httpx.stream("POST", _url(gw) + "/chat/completions", timeout=10, json={
            "model": "m", "stream": True, "x_case": "keepalive", "messages": MESSAGES}) as resp:
        reads = resp.iter_raw()
        first = next(reads)
        t_first = time.monotonic()
        rest = b"".join(reads)
    # committed at the hold's bound (the idle timeout, 0.5 s), not held until the token the upstream wrote 1.2 s after
    # the request reached it: the first bytes came without the token, before it could have been sent
    assert resp.status_code == 200 and t_first - t0 > 0.45 and b"late" not in first, (t_first - t0, first)
    assert t_first < fake.requests[n].at + 1.2, (t_first, fake.requests[n].at)
    assert b"keep-alive" in first + rest and (first + rest).endswith(b"data: [DONE]\n\n")
    # 400 KiB before the first token, which comes 0.5 s later (a comment halfway: never quiet for the idle timeout)
    big = [(0, b": " + b"x" * 4096 + b"\n\n") for _ in range(100)]
    CASES["bulky"] = Plan(parts=[*big, (0.25, b": k\n\n"), (0.25, sse(chunk("late"), chunk(finish="stop")))])

    def attempt() -> tuple[float, float]:
        n = len(fake.requests)
        with httpx.stream("POST", _url(gw) + "/chat/completions", timeout=10, json={
                "model": "m", "stream": True, "x_case": "bulky", "messages": MESSAGES}) as resp:
            reads = resp.iter_raw()
            next(reads)
            t_first = time.monotonic()
            assert b"".join(reads).endswith(b"data: [DONE]\n\n")
        # committed at the byte bound: without it the hold lasts until the token or its time bound (0.5 s each,
        # from the upstream's bytes), so the first bytes could not come before 0.5 s after the request reached it
        return t_first - fake.requests[n].at, 0.5
    timely(attempt)


@pytest.mark.parametrize("stream", [True, False])
def test_nonsense_usage_numbers_never_break_the_answer(fake: EmulatorThread, gw: Proc, stream: bool) -> None:
    """A negative token count (prometheus counters refuse them) or a usage detail of the wrong type is not the
    client's problem: the answer arrives whole, and nothing negative is counted."""
    usage = {"prompt_tokens": -5, "completion_tokens": 2, "total_tokens": -3,
             "prompt_tokens_details": [1], "completion_tokens_details": {"reasoning_tokens": -1}}
    if stream:
        last = orjson.loads(chunk(finish="stop"))
        last["usage"] = usage
        CASES["bad_usage"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), orjson.dumps(last)))])
    else:
        CASES["bad_usage"] = Plan(headers=JSON, parts=[(0, orjson.dumps(
            {"id": "x", "object": "chat.completion", "choices": [], "usage": usage}))], chunked=False)
    before = _metrics(gw)
    with httpx.Client(timeout=10) as client:
        resp = client.post(_url(gw) + "/chat/completions", json={
            "model": "m", "stream": stream, "x_case": "bad_usage", "messages": MESSAGES})
    assert resp.status_code == 200
    if stream:
        assert resp.content.endswith(b"data: [DONE]\n\n")
    after = _metrics(gw)
    assert _grew(before, after, "tiergate_requests_total", outcome="success") == 1
    assert _grew(before, after, "tiergate_tokens_total", token_type="output") == 2
    assert _grew(before, after, "tiergate_tokens_total", token_type="input") == 0


def test_choices_with_odd_indexes_or_empty_finish_reasons(fake: EmulatorThread, gw: Proc) -> None:
    """``"finish_reason": ""`` is no finish, and a choice index the request did not ask for does not finish it (both
    ended streams early, as successes); an unhashable index is not a 500."""
    odd = [orjson.loads(chunk("a")) for _ in range(2)]
    odd[0]["choices"][0]["finish_reason"] = ""
    odd[1]["choices"][0]["index"] = 1
    odd[1]["choices"][0]["finish_reason"] = "stop"
    parts = [(0, sse(chunk(role=True), done=False))] + [(0.35, sse(orjson.dumps(c), done=False)) for c in odd]
    CASES["odd_finish"] = Plan(parts=[*parts, (0.35, sse(chunk("end"), chunk(finish="stop")))])
    resp = _post(gw, "odd_finish")
    assert b'"end"' in resp.content and resp.content.endswith(b"data: [DONE]\n\n")  # not cut at finish_grace
    weird = orjson.loads(chunk(finish="stop"))
    weird["choices"][0]["index"] = [1]
    CASES["weird_index"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), orjson.dumps(weird)))])
    assert _post(gw, "weird_index").status_code == 200


def test_a_clean_end_before_the_finish_is_an_interrupted_stream(fake: EmulatorThread, gw: Proc) -> None:
    """A body that ends cleanly (chunked terminator) after some tokens but before any ``finish_reason`` truncated the
    answer: the client is told so in band (it used to get ``[DONE]`` and a success)."""
    CASES["cut_clean"] = Plan(parts=[(0, sse(chunk(role=True), chunk("The answer is"), done=False))])
    before = _metrics(gw)
    resp = _post(gw, "cut_clean")
    assert [e["error"]["code"] for e in _errors(resp.content)] == ["upstream_stream_interrupted"]
    assert b"[DONE]" not in resp.content
    assert _grew(before, _metrics(gw), "tiergate_requests_total", outcome="stream_error") == 1


def test_an_empty_event_stream_fails_over_and_leaves_nothing_in_flight(fake: EmulatorThread, gw: Proc) -> None:
    """A 200 event stream with no event in it is no answer: the other tier serves it (it used to be an empty
    success that left ``tiergate_in_flight_requests`` above zero)."""
    CASES["empty_sse"] = [Plan(parts=[(0, b"event: ping\n\n")]), Plan(parts=[(0, sse(chunk(role=True), chunk("ok"),
                                                                                     chunk(finish="stop")))])]
    SEEN.pop("empty_sse", None)
    resp = _post(gw, "empty_sse", model="m-fast")
    assert resp.status_code == 200 and resp.headers["x-tiergate-fallback"] == "upstream_bad_response"
    assert sample(_metrics(gw), "tiergate_in_flight_requests") == 0


def test_giving_up_counts_the_attempts_once_and_no_fallback(fake: EmulatorThread, gw: Proc) -> None:
    CASES["both_500"] = Plan(status=500, headers=JSON, parts=[(0, b'{"error":{"message":"down"}}')], chunked=False)
    before = _metrics(gw)
    assert _post(gw, "both_500", model="m-fast").status_code == 500
    after = _metrics(gw)
    assert _grew(before, after, "tiergate_upstream_attempts_count") == 1
    assert _grew(before, after, "tiergate_upstream_attempts_sum") == 2
    assert _grew(before, after, "tiergate_fallbacks_total") == 0  # nothing was served by the fallback


def test_an_error_event_after_the_first_token_tells_health_its_status(fake: EmulatorThread, tmp_path: Path) -> None:
    """An upstream's ``server_error`` event mid-stream counts against its breaker (``failures: 1`` here); a 400-ish
    one (Groq's ``tool_use_failed``) is the request's fault and does not."""
    cfg = _config(fake, fallback=False)
    cfg["upstreams"][1]["health"] = {"failures": 1}
    proc, _ = start_gateway(cfg, tmp_path)
    try:
        CASES["bad_tool"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), '{"error":{"message":"bad","type":'
                                                '"invalid_request_error","code":"tool_use_failed","status_code":400}}',
                                                done=False))])
        CASES["overloaded"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), '{"error":{"message":"overloaded",'
                                                  '"type":"server_error"}}', done=False))])
        _post(proc, "bad_tool")
        assert sample(_metrics(proc), "tiergate_upstream_state", upstream="f-std", state="closed") == 1
        _post(proc, "overloaded")
        assert sample(_metrics(proc), "tiergate_upstream_state", upstream="f-std", state="open") == 1
    finally:
        proc.stop()


def test_a_client_gone_during_its_upload_is_counted(gw: Proc) -> None:
    before = _metrics(gw)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{\"model\":")
        time.sleep(0.1)
    time.sleep(0.2)
    assert _grew(before, _metrics(gw), "tiergate_requests_total", outcome="client_disconnect") == 1


def test_lone_surrogates_the_gateway_quotes_back(gw: Proc) -> None:
    """An unknown model named with a lone surrogate is a 404 (the error message quotes it), and the route endpoint
    explains a request whose metadata holds one (both were 500s)."""
    raw = b'{"model": "gpt-\\ud83d", "messages": [{"role": "user", "content": "x"}]}'
    resp = httpx.post(_url(gw) + "/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    raw = b'{"model": "m", "metadata": {"workload": "\\ud83d"}, "messages": [{"role": "user", "content": "x"}]}'
    resp = httpx.post(f"http://127.0.0.1:{gw.port}/v1/tiergate/route", content=raw,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 200 and resp.json()["tier"] == "standard"


def test_numbers_the_cerebras_dialect_reserialises_stay_exact(fake: EmulatorThread, gw: Proc) -> None:
    """A seed past 64 bits reaches Cerebras exact (orjson reads it as a float), and a number beyond a double's
    range is refused with 400 (it used to be sent as null)."""
    CASES["json_ok"] = JSON_OK
    raw = (b'{"model": "m", "x_case": "json_ok", "seed": 18446744073709551617, '
           b'"messages": [{"role": "user", "content": "x"}]}')
    resp = httpx.post(_url(gw) + "/chat/completions", content=raw,
                      headers={"content-type": "application/json", "x-tiergate-tier": "fast"})
    assert resp.status_code == 200 and b'"seed":18446744073709551617' in fake.requests[-1].body
    resp = httpx.post(_url(gw) + "/chat/completions", content=b'{"model": "m", "temperature": 1e400, "messages": '
                      b'[{"role": "user", "content": "x"}]}', headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_a_request_whose_body_completes_after_the_drain_is_refused(tmp_path: Path) -> None:
    """The drain ends everything still running at ``GATEWAY_DRAIN_TIMEOUT``; a request whose body arrives after that
    gets 503 ``gateway_draining`` (it used to be served until uvicorn cut it, unrecorded)."""
    up = emulator("standard", tmp_path, tps=50, ttft=0.05)
    port = free_port()
    cfg = {"upstreams": [{"name": "std", "tier": "standard", "base_url": f"http://127.0.0.1:{up.port}/v1",
                          "models": {"m": "m"}}]}
    path = tmp_path / "late.yaml"
    path.write_text(orjson.dumps(cfg).decode())
    proc = Proc(["serve", "--config", str(path), "--port", str(port), "--log-level", "warning"], port,
                tmp_path / "late.log", env={"GATEWAY_DRAIN_TIMEOUT": "0.5"})
    try:
        body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body[:10]))
            time.sleep(0.2)
            proc.popen.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # past the drain
            sock.sendall(body[10:])
            answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"gateway_draining" in answer
    finally:
        proc.stop()
        up.stop()
