"""Responses API conversation state across tiers: ``previous_response_id``, affinity, the store's bounds, GET/DELETE.

Two in-test emulators that record every request they get (``EmulatorThread``): ``emu-fast``, chat completions only
(Cerebras dialect, so the gateway bridges to it), and ``emu-standard``, which serves ``/v1/responses`` natively. A
gateway process in front of them, over loopback. Each test reads what reached each upstream, so a conversation
that "works" because the gateway silently started afresh fails here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tools.emulator import EmulatorConfig, EmulatorThread

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
            {"name": "emu-fast", "tier": "fast", "base_url": ups["fast"].base_url, "dialect": "cerebras",
             "timeouts": timeouts, "models": {"gpt-5.6": "gpt-5.6-wse", "wse-only": "wse-only"}},
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
    resp = _create(gw, model="wse-only", input="Find news", tools=[{"type": "web_search"}])
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["param"], err["code"], err["type"]) == ("tools", "unsupported_parameter", "invalid_request_error")
    assert "web_search" in err["message"]
    resp = _create(gw, model="wse-only", input="Later", background=True)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "background"
    assert len(ups["fast"].requests) == n  # nothing was sent half-translated


def test_a_foreign_previous_response_id_never_reaches_a_chat_upstream(gw: Proc, ups: dict[str, EmulatorThread]) -> None:
    """An id the gateway never made (another gateway's, or OpenAI's own): only a native upstream might know it."""
    n = len(ups["fast"].requests)
    resp = _create(gw, model=FAST, previous_response_id="resp_made_elsewhere", input="Go on")
    assert resp.status_code == 200
    assert (resp.headers["x-tiergate-tier"], resp.headers["x-tiergate-fallback"]) == ("standard", "response_affinity")
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
