"""Fault injection over real sockets: each upstream fault, streaming and not, and what the client and the metrics
see; quota spillover before any 429; the circuit breaker opening and closing; the SDK's retries.

Two emulators playing scripted plans, one per tier; each answers by the plan for its tier and the request's
``x_case``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tools.emulator import EmulatorThread, Plan, Received

from conftest import Proc, chunk, free_port, sample, sse, start_gateway

PLANS: dict[tuple[str, str], Plan] = {}
OK_STREAM = sse(chunk(role=True), chunk("ok"), chunk(finish="stop"), chunk(usage=True))
OK_JSON = (b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":'
           b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,'
           b'"completion_tokens":1,"total_tokens":2}}')


def ok(stream: bool, headers: dict[str, str] | None = None) -> Plan:
    if stream:
        return Plan(headers={"content-type": "text/event-stream", **(headers or {})}, parts=[(0, OK_STREAM)])
    return Plan(headers={"content-type": "application/json", **(headers or {})}, parts=[(0, OK_JSON)], chunked=False)


def handler(tier: str) -> Any:
    def answer(req: Received) -> Plan:
        body = orjson.loads(req.body)
        return PLANS.get((tier, body.get("x_case", "")), ok(body.get("stream") is True))
    return answer


@pytest.fixture(scope="module")
def ups() -> Iterator[dict[str, EmulatorThread]]:
    up = {"fast": EmulatorThread(handler("fast")), "standard": EmulatorThread(handler("standard"))}
    yield up
    for u in up.values():
        u.stop()


def _config(ups: dict[str, EmulatorThread], fast_url: str | None = None, **health: Any) -> dict[str, Any]:
    timeouts = {"connect": 0.5, "idle": 0.6, "total": 5}
    return {
        "max_attempts": 3,
        "upstreams": [
            {"name": "fast-1", "tier": "fast", "base_url": fast_url or ups["fast"].base_url,
             "timeouts": {**timeouts, "ttft": 0.3},
             "health": {"failures": 2, "open_seconds": 0.8, **health}, "models": {"m": "m"}},
            {"name": "std-1", "tier": "standard", "base_url": ups["standard"].base_url, "timeouts": timeouts,
             "models": {"m": "m"}},
        ],
        "aliases": {"m-fast": {"model": "m", "tier": "fast"}},
    }


@pytest.fixture(scope="module")
def gw(ups: dict[str, EmulatorThread], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc, _ = start_gateway(_config(ups), tmp_path_factory.mktemp("failover"))
    yield proc
    proc.stop()


def _post(gw: Proc, case: str, stream: bool, **extra: Any) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=10, json={
        "model": "m-fast", "stream": stream, "x_case": case, "messages": [{"role": "user", "content": "x"}], **extra})


def _metrics(gw: Proc) -> str:
    return httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text


def _grew(before: str, after: str, name: str, **labels: str) -> float:
    return sample(after, name, missing_ok=False, **labels) - sample(before, name, **labels)


FAULTS = {
    # case: (fast-tier plan, expected fallback reason)
    "slow_headers": (Plan(head_delay=1.5, parts=[(0, OK_STREAM)]), "upstream_timeout"),
    # the role chunk and a keep-alive comment arrive at once, the first token only after the 0.3 s TTFT limit
    "slow_first_token": (Plan(parts=[(0, b": busy\n\n" + sse(chunk(role=True), done=False)),
                                     (1.0, sse(chunk("late"), chunk(finish="stop")))]), "upstream_ttft_timeout"),
    "429": (Plan(status=429, headers={"content-type": "application/json", "retry-after-ms": "50"},
                 parts=[(0, b'{"error":{"message":"busy","type":"rate_limit_error","param":null,"code":null}}')],
                 chunked=False), "upstream_429"),
    "503": (Plan(status=503, headers={"content-type": "application/json"},
                 parts=[(0, b'{"message":"overloaded","type":"server_error"}')], chunked=False), "upstream_5xx"),
    "not_json": (Plan(headers={"content-type": "text/html"}, parts=[(0, b"<html>maintenance</html>")],
                      chunked=False), "upstream_bad_response"),
    "context": (Plan(status=400, headers={"content-type": "application/json"}, parts=[(
        0, b'{"error":{"message":"This model\'s maximum context length is 8192 tokens","type":'
           b'"invalid_request_error","param":"messages","code":"context_length_exceeded"}}')], chunked=False),
        "context_length"),
}


# a first-token deadline applies to streams only, so slow_first_token has no non-streaming case
@pytest.mark.parametrize(("case", "stream"), [(c, s) for c in FAULTS for s in (True, False)
                                              if s or c != "slow_first_token"])
def test_fast_tier_fault_before_first_byte_fails_over_to_standard(ups: dict[str, EmulatorThread], gw: Proc,
                                                                   case: str, stream: bool) -> None:
    plan, reason = FAULTS[case]
    if case == "slow_headers" and stream:
        reason = "upstream_ttft_timeout"  # the fast tier's 0.3 s TTFT limit covers the wait for its headers
    PLANS[("fast", case)] = plan
    time.sleep(1.0)  # any breaker or cooldown from the previous case is over
    before = _metrics(gw)
    resp = _post(gw, case, stream)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-tiergate-tier"] == "standard" and resp.headers["x-tiergate-fallback"] == reason
    assert resp.headers["x-tiergate-rule"] == "model_alias"
    if stream:
        assert resp.content == OK_STREAM.replace(b"data: " + chunk(usage=True).encode() + b"\n\n", b"")
    else:
        assert resp.content == OK_JSON
    after = _metrics(gw)
    assert _grew(before, after, "tiergate_fallbacks_total", from_tier="fast", to_tier="standard", reason=reason) == 1
    assert _grew(before, after, "tiergate_requests_total", tier="standard", outcome="success") == 1
    assert _grew(before, after, "tiergate_upstream_attempts_bucket", le="1.0") == 0
    assert _grew(before, after, "tiergate_upstream_attempts_bucket", le="2.0") == 1


def test_other_400_is_never_retried(ups: dict[str, EmulatorThread], gw: Proc) -> None:
    PLANS[("fast", "bad")] = Plan(status=400, headers={"content-type": "application/json"}, parts=[(
        0, b'{"error":{"message":"temperature too high","type":"invalid_request_error","param":"temperature",'
           b'"code":"invalid_value"}}')], chunked=False)
    n = len(ups["standard"].requests)
    resp = _post(gw, "bad", True)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
    assert "x-should-retry" not in resp.headers and resp.headers["x-tiergate-tier"] == "fast"
    assert len(ups["standard"].requests) == n


@pytest.mark.parametrize("end", ["reset", "stall"])
def test_fault_after_first_byte_is_never_retried(ups: dict[str, EmulatorThread], gw: Proc, end: str) -> None:
    time.sleep(1.0)
    PLANS[("fast", end)] = Plan(parts=[(0, sse(chunk(role=True), chunk("a"), done=False))], end=end)
    n = len(ups["standard"].requests)
    before = _metrics(gw)
    resp = _post(gw, end, True)
    assert resp.status_code == 200 and resp.headers["x-tiergate-tier"] == "fast"
    last = orjson.loads(resp.content.split(b"\n\n")[-2][6:])
    assert last["error"]["code"] == ("upstream_idle_timeout" if end == "stall" else "upstream_stream_interrupted")
    assert len(ups["standard"].requests) == n  # never after the first byte
    assert _grew(before, _metrics(gw), "tiergate_requests_total", tier="fast", outcome="stream_error") == 1


def test_breaker_opens_then_a_probe_closes_it(ups: dict[str, EmulatorThread], gw: Proc) -> None:
    time.sleep(1.0)
    assert _post(gw, "", False).headers["x-tiergate-tier"] == "fast"  # a success closes any earlier breaker
    PLANS[("fast", "flaky")] = FAULTS["503"][0]
    n_fast = len(ups["fast"].requests)
    for i in range(2):  # failures: 2 opens the breaker, from two request shapes (one alone opens it for itself)
        assert _post(gw, "flaky", False, user=f"u{i}").headers["x-tiergate-fallback"] == "upstream_5xx"
    resp = _post(gw, "flaky", False, user="u2")
    assert resp.headers["x-tiergate-fallback"] == "spillover_circuit_open"  # not even tried
    assert len(ups["fast"].requests) == n_fast + 2
    assert sample(_metrics(gw), "tiergate_upstream_state", missing_ok=False, upstream="fast-1", state="open") == 1
    PLANS.pop(("fast", "flaky"))  # the fast tier recovers
    time.sleep(0.9)  # open_seconds: 0.8
    assert sample(_metrics(gw), "tiergate_upstream_state", upstream="fast-1", state="half_open") == 1
    resp = _post(gw, "flaky", False)  # the probe
    assert resp.headers["x-tiergate-tier"] == "fast" and "x-tiergate-fallback" not in resp.headers
    assert sample(_metrics(gw), "tiergate_upstream_state", upstream="fast-1", state="closed") == 1


def test_all_down_answers_the_last_error_and_tells_the_sdk_not_to_retry(ups: dict[str, EmulatorThread],
                                                                       gw: Proc) -> None:
    time.sleep(1.0)
    for tier in ("fast", "standard"):
        PLANS[(tier, "down")] = FAULTS["503"][0]
    try:
        n = sum(len(u.requests) for u in ups.values())
        with pytest.raises(openai.InternalServerError) as info:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="x", max_retries=2)
            client.chat.completions.create(model="m-fast", messages=[{"role": "user", "content": "x"}],
                                           extra_body={"x_case": "down"})
        assert info.value.response.headers["x-should-retry"] == "false"
        assert sum(len(u.requests) for u in ups.values()) == n + 2  # one attempt per tier, no SDK retries
    finally:
        PLANS.pop(("fast", "down"))
        PLANS.pop(("standard", "down"))


def test_sdk_retries_when_the_gateway_did_not(ups: dict[str, EmulatorThread], tmp_path_factory: pytest.TempPathFactory,
                                              ) -> None:
    cfg = _config(ups)
    cfg["fallback"] = False
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("noretry"))
    try:
        PLANS[("fast", "sdk")] = Plan(status=503, headers={"content-type": "application/json", "retry-after-ms": "10"},
                                      parts=[(0, b'{"error":{"message":"x","type":"server_error"}}')], chunked=False)
        n = len(ups["fast"].requests)
        with pytest.raises(openai.InternalServerError) as info:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{proc.port}/v1", api_key="x", max_retries=2)
            client.chat.completions.create(model="m-fast", messages=[{"role": "user", "content": "x"}],
                                           extra_body={"x_case": "sdk"})
        assert "x-should-retry" not in info.value.response.headers
        assert len(ups["fast"].requests) == n + 2  # the SDK tried 3 times; the third was refused by the breaker
    finally:
        proc.stop()


def test_refused_connection_fails_over(ups: dict[str, EmulatorThread],
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    proc, _ = start_gateway(_config(ups, fast_url=f"http://127.0.0.1:{free_port()}/v1"),
                            tmp_path_factory.mktemp("refused"))
    try:
        for stream in (True, False):
            resp = _post(proc, "", stream)
            assert resp.status_code == 200
            assert resp.headers["x-tiergate-fallback"] == "upstream_unavailable"
    finally:
        proc.stop()


def test_quota_headers_counting_down_spill_to_standard_before_any_429(ups: dict[str, EmulatorThread],
                                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    proc, _ = start_gateway(_config(ups), tmp_path_factory.mktemp("quota"))
    try:
        remaining = iter(range(3, -1, -1))

        def fast(req: Received) -> Plan:
            left = next(remaining)
            if left <= 0:
                return FAULTS["429"][0]  # what a real upstream would answer past its limit
            return ok(False, {"x-ratelimit-remaining-requests": str(left - 1), "x-ratelimit-reset-requests": "1m0s",
                              "x-ratelimit-remaining-tokens": "100000", "x-ratelimit-reset-tokens": "1m0s"})

        ups["fast"].handler = fast
        tiers = [_post(proc, "", False).headers["x-tiergate-tier"] for _ in range(5)]
        assert tiers == ["fast", "fast", "fast", "standard", "standard"]
        assert len([r for r in ups["fast"].requests if b'"x_case":""' in r.body]) >= 3
        metrics = _metrics(proc)
        assert sample(metrics, "tiergate_spillovers_total", missing_ok=False, upstream="fast-1",
                      reason="quota_requests") == 2
        assert sample(metrics, "tiergate_upstream_errors_total", upstream="fast-1", reason="upstream_429") == 0
        assert sample(metrics, "tiergate_upstream_quota_remaining", missing_ok=False, upstream="fast-1",
                      kind="requests") == 0
    finally:
        ups["fast"].handler = handler("fast")
        proc.stop()


def test_max_tokens_reserved_against_the_token_quota(ups: dict[str, EmulatorThread],
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    proc, _ = start_gateway(_config(ups, quota_reserve={"tokens": 500}), tmp_path_factory.mktemp("tokens"))
    try:
        ups["fast"].handler = lambda req: ok(False, {"x-ratelimit-remaining-tokens-minute": "5000",
                                                     "x-ratelimit-reset-tokens-minute": "30.5"})
        assert _post(proc, "", False).headers["x-tiergate-tier"] == "fast"  # learns: 5000 tokens left
        assert _post(proc, "", False, max_completion_tokens=4000).headers["x-tiergate-tier"] == "fast"
        resp = _post(proc, "", False, max_completion_tokens=4600)  # 4600 + prompt + 500 reserve > 5000
        assert resp.headers["x-tiergate-tier"] == "standard"
        assert resp.headers["x-tiergate-fallback"] == "spillover_quota_tokens"
    finally:
        ups["fast"].handler = handler("fast")
        proc.stop()


@pytest.mark.parametrize(("queue_seconds", "second_tier"), [(1.0, "fast"), (0.05, "standard")])
async def test_concurrency_limit_waits_for_a_slot_or_spills_over(ups: dict[str, EmulatorThread],
                                                                 tmp_path_factory: pytest.TempPathFactory,
                                                                 queue_seconds: float, second_tier: str) -> None:
    proc, _ = start_gateway(_config(ups, max_concurrent=1, queue_seconds=queue_seconds),
                            tmp_path_factory.mktemp("queue"))
    try:
        PLANS[("fast", "busy")] = Plan(parts=[(0, sse(chunk(role=True), done=False)),
                                              (0.2, sse(chunk("ok"), chunk(finish="stop")))])
        body = {"model": "m-fast", "stream": True, "x_case": "busy", "messages": [{"role": "user", "content": "x"}]}
        url = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=10) as client:
            first = asyncio.ensure_future(client.post(url, json=body))
            await asyncio.sleep(0.1)  # the first stream holds fast-1's only slot for ~0.2 s (its TTFT limit: 0.3)
            second = await client.post(url, json=body)
            assert (await first).headers["x-tiergate-tier"] == "fast"
        assert second.status_code == 200 and second.headers["x-tiergate-tier"] == second_tier
        if second_tier == "standard":
            assert second.headers["x-tiergate-fallback"] == "spillover_concurrency"
        else:
            assert "x-tiergate-fallback" not in second.headers
    finally:
        PLANS.pop(("fast", "busy"), None)
        proc.stop()


def test_oversized_event_before_the_first_token_fails_over(
        ups: dict[str, EmulatorThread], tmp_path_factory: pytest.TempPathFactory) -> None:
    cfg = _config(ups)
    cfg["limits"] = {"max_event_bytes": 2048}
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("bigevent"))
    try:
        PLANS[("fast", "big")] = Plan(parts=[(0, b"data: " + b"x" * 4096)])  # no token yet, no blank line
        resp = _post(proc, "big", True)  # nothing was sent before the first token: the other tier can serve it
        assert resp.status_code == 200 and resp.headers["x-tiergate-tier"] == "standard"
        assert resp.headers["x-tiergate-fallback"] == "upstream_event_too_large"
        cfg["fallback"] = False
        alone, _ = start_gateway(cfg, tmp_path_factory.mktemp("bigevent-alone"))
        try:
            resp = _post(alone, "big", True)
            assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_event_too_large"
        finally:
            alone.stop()
        assert _post(proc, "", True).status_code == 200  # and the gateway goes on serving
    finally:
        PLANS.pop(("fast", "big"), None)
        proc.stop()
