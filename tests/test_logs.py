"""The request log and the operational events over real sockets: every line parsed back as JSON, one per request,
for a success, a client error, a failover, a stream error and a client that left; secrets planted in bodies and
headers never reach it; breaker and cooldown events; text format for the demo; sampling of successes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.tools.emulator import EmulatorThread, Plan, Received

from conftest import Proc, chunk, sse, start_gateway

SECRET_KEY = "sk-live-PLANTED-KEY-0123456789abcdef"
SECRET_PROMPT = "PLANTED-PROMPT-do-not-log-4f1e"
SECRET_ANSWER = "PLANTED-ANSWER-do-not-log-9c2d"
UPSTREAM_KEY = "sk-upstream-PLANTED-9f8e7d6c5b4a"
OK = sse(chunk(role=True), chunk(SECRET_ANSWER), chunk(finish="stop"), chunk(usage=True))
ERR = (b'{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}')
WHOLE = orjson.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": SECRET_ANSWER}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})


def _plans(case: str, tier: str) -> Plan:
    if case == "failover" and tier == "fast":
        return Plan(status=503, headers={"content-type": "application/json"}, chunked=False, parts=[(0, ERR)])
    if case == "cooldown" and tier == "fast":
        return Plan(status=429, headers={"content-type": "application/json", "retry-after": "7"}, chunked=False,
                    parts=[(0, b'{"error":{"message":"slow down","type":"rate_limit_error","param":null,'
                                b'"code":"rate_limit_exceeded"}}')])
    if case == "broken":  # the first token, then the body ends inside the next event
        events = OK.split(b"\n\n")
        return Plan(parts=[(0, events[0] + b"\n\n" + events[1] + b"\n\n" + events[2][:20])], end="eof")
    if case == "slow":
        return Plan(parts=[(0, OK.split(b"\n\n", 1)[0] + b"\n\n"), (0.05, OK.split(b"\n\n", 2)[1] + b"\n\n")],
                    end="stall")
    return Plan(parts=[(0, OK)])


@pytest.fixture(scope="module")
def ups() -> Iterator[dict[str, EmulatorThread]]:
    def handler(tier: str) -> Any:
        def answer(req: Received) -> Plan:
            body = orjson.loads(req.body)
            if body.get("stream") is not True and not body.get("x_case"):
                return Plan(headers={"content-type": "application/json"}, chunked=False, parts=[(0, WHOLE)])
            return _plans(body.get("x_case", ""), tier)
        return answer
    up = {"fast": EmulatorThread(handler("fast")), "standard": EmulatorThread(handler("standard"))}
    yield up
    for u in up.values():
        u.stop()


def _config(ups: dict[str, EmulatorThread]) -> dict[str, Any]:
    timeouts = {"connect": 1, "idle": 2, "total": 5}
    return {
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": ups["fast"].base_url, "timeouts": timeouts,
             "api_key_env": "TG_TEST_UPSTREAM_KEY", "models": {"m": "m-fast"}, "prices": {"input": 2, "output": 8},
             "health": {"failures": 2, "open_seconds": 30}},
            {"name": "std", "tier": "standard", "base_url": ups["standard"].base_url, "timeouts": timeouts,
             "models": {"m": "m-std"}, "prices": {"input": 1, "output": 4}},
        ],
        "aliases": {"m-fast": {"model": "m", "tier": "fast"}},
    }


@pytest.fixture(scope="module")
def gw(ups: dict[str, EmulatorThread], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc, _ = start_gateway(_config(ups), tmp_path_factory.mktemp("logs"), extra=("--log-level", "info"),
                            env={"GATEWAY_LOG_FORMAT": "json", "TG_TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    yield proc
    proc.stop()


def _ask(gw: Proc, case: str, rid: str, stream: bool = True, **extra: Any) -> httpx.Response:
    body = {"model": "m-fast", "stream": stream, "x_case": case, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": SECRET_PROMPT}], **extra}
    return httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=body, timeout=5,
                      headers={"x-request-id": rid, "authorization": f"Bearer {SECRET_KEY}",
                               "cookie": f"session={SECRET_KEY}"})


def _lines(proc: Proc) -> list[dict[str, Any]]:
    """Every JSON line the gateway wrote to stdout so far (its log file also holds stderr's plain lines)."""
    out = []
    for line in proc.log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _line(proc: Proc, rid: str, timeout: float = 3.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [x for x in _lines(proc) if x.get("event") == "request" and x.get("request_id") == rid]
        if found:
            assert len(found) == 1, found  # one line per request
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no request line for {rid}")


def test_a_success_is_one_json_line_with_every_field(gw: Proc) -> None:
    r = _ask(gw, "", "rid-success")
    assert r.status_code == 200
    line = _line(gw, "rid-success")
    assert line["level"] == "info" and line["time"].endswith("Z")
    assert {k: line[k] for k in ("method", "path", "status", "outcome", "tier", "upstream", "rule", "model",
                                 "upstream_model", "stream", "attempts", "input_tokens", "output_tokens")} == {
        "method": "POST", "path": "/v1/chat/completions", "status": 200, "outcome": "success", "tier": "fast",
        "upstream": "fast", "rule": "model_alias", "model": "m-fast", "upstream_model": "m-fast", "stream": True,
        "attempts": 1, "input_tokens": 5, "output_tokens": 3}
    assert line["fallback"] is None and 0 < line["ttft_s"] <= line["duration_s"] < 5
    assert line["cost_usd"] == pytest.approx((5 * 2 + 3 * 8) / 1e6)


def test_a_whole_answer_is_logged_with_its_status(gw: Proc) -> None:
    assert _ask(gw, "", "rid-whole", stream=False).status_code == 200
    line = _line(gw, "rid-whole")
    assert line["status"] == 200 and line["outcome"] == "success" and line["stream"] is False


def test_a_bad_log_setting_is_named_with_exit_2(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from conftest import ROOT
    for name, value in (("GATEWAY_LOG_SAMPLE", "2"), ("GATEWAY_LOG_FORMAT", "xml")):
        run = subprocess.run([sys.executable, "-m", "gateway", "check-config", "config/demo.yaml"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30, env={**os.environ, name: value})
        assert run.returncode == 2 and "Traceback" not in run.stderr
        assert run.stderr.startswith(f"tiergate: invalid environment: {name}:"), run.stderr


def test_a_client_error_is_logged_with_its_status(gw: Proc) -> None:
    r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=5, headers={"x-request-id": "rid-bad"},
                   json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    line = _line(gw, "rid-bad")
    assert line["outcome"] == "client_error" and line["status"] == 404 and line["upstream"] == "none"
    assert line["model"] == "nope"  # as the client named it


def test_a_failover_is_an_event_and_a_line_naming_the_fallback(gw: Proc) -> None:
    r = _ask(gw, "failover", "rid-failover")
    assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "std"
    line = _line(gw, "rid-failover")
    assert line["upstream"] == "std" and line["fallback"] == "upstream_5xx" and line["attempts"] == 2
    assert any(x["event"] == "failover" and x["request_id"] == "rid-failover" and x["upstream"] == "fast"
               and x["reason"] == "upstream_5xx" for x in _lines(gw))


def test_a_stream_error_and_a_client_that_left(gw: Proc) -> None:
    r = _ask(gw, "broken", "rid-broken")
    assert r.status_code == 200
    assert _line(gw, "rid-broken")["outcome"] == "stream_error"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=0.5,
                   headers={"x-request-id": "rid-left"},
                   json={"model": "m", "stream": True, "x_case": "slow",
                         "messages": [{"role": "user", "content": "x"}]})
    line = _line(gw, "rid-left")
    assert line["outcome"] == "client_disconnect" and line["status"] == 200


def test_breaker_and_cooldown_events(gw: Proc) -> None:
    for i in range(2):  # two failures open the fast upstream's breaker (health.failures: 2)
        _ask(gw, "failover", f"rid-breaker-{i}")
    opened = [x for x in _lines(gw) if x["event"] == "breaker_opened"]
    assert opened and opened[-1]["level"] == "warning" and opened[-1]["upstream"] == "fast"
    assert opened[-1]["open_s"] == 30
    r = _ask(gw, "", "rid-spill")
    assert r.headers["x-tiergate-fallback"] == "spillover_circuit_open"
    assert any(x["event"] == "spillover" and x["request_id"] == "rid-spill" and x["reason"] == "circuit_open"
               for x in _lines(gw))


def test_no_secret_reaches_the_log(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """Planted in the prompt, the answer, the client's Authorization and Cookie, and the upstream's key (which the
    upstream did receive): none of them is in anything the gateway wrote."""
    assert _ask(gw, "", "rid-secret-1", stream=False).status_code == 200
    assert _ask(gw, "", "rid-secret-2").status_code == 200
    _line(gw, "rid-secret-2")
    assert any(r.headers.get("authorization") == f"Bearer {UPSTREAM_KEY}" for r in ups["fast"].requests)
    text = gw.log.read_text(errors="replace")
    for secret in (SECRET_KEY, SECRET_PROMPT, SECRET_ANSWER, UPSTREAM_KEY, "PLANTED"):
        assert secret not in text


def test_a_429_starts_a_cooldown_event_with_its_retry_after(ups: dict[str, EmulatorThread], tmp_path: Path) -> None:
    proc, _ = start_gateway(_config(ups), tmp_path, env={"TG_TEST_UPSTREAM_KEY": UPSTREAM_KEY},  # json by default
                            extra=("--log-level", "info"))
    try:
        _ask(proc, "cooldown", "rid-429")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not any(x["event"] == "cooldown_started" for x in _lines(proc)):
            time.sleep(0.02)
        ev = next(x for x in _lines(proc) if x["event"] == "cooldown_started")
        assert ev["level"] == "warning" and ev["upstream"] == "fast" and ev["retry_after_s"] == 7
        assert any(x["event"] == "config_loaded" and x["upstreams"] == ["fast", "std"] for x in _lines(proc))
    finally:
        proc.stop()


def test_text_format_and_sampling(ups: dict[str, EmulatorThread], tmp_path: Path) -> None:
    proc, _ = start_gateway(_config(ups), tmp_path, env={"TG_TEST_UPSTREAM_KEY": UPSTREAM_KEY,
                                                         "GATEWAY_LOG_FORMAT": "text", "GATEWAY_LOG_SAMPLE": "0"})
    try:
        _ask(proc, "", "rid-sampled-out")
        httpx.post(f"http://127.0.0.1:{proc.port}/v1/chat/completions", timeout=5,
                   headers={"x-request-id": "rid-text-error"},
                   json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and "rid-text-error" not in proc.log.read_text():
            time.sleep(0.02)
        text = proc.log.read_text()
        assert "request_id=rid-text-error" in text and "outcome=client_error" in text  # errors are never sampled
        assert "rid-sampled-out" not in text  # successes are (GATEWAY_LOG_SAMPLE=0)
        assert not any(line.startswith("{") for line in text.splitlines())
    finally:
        proc.stop()


def test_a_rejected_config_is_an_event(tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import ROOT
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams: []\n")
    run = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(bad), "--port", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "invalid config" in run.stderr
    ev = json.loads(run.stdout.strip().splitlines()[-1])
    assert ev["event"] == "config_rejected" and ev["level"] == "error" and str(bad) in ev["problem"]


def test_a_passthrough_request_is_a_line_with_its_usage(stack: Any) -> None:
    """The rest of /v1 is logged too: an embeddings call with the usage its answer reported."""
    r = httpx.post(stack.base_url + "/embeddings", timeout=5, headers={"x-request-id": "rid-embed"},
                   json={"model": "text-embedding-3-small", "input": "hello"})
    assert r.status_code == 200
    line = _line(stack.gateway, "rid-embed")
    assert line["path"] == "/v1/embeddings" and line["outcome"] == "success" and line["status"] == 200
    assert line["upstream"] == "emu-standard" and line["model"] == "text-embedding-3-small"
    assert line["input_tokens"] == r.json()["usage"]["prompt_tokens"] > 0
    r = httpx.get(stack.base_url + "/files", timeout=5, headers={"x-request-id": "rid-files"})
    assert r.status_code == 200
    line = _line(stack.gateway, "rid-files")
    assert line["method"] == "GET" and line["model"] is None and line["upstream_model"] is None


class Recording:
    """A binary stream that keeps each write and counts flushes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.flushes = 0

    def write(self, data: bytes) -> int:
        self.writes.append(data)
        return len(data)

    def flush(self) -> None:
        self.flushes += 1


def test_lines_of_one_loop_turn_leave_in_whole_line_writes_of_at_most_pipe_buf() -> None:
    import asyncio
    import select

    from gateway.observability.logs import TurnFlushed

    raw = Recording()
    out = TurnFlushed(raw)  # type: ignore[arg-type]
    line = b'{"event":"request","n":%03d,"pad":"' + b"x" * 300 + b'"}\n'
    big = b'{"pad":"' + b"y" * 5000 + b'"}\n'

    async def turn() -> None:
        for i in range(30):
            out.write(line % i)
            out.flush()
        out.write(big)
        out.flush()
        assert raw.writes == []  # nothing written during the turn
        await asyncio.sleep(0)
        assert raw.writes  # all of it at the turn's end
        out.write(b"next turn\n")
        out.flush()

    asyncio.run(turn())
    assert raw.writes[-1] == b"next turn\n"
    everything = b"".join(raw.writes)
    assert everything == b"".join(line % i for i in range(30)) + big + b"next turn\n"
    for w in raw.writes:
        assert w.endswith(b"\n") and (len(w) <= select.PIPE_BUF or w == big)
    assert 3 <= len(raw.writes) <= 6 and raw.flushes == len(raw.writes)
    out.write(b"outside a loop\n")
    out.flush()  # no running loop: written at once
    assert raw.writes[-1] == b"outside a loop\n"


def test_a_failed_write_loses_its_own_group_of_lines_only() -> None:
    import select

    from gateway.observability.logs import TurnFlushed

    class Failing(Recording):
        def write(self, data: bytes) -> int:
            if len(self.writes) == 0 and not getattr(self, "failed", False):
                self.failed = True
                raise BlockingIOError(11, "the pipe is full")
            return super().write(data)

    raw = Failing()
    out = TurnFlushed(raw)  # type: ignore[arg-type]
    line = b"x" * 999 + b"\n"
    per_group = select.PIPE_BUF // len(line)
    for _ in range(3 * per_group):
        out.write(line)
    out.out()
    assert b"".join(raw.writes) == line * (2 * per_group)  # the first group was lost, the other two were written
