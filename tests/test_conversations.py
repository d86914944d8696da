"""Responses API conversation state across tiers: ``previous_response_id``, affinity, the store's bounds, GET/DELETE.

Two in-test emulators that record every request they get (``EmulatorThread``): ``emu-fast``, chat completions only
(Cerebras dialect, so the gateway bridges to it), and ``emu-standard``, which serves ``/v1/responses`` natively. A
gateway process in front of them, over loopback. Each test reads what reached each upstream, so a conversation
that "works" because the gateway silently started afresh fails here.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tools.emulator import EmulatorConfig, EmulatorThread, Plan

from conftest import Proc, sample, start_gateway

FAST = "gpt-5.6-sol-fast"
TTL = 1.0  # seconds the test gateway keeps a response


@pytest.fixture(scope="module")
def ups() -> Iterator[dict[str, EmulatorThread]]:
    quick = {"tps": 5000.0, "ttft": 0.002, "max_tokens": 12}
    out = {"fast": EmulatorThread(config=EmulatorConfig(dialect="cerebras", **quick)),  # type: ignore[arg-type]
           "standard": EmulatorThread(config=EmulatorConfig(dialect="openai", **quick))}  # type: ignore[arg-type]
    yield out
    for up in out.values():
        up.stop()


@pytest.fixture(scope="module")
def gw(ups: dict[str, EmulatorThread], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    timeouts = {"connect": 1, "idle": 2, "total": 10}
    cfg = {
        "default_tier": "standard",
        "upstreams": [
            # bad answers are scripted on purpose here: no breaker opens (test_failover covers it)
            {"name": "emu-fast", "tier": "fast", "base_url": ups["fast"].base_url, "dialect": "cerebras",
             "timeouts": timeouts, "health": {"failures": 1000},
             "models": {"gpt-5.6": "gpt-5.6-wse", "wse-only": "wse-only"}},
            {"name": "emu-standard", "tier": "standard", "base_url": ups["standard"].base_url, "dialect": "openai",
             "timeouts": timeouts, "models": {"gpt-5.6": "gpt-5.6-2026-10-01"}},
        ],
        "aliases": {FAST: {"model": "gpt-5.6", "tier": "fast"}},
        "response_store": {"max_items": 100, "max_bytes": 1 << 20, "ttl": TTL},
    }
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("conversations"))
    yield proc
    proc.stop()


def _url(gw: Proc) -> str:
    return f"http://127.0.0.1:{gw.port}/v1"


def _client(gw: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(gw), api_key="unused", max_retries=0)


def _create(gw: Proc, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(_url(gw) + "/responses", json=body, headers=headers, timeout=10)


def _got(up: EmulatorThread, since: int) -> list[tuple[str, dict[str, Any]]]:
    """(path, JSON body) of what ``up`` received after its first ``since`` requests."""
    return [(r.path, orjson.loads(r.body)) for r in up.requests[since:]]


def _text(response: dict[str, Any]) -> str:
    return "".join(p["text"] for i in response["output"] if i["type"] == "message" for p in i["content"]
                   if p["type"] == "output_text")


def test_a_three_turn_conversation_on_the_bridged_tier(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    client = _client(gw)
    n, n_std = len(ups["fast"].requests), len(ups["standard"].requests)
    r1 = client.responses.create(model=FAST, instructions="You are terse.", input="My name is Ada.")
    r2 = client.responses.create(model=FAST, previous_response_id=r1.id, input="What is my name?",
                                 instructions="You are kind.")
    r3 = client.responses.create(model=FAST, previous_response_id=r2.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Say it again."}]}])
    assert r1.id != r2.id != r3.id and all(r.id.startswith("resp_") for r in (r1, r2, r3))
    assert r2.previous_response_id == r1.id and r3.previous_response_id == r2.id
    got = _got(ups["fast"], n)
    assert [p for p, _ in got] == ["/v1/chat/completions"] * 3
    third = got[2][1]["messages"]
    # the whole conversation reached the chat upstream; instructions are not carried over (OpenAI API reference,
    # `instructions`: "not carried over" with previous_response_id)
    assert third == [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "What is my name?"},
        {"role": "assistant", "content": r2.output_text},
        {"role": "user", "content": "Say it again."},
    ]
    assert got[1][1]["messages"][0] == {"role": "system", "content": "You are kind."}
    assert len(ups["standard"].requests) == n_std


def test_get_input_items_and_delete(gw: Proc) -> None:
    client = _client(gw)
    r1 = client.responses.create(model=FAST, input="Hello")
    r2 = client.responses.create(model=FAST, previous_response_id=r1.id, input="Again")
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text and got.status == "completed"
    items = client.responses.input_items.list(r2.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Again"  # type: ignore[union-attr]
    assert client.responses.delete(r2.id) is None  # the SDK returns None on a 200 delete
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r2.id)
    assert info.value.body["code"] == "response_not_found"  # type: ignore[index]
    resp = httpx.delete(_url(gw) + f"/responses/{r2.id}", timeout=5)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"
    # a deleted response cannot be continued: never a silent fresh start
    resp = _create(gw, model=FAST, previous_response_id=r2.id, input="Still there?")
    assert resp.status_code == 400
    assert resp.json()["error"] == {"message": f"Previous response with id '{r2.id}' not found.",
                                    "type": "invalid_request_error", "param": "previous_response_id",
                                    "code": "previous_response_not_found"}
    resp = httpx.get(_url(gw) + f"/responses/{r1.id}/input_items", params={"limit": "many"}, timeout=5)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_a_native_upstreams_responses_are_retrieved_and_deleted_there(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    # gpt-5.6 goes to the standard tier's native Responses API: the response is the upstream's, and so are GET and
    # DELETE of it (response_affinity); the emulator keeps what it made, as OpenAI does, so the demo's standard tier
    # answers them too
    client = _client(gw)
    n_std = len(ups["standard"].requests)
    r1 = client.responses.create(model="gpt-5.6", input="Hello")
    r2 = client.responses.create(model="gpt-5.6", previous_response_id=r1.id, input="Again")
    assert r2.previous_response_id == r1.id
    got = client.responses.with_raw_response.retrieve(r2.id)
    assert got.headers["x-tiergate-upstream"] == "emu-standard"
    assert got.parse().id == r2.id and got.parse().output_text == r2.output_text
    assert client.responses.delete(r2.id) is None
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r2.id)
    assert info.value.body["code"] == "response_not_found"  # type: ignore[index]
    assert [(r.method, r.path.split("?")[0]) for r in ups["standard"].requests[n_std:]] == [
        ("POST", "/v1/responses"), ("POST", "/v1/responses"), ("GET", f"/v1/responses/{r2.id}"),
        ("DELETE", f"/v1/responses/{r2.id}"), ("GET", f"/v1/responses/{r2.id}")]


def test_store_false_keeps_nothing(gw: Proc) -> None:
    resp = _create(gw, model=FAST, input="Forget me", store=False)
    assert resp.status_code == 200 and resp.json()["store"] is False
    rid = resp.json()["id"]
    assert httpx.get(_url(gw) + f"/responses/{rid}", timeout=5).status_code == 404
    assert _create(gw, model=FAST, previous_response_id=rid, input="Hm").status_code == 400


def test_an_expired_conversation_is_an_error_not_a_fresh_start(gw: Proc) -> None:
    first = _create(gw, model=FAST, input="Remember 42").json()
    time.sleep(TTL + 0.3)
    resp = _create(gw, model=FAST, previous_response_id=first["id"], input="What number?")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "previous_response_not_found"
    assert httpx.get(_url(gw) + f"/responses/{first['id']}", timeout=5).status_code == 404


def test_a_native_conversation_stays_with_its_upstream(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """First turn native on the standard tier; the second asks for the fast tier: only the standard upstream knows
    the conversation, so it goes back there (rule ``response_affinity``), in headers and in the route explanation."""
    n = {k: len(u.requests) for k, u in ups.items()}
    first = _create(gw, model="gpt-5.6", input="Hi")
    assert first.headers["x-tiergate-tier"] == "standard" and first.headers["x-tiergate-rule"] == "default"
    rid = first.json()["id"]
    follow = {"model": "gpt-5.6", "previous_response_id": rid, "input": "And then?"}
    second = _create(gw, headers={"x-tiergate-tier": "fast"}, **follow)
    assert second.status_code == 200
    assert (second.headers["x-tiergate-tier"], second.headers["x-tiergate-rule"]) == ("standard", "response_affinity")
    got = _got(ups["standard"], n["standard"])
    assert [p for p, _ in got] == ["/v1/responses"] * 2 and got[1][1]["previous_response_id"] == rid
    assert len(ups["fast"].requests) == n["fast"]
    route = httpx.post(_url(gw) + "/tiergate/route", json=follow, headers={"x-tiergate-tier": "fast"}, timeout=5)
    explained = route.json()
    assert (explained["tier"], explained["rule"]) == ("standard", "response_affinity")
    assert [c["upstream"] for c in explained["candidates"]] == ["emu-standard"]


def test_a_held_conversation_may_move_to_a_native_upstream(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """A conversation the gateway holds (bridged) moves to the standard tier with its history inline (the native
    upstream never saw it, so no previous_response_id goes there); the turn after that is the native upstream's."""
    n = len(ups["standard"].requests)
    r1 = _create(gw, model=FAST, input="Plan a trip.").json()
    moved = _create(gw, headers={"x-tiergate-tier": "standard"}, model="gpt-5.6", previous_response_id=r1["id"],
                    input="Shorter, please.")
    assert moved.status_code == 200 and moved.headers["x-tiergate-tier"] == "standard"
    sent = _got(ups["standard"], n)[0][1]
    assert "previous_response_id" not in sent
    assert [(i.get("role"), i["type"]) for i in sent["input"]] == [
        ("user", "message"), ("assistant", "message"), ("user", "message")]
    part = sent["input"][1]["content"][0]
    assert (part["type"], part["text"]) == ("output_text", _text(r1))
    third = _create(gw, headers={"x-tiergate-tier": "fast"}, model="gpt-5.6",
                    previous_response_id=moved.json()["id"], input="Thanks")
    assert third.headers["x-tiergate-rule"] == "response_affinity" and third.headers["x-tiergate-tier"] == "standard"


def test_what_the_bridge_cannot_serve_goes_native_or_is_refused(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    n = len(ups["fast"].requests)
    resp = _create(gw, model=FAST, input="Find news", tools=[{"type": "web_search"}])
    assert resp.status_code == 200
    assert (resp.headers["x-tiergate-tier"], resp.headers["x-tiergate-fallback"]) == ("standard", "responses_feature")
    resp = _create(gw, model="wse-only", input="Find news", tools=[{"type": "web_search"}],
                   tool_choice={"type": "web_search"})  # forced: no upstream of the model runs it
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["param"], err["code"], err["type"]) == ("tools", "unsupported_parameter", "invalid_request_error")
    assert "web_search" in err["message"]
    resp = _create(gw, model="wse-only", input="Find news", tools=[{"type": "file_search", "vector_store_ids": []}],
                   tool_choice="required")  # required, and nothing would be left to call
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"
    resp = _create(gw, model="wse-only", input="Later", background=True)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "background"
    assert len(ups["fast"].requests) == n  # nothing was sent half-translated


def test_a_hosted_tool_only_offered_on_a_bridge_only_model_is_dropped_and_said_so(
        gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """Codex CLI offers ``web_search`` beside its function tools for any model: on a model only bridged upstreams
    serve, the request is served without it (``x-tiergate-tools-dropped``, and ``tools_dropped`` in its log line)
    rather than refused; the chat upstream is offered the function tools alone, and the Response echoes what was
    served."""
    fn = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}
    resp = _create(gw, model="wse-only", input="Find news", tools=[fn, {"type": "web_search"}])
    assert resp.status_code == 200, resp.text
    assert (resp.headers["x-tiergate-tier"], resp.headers["x-tiergate-tools-dropped"]) == ("fast", "web_search")
    sent = json.loads(ups["fast"].requests[-1].body)
    assert [t["function"]["name"] for t in sent["tools"]] == ["shell"]
    assert [t["type"] for t in resp.json()["tools"]] == ["function"]
    log = [json.loads(line) for line in gw.log.read_text().splitlines() if line.startswith("{")]
    line = next(r for r in log if r.get("request_id") == resp.headers["x-request-id"])
    assert line["tools_dropped"] == ["web_search"] and line["upstream"] == "emu-fast"
    native = _create(gw, model=FAST, input="Find news", tools=[fn, {"type": "web_search"}])
    assert "x-tiergate-tools-dropped" not in native.headers  # an upstream of the model runs it: it goes there
    assert native.headers["x-tiergate-fallback"] == "responses_feature"


def test_a_foreign_previous_response_id_never_reaches_a_chat_upstream(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """An id the gateway never made (another gateway's, or OpenAI's own): only a native upstream might know it, and
    this one does not, so it says so (its 400 relayed), rather than a chat upstream starting afresh."""
    n, n_std = len(ups["fast"].requests), len(ups["standard"].requests)
    resp = _create(gw, model=FAST, previous_response_id="resp_made_elsewhere", input="Go on")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "previous_response_not_found"
    assert resp.headers["x-tiergate-fallback"] == "response_affinity"
    assert _got(ups["standard"], n_std)[0][1]["previous_response_id"] == "resp_made_elsewhere"
    resp = _create(gw, model="wse-only", previous_response_id="resp_made_elsewhere", input="Go on")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "previous_response_not_found"
    assert len(ups["fast"].requests) == n


def test_bridged_traffic_is_measured_like_native(gw: Proc) -> None:
    before = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    with _client(gw).responses.stream(model=FAST, input="Count") as stream:
        final = stream.get_final_response()
    after = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    fast = {"tier": "fast", "upstream": "emu-fast"}

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, missing_ok=False, **labels) - sample(before, name, **labels)

    assert grew("tiergate_responses_api_requests_total", mode="bridge", **fast) == 1
    assert final.usage is not None
    assert grew("tiergate_tokens_total", tier="fast", token_type="output") == final.usage.output_tokens
    assert grew("tiergate_tokens_total", tier="fast", token_type="input") == final.usage.input_tokens
    assert grew("tiergate_time_to_first_token_seconds_count", **fast) == 1
    assert grew("tiergate_requests_total", tier="fast", outcome="success") == 1


# ---- what an adversarial review found ------------------------------------------------------------------------

def _sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + (b"data: [DONE]\n\n" if done else b"")


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@contextlib.contextmanager
def _scripted(up: EmulatorThread, plan: Plan) -> Iterator[None]:
    up.handler = lambda req: plan
    try:
        yield
    finally:
        up.handler = None


STALLS_AFTER_DONE = Plan(parts=[(0, _sse(_chunk({"role": "assistant", "content": "Hi"}), _chunk({}, "stop"),
                                         {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                          "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                                                   "total_tokens": 4}}))], end="stall")


def test_a_response_is_kept_before_its_terminal_event_leaves(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """An agent sends its next turn the moment it reads ``response.completed``, and may close the stream then, while
    the upstream's connection is still open: the response must already be held."""
    with _scripted(ups["fast"], STALLS_AFTER_DONE):
        for leave in (False, True):
            with httpx.Client(timeout=10) as client, client.stream(
                    "POST", _url(gw) + "/responses", json={"model": FAST, "input": "hi", "stream": True}) as resp:
                rid = None
                for line in resp.iter_lines():
                    if line.startswith("data: ") and '"response.completed"' in line:
                        rid = orjson.loads(line[6:])["response"]["id"]
                        break
                assert rid is not None
                if not leave:  # follow up at once, the stream still open
                    follow = _create(gw, model=FAST, previous_response_id=rid, input="and?")
                    assert follow.status_code == 200, follow.text
            if leave:  # left right after the terminal event
                assert httpx.get(_url(gw) + f"/responses/{rid}", timeout=5).status_code == 200


def test_a_response_larger_than_the_store_evicts_no_one_else(gw: Proc) -> None:
    kept = [_create(gw, model=FAST, input=f"small {i}").json()["id"] for i in range(3)]
    big = _create(gw, model=FAST, input="x" * (1 << 20) + " [[emulate tokens=2]]")  # over max_bytes (1 MiB)
    assert big.status_code == 200
    assert httpx.get(_url(gw) + f"/responses/{big.json()['id']}", timeout=5).status_code == 404
    assert [httpx.get(_url(gw) + f"/responses/{r}", timeout=5).status_code for r in kept] == [200] * 3


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": 123}, "previous_response_id"),
    ({"input": {"role": "user"}}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0]"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
])
def test_a_wrong_type_is_a_400_naming_it_never_a_guess(gw: Proc, ups: dict[str, EmulatorThread],
                                                       body: dict[str, Any], param: str) -> None:
    n = len(ups["fast"].requests)
    resp = _create(gw, model="wse-only", **body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, "invalid_type", "invalid_request_error")
    assert len(ups["fast"].requests) == n


@pytest.mark.parametrize("answer", [b'{"error":{"message":"busy","type":"server_error"}}', b'{"choices":[]}',
                                    b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":null}]}'])
def test_a_chat_answer_without_a_message_is_a_bad_response(gw: Proc, ups: dict[str, EmulatorThread],
                                                           answer: bytes) -> None:
    with _scripted(ups["fast"], Plan(headers={"content-type": "application/json"}, parts=[(0, answer)],
                                     chunked=False)):
        only = _create(gw, model="wse-only", input="hi")
        moved = _create(gw, model=FAST, input="hi")
    assert only.status_code == 502 and only.json()["error"]["code"] == "upstream_bad_response"
    assert (moved.status_code, moved.headers["x-tiergate-tier"]) == (200, "standard")
    assert moved.headers["x-tiergate-fallback"] == "upstream_bad_response"


def test_routing_counts_the_held_conversation(gw: Proc) -> None:
    first = _create(gw, model=FAST, input="y" * 40_000).json()
    route = httpx.post(_url(gw) + "/tiergate/route", timeout=5, json={
        "model": FAST, "previous_response_id": first["id"], "input": "short", "metadata": {"messages": "not chat"}})
    assert route.status_code == 200, route.text
    facts = route.json()["facts"]
    assert facts["api"] == "responses" and facts["prompt_tokens_estimate"] > 10_000


def test_native_responses_and_input_item_pages_say_what_is_wrong(gw: Proc) -> None:
    native = _create(gw, model="gpt-5.6", input="Hi").json()["id"]
    resp = httpx.get(_url(gw) + f"/responses/{native}", timeout=5)  # the upstream that made it alone holds it
    assert resp.headers["x-tiergate-upstream"] == "emu-standard"
    assert resp.headers["x-tiergate-rule"] == "response_affinity"
    held = _create(gw, model=FAST, input="Hi").json()["id"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after")):
        resp = httpx.get(_url(gw) + f"/responses/{held}/input_items", params=params, timeout=5)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, params


async def test_the_store_bounds_and_a_look_that_continues_nothing() -> None:
    from gateway.responses.store import OVERHEAD, Bridged, MemoryResponseStore, encode

    now = [0.0]

    def turn(previous: str | None, text: str = "x") -> Bridged:
        return Bridged({"output": [{"type": "message", "text": text}]}, [{"type": "message"}], previous)

    one = len(encode(turn("r1"))) + OVERHEAD  # what a kept turn counts against max_bytes
    store = MemoryResponseStore(max_items=3, max_bytes=3 * one, ttl=10, clock=lambda: now[0])
    assert await store.put("r1", turn(None)) and await store.put("r2", turn("r1"))
    assert not await store.put("huge", turn(None, "x" * 3 * one)) and len(store) == 2  # kept no one out for it
    now[0] = 9
    assert await store.history("r2", None, refresh=False) is not None  # /v1/tiergate/route: a look only
    now[0] = 11
    assert await store.history("r2", None) is None  # it was not refreshed by the look
    assert await store.put("a", turn(None)) and await store.put("b", turn("a"))
    now[0] = 20
    assert len(await store.history("b", None) or []) == 4  # continued: both links live another ttl
    now[0] = 29
    assert await store.get("a", None) is not None
    assert store.bytes <= store.max_bytes


# ---- a second review ---------------------------------------------------------------------------------------

REASONS = Plan(headers={"content-type": "application/json"}, chunked=False, parts=[(0, orjson.dumps({
    "id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "reasoning": "Thinking.",
                                                         "content": "Hi"}}]}))])


def test_a_conversation_resent_in_full_with_its_reasoning_goes_on(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """What the Agents SDK (store=False) and LangChain send: every earlier item back, reasoning included."""
    with _scripted(ups["fast"], REASONS):
        first = _create(gw, model="wse-only", input="hi", store=False).json()
    assert [i["type"] for i in first["output"]] == ["reasoning", "message"]
    history = [{"role": "user", "content": "hi"}, *first["output"], {"role": "user", "content": "again"}]
    n, n_std = len(ups["fast"].requests), len(ups["standard"].requests)
    again = _create(gw, model="wse-only", input=history)
    assert again.status_code == 200, again.text
    assert _got(ups["fast"], n)[0][1]["messages"] == [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "Hi"},
                                                     {"role": "user", "content": "again"}]
    moved = _create(gw, headers={"x-tiergate-tier": "standard"}, model="gpt-5.6", input=history)
    assert moved.status_code == 200 and moved.headers["x-tiergate-tier"] == "standard"
    sent = _got(ups["standard"], n_std)[0][1]["input"]
    assert [i.get("type", "message") for i in sent] == ["message", "message", "message"]
    assert not any(str(i.get("id", "")).startswith(("msg_tg", "rs_tg")) for i in sent)  # ids it never issued


def test_a_client_that_closes_on_response_failed_counts_a_stream_error(gw: Proc,
                                                                       ups: dict[str, EmulatorThread]) -> None:
    failing = Plan(parts=[(0, _sse(_chunk({"role": "assistant", "content": "par"}), done=False)),
                          (0.01, b'data: {"error":{"message":"overloaded","type":"server_error"}}\n\n')],
                   end="stall")
    before = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    with _scripted(ups["fast"], failing), httpx.Client(timeout=10) as client, client.stream(
            "POST", _url(gw) + "/responses", json={"model": "wse-only", "input": "hi", "stream": True}) as resp:
        for line in resp.iter_lines():
            if '"response.failed"' in line:
                break
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
        lab = {"tier": "fast", "upstream": "emu-fast"}
        if sample(after, "tiergate_requests_total", outcome="stream_error", **lab) > sample(
                before, "tiergate_requests_total", outcome="stream_error", **lab):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("no stream_error was counted")
    assert sample(after, "tiergate_requests_total", outcome="client_disconnect", **lab) == sample(
        before, "tiergate_requests_total", outcome="client_disconnect", **lab)
    assert sample(after, "tiergate_upstream_errors_total", reason="upstream_error_event", **lab) == sample(
        before, "tiergate_upstream_errors_total", reason="upstream_error_event", **lab) + 1


def test_a_query_parameter_of_the_wrong_type_is_named(gw: Proc) -> None:
    held = _create(gw, model=FAST, input="Hi").json()["id"]
    resp = httpx.get(_url(gw) + f"/responses/{held}/input_items", params={"limit": "abc"}, timeout=5)
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "limit" and "Invalid value for 'limit'" in err["message"]
