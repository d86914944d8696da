"""The emulator acts enough like a model for agents to run (the Responses bridge is tried with them): tool calls whose
arguments satisfy the tool's JSON schema until a tool result comes back, then text; ``n``; token limits (``length`` /
``incomplete``); ``response_format`` / ``text.format`` JSON schemas. Checked over loopback against the emulator alone,
with the ``jsonschema`` library and the openai SDK's types as judges."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from gateway.tools.emulator import EmulatorConfig, EmulatorThread, schema_instance

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"], "properties": {
    "city": {"type": "string", "minLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 3},
    "unit": {"type": "string", "enum": ["c", "f"]}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def emu() -> Iterator[dict[str, EmulatorThread]]:
    quick = {"tps": 5000.0, "ttft": 0.001}
    out = {d: EmulatorThread(config=EmulatorConfig(dialect=d, **quick)) for d in ("openai", "cerebras")}  # type: ignore[arg-type]
    yield out
    for e in out.values():
        e.stop()


def _post(emu: EmulatorThread, path: str, **body: Any) -> httpx.Response:
    return httpx.post(emu.base_url + path, json={"model": "m", **body}, timeout=10)


def _chat_stream(emu: EmulatorThread, **body: Any) -> list[dict[str, Any]]:
    raw = _post(emu, "/chat/completions", stream=True, **body).content
    return [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


class Forecast(BaseModel):
    city: str = Field(min_length=1, max_length=3)
    high: float = Field(gt=-90, lt=60)
    days: list[int] = Field(min_length=2)
    kind: str | None = None


@pytest.mark.parametrize("schema", [
    WEATHER,
    Forecast.model_json_schema(),
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "array", "items": {
        "anyOf": [{"type": "null"}, {"type": "number", "exclusiveMinimum": 0, "maximum": 1}]}, "minItems": 3}}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}, "n": {
        "type": ["null", "integer"], "exclusiveMinimum": 4, "exclusiveMaximum": 6}, "c": {"const": "x"}}},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}},
               {"type": "object", "properties": {"b": {"type": "string", "maxLength": 2}}}]},
], ids=["enum_min_max", "pydantic", "ref_anyof_exclusive", "format_nullable_const", "allof_maxlength"])
def test_schema_instances_validate(schema: dict[str, Any]) -> None:
    jsonschema.validate(schema_instance(schema), schema)


def test_a_whole_number_is_written_as_an_integer_for_a_client_that_parses_one() -> None:
    """Codex CLI declares ``timeout_ms`` a ``number`` and parses an integer: ``7.0`` made it log a parse error."""
    args = json.dumps(schema_instance({"type": "object", "properties": {
        "timeout_ms": {"type": "number"}, "count": {"type": "integer", "minimum": 2}, "ratio": {
            "type": "number", "minimum": 0, "maximum": 1}}}))
    assert json.loads(args) == {"timeout_ms": 7, "count": 3, "ratio": 0.5}
    assert '"timeout_ms": 7,' in args  # not 7.0


def test_chat_calls_the_tool_then_answers_after_its_result(emu: dict[str, EmulatorThread]) -> None:
    for dialect, up in emu.items():
        msgs = [{"role": "user", "content": "weather?"}]
        first = ChatCompletion.model_validate(_post(up, "/chat/completions", messages=msgs, tools=[CHAT_TOOL]).json())
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert first.choices[0].finish_reason == "tool_calls", dialect
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = ChatCompletion.model_validate(_post(up, "/chat/completions", messages=msgs,
                                                     tools=[CHAT_TOOL]).json())
        assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
        # streamed: the same call, its arguments in deltas
        chunks = _chat_stream(up, messages=msgs[:1], tools=[CHAT_TOOL], tool_choice="required")
        args = "".join(c["choices"][0]["delta"].get("tool_calls", [{}])[0].get("function", {}).get("arguments", "")
                       for c in chunks if c["choices"])
        jsonschema.validate(json.loads(args), WEATHER)
        # (Cerebras leaves finish_reason out of the chunks before the last, as its API does)
        assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "tool_calls"


def test_chat_n_limits_and_json(emu: dict[str, EmulatorThread]) -> None:
    up = emu["openai"]
    msgs = [{"role": "user", "content": "hi"}]
    whole = _post(up, "/chat/completions", messages=msgs, n=3).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    chunks = _chat_stream(up, messages=msgs, n=2, stream_options={"include_usage": True})
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    cut = _post(up, "/chat/completions", messages=msgs, max_completion_tokens=3).json()
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": WEATHER}}
    text = _post(up, "/chat/completions", messages=msgs, response_format=fmt).json()["choices"][0]["message"]
    jsonschema.validate(json.loads(text["content"]), WEATHER)
    obj = _post(up, "/chat/completions", messages=msgs, response_format={"type": "json_object"}).json()
    assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)


def test_responses_natively_and_only_on_the_openai_dialect(emu: dict[str, EmulatorThread]) -> None:
    up = emu["openai"]
    first = Response.model_validate(_post(up, "/responses", input="weather?", tools=[RESPONSES_TOOL]).json())
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    after = _post(up, "/responses", tools=[RESPONSES_TOOL], input=[
        {"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]).json()
    assert Response.model_validate(after).output_text
    fmt = {"type": "json_schema", "name": "w", "strict": True, "schema": WEATHER}
    jsonschema.validate(json.loads(Response.model_validate(_post(up, "/responses", input="x", text={
        "format": fmt}).json()).output_text), WEATHER)
    cut = Response.model_validate(_post(up, "/responses", input="x", max_output_tokens=2).json())
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    raw = _post(up, "/responses", input="x", stream=True, tools=[RESPONSES_TOOL]).content
    events = [EVENT.validate_json(e.split(b"\ndata: ", 1)[1]) for e in raw.split(b"\n\n") if e]
    assert events[-1].type == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    # Cerebras Inference has no Responses API: the emulator of its dialect neither
    assert _post(emu["cerebras"], "/responses", input="x").status_code == 404


def test_a_follow_up_to_a_response_the_emulator_never_made_is_refused(emu: dict[str, EmulatorThread]) -> None:
    up = emu["openai"]
    resp = _post(up, "/responses", input="x", previous_response_id="resp_unknown")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "previous_response_not_found"
    made = _post(up, "/responses", input="x").json()["id"]
    assert _post(up, "/responses", input="y", previous_response_id=made).status_code == 200


@pytest.mark.parametrize(("dialect", "suffix", "reset"), [("openai", "", r"\d+\.\d{3}s"),
                                                          ("cerebras", "-minute", r"\d+\.\d{3}")])
def test_a_token_budget_is_shared_by_every_caller_and_reported(dialect: str, suffix: str, reset: str) -> None:
    emu = EmulatorThread(config=EmulatorConfig(dialect=dialect, ttft=0.001, tps=10_000, tokens_per_minute=2500))
    try:
        body = {"model": "m", "max_tokens": 1000, "messages": [{"role": "user", "content": "[[emulate tokens=2]]"}]}
        cost = 1000 + len(json.dumps(body["messages"], separators=(",", ":"))) // 4
        first, second, third = (_post(emu, "/chat/completions", **body) for _ in range(3))
        assert first.status_code == second.status_code == 200
        assert int(first.headers[f"x-ratelimit-remaining-tokens{suffix}"]) == 2500 - cost
        assert int(second.headers[f"x-ratelimit-remaining-tokens{suffix}"]) == 2500 - 2 * cost
        assert first.headers[f"x-ratelimit-limit-tokens{suffix}"] == "2500"
        assert re.fullmatch(reset, first.headers[f"x-ratelimit-reset-tokens{suffix}"])
        assert third.status_code == 429  # the rest does not cover a third: refused, and not charged
        assert int(third.headers[f"x-ratelimit-remaining-tokens{suffix}"]) == 2500 - 2 * cost
        off = httpx.post(emu.base_url.removesuffix("/v1") + "/emulator/config", json={"tokens_per_minute": 0})
        assert off.json()["tokens_per_minute"] is None
        assert _post(emu, "/chat/completions", **body).status_code == 200
    finally:
        emu.stop()


def test_websocket_mode_serves_the_stream_as_frames(emu: dict[str, EmulatorThread]) -> None:
    """``GET /v1/responses`` upgraded (OpenAI dialect): each ``response.create`` streams the events a streamed POST
    would, one per frame with its ``stream_id``; a follow-up continues a response it made; one it did not make, and
    a ``status`` directive, are ``error`` events; the Cerebras dialect refuses the upgrade as it refuses the path."""
    import openai
    from websockets.exceptions import InvalidStatus

    sdk = openai.OpenAI(base_url=emu["openai"].base_url, api_key="unused", max_retries=0)
    with sdk.responses.connect() as conn:
        conn.response.create(model="m", input="weather?", tools=[RESPONSES_TOOL], stream_id="lane-1")
        first = []
        for event in conn:
            first.append(event)
            if event.type == "response.completed":
                break
        call = first[-1].response.output[0]
        conn.response.create(model="m", previous_response_id=first[-1].response.id, tools=[RESPONSES_TOOL],
                             input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
                                    {"type": "message", "role": "user", "content": "[[emulate tool=call]]"}])
        again = []
        for event in conn:
            again.append(event)
            if event.type == "response.completed":
                break
        conn.response.create(model="m", input="hi", previous_response_id="resp_unknown")
        unknown = conn.recv()
        conn.response.create(model="m", input="hi [[emulate status=503]]")
        unavailable = conn.recv()
    assert [e.type for e in first][:2] == ["response.created", "response.in_progress"]
    assert {e.stream_id for e in first} == {"lane-1"}
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert again[-1].response.output[0].type == "function_call", "tool=call: another step of the loop"
    assert unknown.type == "error" and unknown.error.code == "previous_response_not_found"
    assert unavailable.type == "error" and unavailable.status == 503
    assert [r.method for r in emu["openai"].requests[-5:]] == ["GET"] + ["WS"] * 4  # the handshake, then each message
    with pytest.raises(InvalidStatus) as refused:
        openai.OpenAI(base_url=emu["cerebras"].base_url, api_key="x").responses.connect().enter()
    assert refused.value.response.status_code == 404


def _until_done(conn: Any) -> list[Any]:
    events = []
    for event in conn:
        events.append(event)
        if event.type in ("response.completed", "error"):
            return events
    raise AssertionError(f"the socket ended after {[e.type for e in events]}")


def test_a_store_false_response_is_kept_only_by_the_socket_that_made_it(emu: dict[str, EmulatorThread]) -> None:
    """As OpenAI's API: a ``store: false`` response is not retrievable (404) nor continued over HTTP (400); over
    WebSocket mode the socket that made it keeps it in memory, so it continues there, and only there."""
    import openai

    up = emu["openai"]
    made = _post(up, "/responses", input="x", store=False).json()["id"]
    assert httpx.get(f"{up.base_url}/responses/{made}").status_code == 404
    follow = _post(up, "/responses", input="y", previous_response_id=made)
    assert follow.status_code == 400 and follow.json()["error"]["code"] == "previous_response_not_found"
    stored = _post(up, "/responses", input="x").json()["id"]
    assert httpx.get(f"{up.base_url}/responses/{stored}").status_code == 200

    sdk = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0)
    with sdk.responses.connect() as conn:
        conn.response.create(model="m", input="x", store=False)
        on_socket = _until_done(conn)[-1].response.id
        conn.response.create(model="m", input="y", store=False, previous_response_id=on_socket)
        assert _until_done(conn)[-1].type == "response.completed", "its own socket continues it"
        conn.response.create(model="m", input="y", previous_response_id=stored)
        assert _until_done(conn)[-1].type == "response.completed", "a stored one continues on any socket"
    with sdk.responses.connect() as other:
        other.response.create(model="m", input="y", previous_response_id=on_socket)
        refused = _until_done(other)[-1]
    assert refused.type == "error" and refused.error.code == "previous_response_not_found"
    assert httpx.get(f"{up.base_url}/responses/{on_socket}").status_code == 404
    assert _post(up, "/responses", input="y", previous_response_id=on_socket).status_code == 400


def test_a_warm_up_makes_a_response_without_output(emu: dict[str, EmulatorThread]) -> None:
    """``generate: false`` over WebSocket mode (OpenAI's WebSocket mode guide: a warm-up): ``response.created`` and
    ``response.completed`` with no output and no output tokens; the response is continued as any other."""
    import openai

    sdk = openai.OpenAI(base_url=emu["openai"].base_url, api_key="unused", max_retries=0)
    with sdk.responses.connect() as conn:
        conn.send({"type": "response.create", "model": "m", "input": "the tools and instructions",
                   "generate": False})  # type: ignore[arg-type]
        warm = _until_done(conn)
        conn.response.create(model="m", input="now answer", previous_response_id=warm[-1].response.id)
        answered = _until_done(conn)
    assert [e.type for e in warm] == ["response.created", "response.completed"]
    done = warm[-1].response
    assert done.output == [] and done.usage is not None and done.usage.output_tokens == 0
    assert done.usage.input_tokens > 0
    assert answered[-1].type == "response.completed" and answered[-1].response.output_text
