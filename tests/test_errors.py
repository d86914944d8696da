"""Bad client input and upstream errors: OpenAI's envelope, the right status, the SDK's matching class."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import Stack, emulator, fast_directive, free_port, sample, start_gateway

QUICK = fast_directive(tokens=3, tps=2000, ttft_ms=2)
MSG = [{"role": "user", "content": f"hi {QUICK}"}]


def _envelope(resp: httpx.Response) -> dict[str, Any]:
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "detail" not in body and "Traceback" not in resp.text
    return body["error"]


def _still_serves(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    assert client.chat.completions.create(model="gpt-5.6", messages=MSG).choices[0].message.content


@pytest.mark.parametrize(
    ("content", "status", "code", "param", "sdk_error"),
    [
        (b"{bad json", 400, "invalid_json", None, openai.BadRequestError),
        (b"[1, 2, 3]", 400, "invalid_json", None, openai.BadRequestError),
        (b'"just a string"', 400, "invalid_json", None, openai.BadRequestError),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "missing_required_parameter", "model",
         openai.BadRequestError),
        (b'{"model": 42, "messages": [{"role": "user", "content": "hi"}]}', 400, "invalid_type", "model",
         openai.BadRequestError),
        (b'{"model": "gpt-5.6"}', 400, "missing_required_parameter", "messages", openai.BadRequestError),
        (b'{"model": "gpt-5.6", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400,
         "invalid_type", "stream", openai.BadRequestError),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found",
         "model", openai.NotFoundError),
    ],
)
def test_bad_input_gets_envelope_status_and_sdk_class(stack: Stack, content: bytes, status: int, code: str,
                                                       param: str | None, sdk_error: type[Exception]) -> None:
    resp = httpx.post(stack.base_url + "/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=5)
    assert resp.status_code == status
    err = _envelope(resp)
    assert err["code"] == code and err["param"] == param and err["type"] == "invalid_request_error"
    assert resp.headers["x-request-id"]
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=2)
    with pytest.raises(sdk_error) as info:
        client.post("/chat/completions", cast_to=object, content=content,
                    options={"headers": {"content-type": "application/json"}})
    assert info.value.code == code  # type: ignore[attr-defined]
    _still_serves(stack)


def test_unknown_model_through_sdk(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=2)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=MSG, stream=True)
    assert info.value.param == "model"
    _still_serves(stack)


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [("POST", "/v1/nope", 404, "unknown_url"), ("GET", "/v1/tiergate/route", 405, "method_not_allowed"),
     ("GET", "/nope", 404, "unknown_url")],
)
def test_unknown_url_and_wrong_method(stack: Stack, method: str, path: str, status: int, code: str) -> None:
    resp = httpx.request(method, stack.root + path, json={}, timeout=5)
    assert resp.status_code == status
    assert _envelope(resp)["code"] == code


def test_wrong_content_type_and_oversized_body(stack: Stack) -> None:
    resp = httpx.post(stack.base_url + "/chat/completions", content=b"model=gpt-5.6",
                      headers={"content-type": "application/x-www-form-urlencoded"}, timeout=5)
    assert resp.status_code == 415 and _envelope(resp)["code"] == "unsupported_media_type"
    big = b'{"model": "gpt-5.6", "messages": [{"role": "user", "content": "' + b"x" * (17 * 1024 * 1024) + b'"}]}'
    resp = httpx.post(stack.base_url + "/chat/completions", content=big,
                      headers={"content-type": "application/json"}, timeout=20)
    assert resp.status_code == 413 and _envelope(resp)["code"] == "request_too_large"
    _still_serves(stack)


def test_bad_input_is_counted_as_client_error(stack: Stack) -> None:
    before = sample(stack.metrics(), "tiergate_requests_total", outcome="client_error")
    httpx.post(stack.base_url + "/chat/completions", content=b"{", headers={"content-type": "application/json"},
               timeout=5)
    assert sample(stack.metrics(), "tiergate_requests_total", outcome="client_error") == before + 1


def test_upstream_429_before_first_byte_is_relayed_with_retry_headers(stack: Stack) -> None:
    directive = fast_directive(status=429, retry_after_ms=300, code="rate_limit_exceeded", message="slow_down")
    body = {"model": "gpt-5.6", "stream": True, "messages": [{"role": "user", "content": directive}]}
    resp = httpx.post(stack.base_url + "/chat/completions", json=body, timeout=10)
    assert resp.status_code == 429
    err = _envelope(resp)
    assert err["message"] == "slow_down" and err["code"] == "rate_limit_exceeded"
    assert resp.headers["retry-after-ms"] == "300"
    # both tiers answered 429, so the gateway already retried: it tells the SDK not to retry again
    assert resp.headers["x-should-retry"] == "false"
    # both upstreams now rest for their retry-after-ms: the gateway answers for them without calling them, with
    # the rate limit they reported (429, not the 503 of an open breaker, which would send the SDK to retry at once)
    resting = httpx.post(stack.base_url + "/chat/completions", json=body, timeout=10)
    assert resting.status_code == 429 and _envelope(resting)["code"] == "rate_limit_exceeded"
    assert _envelope(resting)["type"] == "rate_limit_error" and resting.headers["retry-after"] == "1"
    time.sleep(0.35)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=2)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="gpt-5.6", messages=body["messages"], stream=True)
    assert info.value.code == "rate_limit_exceeded"
    time.sleep(0.35)  # let both cooldowns end for the tests that follow


def test_upstream_400_is_not_retried_on_the_other_tier(stack: Stack) -> None:
    before = sample(stack.metrics(), "tiergate_upstream_errors_total")
    directive = fast_directive(status=400, code="invalid_value", message="temperature_too_high")
    resp = httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
        "model": "gpt-5.6", "messages": [{"role": "user", "content": directive}]})
    assert resp.status_code == 400
    assert _envelope(resp)["code"] == "invalid_value"
    assert "x-should-retry" not in resp.headers
    assert sample(stack.metrics(), "tiergate_upstream_errors_total") == before + 1


def test_unreachable_fast_tier_falls_back_then_502_when_all_down(tmp_path: Path) -> None:
    standard = emulator("standard", tmp_path)
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens here: connection refused
    cfg = {
        "upstreams": [
            {"name": "down-fast", "tier": "fast", "base_url": dead, "models": {"gpt-5.6": "x"}},
            {"name": "up-standard", "tier": "standard", "base_url": f"http://127.0.0.1:{standard.port}/v1",
             "models": {"gpt-5.6": "y"}},
        ],
        "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"}},
    }
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        base = f"http://127.0.0.1:{gw.port}/v1"
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="gpt-5.6-sol-fast", messages=MSG)
        assert raw.headers["x-tiergate-tier"] == "standard"
        assert raw.headers["x-tiergate-fallback"] == "upstream_unavailable"
        assert raw.parse().choices[0].message.content
        standard.stop()
        resp = httpx.post(base + "/chat/completions", json={"model": "gpt-5.6-sol-fast", "messages": MSG}, timeout=10)
        assert resp.status_code == 502
        assert _envelope(resp)["code"] == "upstream_unavailable"
        assert resp.headers["x-should-retry"] == "false"
    finally:
        gw.stop()
        standard.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/metrics/", "/v1/models/"])
def test_trailing_slash_is_an_unknown_url_never_a_redirect(stack: Stack, path: str) -> None:
    resp = httpx.request("POST" if "chat" in path else "GET", stack.root + path, json={}, timeout=5,
                         headers={"host": "evil.example"})
    assert resp.status_code == 404 and "location" not in resp.headers
    assert _envelope(resp)["code"] in ("unknown_url", "model_not_found")


@pytest.mark.parametrize(("given", "kept"), [("abc-123_XYZ.9", True), ("x" * 201, False), ("é😀", False),
                                             ("has space ok", True), ("tab\tno", False)])
def test_request_id_is_echoed_only_when_short_printable_ascii(stack: Stack, given: str, kept: bool) -> None:
    for body in ({"model": "gpt-5.6", "messages": MSG}, {"model": "nope", "messages": MSG}):
        resp = httpx.post(stack.base_url + "/chat/completions", json=body, timeout=10,
                          headers={"x-request-id": given.encode()})
        rid = resp.headers["x-request-id"]
        assert (rid == given) if kept else (rid.startswith("req_") and len(rid) == 36)


def test_health_and_model_endpoints(stack: Stack) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.head(stack.root + path, timeout=5).status_code == 200
    listed = httpx.get(stack.base_url + "/models", timeout=5).json()
    assert [m["id"] for m in listed["data"]][:2] == ["gpt-5.6", "gpt-5.6-sol-fast"]  # then the upstream's
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    assert client.models.retrieve("gpt-5.6-sol-fast").id == "gpt-5.6-sol-fast"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
