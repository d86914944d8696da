"""Upstream answers in shapes other gateways misread (public bug reports of gateways and SDKs), each played byte for
byte by a scripted upstream on a loopback socket behind a real gateway: the status an error event names wherever it
sits, a string-valued error with its type, a float reset as ``retry-after-ms``, two parallel tool calls sent on one
index, usage asked of every chat upstream the bridge streams from, compressed error bodies on the passthrough, and
tool-call arguments sent as JSON rather than a JSON string.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.tools.emulator import EmulatorThread, Plan, Received

from conftest import Proc, chunk, sse, start_gateway

CASES: dict[str, Plan] = {}
JSON = {"content-type": "application/json"}
EVENTS = {"content-type": "text/event-stream"}


def _handler(req: Received) -> Plan:
    body = json.loads(req.body) if req.body else {}
    found = re.search(rb"case=(\w+)", req.body)  # in a message's text: it crosses every translation untouched
    case = found.group(1).decode() if found else ""
    if case == "usage_when_asked":  # an upstream that reports usage only when stream_options asks for it
        options = body.get("stream_options") or {}
        usage = ({"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
                 if options.get("include_usage") else None)
        tail = [orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage})
                .decode()] if usage else []
        return Plan(headers=EVENTS, parts=[(0, sse(chunk(role=True), chunk("hi"), chunk(" there"),
                                                   chunk(finish="stop"), *tail))])
    return CASES.get(case, Plan(parts=[(0, sse(chunk(role=True), chunk("ok"), chunk(finish="stop")))]))


@pytest.fixture(scope="module")
def fake() -> Iterator[EmulatorThread]:
    up = EmulatorThread(_handler)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def gw(fake: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    health = {"failures": 1000, "cooldown_default": 0}
    timeouts = {"connect": 1, "idle": 2, "total": 5, "finish_grace": 0.3}
    cfg: dict[str, Any] = {
        "max_attempts": 1,  # each case is one upstream's answer, not a failover
        "upstreams": [
            {"name": "s-fast", "tier": "fast", "base_url": fake.base_url, "dialect": "cerebras", "health": health,
             "timeouts": timeouts, "models": {"m": "m-fast"}},
            {"name": "s-std", "tier": "standard", "base_url": fake.base_url, "dialect": "openai", "health": health,
             "timeouts": timeouts, "models": {"m": "m-std"}},
        ]}
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("shapes"))
    yield proc
    proc.stop()


def _chat(gw: Proc, case: str, tier: str = "fast", stream: bool = True) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=10, headers={"x-tiergate-tier": tier},
                      json={"model": "m", "stream": stream, "messages": [{"role": "user", "content": f"case={case}"}]})


def _bridged(gw: Proc, case: str, stream: bool) -> dict[str, Any]:
    """A Responses request to the fast tier (Cerebras dialect: served through the bridge); the Response object."""
    r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/responses", timeout=10, headers={"x-tiergate-tier": "fast"},
                   json={"model": "m", "input": f"case={case}", "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        return dict(r.json())
    events = [json.loads(line[len("data: "):]) for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed", events[-1]
    return dict(events[-1]["response"])


def test_an_error_event_whose_status_sits_beside_the_error_is_answered_with_it(gw: Proc) -> None:
    """Cerebras' form: ``{"error": {... "" ...}, "status_code": 429}``: a 429, not a 500."""
    CASES["status_beside"] = Plan(headers=EVENTS, parts=[(0, b'data: {"error":{"message":"Requests per minute limit '
                                                             b'exceeded","type":"","param":"","code":""},'
                                                             b'"status_code":429}\n\n')])
    r = _chat(gw, "status_beside")
    assert r.status_code == 429, r.text
    assert r.json()["error"]["message"] == "Requests per minute limit exceeded"


def test_a_string_error_with_its_type_keeps_its_words_and_status(gw: Proc) -> None:
    """text-generation-inference and older vLLM: ``{"error": "text", "error_type": "validation"}``."""
    CASES["string_error"] = Plan(headers=EVENTS, parts=[(0, b'data: {"error":"Input validation error: `inputs` tokens '
                                                            b'+ `max_new_tokens` must be <= 4096","error_type":'
                                                            b'"validation"}\n\n')])
    r = _chat(gw, "string_error")
    assert r.status_code == 422, r.text  # as TGI's own HTTP server answers a validation error
    error = r.json()["error"]
    assert error["message"].startswith("Input validation error") and error["type"] == "validation"


def test_a_429_with_float_resets_only_gets_retry_after_ms_too(gw: Proc) -> None:
    """Cerebras answers 429 with ``x-ratelimit-reset-tokens-minute: 12.25`` and no retry-after; the openai SDKs read
    ``retry-after-ms`` first."""
    CASES["float_reset"] = Plan(status=429, headers={**JSON, "x-ratelimit-remaining-tokens-minute": "0",
                                                     "x-ratelimit-reset-tokens-minute": "12.25"},
                                parts=[(0, b'{"message":"Tokens per minute limit exceeded","type":'
                                           b'"too_many_tokens_error","param":"quota","code":"token_quota_exceeded"}')],
                                chunked=False)
    r = _chat(gw, "float_reset", tier="standard", stream=False)  # it rests that upstream for 12 s: not the fast one
    assert r.status_code == 429, r.text
    assert r.headers["retry-after-ms"] == "12250" and r.headers["retry-after"] == "13"


def _calls(response: dict[str, Any]) -> list[tuple[str, str]]:
    return [(item["name"], item["arguments"]) for item in response["output"] if item["type"] == "function_call"]


def test_two_parallel_tool_calls_on_one_index_stay_two_calls(gw: Proc) -> None:
    """Both calls say ``index: 0`` but carry their own ids: two function_call items, never one whose arguments are
    two JSON objects back to back."""
    def call(cid: str, name: str, args: str) -> str:
        return orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
            "tool_calls": [{"index": 0, "id": cid, "type": "function", "function": {"name": name,
                                                                                 "arguments": args}}]}}]}).decode()
    CASES["same_index"] = Plan(headers=EVENTS, parts=[(0, sse(chunk(role=True), call("call_a", "f", '{"x":1}'),
                                                             call("call_b", "g", '{"y":2}'),
                                                             chunk(finish="tool_calls")))])
    assert _calls(_bridged(gw, "same_index", stream=True)) == [("f", '{"x":1}'), ("g", '{"y":2}')]


def test_tool_arguments_sent_as_json_are_a_json_string_for_the_client(gw: Proc) -> None:
    """llama.cpp may send ``"arguments": {"x": 1}``: the Response carries the JSON text, not empty arguments."""
    streamed = orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
        "tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                        "function": {"name": "f", "arguments": {"x": 1}}}]}}]}).decode()
    CASES["json_args"] = Plan(headers=EVENTS, parts=[(0, sse(chunk(role=True), streamed, chunk(finish="tool_calls")))])
    assert _calls(_bridged(gw, "json_args", stream=True)) == [("f", '{"x":1}')]
    whole = {"id": "c", "object": "chat.completion", "created": 1, "model": "m-fast", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}}]}
    CASES["json_args_whole"] = Plan(headers=JSON, parts=[(0, orjson.dumps(whole))], chunked=False)
    assert _calls(_bridged(gw, "json_args_whole", stream=False)) == [("f", '{"x":1}')]


def test_a_bridged_stream_asks_a_cerebras_dialect_upstream_for_usage(gw: Proc, fake: EmulatorThread) -> None:
    """An upstream that reports usage only when asked: the bridge asks, so the Response has its usage and the
    tokens are counted."""
    response = _bridged(gw, "usage_when_asked", stream=True)
    assert response["usage"]["input_tokens"] == 7 and response["usage"]["output_tokens"] == 2
    sent = json.loads(fake.requests[-1].body)
    assert sent["stream_options"] == {"include_usage": True}


def test_a_compressed_error_body_on_the_passthrough_is_read_decoded(gw: Proc) -> None:
    """An embeddings 400 sent gzip-compressed: the client gets the upstream's message and code, not mangled bytes."""
    error = {"error": {"message": "Invalid 'input': empty string.", "type": "invalid_request_error",
                       "param": "input", "code": "invalid_value"}}
    CASES["gzip_error"] = Plan(status=400, headers={**JSON, "content-encoding": "gzip"},
                               parts=[(0, gzip.compress(orjson.dumps(error)))], chunked=False)
    r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/embeddings", timeout=10,
                   json={"model": "text-embedding-3-small", "input": "", "user": "case=gzip_error"})
    assert r.status_code == 400, r.content
    assert r.json()["error"] == error["error"]


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path) -> Iterator[None]:
    yield
    CASES.clear()


def test_an_empty_stream_for_a_prompt_no_tier_holds_is_the_clients_400(fake: EmulatorThread, tmp_path: Path) -> None:
    """Both tiers are llama.cpp servers (vllm dialect) with a 100-token window; each answers a streamed over-long
    prompt with 200 and an empty body: the client gets 400 context_length_exceeded, not 502, and no breaker opens
    however often it is sent."""
    CASES["empty"] = Plan(headers=EVENTS, parts=[(0, b"")])
    health = {"failures": 2}  # two upstream failures would open a breaker
    cfg = {"upstreams": [
        {"name": f"ll-{tier}", "tier": tier, "base_url": fake.base_url, "dialect": "vllm", "context_window": 100,
         "health": health, "models": {"m": f"m-{tier}"}} for tier in ("fast", "standard")]}
    proc, _ = start_gateway(cfg, tmp_path)
    try:
        prompt = "case=empty " + "word " * 400  # ~400 tokens by the gateway's estimate
        for _ in range(4):
            r = httpx.post(f"http://127.0.0.1:{proc.port}/v1/chat/completions", timeout=10,
                           json={"model": "m", "stream": True, "messages": [{"role": "user", "content": prompt}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        ok = httpx.post(f"http://127.0.0.1:{proc.port}/v1/chat/completions", timeout=10,
                        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text  # nothing rests: the upstreams did nothing wrong
    finally:
        proc.stop()
