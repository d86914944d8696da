"""Complete Response objects: what the Responses bridge answers (whole, and in every stream event that carries the
response: created, in_progress and the terminal completed, incomplete or failed) and what the emulator answers
natively carry every field the Responses API's ``Response`` object requires, each of its JSON type, with the values
used, and one model name throughout (the upstream's, as its answer names it).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types.responses import Response

from conftest import Stack

# The fields a Response object must carry and their JSON types (null where the schema allows it), from:
# - the Open Responses specification, schema `ResponseResource`, its `required` list of 32 fields
#   (github.com/openresponses/openresponses, schema/components/schemas/ResponseResource.json; published
#   openapi.json version 2026-04-24), read on 2026-12-02: the list its public compliance suite checks, whose
#   TypeScript runner failed the bridge on exactly the fields a sampling default or a newer field was missing from;
# - the OpenAI API reference, Responses API, "The response object" (the same fields and types; openai-python 3.57.0,
#   whose generated `Response` type every object is also validated against, reads it), read on 2026-12-02.
# "number" is an int or a float, "integer" an int, never a boolean (JSON Schema's types, not Python's: True is an
# int in Python).
REQUIRED: dict[str, tuple[str, ...]] = {
    "id": ("string",), "object": ("string",), "created_at": ("integer",), "completed_at": ("integer", "null"),
    "status": ("string",), "incomplete_details": ("object", "null"), "model": ("string",),
    "previous_response_id": ("string", "null"), "instructions": ("string", "array", "null"), "output": ("array",),
    "error": ("object", "null"), "tools": ("array",), "tool_choice": ("string", "object"), "truncation": ("string",),
    "parallel_tool_calls": ("boolean",), "text": ("object",), "top_p": ("number",), "presence_penalty": ("number",),
    "frequency_penalty": ("number",), "top_logprobs": ("integer",), "temperature": ("number",),
    "reasoning": ("object", "null"), "user": ("string", "null"), "usage": ("object", "null"),
    "max_output_tokens": ("integer", "null"), "max_tool_calls": ("integer", "null"), "store": ("boolean",),
    "background": ("boolean",), "service_tier": ("string",), "metadata": ("object",),
    "safety_identifier": ("string", "null"), "prompt_cache_key": ("string", "null"),
}
# the values the OpenAI API reference allows for the fields that are enumerations
ENUMS: dict[str, frozenset[Any]] = {
    "object": frozenset({"response"}),
    "status": frozenset({"completed", "failed", "in_progress", "cancelled", "queued", "incomplete"}),
    "truncation": frozenset({"auto", "disabled"}),
    "service_tier": frozenset({"auto", "default", "flex", "scale", "priority"}),
}
TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}]


def json_type(value: Any) -> str:
    """The JSON Schema type of a decoded JSON value (``integer`` for an int, which is also a ``number``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    kinds = {float: "number", str: "string", list: "array", dict: "object"}
    return kinds[type(value)]


def _of(value: Any, allowed: tuple[str, ...]) -> bool:
    kind = json_type(value)
    return kind in allowed or kind == "integer" and "number" in allowed


def _check(response: dict[str, Any], where: str) -> None:
    missing = sorted(set(REQUIRED) - set(response))
    assert not missing, f"{where}: the Response lacks {missing}"
    wrong = {k: (response[k], json_type(response[k]), want) for k, want in REQUIRED.items()
             if not _of(response[k], want)}
    assert not wrong, f"{where}: wrong types {wrong}"
    odd = {k: response[k] for k, values in ENUMS.items() if response[k] not in values}
    assert not odd, f"{where}: values outside the enumeration {odd}"
    assert response["created_at"] > 0 and all(isinstance(v, str) for v in response["metadata"].values())
    assert isinstance(response["text"].get("verbosity"), str) and isinstance(response["text"].get("format"), dict)
    assert isinstance(response["tool_choice"], dict) or response["tool_choice"] in ("none", "auto", "required")
    for tool in response["tools"]:
        if tool.get("type") == "function":
            assert isinstance(tool.get("strict"), bool), f"{where}: a function tool without strict: {tool}"
    status = response["status"]
    if status == "completed":
        assert isinstance(response["completed_at"], int) and response["completed_at"] >= response["created_at"]
    else:
        assert response["completed_at"] is None, f"{where}: completed_at on a {status} response"
    assert (response["error"] is not None) == (status == "failed"), f"{where}: error {response['error']} ({status})"
    if status == "failed":
        assert {json_type(response["error"].get(k)) for k in ("code", "message")} == {"string"}, response["error"]
    if status == "incomplete":
        assert json_type(response["incomplete_details"].get("reason")) == "string"
    if response["usage"] is not None:
        assert all(json_type(response["usage"].get(k)) == "integer"
                   for k in ("input_tokens", "output_tokens", "total_tokens")), response["usage"]
    Response.model_validate(response)  # and the openai SDK reads it as its own type


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in r.text.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize(("tier", "mode"), [("fast", "bridge"), ("standard", "native")])
def test_whole_and_streamed_responses_are_complete_on_both_paths(stack: Stack, tier: str, mode: str) -> None:
    body = {"model": "gpt-5.6", "input": "Say hi [[emulate tokens=6]]", "tools": TOOLS, "temperature": 0.3,
            "presence_penalty": 0.5, "max_tool_calls": 2}
    headers = {"x-tiergate-tier": tier}
    whole = httpx.post(stack.base_url + "/responses", json=body, headers=headers, timeout=10)
    assert whole.status_code == 200 and whole.headers["x-tiergate-tier"] == tier, whole.text
    assert "x-tiergate-fallback" not in whole.headers
    _check(whole.json(), f"{mode} whole")
    used = {k: whole.json()[k] for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                                         "max_tool_calls")}
    assert used == {"temperature": 0.3, "top_p": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.0,
                    "max_tool_calls": 2}  # the client's, else the default
    streamed = httpx.post(stack.base_url + "/responses", json={**body, "stream": True}, headers=headers, timeout=10)
    carried = [e["response"] for e in _events(streamed) if isinstance(e.get("response"), dict)]
    assert [e["status"] for e in carried] == ["in_progress", "in_progress", "completed"]
    for response in carried:
        _check(response, f"{mode} stream")
    assert len({r["model"] for r in [*carried, whole.json()]}) == 1, "one model name throughout"


@pytest.mark.parametrize(("tier", "mode"), [("fast", "bridge"), ("standard", "native")])
def test_an_incomplete_response_is_complete_too(stack: Stack, tier: str, mode: str) -> None:
    """``max_output_tokens`` reached: ``incomplete`` with its reason, whole and as the stream's terminal event."""
    body = {"model": "gpt-5.6", "input": "Say hi [[emulate tokens=40]]", "max_output_tokens": 16}
    headers = {"x-tiergate-tier": tier}
    whole = httpx.post(stack.base_url + "/responses", json=body, headers=headers, timeout=10)
    assert whole.status_code == 200 and whole.headers["x-tiergate-tier"] == tier, whole.text
    streamed = httpx.post(stack.base_url + "/responses", json={**body, "stream": True}, headers=headers, timeout=10)
    last = _events(streamed)[-1]
    assert last["type"] == "response.incomplete", last
    for response, where in ((whole.json(), "whole"), (last["response"], "stream")):
        _check(response, f"{mode} incomplete {where}")
        assert response["status"] == "incomplete" and response["max_output_tokens"] == 16
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(("tier", "mode", "directive"), [
    ("fast", "bridge", "drop_after=4"),  # the chat upstream's connection reset after three tokens
    ("standard", "native", "fail_after=3"),  # the native upstream's own response.failed after three tokens
])
def test_a_response_that_fails_mid_stream_is_complete_too(stack: Stack, tier: str, mode: str,
                                                          directive: str) -> None:
    """An upstream failing after the first token: the stream's terminal event is ``response.failed`` whose Response
    carries its ``error``, and never a ``response.completed``."""
    body = {"model": "gpt-5.6", "input": f"Say hi [[emulate tokens=20 {directive}]]", "stream": True}
    r = httpx.post(stack.base_url + "/responses", json=body, headers={"x-tiergate-tier": tier}, timeout=10)
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == tier, r.text
    events = _events(r)
    kinds = [e.get("type") for e in events]
    assert "response.output_text.delta" in kinds and "response.completed" not in kinds, kinds
    assert kinds[-1] == "response.failed", kinds
    failed = events[-1]["response"]
    _check(failed, f"{mode} failed")
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error", failed["error"]
    carried = [e["response"] for e in events if isinstance(e.get("response"), dict)]
    assert len({c["id"] for c in carried}) == 1 and len({c["model"] for c in carried}) == 1


def test_encrypted_reasoning_asked_of_a_model_without_reasoning_gives_no_reasoning_item(stack: Stack) -> None:
    """``include: ["reasoning.encrypted_content"]`` (pydantic-ai and Codex CLI send it on every request) through the
    bridge: answered on the fast tier as OpenAI answers it for a model without reasoning, with no reasoning item
    (and so no ``encrypted_content``), whole and streamed."""
    body = {"model": "gpt-5.6", "input": "Say hi [[emulate tokens=6]]", "include": ["reasoning.encrypted_content"]}
    headers = {"x-tiergate-tier": "fast"}
    whole = httpx.post(stack.base_url + "/responses", json=body, headers=headers, timeout=10)
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-tiergate-tier"] == "fast" and "x-tiergate-fallback" not in whole.headers
    _check(whole.json(), "bridge whole with include")
    assert [i["type"] for i in whole.json()["output"]] == ["message"]
    assert "encrypted_content" not in whole.text
    streamed = httpx.post(stack.base_url + "/responses", json={**body, "stream": True}, headers=headers, timeout=10)
    assert streamed.headers["x-tiergate-tier"] == "fast" and "x-tiergate-fallback" not in streamed.headers
    events = _events(streamed)
    assert events[-1]["type"] == "response.completed", events[-1]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["message"] and not any(e["type"].startswith("response.reasoning") for e in events)
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message"]
    assert "encrypted_content" not in streamed.text


def test_the_bridge_names_the_upstreams_model_from_the_first_event_to_the_last(stack: Stack) -> None:
    """The fast emulator answers as ``gpt-5.6-wse`` (the upstream id the config maps gpt-5.6 to): every event says so,
    as every relayed chat chunk does."""
    r = httpx.post(stack.base_url + "/responses", headers={"x-tiergate-tier": "fast"}, timeout=10,
                   json={"model": "gpt-5.6-sol-fast", "input": "hi", "stream": True})
    models = {e["response"]["model"] for e in _events(r) if isinstance(e.get("response"), dict)}
    assert models == {"gpt-5.6-wse"}
