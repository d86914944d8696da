"""The Responses <-> chat-completions bridge (``gateway.responses.stream``), in-process: golden translations both ways,
and every bridged event stream checked against the ``openai`` SDK's own types and its ``responses.stream()``
accumulation.

The streams come from hand-built chat chunks and from every recorded chat stream in ``tests/fixtures/upstream/``
(text, tool calls, parallel tool calls, a refusal, reasoning, ``finish_reason: length``, n=2, Groq's error event,
OpenRouter's error chunk), played through :class:`gateway.responses.stream.BridgeRelay` as the upstream's reads.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.errors import GatewayError
from gateway.responses.ids import ID_PREFIX, new_id
from gateway.responses.request import (
    as_input,
    chat_request,
    droppable_tools,
    input_items,
    native_input,
    unbridgeable,
)
from gateway.responses.stream import BridgeRelay, _Item
from gateway.responses.whole import Draft, response_usage, whole_response
from gateway.wire.body import loads

from conftest import FIXTURES, chunk, sse

EVENT = TypeAdapter(ResponseStreamEvent)
CHAT_STREAMS = sorted(p.stem for p in FIXTURES.glob("*.json")
                      if orjson.loads(p.read_bytes())["streaming"] and "/chat/" in orjson.loads(p.read_bytes())[
                          "request"]["path"])


# ---- request side --------------------------------------------------------------------------------------------

TOOL = {"type": "function", "name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": True}


def test_a_string_input_with_instructions_and_every_mapped_option() -> None:
    body = {"model": "m", "instructions": "Be brief.", "input": "hi", "tools": [TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 64, "temperature": 0.2, "top_p": 0.9, "user": "u",
            "safety_identifier": "s", "service_tier": "priority", "prompt_cache_key": "k", "stream": True,
            "text": {"format": {"type": "json_schema", "name": "W", "schema": {"type": "object"}, "strict": True},
                     "verbosity": "low"},
            "reasoning": {"effort": "high", "summary": "auto"}, "top_logprobs": 2,
            "store": True, "metadata": {"workload": "agent"}, "truncation": "disabled",
            "include": ["message.output_text.logprobs"], "prompt_cache_retention": "24h", "presence_penalty": 0.5,
            "frequency_penalty": -0.25, "max_tool_calls": 3}
    assert unbridgeable(body) is None
    assert chat_request(body, []) == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                    "parameters": TOOL["parameters"], "strict": True}}],
        "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0.2, "top_p": 0.9, "user": "u",
        "presence_penalty": 0.5, "frequency_penalty": -0.25, "safety_identifier": "s", "service_tier": "priority",
        "prompt_cache_key": "k", "stream": True,
        "max_completion_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "W", "schema": {"type": "object"},
                                                                   "strict": True}},
        "verbosity": "low", "reasoning_effort": "high", "logprobs": True, "top_logprobs": 2,
    }


def test_every_input_item_type_and_the_history_before_it() -> None:
    history = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Oslo and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city":"Rome"}'},
    ]
    body = {"model": "m", "input": [
        {"type": "function_call_output", "call_id": "call_a", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "sun"}]},
        {"role": "developer", "content": "Answer in French."},
        {"role": "system", "content": [{"type": "input_text", "text": "Be brief."}, {"type": "input_text",
                                                                                     "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/b.png"}]},
        {"role": "user", "content": [
            {"type": "input_text", "text": "and this?"},
            {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"},
            {"type": "input_file", "file_id": "file_1", "filename": "a.pdf"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
    ]}
    assert unbridgeable(body) is None
    assert chat_request(body, history)["messages"] == [
        {"role": "user", "content": "weather in Oslo and Rome?"},  # text alone: a plain string
        {"role": "assistant", "content": "Checking.", "tool_calls": [  # parallel calls join the message before them
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_b", "content": "sun"},
        {"role": "system", "content": "Answer in French."},
        {"role": "system", "content": "Be brief.\n\nBe kind."},  # several text parts: one string in a system message
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/b.png"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "and this?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
            {"type": "file", "file": {"file_id": "file_1", "filename": "a.pdf"}}]},
        {"role": "assistant", "content": None, "refusal": "I can't."},
    ]


def test_a_named_tool_choice_and_json_object() -> None:
    chat = chat_request({"model": "m", "input": "x", "tools": [TOOL], "tool_choice": {
        "type": "function", "name": "get_weather"}, "text": {"format": {"type": "json_object"}}}, [])
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [TOOL, {"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1}]}, "tools"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["some.future.value"]}, "include"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input"),
])
def test_what_the_bridge_cannot_serve_is_named(extra: dict[str, Any], param: str) -> None:
    found = unbridgeable({"model": "m", "input": "x", **extra})
    assert found is not None and found[0] == param


@pytest.mark.parametrize(("extra", "dropped"), [
    ({"tools": [TOOL, {"type": "web_search"}]}, ("web_search",)),  # Codex CLI's default tools
    ({"tools": [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}]}, ("file_search",
                                                                                          "web_search")),
    ({"tools": [TOOL], "input": [{"type": "additional_tools", "tools": [{"type": "web_search"}]}]}, ("web_search",)),
    ({"tools": [TOOL, {"type": "web_search"}], "tool_choice": "required"}, ("web_search",)),
    ({"tools": [TOOL, {"type": "web_search"}], "tool_choice": {"type": "web_search"}}, ()),  # forced
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, ()),  # nothing left to call
    ({"tools": [TOOL, {"type": "web_search"}], "background": True}, ()),  # bridged without it: still not
    ({"tools": [TOOL]}, ()),  # nothing to drop
])
def test_which_hosted_tools_may_be_dropped(extra: dict[str, Any], dropped: tuple[str, ...]) -> None:
    body = {"model": "m", "input": "x", **extra}
    assert droppable_tools(body) == dropped
    if dropped:
        chat = chat_request(body, [])
        assert [t["function"]["name"] for t in chat.get("tools", [])] == (["get_weather"] if TOOL in body["tools"]
                                                                         else [])


def test_max_tool_calls_is_accepted_echoed_and_not_sent() -> None:
    """It limits built-in tool calls only ("The maximum number of total calls to built-in tools that can be processed
    in a response", OpenAI API reference), and the bridge runs none: it changes nothing, so it is no reason to leave
    the bridge; the Response says what the client asked, as the API's does."""
    body = {"model": "m", "input": "x", "tools": [TOOL], "max_tool_calls": 2}
    assert unbridgeable(body) is None
    assert "max_tool_calls" not in chat_request(body, [])
    assert Draft(body, new_id(ID_PREFIX)).response("completed", [])["max_tool_calls"] == 2
    assert _draft().response("completed", [])["max_tool_calls"] is None


def test_a_conversation_moved_to_a_native_upstream_loses_only_what_it_cannot_read() -> None:
    items = [{"type": "message", "id": "msg_tg1", "role": "user", "content": "a"},
             {"type": "reasoning", "id": "rs_tg1", "summary": []},
             {"type": "message", "id": "msg_tg2", "status": "completed", "role": "assistant", "content": [
                 {"type": "output_text", "text": "b", "annotations": []}]}]
    assert as_input(items) == [{"type": "message", "role": "user", "content": "a"},
                                      {"type": "message", "role": "assistant", "content": [
                                          {"type": "output_text", "text": "b", "annotations": []}]}]


# ---- response side: whole ------------------------------------------------------------------------------------

def _draft(**body: Any) -> Draft:
    return Draft({"model": "m", "input": "x", **body}, new_id(ID_PREFIX))


def test_a_whole_completion_with_reasoning_text_refusal_and_tool_calls() -> None:
    completion = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m-2026", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Let me look.", "refusal": "Not that part.", "reasoning_content": "hmm",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                           {"id": "call_2", "type": "function",
                            "function": {"name": "g", "arguments": "{\"a\":1}"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                  "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2}}}
    response = whole_response(completion, _draft(tools=[TOOL]))
    parsed = Response.model_validate(response)
    assert parsed.status == "completed" and parsed.model == "m-2026" and parsed.id.startswith("resp_tg")
    assert [o.type for o in parsed.output] == ["reasoning", "message", "function_call", "function_call"]
    assert parsed.output_text == "Let me look."
    message = parsed.output[1]
    assert [c.type for c in message.content] == ["output_text", "refusal"]  # type: ignore[union-attr]
    assert [(o.call_id, o.name, o.arguments) for o in parsed.output[2:]] == [  # type: ignore[union-attr]
        ("call_1", "f", "{}"), ("call_2", "g", '{"a":1}')]
    assert parsed.usage is not None and (parsed.usage.input_tokens, parsed.usage.output_tokens) == (10, 7)
    assert parsed.usage.input_tokens_details.cached_tokens == 4
    assert parsed.usage.output_tokens_details.reasoning_tokens == 2


def test_a_whole_completion_cut_at_the_token_limit_is_incomplete() -> None:
    completion = {"choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant",
                                                                                  "content": "Once upon"}}]}
    parsed = Response.model_validate(whole_response(completion, _draft(max_output_tokens=2)))
    assert parsed.status == "incomplete" and parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens" and parsed.max_output_tokens == 2


# ---- response side: streams ----------------------------------------------------------------------------------

class Reads:
    """An upstream body played from ``reads`` (``gateway.stream.relay.StreamBody``)."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.i = 0

    def watch_idle(self) -> None:
        pass

    async def chunks(self) -> AsyncIterator[bytes]:
        while self.i < len(self.reads):
            self.i += 1
            yield self.reads[self.i - 1]


async def _bridge(reads: list[bytes], **body: Any) -> tuple[list[dict[str, Any]], BridgeRelay]:
    relay = BridgeRelay(_draft(**body), max_event_bytes=1 << 20, finish_grace=0.05)
    written: list[bytes] = []

    async def write(data: bytes) -> None:
        written.append(data)

    await relay.run(Reads(reads), write)
    out = b"".join(written)
    events = []
    for raw in out.split(b"\n\n")[:-1]:
        head, data = raw.split(b"\n", 1)
        assert head.startswith(b"event: ") and data.startswith(b"data: ")
        event = loads(data[6:])  # a lone surrogate is written escaped, as the upstream sent it
        assert event["type"] == head[7:].decode()  # the event: line names its type
        events.append(event)
    assert out.endswith(b"\n\n") and b"[DONE]" not in out
    return events, relay


def _check(events: list[dict[str, Any]]) -> Any:
    """The stream is well formed (every event of the SDK's types, numbered, created first, one terminal event last)
    and the SDK's stream helper accumulates it; returns the helper's final response (None when it failed)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    terminal = [e for e in events if e["type"] in ("response.completed", "response.incomplete", "response.failed")]
    assert len(terminal) == 1 and terminal[0] is events[-1]
    state = ResponseStreamState(input_tools=[], text_format=openai_omit())
    for e in events:
        state.handle_event(EVENT.validate_python(e))
    if events[-1]["type"] != "response.completed":
        return None
    return state._completed_response


def openai_omit() -> Any:
    from openai import omit

    return omit


async def test_a_text_stream_becomes_the_typed_event_stream() -> None:
    events, relay = await _bridge([sse(chunk(role=True), done=False), sse(chunk("Hel"), done=False),
                                   sse(chunk("lo"), chunk(finish="stop"), chunk(usage=True))])
    final = _check(events)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert final.output_text == "Hello" and final.usage.output_tokens == 3
    assert relay.response is not None and relay.response["output"][0]["content"][0]["text"] == "Hello"


async def test_a_stream_cut_mid_tool_call_fails_and_never_completes() -> None:
    tool = orjson.loads(chunk())
    tool["choices"][0]["delta"] = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                   "function": {"name": "get_weather", "arguments": '{"ci'}}]}
    events, _ = await _bridge([sse(chunk(role=True), orjson.dumps(tool), done=False)])
    assert _check(events) is None
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert "upstream_stream_interrupted" in events[-1]["response"]["error"]["message"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added[0]["item"]["call_id"] == "call_1" and added[0]["item"]["name"] == "get_weather"


async def test_the_token_limit_is_an_incomplete_response() -> None:
    events, _ = await _bridge([sse(chunk(role=True), chunk("Once"), chunk(finish="length"))], max_output_tokens=1)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    _check(events)


async def test_an_upstream_error_event_after_the_first_token_is_a_failed_response() -> None:
    err = '{"error":{"message":"overloaded","type":"server_error","code":"overloaded"}}'
    events, relay = await _bridge([sse(chunk(role=True), chunk("par"), err, done=False)])
    assert events[-1]["type"] == "response.failed" and relay.stats.error == "upstream_error_event"
    # the Responses API's own error codes: the upstream's rides in the message
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "overloaded (overloaded)"}
    assert not [e for e in events if e["type"] == "response.completed"]


async def test_an_error_event_before_the_first_token_is_an_http_error() -> None:
    err = '{"error":{"message":"bad","type":"invalid_request_error","status_code":400}}'
    with pytest.raises(GatewayError) as info:
        await _bridge([sse(chunk(role=True), err, done=False)])
    assert info.value.status == 400


def _fixture_reads(name: str) -> list[bytes]:
    body = (FIXTURES / f"{name}.body").read_bytes()
    return [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]


EXPECTED = {  # fixture -> output item types of the bridged response, and its terminal event
    "openai_chat_stream_parallel_tool_calls": (["function_call", "function_call"], "response.completed"),
    "openai_chat_stream_tool_call": (["function_call"], "response.completed"),
    "cerebras_chat_stream_tool_call": (["reasoning", "function_call"], "response.completed"),
    "cerebras_chat_stream_text": (["reasoning", "message"], "response.completed"),
    "openai_chat_stream_refusal": (["message"], "response.completed"),
    "llamacpp_chat_stream_reasoning": (["reasoning", "message"], "response.completed"),
    "openai_chat_stream_include_usage_length": ([], "response.incomplete"),
    "vllm_chat_stream": (["message"], "response.incomplete"),
    "groq_stream_error_event_tool_use_failed": (["reasoning"], "response.failed"),
    "openrouter_stream_comments_and_error_chunk": (["reasoning"], "response.failed"),
}


@pytest.mark.parametrize("name", CHAT_STREAMS)
async def test_every_recorded_chat_stream_bridges_to_a_valid_event_stream(name: str) -> None:
    events, relay = await _bridge(_fixture_reads(name))
    final = _check(events)
    types = [i["type"] for i in events[-1]["response"]["output"]]
    want = EXPECTED.get(name, (["message"], "response.completed"))
    assert (types, events[-1]["type"]) == want, name
    if final is not None:
        # the stream helper's ``parsed`` fields are the SDK's own additions, not on the wire
        assert _unparsed(final.model_dump()["output"]) == Response.model_validate(relay.response).model_dump()["output"]


def _unparsed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _unparsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_unparsed(v) for v in value]
    return value


async def test_the_recorded_refusal_and_parallel_calls_keep_their_content() -> None:
    events, _ = await _bridge(_fixture_reads("openai_chat_stream_refusal"))
    assert events[-1]["response"]["output"][0]["content"][0]["type"] == "refusal"
    events, _ = await _bridge(_fixture_reads("openai_chat_stream_parallel_tool_calls"))
    calls = events[-1]["response"]["output"]
    assert len({c["call_id"] for c in calls}) == 2 and all(orjson.loads(c["arguments"]) for c in calls)


def test_usage_maps_with_its_details() -> None:
    assert response_usage({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                  "prompt_tokens_details": {"cached_tokens": 1},
                                  "completion_tokens_details": {"reasoning_tokens": 2}}) == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 8}
    assert response_usage(None) is None


def test_input_items_get_ids_and_keep_what_they_hold() -> None:
    items = input_items({"input": [{"role": "user", "content": "a"}, copy.deepcopy(TOOL | {"type": "x"})]})
    assert items[0]["type"] == "message" and items[0]["id"].startswith("msg_tg") and items[0]["content"] == "a"
    assert input_items({"input": "hi"})[0]["content"] == [{"type": "input_text", "text": "hi"}]


@pytest.mark.parametrize(("kind", "content_index"), [
    ("response.output_text.delta", 0), ("response.refusal.delta", 1), ("response.reasoning_text.delta", 0),
    ("response.function_call_arguments.delta", None)])
def test_a_delta_event_from_its_cached_head_is_what_emit_writes(kind: str, content_index: int | None) -> None:
    relay = BridgeRelay(_draft(), max_event_bytes=1 << 20, finish_grace=0.05)
    item = _Item(0, "message", "msg_tg")
    fast: list[bytes] = []
    slow: list[bytes] = []
    for text in ("Hel", 'lo "quoted"\n', "\ud800 lone surrogate", "é"):
        relay._delta(fast, kind, item, text, content_index)
        fields: dict[str, Any] = {"item_id": item.id, "output_index": 0}
        if content_index is not None:
            fields["content_index"] = content_index
        fields["delta"] = text
        if kind == "response.output_text.delta":
            fields["logprobs"] = []
        relay._seq -= 1
        relay._emit(slow, kind, **fields)
    assert fast == slow and relay._seq == 4


# ---- what an adversarial review found ------------------------------------------------------------------------

def _delta_chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> str:
    return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish, **choice}]}).decode()


async def test_tool_call_deltas_without_an_index_are_told_apart_by_id() -> None:
    calls = [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
             {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"b"'}},
             {"function": {"arguments": ":2}"}}]  # no id: the last call goes on
    events, _ = await _bridge([sse(chunk(role=True), *[_delta_chunk({"tool_calls": [c]}) for c in calls],
                                   _delta_chunk({}, "tool_calls"))])
    final = _check(events)
    got = [(i.call_id, i.name, i.arguments) for i in final.output]
    assert got == [("call_a", "f", '{"a":1}'), ("call_b", "g", '{"b":2}')]


async def test_odd_tool_call_indexes_and_late_names_do_not_break_the_stream() -> None:
    calls = [{"index": [0], "id": "call_a", "function": {"arguments": "{}"}},  # an unhashable index
             {"index": [0], "function": {"name": "late_name"}},  # the name after the first delta
             {"index": 1, "id": 7, "function": {"name": 8, "arguments": "{}"}}]  # not strings: not trusted
    events, _ = await _bridge([sse(chunk(role=True), *[_delta_chunk({"tool_calls": [c]}) for c in calls],
                                   _delta_chunk({}, "tool_calls"))])
    final = _check(events)
    assert [(i.name, i.arguments) for i in final.output] == [("late_name", "{}"), ("", "{}")]
    assert final.output[1].call_id.startswith("call_tg")


async def test_logprobs_the_request_asked_for_are_carried() -> None:
    lp = {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                       "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}]}
    events, _ = await _bridge([sse(chunk(role=True), _delta_chunk({"content": "Hi"}, logprobs=lp),
                                   _delta_chunk({}, "stop"))], include=["message.output_text.logprobs"])
    final = _check(events)
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert delta["logprobs"] == lp["content"]
    assert final.output[0].content[0].logprobs[0].token == "Hi"
    whole = whole_response({"choices": [{"index": 0, "finish_reason": "stop", "logprobs": lp, "message": {
        "role": "assistant", "content": "Hi"}}]}, _draft())
    assert whole["output"][0]["content"][0]["logprobs"] == lp["content"]


async def test_a_failed_stream_keeps_the_text_it_sent_and_continues_validly() -> None:
    err = '{"error":{"message":"overloaded","type":"server_error"}}'
    events, relay = await _bridge([sse(chunk(role=True), chunk("partial"), err, done=False)])
    assert events[-1]["type"] == "response.failed"
    Response.model_validate(events[-1]["response"])
    message = events[-1]["response"]["output"][0]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "partial"
    # an assistant turn that said nothing is not sent to a chat upstream (chat APIs refuse it)
    empty = {"type": "message", "role": "assistant", "status": "incomplete", "content": []}
    assert chat_request({"model": "m", "input": "again"}, [empty])["messages"] == [
        {"role": "user", "content": "again"}]


async def test_a_refusal_before_text_keeps_its_content_index() -> None:
    events, _ = await _bridge([sse(chunk(role=True), _delta_chunk({"refusal": "No."}), chunk(" But this."),
                                   _delta_chunk({}, "stop"))])
    final = _check(events)
    added = [e["part"]["type"] for e in events if e["type"] == "response.content_part.added"]
    assert added == ["refusal", "output_text"]
    assert [p.type for p in final.output[0].content] == ["refusal", "output_text"]


def test_content_as_text_parts_is_read_and_a_completion_without_a_message_is_a_bad_response() -> None:
    whole = whole_response({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}}]},
        _draft(tool_choice=None, parallel_tool_calls=None))
    assert Response.model_validate(whole).output_text == "Hello"  # and null echoes are the API's defaults
    for completion in ({"error": {"message": "x"}}, {"choices": []}, {}, {"choices": [{"message": None}]}):
        with pytest.raises(GatewayError) as info:
            whole_response(completion, _draft())
        assert info.value.status == 502 and info.value.code == "upstream_bad_response"


@pytest.mark.parametrize(("extra", "param"), [
    ({"instructions": ["be brief"]}, "instructions"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "name": 5}]}, "tools[0]"),
    ({"text": "json"}, "text"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"max_output_tokens": "10"}, "max_output_tokens"),
    ({"max_tool_calls": "3"}, "max_tool_calls"),
    ({"max_tool_calls": True}, "max_tool_calls"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),
    ({"frequency_penalty": False}, "frequency_penalty"),
    ({"input": [{"role": "user", "content": {"text": "hi"}}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0]"),
])
def test_a_value_of_the_wrong_shape_is_named_not_dropped(extra: dict[str, Any], param: str) -> None:
    found = unbridgeable({"model": "m", "input": "x", **extra})
    assert found is not None and (found[0], found[2]) == (param, "invalid_type")


# ---- a second review ---------------------------------------------------------------------------------------

def test_reasoning_sent_back_bridges_and_is_dropped() -> None:
    body = {"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_tg1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "id": "msg_tg1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"role": "user", "content": "again"}]}
    assert unbridgeable(body) is None
    assert chat_request(body, [])["messages"] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"}]
    # to a native upstream: the gateway's own items lose their ids and the reasoning goes; the upstream's stay
    body["input"].append({"type": "function_call", "id": "fc_up1", "call_id": "c", "name": "f", "arguments": "{}"})
    assert native_input(body) == [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello",
                                                               "annotations": []}]},
        {"role": "user", "content": "again"},
        {"type": "function_call", "id": "fc_up1", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert native_input({"model": "m", "input": "hi"}) is None


def test_a_tool_output_with_an_image_is_not_flattened_to_text() -> None:
    found = unbridgeable({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "https://example.com/a.png"}]}]})
    assert found is not None and (found[0], found[2]) == ("input[0].output", "unsupported_parameter")


async def test_a_chunk_only_the_standard_library_reads_is_read_and_garbage_fails_the_response() -> None:
    split = '{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,' \
            '"delta":{"content":"\\ud83d"},"finish_reason":null}]}'  # half an emoji: a lone surrogate escape
    events, _ = await _bridge([sse(chunk(role=True), chunk("a"), split, chunk(finish="stop"))])
    assert events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "a\ud83d"
    events, relay = await _bridge([sse(chunk(role=True), chunk("a"), "{not json", chunk(finish="stop"))])
    assert events[-1]["type"] == "response.failed" and relay.stats.error == "upstream_bad_response"
    assert "upstream_bad_response" in events[-1]["response"]["error"]["message"]


async def test_what_the_token_limit_cut_is_marked_incomplete() -> None:
    call = _delta_chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a'}}]})
    events, _ = await _bridge([sse(chunk(role=True), chunk("Let me"), call, _delta_chunk({}, "length"))],
                              max_output_tokens=3)
    assert events[-1]["type"] == "response.incomplete"
    assert [i["status"] for i in events[-1]["response"]["output"]] == ["completed", "incomplete"]
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["completed", "incomplete"]
    whole = whole_response({"choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "Once upon"}}]}, _draft(max_output_tokens=2))
    assert [i["status"] for i in whole["output"]] == ["incomplete"]


async def test_a_call_id_used_twice_becomes_two_calls() -> None:
    calls = [{"index": i, "id": "call_same", "function": {"name": "f", "arguments": "{}"}} for i in (0, 1)]
    events, _ = await _bridge([sse(chunk(role=True), *[_delta_chunk({"tool_calls": [c]}) for c in calls],
                                   _delta_chunk({}, "tool_calls"))])
    final = _check(events)
    assert len({i.call_id for i in final.output}) == 2 and final.output[0].call_id == "call_same"


def test_an_error_event_with_objects_where_names_go_is_still_read() -> None:
    from gateway.errors import event_error

    err = event_error({"error": {"message": "bad", "type": {"kind": "x"}, "code": {"n": 1}}})
    assert err.status == 500 and err.message == "bad"


# --- Codex CLI's tools: namespaces of functions and freeform custom tools, in an additional_tools input item -------

CODEX_TOOLS = {"type": "additional_tools", "role": "developer", "tools": [
    {"type": "namespace", "name": "functions", "description": "", "tools": [
        {"type": "custom", "name": "exec", "description": "Run JavaScript.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "function", "name": "wait", "description": "Wait.", "strict": False,
         "parameters": {"type": "object", "properties": {"ms": {"type": "number"}}}}]}]}


def test_codex_tools_are_offered_as_chat_functions_and_its_calls_go_back_as_tool_calls() -> None:
    body = {"model": "m", "input": [CODEX_TOOLS, {"type": "message", "role": "user", "content": "hi"},
                                    {"type": "custom_tool_call", "call_id": "c1", "name": "exec", "input": "1+1"},
                                    {"type": "custom_tool_call_output", "call_id": "c1", "output": "2"}],
            "client_metadata": {"session_id": "s"}, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "low", "context": "all_turns"}}
    assert unbridgeable(body) is None
    chat = chat_request(body, [])
    tools = {t["function"]["name"]: t["function"] for t in chat["tools"]}
    assert set(tools) == {"exec", "wait"}
    assert tools["exec"]["parameters"]["required"] == ["input"] and "start: /.+/" in tools["exec"]["description"]
    assert chat["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "exec", "arguments": '{"input":"1+1"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]


def test_a_call_of_a_custom_tool_is_a_custom_tool_call_whole_and_streamed() -> None:
    completion = {"id": "c", "object": "chat.completion", "model": "m", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec", "arguments": '{"input":"1+1"}'}}]}}]}
    whole = whole_response(completion, _draft(input=[CODEX_TOOLS, {"role": "user", "content": "hi"}]))
    assert [(i["type"], i["name"], i["input"]) for i in whole["output"]] == [("custom_tool_call", "exec", "1+1")]


async def test_a_streamed_custom_tool_call_gives_its_input_whole_at_the_end() -> None:
    def piece(args: str, first: bool) -> str:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": args}}
        if first:
            call.update(id="call_1", type="function", function={"name": "exec", "arguments": args})
        return orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"tool_calls": [call]}}]}).decode()
    events, _ = await _bridge([sse(chunk(role=True), piece('{"inp', True), piece('ut":"1+1"}', False),
                                   chunk(finish="tool_calls"))],
                              input=[CODEX_TOOLS, {"role": "user", "content": "hi"}])
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert done["input"] == "1+1"
    item = events[-1]["response"]["output"][0]
    assert (item["type"], item["call_id"], item["input"]) == ("custom_tool_call", "call_1", "1+1")
