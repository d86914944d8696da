"""The wire contract's conformance checks (docs/reference/wire.md#conformance-checks) over real sockets.

One emulator playing scripted plans serves both tiers (fast: Cerebras dialect, standard: OpenAI dialect); each test
picks its scripted answer with a top-level ``x_case`` field, which the OpenAI dialect forwards untouched.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tools.emulator import EmulatorThread, Plan, Received

from conftest import Proc, chunk, on_time, round_trip, sample, sse, start_gateway, timely

CASES: dict[str, Plan] = {}
SECRET = "sk-SECRET-4f1c9"


def _handler(req: Received) -> Plan:
    try:
        case = orjson.loads(req.body).get("x_case", "")
    except orjson.JSONDecodeError:
        case = ""
    return CASES.get(case, Plan(parts=[(0, sse(chunk(role=True), chunk("ok"), chunk(finish="stop")))]))


@pytest.fixture(scope="module")
def fake() -> Iterator[EmulatorThread]:
    up = EmulatorThread(_handler)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def gw(fake: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    cfg = {
        "max_attempts": 1,
        "upstreams": [
            # the cases break many streams in a row on purpose: no breaker opens (test_failover covers it)
            {"name": "fake-fast", "tier": "fast", "base_url": fake.base_url, "dialect": "cerebras",
             "api_key_env": "FAKE_FAST_KEY", "timeouts": {"connect": 1, "idle": 0.5, "total": 5},
             "health": {"failures": 1000}, "models": {"m": "m-fast"}},
            {"name": "fake-std", "tier": "standard", "base_url": fake.base_url, "dialect": "openai",
             "api_key_env": "FAKE_STD_KEY", "timeouts": {"connect": 1, "idle": 0.5, "total": 5},
             "health": {"failures": 1000}, "models": {"m": "m-std"}},
        ],
    }
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("conf"),
                            env={"FAKE_FAST_KEY": "fast-upstream-key", "FAKE_STD_KEY": "std-upstream-key"})
    yield proc
    proc.stop()


def _url(gw: Proc) -> str:
    return f"http://127.0.0.1:{gw.port}/v1"


def _client(gw: Proc, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(gw), api_key=SECRET, max_retries=retries)


def _stream_bytes(gw: Proc, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    resp = httpx.post(_url(gw) + "/chat/completions", json={"model": "m", "stream": True, "messages": [
        {"role": "user", "content": "x"}], **body}, headers=headers, timeout=10)
    return resp


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


# 1. pass-through and 2. usage injected for metering
def test_plain_stream_passes_through_and_usage_is_metered_not_shown(fake: EmulatorThread, gw: Proc) -> None:
    body = sse(chunk(role=True), chunk("Hel"), chunk("lo"), chunk(finish="stop"), chunk(usage=True))
    CASES["pass"] = Plan(parts=[(0, body)])
    before = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
    resp = _stream_bytes(gw, {"x_case": "pass"})
    sent = orjson.loads(fake.requests[-1].body)
    assert sent["stream_options"] == {"include_usage": True}  # asked upstream for usage
    usage_event = b"data: " + chunk(usage=True).encode() + b"\n\n"
    assert resp.content == body.replace(usage_event, b"")  # ... and removed it from the client's stream
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert "content-length" not in resp.headers
    after = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
    grew = sample(after, "tiergate_tokens_total", missing_ok=False, token_type="output", tier="standard") - sample(
        before, "tiergate_tokens_total", token_type="output", tier="standard")
    assert grew == 3


# 3. usage requested by the client from a Cerebras-style upstream (usage on the finish chunk, no [DONE])
def test_client_usage_from_cerebras_style_upstream(fake: EmulatorThread, gw: Proc) -> None:
    finish = orjson.loads(chunk(finish="stop"))
    finish["usage"] = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    finish["time_info"] = {"queue_time": 0.001, "prompt_time": 0.002, "completion_time": 0.003, "total_time": 0.006}
    CASES["cb"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), chunk("b"), orjson.dumps(finish), done=False))])
    client = _client(gw)
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "x"}],
                                        stream_options={"include_usage": True},
                                        extra_body={"x_case": "cb"}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.usage is not None and final.usage.completion_tokens == 2


# 4. line endings, split CR/LF, multi-line data
@pytest.mark.parametrize("framing", ["crlf", "cr", "mixed", "split_crlf", "multiline"])
def test_line_endings_give_identical_chunks(fake: EmulatorThread, gw: Proc, framing: str) -> None:
    events = [chunk(role=True), chunk("one"), chunk("two\u2028three"), chunk(finish="stop")]
    lf = sse(*events)
    if framing == "crlf":
        parts = [(0.0, lf.replace(b"\n", b"\r\n"))]
    elif framing == "cr":
        parts = [(0.0, lf.replace(b"\n", b"\r"))]
    elif framing == "mixed":
        out = b""
        for i, ev in enumerate(_events(lf)):
            eol = (b"\n", b"\r\n", b"\r")[i % 3]
            out += ev + eol + eol
        parts = [(0.0, out)]
    elif framing == "split_crlf":
        crlf = lf.replace(b"\n", b"\r\n")
        cut = crlf.index(b"\r\n") + 1  # the CR in one read, its LF in the next
        parts = [(0.0, crlf[:cut]), (0.05, crlf[cut:])]
    else:
        text = chunk("one")
        mid = text.index(",")
        parts = [(0.0, sse(chunk(role=True), done=False) + b"data: " + text[:mid].encode() + b"\ndata: "
                  + text[mid:].encode() + b"\n\n" + sse(chunk(finish="stop")))]
        events = [chunk(role=True), chunk("one"), chunk(finish="stop")]
    CASES["frame"] = Plan(parts=parts)
    got = list(_client(gw).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                   stream=True, extra_body={"x_case": "frame"}))
    assert [c.model_dump() for c in got] == [
        openai.types.chat.ChatCompletionChunk.model_validate_json(e).model_dump() for e in events]


# 5. BOM, comments and U+2028; 6. never emit data-less events
def test_bom_comments_u2028_and_dataless_events(fake: EmulatorThread, gw: Proc) -> None:
    body = (b"\xef\xbb\xbf: ping\n\n" + sse(chunk(role=True), done=False) + b"event: ping\n\nid: 7\n\n\nretry: 10\n\n"
            + sse(chunk("a\u2028b"), chunk(finish="stop")))
    CASES["bom"] = Plan(parts=[(0, body)])
    resp = _stream_bytes(gw, {"x_case": "bom"})
    assert not resp.content.startswith(b"\xef\xbb\xbf")
    lines = resp.content.split(b"\n")
    assert not [ln for ln in lines if ln.startswith((b"event:", b"id:", b"retry:"))]
    assert "a\u2028b".encode() in resp.content
    got = list(_client(gw).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                   stream=True, extra_body={"x_case": "bom"}))
    assert [c.choices[0].delta.content for c in got] == ["", "a\u2028b", None]


# 7. an error event after the 200
def test_error_mid_stream_raises_api_error_in_the_sdk(fake: EmulatorThread, gw: Proc) -> None:
    err = b'{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}'
    CASES["err"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), err, done=False))], end="eof")
    with pytest.raises(openai.APIError) as info:
        list(_client(gw).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 stream=True, extra_body={"x_case": "err"}))
    assert info.value.message == "overloaded"
    assert not isinstance(info.value, openai.APIStatusError)
    resp = _stream_bytes(gw, {"x_case": "err"})
    assert b"[DONE]" not in resp.content


# 8. upstream EOF or reset mid-stream
@pytest.mark.parametrize("end", ["eof", "reset", "stall"])
def test_upstream_dies_mid_stream_gives_one_inband_error(fake: EmulatorThread, gw: Proc, end: str) -> None:
    CASES["die"] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), done=False))], end=end)
    before = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
    resp = _stream_bytes(gw, {"x_case": "die"})
    assert resp.status_code == 200
    events = _events(resp.content)
    assert events[:2] == _events(sse(chunk(role=True), chunk("a"), done=False))
    last = orjson.loads(events[-1][len(b"data: "):])
    code = "upstream_idle_timeout" if end == "stall" else "upstream_stream_interrupted"
    assert last["error"]["code"] == code and set(last["error"]) == {"message", "type", "param", "code"}
    assert b"[DONE]" not in resp.content and len(events) == 3
    after = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
    assert sample(after, "tiergate_requests_total", missing_ok=False, outcome="stream_error") == sample(
        before, "tiergate_requests_total", outcome="stream_error") + 1
    assert sample(after, "tiergate_upstream_errors_total", missing_ok=False, reason=code) == sample(
        before, "tiergate_upstream_errors_total", reason=code) + 1
    with pytest.raises(openai.APIError) as info:
        list(_client(gw).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 stream=True, extra_body={"x_case": "die"}))
    assert info.value.code == code  # type: ignore[attr-defined]


# 9. an error before the first byte: status, envelope (flat Cerebras body wrapped), retry headers kept
def test_429_flat_body_before_first_byte(fake: EmulatorThread, gw: Proc) -> None:
    flat = b'{"message":"Requests per minute limit exceeded","type":"too_many_requests_error","param":"quota",' \
           b'"code":"request_quota_exceeded"}'
    CASES["429"] = Plan(status=429, headers={"content-type": "application/json", "retry-after-ms": "200",
                                             "x-ratelimit-remaining-requests-day": "0"},
                        parts=[(0, flat)], chunked=False)
    n = len(fake.requests)
    resp = _stream_bytes(gw, {"x_case": "429"})
    assert resp.status_code == 429 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {"error": {"message": "Requests per minute limit exceeded",
                                     "type": "too_many_requests_error", "param": "quota",
                                     "code": "request_quota_exceeded"}}
    assert resp.headers["retry-after-ms"] == "200"
    assert resp.headers["x-ratelimit-remaining-requests-day"] == "0"
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as info:
        _client(gw, retries=2).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                       stream=True, extra_body={"x_case": "429"})
    assert info.value.code == "request_quota_exceeded"
    assert len(fake.requests) - n == 1 + 3  # one by httpx above, three by the SDK (it retried twice)
    assert time.monotonic() - t0 >= 0.4  # and honoured retry-after-ms between attempts


# 11. timeouts: no status line within the idle timeout -> 504 in the envelope
@pytest.mark.parametrize("stream", [True, False])
def test_upstream_hangs_before_headers_gives_504(fake: EmulatorThread, gw: Proc, stream: bool) -> None:
    CASES["hang"] = Plan(head_delay=2.0, parts=[(0, sse(chunk("late")))])  # idle timeout is 0.5 s
    t0 = time.monotonic()
    resp = httpx.post(_url(gw) + "/chat/completions", timeout=5, json={
        "model": "m", "stream": stream, "x_case": "hang", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "upstream_timeout"
    assert 0.5 <= time.monotonic() - t0 < 1.5


# 12. field filtering for Cerebras; the same request to OpenAI is byte-identical apart from the model
def test_cerebras_fields_dropped_openai_body_byte_identical(fake: EmulatorThread, gw: Proc) -> None:
    body = (b'{"messages": [{"role": "user", "content": "x"}], "model": "m", "metadata": {"k": "v"}, "store": true, '
            b'"service_tier": "priority", "parallel_tool_calls": true, "prompt_cache_key": "p", '
            b'"stream_options": {"include_obfuscation": false}, "temperature": 1.2, "max_tokens": 256, '
            b'"x_unknown_field": [1, 2.50, "\\u00e9"]}')
    httpx.post(_url(gw) + "/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=5)
    sent = orjson.loads(fake.requests[-1].body)  # service_tier=priority routed it to the fast tier (Cerebras)
    for field in ("metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key"):
        assert field not in sent
    assert "include_obfuscation" not in sent.get("stream_options", {})
    assert sent["temperature"] == 1.2 and sent["max_tokens"] == 256 and sent["model"] == "m-fast"
    httpx.post(_url(gw) + "/chat/completions", content=body, timeout=5,
               headers={"content-type": "application/json", "x-tiergate-tier": "standard"})
    # byte-identical apart from the model and the stream_options, which mean nothing on a request that does not
    # stream (strict upstreams refuse them): removed with the comma beside them, every other byte kept, the fast
    # service tier too (OpenAI sells priority processing on its standard tier: the client asked for it)
    assert fake.requests[-1].body == body.replace(b'"model": "m"', b'"model": "m-std"').replace(
        b'"stream_options": {"include_obfuscation": false}, ', b"")


# 14. service_tier echo: the upstream's answer is relayed untouched
def test_nonstream_body_relayed_untouched(fake: EmulatorThread, gw: Proc) -> None:
    answer = (b'{"id":"x","object":"chat.completion","created":1,"model":"gpt-5.6-2026-10-01",'
              b'"service_tier":"default","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
              b'"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
              b'"total_tokens":2}}\n')
    CASES["echo"] = Plan(headers={"content-type": "application/json"}, parts=[(0, answer)], chunked=False)
    resp = httpx.post(_url(gw) + "/chat/completions", timeout=5, json={
        "model": "m", "service_tier": "auto", "x_case": "echo", "messages": [{"role": "user", "content": "x"}]})
    assert resp.content == answer
    CASES["notjson"] = Plan(headers={"content-type": "text/html"}, parts=[(0, b"<html>oops</html>")], chunked=False)
    resp = httpx.post(_url(gw) + "/chat/completions", timeout=5, json={
        "model": "m", "x_case": "notjson", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_bad_response"


def test_no_client_credential_reaches_an_upstream_and_no_upstream_secret_reaches_the_client(
        fake: EmulatorThread, gw: Proc) -> None:
    CASES["hdr"] = Plan(headers={
        "content-type": "text/event-stream", "set-cookie": f"s={SECRET}", "x-internal-token": SECRET,
        "authorization": SECRET, "openai-organization": SECRET, "x-ratelimit-remaining-tokens": "99",
        "content-encoding": "identity", "retry-after": "1"}, parts=[(0, sse(chunk("a")))])
    planted = dict.fromkeys(("authorization", "api-key", "x-api-key", "cookie", "proxy-authorization",
                             "openai-organization", "openai-project", "x-goog-api-key", "x-secret"), SECRET)
    planted["authorization"] = f"Bearer {SECRET}"
    for tier in ("fast", "standard"):
        resp = httpx.post(_url(gw) + "/chat/completions", timeout=5, headers={**planted, "x-tiergate-tier": tier},
                          json={"model": "m", "stream": True, "x_case": "hdr",
                                "messages": [{"role": "user", "content": "x"}]})
        got = fake.requests[-1]
        assert SECRET not in repr(got.headers)
        assert got.headers["authorization"] == f"Bearer {tier if tier == 'fast' else 'std'}-upstream-key"
        assert got.headers["accept-encoding"] == "identity"
        assert SECRET not in repr(dict(resp.headers))
        assert resp.headers["x-ratelimit-remaining-tokens"] == "99" and resp.headers["retry-after"] == "1"
        assert "set-cookie" not in resp.headers and "content-encoding" not in resp.headers


FINISH_GRACE = 2.0  # timeouts.finish_grace's default: how long a finished stream (left or not) waits for its usage
LEAVE_GRACE = 1.0  # how long the upstream may stay open after a client left before the finish (docs/routing.md)


@pytest.mark.parametrize("phase", ["headers", "first_token", "mid_stream", "nonstream", "nonstream_large_body"])
def test_client_disconnect_closes_the_upstream_quickly(fake: EmulatorThread, gw: Proc, phase: str) -> None:
    """Before the first token (three of the four disconnect phases) the upstream sees its connection closed within
    100 ms; mid-stream, before any finish_reason, once the gateway has read on for the usage for the 1 s a leave
    before the finish allows (nothing more reaches the client; what it reads is charged), not ``finish_grace``
    (2 s): within 100 ms of that. Also after a request body large enough (300 KB, an agent's long context) that the
    server paused reading the client while it arrived: nothing reads the client once the body is in, so the server
    must have resumed reading to see it go."""
    ticks = [(0.05, sse(chunk("b"), done=False)) for _ in range(60)]
    CASES["cancel"] = {
        "headers": Plan(head_delay=0.45, parts=[(0, sse(chunk("a")))]),  # under the 0.5 s idle timeout
        "first_token": Plan(parts=[(0, b": hello\n\n"), (0.45, sse(chunk("a"), done=False)), *ticks]),
        "mid_stream": Plan(parts=[(0, sse(chunk("a"), done=False)), *ticks]),
        "nonstream": Plan(head_delay=0.45, headers={"content-type": "application/json"}, parts=[(0, b"{}")],
                          chunked=False),
    }[phase.removesuffix("_large_body")]
    body = orjson.dumps({"model": "m", "stream": not phase.startswith("nonstream"), "x_case": "cancel",
                         "messages": [{"role": "user", "content": "x" * (300_000 if "large" in phase else 1)}]})

    def attempt() -> tuple[float, float]:
        floor = round_trip(gw.port)  # what one exchange with the gateway costs at this moment's load
        before = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
        closed = len(fake.closed_at)
        t_close = _disconnect(fake, gw, body, phase)
        deadline = time.monotonic() + 2 + FINISH_GRACE
        while len(fake.closed_at) == closed and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(fake.closed_at) > closed, "the upstream connection was never closed"
        grace = LEAVE_GRACE if phase == "mid_stream" else 0.0
        assert fake.closed_at[-1] - t_close >= grace  # mid-stream: it read on for the usage first
        time.sleep(0.05)
        after = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
        assert sample(after, "tiergate_requests_total", missing_ok=False, outcome="client_disconnect") == sample(
            before, "tiergate_requests_total", outcome="client_disconnect") + 1
        assert sample(after, "tiergate_in_flight_requests", missing_ok=False) == 0
        # a stream the client left after its first token still counts in TTFT (users press "stop")
        ttft_grew = sample(after, "tiergate_time_to_first_token_seconds_count", tier="standard") - sample(
            before, "tiergate_time_to_first_token_seconds_count", tier="standard")
        assert ttft_grew == (1 if phase == "mid_stream" else 0)
        # within 100 ms over the loopback floor (mid-stream: of the 1 s; a gateway that read on for finish_grace
        # would take 2 s); a gateway that noticed only when the upstream next spoke would take 0.25-0.35 s (the first
        # token or the head at 0.45 s)
        return fake.closed_at[-1] - t_close - grace, 0.1 + floor
    timely(attempt)


def test_a_client_that_leaves_after_the_finish_is_read_on_for_the_whole_finish_grace(
        fake: EmulatorThread, gw: Proc) -> None:
    """The 1 s bound is for a leave before the finish: once every choice has its finish_reason (SDK loops ``break``
    there), the usage is waited for the whole ``finish_grace`` (2 s here): usage that comes 1.5 s after the leave is
    counted as the upstream reported it, and the request is a success. Keep-alive comments meanwhile keep the 0.5 s
    idle timeout from ending the read first."""
    pings = [(0.05, b": ping\n\n") for _ in range(30)]
    parts = [(0.0, sse(chunk(role=True), chunk("a"), chunk(finish="stop"), done=False)), *pings,
             (0.0, sse(chunk(usage=True)))]
    usage_at = sum(delay for delay, _ in parts)  # 1.5 s after the finish: past LEAVE_GRACE, within FINISH_GRACE
    CASES["late_usage"] = Plan(parts=parts)
    body = orjson.dumps({"model": "m", "stream": True, "x_case": "late_usage",
                         "messages": [{"role": "user", "content": "x"}]})

    def attempt() -> list[str]:
        before = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
        n = len(fake.requests)
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while b'"finish_reason":"stop"' not in got:
                got += sock.recv(65536)
            t_close = time.monotonic()
        lead = fake.requests[n].at + usage_at - t_close  # how long after the leave the usage left the upstream
        deadline = time.monotonic() + 2 + FINISH_GRACE
        while True:
            after = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
            done = sample(after, "tiergate_requests_total", tier="standard") - sample(
                before, "tiergate_requests_total", tier="standard")
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.02)

        def grew(name: str, **labels: str) -> float:
            return sample(after, name, **labels) - sample(before, name, **labels)
        assert grew("tiergate_requests_total", tier="standard", outcome="success") == 1
        if lead <= LEAVE_GRACE + 0.1:  # this machine was too slow for the case to say anything: again
            return [f"the usage left the upstream only {lead:.3f} s after the leave"]
        assert grew("tiergate_tokens_total", tier="standard", token_type="output", usage="reported") == 3
        assert grew("tiergate_usage_estimated_total", tier="standard") == 0
        return []
    on_time(attempt)


def _disconnect(fake: EmulatorThread, gw: Proc, body: bytes, phase: str) -> float:
    """Send ``body`` on a raw connection, wait until the upstream has it (and for ``phase``'s moment), and close the
    connection; returns when (``time.monotonic()``, just before the close)."""
    n = len(fake.requests)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 2
        while len(fake.requests) == n and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(fake.requests) > n, "the request never reached the upstream"
        if phase == "mid_stream":
            got = b""
            while b'"b"' not in got:
                got += sock.recv(65536)
        elif phase == "first_token":
            time.sleep(0.2)  # the comment arrived upstream; the first token comes at 0.45 s
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(65536)  # nothing is sent before the first token (the commit point): not even the comment
        else:
            time.sleep(0.1)
        return time.monotonic()  # taken before the close: the gateway may see it before this thread runs again


def test_a_thousand_disconnects_leave_no_connection_or_task_behind(fake: EmulatorThread, gw: Proc) -> None:
    """250 client disconnects in each of the four phases, 25 at a time: afterwards the gateway holds no more
    file descriptors than before and every upstream connection it opened is closed."""
    CASES["leak"] = Plan(parts=[(0, sse(chunk("a"), done=False)), (5.0, sse(chunk("b")))])
    CASES["leak_headers"] = Plan(head_delay=5.0, parts=[(0, sse(chunk("a")))])
    CASES["leak_first"] = Plan(parts=[(0, sse(chunk(role=True), done=False)), (5.0, sse(chunk("b")))])
    pid = gw.popen.pid
    httpx.get(f"http://127.0.0.1:{gw.port}/healthz", timeout=5)
    baseline = _descriptors(pid)
    requests = {phase: orjson.dumps({"model": "m", "stream": phase != "nonstream", "x_case": case,
                                     "messages": [{"role": "user", "content": "x"}]})
                for phase, case in (("headers", "leak_headers"), ("first_token", "leak_first"),
                                    ("mid_stream", "leak"), ("nonstream", "leak_headers"))}
    t_end = time.monotonic() + 60
    for phase, body in requests.items():
        for _ in range(10):  # 10 waves of 25 = 250 per phase
            assert time.monotonic() < t_end, "bounded: the loop must finish within 60 s"
            socks = []
            for _ in range(25):
                s = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(body), body))
                socks.append(s)
            if phase in ("first_token", "mid_stream"):
                for s in socks:
                    s.recv(65536)  # the first token arrived: the stream is open on both sides
            else:
                time.sleep(0.05)  # the gateway is waiting for the upstream's status line
            for s in socks:
                s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and fake.opened - len(fake.closed_at) > 0:
        time.sleep(0.05)
    assert fake.opened - len(fake.closed_at) == 0, "upstream connections left open"
    # Every client left and every upstream connection is closed, so the gateway holds no TCP connection at all: one
    # left is a leak (1,000 disconnects that each leaked would leave hundreds), waited for while a busy machine's
    # late closes land. Its other descriptors are counted apart: a few opened lazily meanwhile (a log file, the
    # metrics' files) are not a leak, far more than one per hundred disconnects is.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _descriptors(pid)[0]:
        time.sleep(0.1)
    connections, others = _descriptors(pid)
    assert connections == 0, f"{connections} connections left open after 1,000 disconnects"
    assert others <= baseline[1] + 1000 // 100, f"descriptors left open after 1,000 disconnects: {others}"
    metrics = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    assert sample(metrics, "tiergate_in_flight_requests", missing_ok=False) == 0


def _descriptors(pid: int) -> tuple[int, int]:
    """Process ``pid``'s open descriptors: (its TCP connections, everything else). A connection is a socket that is
    neither a Unix socket nor a listening one (``/proc/net``): open, closing, or reset by its peer and not closed."""
    sockets, others = set(), 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
        else:
            others += 1
    apart = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        apart |= {cols[9] for line in Path(table).read_text().splitlines()[1:] if (cols := line.split())[3] == "0A"}
    return len(sockets - apart), others


# Responses API: the terminal event ends the client's stream even when the upstream keeps its response open
def test_responses_stream_ends_at_its_terminal_event(fake: EmulatorThread, gw: Proc) -> None:
    def ev(etype: str, **fields: Any) -> bytes:
        return b"event: " + etype.encode() + b"\ndata: " + orjson.dumps({"type": etype, **fields}) + b"\n\n"

    usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
    CASES["resp_open"] = Plan(parts=[(0, ev("response.created", sequence_number=0,
                                            response={"id": "resp_1", "status": "in_progress"})
                                      + ev("response.output_text.delta", sequence_number=1, item_id="m1",
                                           output_index=0, content_index=0, delta="hi")
                                      + ev("response.completed", sequence_number=2,
                                           response={"id": "resp_1", "status": "completed", "usage": usage}))],
                              end="stall")  # the idle timeout is 0.5 s: the client must not wait for it
    stream = _client(gw).responses.create(model="m", input="x", stream=True, extra_body={"x_case": "resp_open"})
    # an in-band error after the terminal event would raise APIError here
    assert [event.type for event in stream] == ["response.created", "response.output_text.delta",
                                                "response.completed"]

    def attempt() -> tuple[float, float]:  # the raw body: the SDK stops reading at the terminal event
        body = {"model": "m", "input": "x", "stream": True, "x_case": "resp_open"}
        data, ended_at = b"", 0.0
        with httpx.stream("POST", _url(gw) + "/responses", json=body, timeout=10) as resp:
            for part in resp.iter_raw():
                data += part
                ended_at = ended_at or (time.monotonic() if b"response.completed" in data else 0.0)
        assert data.endswith(b"\n\n") and data.count(b"event: ") == 3 and ended_at, data
        # the body ended right after the terminal event: a gateway that waited for the upstream's end would end it
        # at the idle timeout, 0.5 s after the upstream's last byte
        return time.monotonic() - ended_at, 0.3
    timely(attempt)
