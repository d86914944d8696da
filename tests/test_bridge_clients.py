"""The clients agents run, unchanged, on the fast tier through the Responses bridge, over loopback sockets.

The session stack's fast tier is a Cerebras-dialect emulator (chat completions only: its ``/v1/responses`` is a 404,
as on the real API), so every Responses request the fast tier serves went through ``gateway.responses.stream``. Each
client is pointed at the gateway and nothing else changes; each test asserts the fast tier served every request it made
(``x-tiergate-tier``, read from the wire by an httpx event hook or the client's own response object), the answer,
and its tool calls, checked against the tools' JSON schemas.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from conftest import ROOT, Stack, sample

NODE_DIR = ROOT / "tests" / "node"
FAST = "gpt-5.6-sol-fast"  # the demo's alias (docs/quickstart.md): fast tier, same weights as gpt-5.6
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
                "parameters": WEATHER, "strict": True}
QUICK = "[[emulate tps=2000 ttft_ms=5]]"  # the emulator's directive: a quick answer keeps the suite short


class Wire:
    """httpx event hooks that note (method, path, status, x-tiergate-tier, x-tiergate-fallback) of every response."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, str | None, str | None]] = []
        self.bodies: list[dict[str, Any]] = []  # the JSON request bodies the client sent

    def note_request(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content or b"{}"))

    async def anote_request(self, request: httpx.Request) -> None:
        self.note_request(request)

    def note(self, response: httpx.Response) -> None:
        self.seen.append((response.request.method, response.request.url.path, response.status_code,
                          response.headers.get("x-tiergate-tier"), response.headers.get("x-tiergate-fallback")))

    async def anote(self, response: httpx.Response) -> None:
        self.note(response)

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self.note_request], "response": [self.note]}, timeout=20)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self.anote_request], "response": [self.anote]}, timeout=20)

    def assert_fast(self, paths: int = 1) -> None:
        """Every request went to ``/v1/responses``, answered 200 by the fast tier with no fallback."""
        assert len(self.seen) >= paths, self.seen
        assert all(s == ("POST", "/v1/responses", 200, "fast", None) for s in self.seen), self.seen


def _bridged(stack: Stack) -> float:
    return sample(stack.metrics(), "tiergate_responses_api_requests_total", tier="fast", upstream="emu-fast",
                  mode="bridge")


# --- openai-python --------------------------------------------------------------------------------------------------

def test_openai_python_create_whole_and_streamed(stack: Stack) -> None:
    wire = Wire()
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, http_client=wire.client())
    before = _bridged(stack)
    raw = client.responses.with_raw_response.create(model=FAST, input=f"Say hello {QUICK}",
                                                    instructions="Be brief.")
    assert raw.headers["x-tiergate-tier"] == "fast"
    whole = raw.parse()
    assert whole.id.startswith("resp_") and whole.status == "completed" and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0

    stream = client.responses.create(model=FAST, input=f"Say hello {QUICK}", stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert text and final.output_text == text and final.usage.output_tokens > 0
    wire.assert_fast(2)
    assert _bridged(stack) == before + 2


def test_openai_python_stream_helper_accumulates_a_tool_call(stack: Stack) -> None:
    wire = Wire()
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, http_client=wire.client())
    with client.responses.stream(model=FAST, input=f"Weather in Paris? {QUICK}",
                                 tools=[WEATHER_TOOL]) as stream:  # type: ignore[list-item]
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    calls = [i for i in final.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert calls[0].arguments == deltas
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    wire.assert_fast()


def test_openai_python_structured_output_parses(stack: Stack) -> None:
    from pydantic import BaseModel

    class Answer(BaseModel):
        city: str
        temperature_c: float

    wire = Wire()
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, http_client=wire.client())
    parsed = client.responses.parse(model=FAST, input=f"Paris weather {QUICK}", text_format=Answer)
    assert isinstance(parsed.output_parsed, Answer) and parsed.output_parsed.city
    wire.assert_fast()


# --- the OpenAI Agents SDK ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chained", [False, True], ids=["full_history", "previous_response_id"])
async def test_an_agents_sdk_tool_agent_runs_to_completion_on_the_fast_tier(stack: Stack, chained: bool) -> None:
    """Two model calls: the first asks for the tool, the second answers after its result. With
    ``auto_previous_response_id`` the second call sends only the tool output and ``previous_response_id``, so the
    gateway's store of bridged responses supplies the rest of the conversation."""
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would otherwise export traces to api.openai.com
    calls: list[dict[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: Literal["c", "f"]) -> str:
        """Current weather in a city."""
        calls.append({"city": city, "unit": unit})
        return f"18 degrees {unit} and clear in {city}"

    wire = Wire()
    model = OpenAIResponsesModel(FAST, openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                                          http_client=wire.async_client()))
    agent = Agent(name="weather", instructions="Use the tool, then answer.", model=model, tools=[get_weather])
    result = await Runner.run(agent, f"What is the weather in Oslo? {QUICK}", max_turns=4,
                              run_config=RunConfig(tracing_disabled=True), auto_previous_response_id=chained)
    assert len(calls) == 1 and calls[0]["city"] and calls[0]["unit"] in ("c", "f")
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2
    wire.assert_fast(2)
    second = wire.bodies[1]
    first_id = result.raw_responses[0].response_id
    if chained:  # only the tool's output travels; the gateway holds the rest
        assert second["previous_response_id"] == first_id and first_id and first_id.startswith("resp_")
        assert [i["type"] for i in second["input"]] == ["function_call_output"]
    else:
        assert "previous_response_id" not in second
        assert [i.get("type", "message") for i in second["input"]] == ["message", "function_call",
                                                                       "function_call_output"]
    kinds = [getattr(i, "type", None) for i in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]


# --- pydantic-ai ----------------------------------------------------------------------------------------------------

async def test_a_pydantic_ai_responses_agent_runs_its_tool_loop_on_the_fast_tier(stack: Stack) -> None:
    """pydantic-ai's ``OpenAIResponsesModel`` sends ``include: ["reasoning.encrypted_content"]`` on every request;
    the bridge once refused it, so such agents silently left the fast tier for the standard one."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[str] = []
    wire = Wire()
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                http_client=wire.async_client())
    agent = Agent(OpenAIResponsesModel(FAST, provider=OpenAIProvider(openai_client=client)),
                  instructions="Use the tool, then answer.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18 degrees and clear in {city}"

    result = await agent.run(f"What is the weather in Oslo? {QUICK}")
    assert calls and isinstance(result.output, str) and result.output
    assert len(wire.bodies) >= 2 and all("reasoning.encrypted_content" in b.get("include", []) for b in wire.bodies)
    wire.assert_fast(2)


# --- openai-node ----------------------------------------------------------------------------------------------------

# skipped on a developer's machine without Node or the pinned client; never in CI (CI=true), where .ci/run installs it
@pytest.mark.skipif((shutil.which("node") is None or not (NODE_DIR / "node_modules" / "openai").is_dir())
                    and not os.environ.get("CI"), reason="openai-node is not installed (npm ci --prefix tests/node)")
def test_openai_node_responses_stream(stack: Stack) -> None:
    node = shutil.which("node")
    assert node, "node is needed (`.ci/run` installs nodejs and runs `npm ci --prefix tests/node`)"
    out = subprocess.run([node, str(NODE_DIR / "responses_stream.mjs"), stack.base_url, FAST, f"Say hi {QUICK}"],
                         capture_output=True, text=True, timeout=60, cwd=NODE_DIR,
                         env={**os.environ, "OPENAI_API_KEY": "unused"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["tiers"] == ["fast"] and seen["status"] == "completed"
    assert seen["types"][0] == "response.created" and seen["types"][-1] == "response.completed"
    assert seen["text"] and seen["final_text"] == seen["text"] and seen["output_tokens"] > 0


# --- LangChain ------------------------------------------------------------------------------------------------------

def _langchain(stack: Stack, wire: Wire, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,  # type: ignore[arg-type]
                      http_client=wire.client(), **kw)


@pytest.mark.parametrize("how", ["automatic", "use_responses_api"])
def test_langchain_invoke_and_stream_on_the_fast_tier(stack: Stack, how: str) -> None:
    """``ChatOpenAI(model="gpt-5.6-sol-fast")`` switches to ``/v1/responses`` by itself (the model name is in
    LangChain's Responses-only prefixes); ``use_responses_api=True`` asks for it."""
    wire = Wire()
    llm = _langchain(stack, wire, model=FAST, **({"use_responses_api": True} if how == "use_responses_api" else {}))
    answer = llm.invoke(f"Say hello {QUICK}")
    assert answer.text and answer.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream(f"Say hello {QUICK}"))
    assert "".join(c.text for c in chunks) and len(chunks) > 3
    wire.assert_fast(2)


def test_langchain_tool_calls_and_structured_output(stack: Stack) -> None:
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        """A forecast for one city."""

        city: str = Field(min_length=1)
        high_c: int

    wire = Wire()
    llm = _langchain(stack, wire, model=FAST)
    with_tools = llm.bind_tools([WEATHER_TOOL])
    msg = with_tools.invoke(f"Weather in Rome? {QUICK}")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER)
    forecast = llm.with_structured_output(Forecast).invoke(f"Forecast for Rome {QUICK}")
    assert isinstance(forecast, Forecast) and forecast.city
    wire.assert_fast(2)

