"""Complete Response objects: what the Responses bridge answers (whole, and in every stream event that carries the
response) and what the emulator answers natively carry every field the Responses API's ``Response`` object has,
with the values used, and one model name throughout (the upstream's, as its answer names it).

The fields and their types: the OpenAI API reference, "The response object", and the Open Responses specification's
``Response`` schema, whose required list the public compliance suite checks (its TypeScript runner failed the bridge
on exactly the fields a sampling default or a newer field was missing from).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types.responses import Response

from conftest import Stack

NUMBER = (int, float)
# field -> the JSON types its value may have (None: null allowed)
REQUIRED: dict[str, tuple[Any, ...]] = {
    "id": (str,), "object": (str,), "created_at": (int,), "completed_at": (int, type(None)), "status": (str,),
    "incomplete_details": (dict, type(None)), "model": (str,), "previous_response_id": (str, type(None)),
    "instructions": (str, list, type(None)), "output": (list,), "error": (dict, type(None)), "tools": (list,),
    "tool_choice": (str, dict), "truncation": (str,), "parallel_tool_calls": (bool,), "text": (dict,),
    "top_p": NUMBER, "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "top_logprobs": (int,),
    "temperature": NUMBER, "reasoning": (dict, type(None)), "usage": (dict, type(None)),
    "max_output_tokens": (int, type(None)), "max_tool_calls": (int, type(None)), "store": (bool,),
    "background": (bool,), "service_tier": (str,), "metadata": (dict,), "safety_identifier": (str, type(None)),
    "prompt_cache_key": (str, type(None)),
}
TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}]


def _check(response: dict[str, Any], where: str) -> None:
    missing = sorted(set(REQUIRED) - set(response))
    assert not missing, f"{where}: the Response lacks {missing}"
    wrong = {k: response[k] for k, types in REQUIRED.items() if not isinstance(response[k], types)}
    assert not wrong, f"{where}: wrong types {wrong}"
    assert isinstance(response["text"].get("verbosity"), str) and isinstance(response["text"].get("format"), dict)
    for tool in response["tools"]:
        if tool.get("type") == "function":
            assert isinstance(tool.get("strict"), bool), f"{where}: a function tool without strict: {tool}"
    if response["status"] == "completed":
        assert isinstance(response["completed_at"], int) and response["completed_at"] >= response["created_at"]
    Response.model_validate(response)  # and the openai SDK reads it as its own type


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in r.text.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize(("tier", "mode"), [("fast", "bridge"), ("standard", "native")])
def test_whole_and_streamed_responses_are_complete_on_both_paths(stack: Stack, tier: str, mode: str) -> None:
    body = {"model": "gpt-5.6", "input": "Say hi [[emulate tokens=6]]", "tools": TOOLS, "temperature": 0.3}
    headers = {"x-tiergate-tier": tier}
    whole = httpx.post(stack.base_url + "/responses", json=body, headers=headers, timeout=10)
    assert whole.status_code == 200 and whole.headers["x-tiergate-tier"] == tier, whole.text
    _check(whole.json(), f"{mode} whole")
    assert whole.json()["temperature"] == 0.3 and whole.json()["top_p"] == 1.0  # the client's, else the default
    streamed = httpx.post(stack.base_url + "/responses", json={**body, "stream": True}, headers=headers, timeout=10)
    carried = [e["response"] for e in _events(streamed) if isinstance(e.get("response"), dict)]
    assert [e["status"] for e in carried] == ["in_progress", "in_progress", "completed"]
    for response in carried:
        _check(response, f"{mode} stream")
    assert len({r["model"] for r in [*carried, whole.json()]}) == 1, "one model name throughout"


def test_an_incomplete_bridged_response_is_complete_too(stack: Stack) -> None:
    body = {"model": "gpt-5.6", "input": "Say hi [[emulate tokens=40]]", "max_output_tokens": 5, "stream": True}
    r = httpx.post(stack.base_url + "/responses", json=body, headers={"x-tiergate-tier": "fast"}, timeout=10)
    last = _events(r)[-1]
    assert last["type"] == "response.incomplete", last
    _check(last["response"], "bridge incomplete")
    assert last["response"]["completed_at"] is None and last["response"]["max_output_tokens"] == 5


def test_the_bridge_names_the_upstreams_model_from_the_first_event_to_the_last(stack: Stack) -> None:
    """The fast emulator answers as ``gpt-5.6-wse`` (the upstream id the config maps gpt-5.6 to): every event says so,
    as every relayed chat chunk does."""
    r = httpx.post(stack.base_url + "/responses", headers={"x-tiergate-tier": "fast"}, timeout=10,
                   json={"model": "gpt-5.6-sol-fast", "input": "hi", "stream": True})
    models = {e["response"]["model"] for e in _events(r) if isinstance(e.get("response"), dict)}
    assert models == {"gpt-5.6-wse"}
