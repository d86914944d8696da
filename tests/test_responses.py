"""``POST /v1/responses``: recorded Responses API streams relayed byte for byte with nothing appended, timed at
the first output delta (not ``response.created``), usage from the terminal event; only OpenAI-dialect upstreams."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import FIXTURES, Stack, sample


def _request(name: str, stream: bool = True, model: str = "gpt-5.6") -> dict[str, object]:
    directive = f"[[emulate transcript={name} tps=200 ttft_ms=30]]"
    return {"model": model, "stream": stream, "input": [{"role": "user", "content": f"Reply: pong {directive}"}]}


@pytest.mark.parametrize("name", ["openai_responses_stream_text", "openai_responses_stream_tool_call"])
def test_responses_stream_relayed_byte_for_byte(stack: Stack, name: str) -> None:
    expected = (FIXTURES / f"{name}.body").read_bytes()
    before = stack.metrics()
    resp = httpx.post(stack.base_url + "/responses", json=_request(name), timeout=10)
    assert resp.status_code == 200
    assert resp.content == expected  # nothing appended: no [DONE] on Responses streams
    assert resp.headers["x-tiergate-tier"] == "standard"
    after = stack.metrics()
    lab = {"tier": "standard", "model": "gpt-5.6"}
    assert sample(after, "tiergate_time_to_first_token_seconds_count", missing_ok=False, **lab) == sample(
        before, "tiergate_time_to_first_token_seconds_count", **lab) + 1
    # events are 5 ms apart after a 30 ms TTFT; the first *.delta is not the first event (response.created)
    first_delta = next(i for i, e in enumerate(expected.split(b"\n\n")) if b".delta\n" in e + b"\n")
    ttft = sample(after, "tiergate_time_to_first_token_seconds_sum", **lab) - sample(
        before, "tiergate_time_to_first_token_seconds_sum", **lab)
    assert ttft >= 0.030 + first_delta * 0.005 - 0.001
    assert sample(after, "tiergate_requests_total", **lab, outcome="success") == sample(
        before, "tiergate_requests_total", **lab, outcome="success") + 1


def test_responses_usage_and_sdk_events(stack: Stack) -> None:
    before = stack.metrics()
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    body = _request("openai_responses_stream_text")
    events = list(client.responses.create(model="gpt-5.6", input=body["input"], stream=True))  # type: ignore[arg-type]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "pong"
    after = stack.metrics()
    lab = {"tier": "standard", "model": "gpt-5.6"}
    for token_type, n in (("input", 11), ("output", 5)):
        assert sample(after, "tiergate_tokens_total", missing_ok=False, token_type=token_type, **lab) == sample(
            before, "tiergate_tokens_total", token_type=token_type, **lab) + n


def test_responses_reach_a_cerebras_dialect_upstream_through_the_bridge(stack: Stack) -> None:
    before = stack.metrics()
    resp = httpx.post(stack.base_url + "/responses", timeout=10, json={
        "model": "gpt-5.6-sol-fast", "input": "Reply: pong [[emulate tps=500 ttft_ms=5]]"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-tiergate-tier"] == "fast" and "x-tiergate-fallback" not in resp.headers
    body = resp.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["output"][-1]["type"] == "message" and body["output"][-1]["content"][0]["text"]
    after = stack.metrics()
    lab = {"tier": "fast", "upstream": "emu-fast", "mode": "bridge"}
    assert sample(after, "tiergate_responses_api_requests_total", missing_ok=False, **lab) == sample(
        before, "tiergate_responses_api_requests_total", **lab) + 1
    # a Responses transcript on a chat-only upstream is not a chat stream: a bad response, failed over
    resp = httpx.post(stack.base_url + "/responses", timeout=10,
                      json=_request("openai_responses_stream_text", model="gpt-5.6-sol-fast"))
    assert resp.status_code == 200
    assert resp.headers["x-tiergate-tier"] == "standard"
    assert resp.headers["x-tiergate-fallback"] == "upstream_bad_response"


def test_responses_bad_input(stack: Stack) -> None:
    resp = httpx.post(stack.base_url + "/responses", json={"input": "hi"}, timeout=5)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    resp = httpx.post(stack.base_url + "/responses", json={"model": "nope", "input": "hi"}, timeout=5)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_emulated_responses_api_stream_and_whole(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    prompt = "hi [[emulate tokens=5 tps=2000 ttft_ms=2]]"
    with client.responses.stream(model="gpt-5.6", input=prompt) as stream:
        final = stream.get_final_response()
    assert final.output_text == " Every token leaves the gateway" and final.usage is not None
    assert final.usage.output_tokens == 5
    whole = client.responses.create(model="gpt-5.6", input=prompt)
    assert whole.output_text == " Every token leaves the gateway" and whole.usage.output_tokens == 5


TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.parametrize("model", ["gpt-5.6-sol-fast", "gpt-5.6"])  # the bridge, and a native upstream
def test_a_tool_output_that_answers_no_call_is_a_400_as_openai_answers_it(stack: Stack, model: str) -> None:
    """OpenAI answers 400 ("No tool call found for function call output with call_id ..."); before, the bridge sent
    a chat upstream a ``tool`` message that followed no ``tool_calls``. A matching output, in the conversation the
    gateway holds or in the same input, still goes through."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=[TOOL],  # type: ignore[list-item]
                                    tool_choice="required")
    call = next(item for item in first.output if item.type == "function_call")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, previous_response_id=first.id, tools=[TOOL],  # type: ignore[list-item]
                                input=[{"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}])
    assert err.value.body == {"message": "No tool call found for function call output with call_id call_nowhere.",
                              "type": "invalid_request_error", "param": "input", "code": None}
    with pytest.raises(openai.BadRequestError):  # no conversation at all
        client.responses.create(model=model, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                     "output": "sunny"}])
    answered = client.responses.create(model=model, previous_response_id=first.id, tools=[TOOL],  # type: ignore[list-item]
                                       input=[{"type": "function_call_output", "call_id": call.call_id,
                                               "output": "sunny"}])
    assert answered.status == "completed"
    inline = client.responses.create(model=model, tools=[TOOL], input=[  # type: ignore[list-item]
        {"role": "user", "content": "weather?"}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                  "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert inline.status == "completed"


def test_a_warm_up_over_http_is_answered_by_the_gateway_and_continued_on_the_fast_tier(stack: Stack) -> None:
    """``generate: false`` whole over HTTP: the gateway's own empty Response (upstream ``none``, usage zero); the
    turn continuing it goes where its rules say (the bridged fast tier), with the warm-up's input in its prompt."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    raw = client.responses.with_raw_response.create(model="gpt-5.6-sol-fast", input="context " * 50,
                                                    extra_body={"generate": False})
    warm = raw.parse()
    assert (raw.headers["x-tiergate-tier"], raw.headers["x-tiergate-upstream"]) == ("fast", "none")
    assert warm.output == [] and warm.usage is not None and warm.usage.total_tokens == 0
    then = client.responses.with_raw_response.create(model="gpt-5.6-sol-fast", previous_response_id=warm.id,
                                                     input="go on")
    assert then.headers["x-tiergate-tier"] == "fast" and then.headers["x-tiergate-upstream"] != "none"
    assert then.parse().usage.input_tokens > 50  # type: ignore[union-attr]


@pytest.mark.parametrize("model", ["gpt-5.6-sol-fast", "gpt-5.6"])  # the gateway's store, and a native upstream's
def test_a_responses_input_items_are_listed_on_both_paths(stack: Stack, model: str) -> None:
    """OpenAI API reference, "List input items": newest first by default, ``order``, ``limit`` and ``has_more``."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    made = client.responses.create(model=model, input=[
        {"role": "user", "content": "first"}, {"role": "user", "content": "second [[emulate tokens=2]]"}])
    page = client.responses.input_items.list(made.id)
    texts = [item.content[0].text for item in page.data]  # type: ignore[union-attr]
    assert texts == ["second [[emulate tokens=2]]", "first"] and all(item.id for item in page.data)
    one = client.responses.input_items.list(made.id, order="asc", limit=1)
    assert [i.content[0].text for i in one.data] == ["first"] and one.has_more  # type: ignore[union-attr]
