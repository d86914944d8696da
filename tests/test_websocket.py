"""The Responses API's WebSocket mode through the gateway, over real sockets, with the real ``openai`` SDK's
``client.responses.connect()``: the fast tier through the bridge (a Cerebras-dialect emulator: chat completions
only), the standard tier natively over an upstream socket (an OpenAI-dialect emulator with ``websocket: true``), the
socket's memory for ``previous_response_id`` with ``store: false``, a client leaving (its upstream closed), the drain
(the response finishes, then 1001), the handshake's key check, and the limits (message size, sockets per key,
idle)."""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from gateway.http.server import GuardedWebSocketsProtocol
from gateway.tenancy.keys import digest
from gateway.tools.emulator import EmulatorConfig, EmulatorThread, Plan

from conftest import SCRAPE, Proc, default_config, emulator, free_port, sample, scraped, start_gateway

TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"], "additionalProperties": False}, "strict": True}]
KEY = "tg-ws-test-key"


def ws_config(fast: str, standard: str, **overrides: Any) -> dict[str, Any]:
    """The test config, the standard upstream offering WebSocket mode."""
    cfg = default_config(fast, standard, **overrides)
    cfg["upstreams"][1]["websocket"] = True
    return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, EmulatorThread, EmulatorThread]]:
    """A gateway in front of two in-process emulators (they record what they were sent)."""
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(config=EmulatorConfig.for_tier("standard", ttft=0.05, tps=400))
    gw, _ = start_gateway(ws_config(fast.base_url, standard.base_url), tmp_path_factory.mktemp("ws"))
    yield gw, fast, standard
    gw.stop()
    fast.stop()
    standard.stop()


def client(port: int, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def until_done(conn: Any, limit: int = 2000) -> list[Any]:
    """The events of one response, through its terminal event (or an ``error`` event)."""
    events = []
    for event in conn:
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events
        assert len(events) < limit
    raise AssertionError(f"the socket ended after {[e.type for e in events]}")


def tool_loop(conn: Any, model: str, store: bool) -> tuple[list[Any], list[Any]]:
    """A two-turn tool loop on one socket: the model calls the tool, the tool's output goes back with
    ``previous_response_id`` (only the new item, as WebSocket mode wants), the model answers in text."""
    conn.response.create(model=model, input="What is the weather in Paris?", tools=TOOLS, store=store)
    first = until_done(conn)
    done = first[-1]
    assert done.type == "response.completed", done
    call = next(item for item in done.response.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    conn.response.create(model=model, previous_response_id=done.response.id, tools=TOOLS, store=store,
                         input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    second = until_done(conn)
    assert second[-1].type == "response.completed", second[-1]
    return first, second


def test_a_tool_loop_on_the_fast_tier_goes_through_the_bridge(stack: tuple[Proc, EmulatorThread,
                                                                             EmulatorThread]) -> None:
    gw, fast, standard = stack
    fast_before, std_before = len(fast.requests), len(standard.requests)
    with client(gw.port).responses.connect() as conn:
        first, second = tool_loop(conn, "gpt-5.6-sol-fast", store=True)
    assert first[0].type == "response.created" and first[0].response.id.startswith("resp_tg")
    assert any(e.type == "response.function_call_arguments.delta" for e in first)
    text = "".join(e.delta for e in second if e.type == "response.output_text.delta")
    assert text and second[-1].response.output_text == text
    sent = fast.requests[fast_before:]
    assert [r.path for r in sent] == ["/v1/chat/completions"] * 2, "each turn is one streamed chat completion"
    history = json.loads(sent[1].body)["messages"]
    assert [m["role"] for m in history][-2:] == ["assistant", "tool"], "the bridge sent the whole conversation"
    assert len(standard.requests) == std_before


def test_a_tool_loop_on_the_standard_tier_crosses_one_upstream_socket(stack: tuple[Proc, EmulatorThread,
                                                                                   EmulatorThread]) -> None:
    gw, fast, standard = stack
    fast_before, std_before = len(fast.requests), len(standard.requests)
    with client(gw.port).responses.connect() as conn:
        first, second = tool_loop(conn, "gpt-5.6", store=True)
    assert first[0].response.id.startswith("resp_emu"), "the upstream's own response, relayed"
    sent = [r for r in standard.requests[std_before:] if r.method != "GET"]  # not the upstream socket's handshake
    assert [r.method for r in sent] == ["WS", "WS"], "both turns went as response.create frames"
    assert sent[0].connection == sent[1].connection, "over one upstream socket"
    assert json.loads(sent[1].body)["previous_response_id"] == first[-1].response.id
    assert len(fast.requests) == fast_before


@pytest.mark.parametrize("model", ["gpt-5.6-sol-fast", "gpt-5.6"])
def test_store_false_is_continued_from_the_sockets_memory_only(stack: tuple[Proc, EmulatorThread, EmulatorThread],
                                                               model: str) -> None:
    """On the bridge (the fast tier) and natively over an upstream socket (the standard tier, whose emulator keeps a
    store: false response only in that socket's memory, as OpenAI's API does): the socket continues it; over HTTP, or
    on another socket, the id is unknown; GET /v1/responses/{id} does not find it."""
    gw, _, _ = stack
    with client(gw.port).responses.connect() as conn:
        first, _ = tool_loop(conn, model, store=False)
    # nothing kept it beyond its socket: over HTTP (or another socket) the id is unknown, as OpenAI's store: false is
    made = first[-1].response.id
    with pytest.raises(openai.BadRequestError) as err:
        client(gw.port).responses.create(model=model, input="and tomorrow?", previous_response_id=made)
    assert err.value.code == "previous_response_not_found"
    with client(gw.port).responses.connect() as other:
        other.response.create(model=model, input="and tomorrow?", previous_response_id=made)
        refused = until_done(other)[-1]
    assert refused.type == "error" and refused.status == 400
    assert refused.error.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client(gw.port).responses.retrieve(made)


def test_a_warm_up_is_answered_by_the_gateway_and_the_turn_after_it_stays_on_the_fast_tier(
        stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    """``generate: false`` (a warm-up: OpenAI's WebSocket mode guide; Codex CLI's first message on a socket) reaches
    no upstream: the gateway answers an empty lifecycle at the tier the rules pick (upstream ``none``, nothing
    billed) and holds its input, so the real turn that continues it is routed by its own rules: the bridged fast
    tier, with the warm-up's input in its conversation."""
    gw, fast, standard = stack
    fast_before, std_before = len(fast.requests), len(standard.requests)
    with client(gw.port).responses.connect() as conn:
        conn.send({"type": "response.create", "model": "gpt-5.6-sol-fast", "input": "the warm-up's instructions",
                   "instructions": "be brief", "generate": False, "store": False})  # type: ignore[arg-type]
        warm = until_done(conn)
        assert len(fast.requests) == fast_before and len(standard.requests) == std_before  # nothing went upstream
        conn.response.create(model="gpt-5.6-sol-fast", input="now [[emulate tokens=3]]", store=False,
                             previous_response_id=warm[-1].response.id)
        answered = until_done(conn)
    assert [e.type for e in warm] == ["response.created", "response.in_progress", "response.completed"]
    done = warm[-1].response
    assert done.output == [] and done.status == "completed" and done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (0, 0)
    assert done.instructions == "be brief" and done.model == "gpt-5.6-sol-fast"
    assert answered[-1].type == "response.completed"
    assert len(standard.requests) == std_before
    sent = json.loads(fast.requests[-1].body)
    assert "the warm-up's instructions" in json.dumps(sent["messages"])
    log = [json.loads(line) for line in gw.log.read_text().splitlines() if line.startswith("{")]
    lines = [r for r in log if r.get("method") == "WS" and r.get("model") == "gpt-5.6-sol-fast"][-2:]
    assert [(r["tier"], r["upstream"], r["status"]) for r in lines] == [("fast", "none", 200),
                                                                         ("fast", "emu-fast", 200)]
    assert lines[0]["cost_usd"] in (None, 0) and lines[0]["fallback"] is None


def test_a_warm_up_after_a_native_response_goes_to_the_upstream_that_holds_it(
        stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    """The gateway cannot hold what follows from a conversation only a native upstream holds: that warm-up goes to
    it (``response_affinity``), which answers it as OpenAI does."""
    gw, _, standard = stack
    with client(gw.port).responses.connect() as conn:
        conn.response.create(model="gpt-5.6", input="first [[emulate tokens=2]]", store=False)
        first = until_done(conn)
        before = len(standard.requests)
        conn.send({"type": "response.create", "model": "gpt-5.6", "input": "more context", "generate": False,
                   "previous_response_id": first[-1].response.id, "store": False})  # type: ignore[arg-type]
        warm = until_done(conn)
    assert warm[-1].type == "response.completed" and warm[-1].response.output == []
    sent = [json.loads(r.body) for r in standard.requests[before:] if r.method == "WS"]
    assert len(sent) == 1 and sent[0]["generate"] is False


def test_lanes_are_served_side_by_side_each_in_order(stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    gw, _, _ = stack
    with client(gw.port).responses.connect() as conn:
        for lane in ("a", "b", "a"):
            conn.response.create(model="gpt-5.6-sol-fast", input=f"lane {lane} [[emulate tokens=20 tps=400]]",
                                 stream_id=lane)
        seen: dict[str, list[str]] = {"a": [], "b": []}
        ended = 0
        for event in conn:
            assert event.stream_id in seen, event
            seen[event.stream_id].append(event.type)
            if event.type == "response.completed":
                ended += 1
                if ended == 3:
                    break
    assert seen["a"].count("response.created") == 2 and seen["b"].count("response.created") == 1
    # FIFO within a lane: the second response of lane a starts after the first ended
    first_end = seen["a"].index("response.completed")
    assert seen["a"].index("response.created", 1) > first_end


def test_steer_and_unknown_events_are_answered(stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    gw, _, _ = stack
    with client(gw.port).responses.connect() as conn:
        conn.response.steer(input="shorter, please", previous_response_id="resp_x")
        steer = conn.recv()
        conn.send_raw(json.dumps({"type": "response.cancel"}))
        unknown = conn.recv()
        not_events = []
        for raw in ("null", "[]", "5", '"response.create"', "{}"):  # JSON, but not an object with a type
            conn.send_raw(raw)
            not_events.append(conn.recv())
        conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate tokens=2]]")
        assert until_done(conn)[-1].type == "response.completed", "the socket goes on"
    assert steer.type == "response.steer.failed" and steer.error.code == "steering_not_supported"
    assert steer.steer.input == "shorter, please"
    assert unknown.type == "error" and unknown.status == 400 and unknown.error.param == "type"
    for refused in not_events:
        assert refused.type == "error" and refused.status == 400 and refused.error.code == "unknown_event_type"
        assert "must be a JSON object with a 'type'" in refused.error.message, refused


def test_each_message_is_metered_and_an_error_status_is_an_error_event(stack: tuple[Proc, EmulatorThread,
                                                                                    EmulatorThread]) -> None:
    gw, _, _ = stack
    text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
    before = sample(text, "tiergate_requests_total", tier="fast", outcome="success")
    ttft_before = sample(text, "tiergate_time_to_first_token_seconds_count", tier="fast")
    with client(gw.port).responses.connect() as conn:
        for _ in range(3):
            conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate tokens=4]]")
            assert until_done(conn)[-1].type == "response.completed"
        conn.response.create(model="no-such-model", input="hi")
        missing = until_done(conn)[-1]
        conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate status=429 retry_after_ms=50]]")
        limited = until_done(conn)[-1]
        text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text
        assert sample(text, "tiergate_websocket_sockets") >= 1
    time.sleep(0.1)  # both tiers' 50 ms cooldowns pass before the next test
    assert missing.type == "error" and missing.status == 404 and missing.error.code == "model_not_found"
    assert limited.type == "error" and limited.status == 429
    assert sample(text, "tiergate_requests_total", tier="fast", outcome="success") - before == 3
    assert sample(text, "tiergate_time_to_first_token_seconds_count", tier="fast") - ttft_before == 3
    log = [json.loads(line) for line in gw.log.read_text().splitlines() if line.startswith("{")]
    assert any(r.get("method") == "WS" and r.get("status") == 404 for r in log)


def _left_mid_response(gw: Proc, up: EmulatorThread, model: str) -> None:
    """A client that leaves after a few deltas of a long response: the upstream's connection closes long before
    the response would have ended."""
    closed = len(up.closed_at)
    with client(gw.port).responses.connect() as conn:
        conn.response.create(model=model, input="long [[emulate tokens=2000 tps=100]]")  # 20 s of output
        deltas = 0
        for event in conn:
            if event.type.endswith(".delta"):
                deltas += 1
                if deltas == 3:
                    left = time.monotonic()
                    break
    deadline = left + 10  # half the response's own length: it is cancelled, not played out
    while len(up.closed_at) == closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(up.closed_at) > closed, "the upstream connection stayed open after the client left"
    assert up.closed_at[-1] - left < 10


def test_a_client_that_leaves_cancels_the_bridged_upstream(stack: tuple[Proc, EmulatorThread,
                                                                       EmulatorThread]) -> None:
    gw, fast, _ = stack
    _left_mid_response(gw, fast, "gpt-5.6-sol-fast")


def test_a_client_that_leaves_closes_the_upstream_socket(stack: tuple[Proc, EmulatorThread,
                                                                      EmulatorThread]) -> None:
    gw, _, standard = stack
    _left_mid_response(gw, standard, "gpt-5.6")
    with client(gw.port).responses.connect() as conn:  # the next socket opens a new upstream socket
        conn.response.create(model="gpt-5.6", input="hi [[emulate tokens=2]]")
        assert until_done(conn)[-1].type == "response.completed"


def test_a_native_upstream_without_websocket_mode_gets_one_http_request_per_message(tmp_path: Path) -> None:
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(config=EmulatorConfig.for_tier("standard", ttft=0.02, tps=500))
    gw, _ = start_gateway(default_config(fast.base_url, standard.base_url), tmp_path)
    try:
        with client(gw.port).responses.connect() as conn:
            # stored: over HTTP the upstream holds what it made only so (a store: false turn is not continued there,
            # as OpenAI's API does not continue it: docs/websocket.md#memory)
            _, second = tool_loop(conn, "gpt-5.6", store=True)
        sent = [(r.method, r.path) for r in standard.requests]
        assert sent == [("POST", "/v1/responses")] * 2
        assert json.loads(standard.requests[1].body)["stream"] is True
        assert second[-1].type == "response.completed"
    finally:
        gw.stop()
        fast.stop()
        standard.stop()


def test_an_upstream_that_refuses_the_upgrade_gets_http_from_then_on(tmp_path: Path) -> None:
    refuse = Plan(status=404, headers={"content-type": "application/json"}, chunked=False,
                  parts=[(0.0, b'{"error":{"message":"Not found","type":"invalid_request_error","code":null}}')])
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(lambda r: refuse if r.method == "GET" else None,
                              EmulatorConfig.for_tier("standard", ttft=0.02, tps=500))
    gw, _ = start_gateway(ws_config(fast.base_url, standard.base_url), tmp_path)
    try:
        with client(gw.port).responses.connect() as conn:
            _, second = tool_loop(conn, "gpt-5.6", store=True)
        assert [(r.method, r.path) for r in standard.requests] == [("GET", "/v1/responses"),
                                                                    ("POST", "/v1/responses"),
                                                                    ("POST", "/v1/responses")]
        assert second[-1].type == "response.completed" and not fast.requests
        assert "upstream_websocket_refused" in gw.log.read_text()
    finally:
        gw.stop()
        fast.stop()
        standard.stop()


@pytest.mark.parametrize("model", ["gpt-5.6", "gpt-5.6-sol-fast"])
def test_the_drain_finishes_the_response_in_flight_then_closes_with_1001(tmp_path: Path, model: str) -> None:
    fast, standard = emulator("fast", tmp_path), emulator("standard", tmp_path)
    gw, _ = start_gateway(ws_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1"),
                          tmp_path, env={"GATEWAY_DRAIN_TIMEOUT": "20"})
    try:
        with client(gw.port).responses.connect() as conn:
            # 40 tokens at 20 tokens/s: two seconds of output, the drain begins at the first
            conn.response.create(model=model, input="drain [[emulate tokens=40 tps=20]]")
            events = []
            for event in conn:
                events.append(event)
                if event.type.endswith(".delta"):
                    gw.popen.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                    break
            time.sleep(0.2)  # the drain has begun: a message after it is not served
            conn.response.create(model=model, input="one more [[emulate tokens=3]]")
            events += list(conn)  # the rest of the response, then the close ends the iteration (1001 is OK)
            code = conn._connection.close_code
        finished = time.monotonic() - signalled
        assert events[-1].type == "response.completed", [e.type for e in events[-3:]]
        assert sum(e.type == "response.output_text.delta" for e in events) == 40
        refused = [(e.status, e.error.code) for e in events if e.type == "error"]
        assert refused == [(503, "gateway_draining")], "the message sent during the drain is answered, not served"
        assert code == 1001
        assert finished > 1.0, "the response was cut at the signal"  # half of its two seconds: it ran on
        assert gw.popen.wait(15) in (0, -signal.SIGTERM)
    finally:
        gw.stop()
        fast.stop()
        standard.stop()


def test_a_reload_applies_to_the_next_message_of_an_open_socket(tmp_path: Path) -> None:
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(config=EmulatorConfig.for_tier("standard", ttft=0.02, tps=500))
    cfg = ws_config(fast.base_url, standard.base_url)
    gw, path = start_gateway(cfg, tmp_path, extra=("--log-level", "info"))
    try:
        with client(gw.port).responses.connect() as conn:
            conn.response.create(model="gpt-5.6", input="before [[emulate tokens=2]]")
            assert until_done(conn)[-1].type == "response.completed"
            sockets = {r.connection for r in standard.requests if r.method == "WS"}
            closed = len(standard.closed_at)
            path.write_text(json.dumps({**cfg, "default_tier": "fast"}))  # gpt-5.6 now goes to the fast tier
            gw.popen.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while '"reload": true' not in gw.log.read_text().replace('"reload":true', '"reload": true'):
                assert time.monotonic() < deadline, "the reload was not logged"
                time.sleep(0.05)
            conn.response.create(model="gpt-5.6", input="after [[emulate tokens=2]]")
            assert until_done(conn)[-1].type == "response.completed"
            deadline = time.monotonic() + 5
            while len(standard.closed_at) == closed:  # the old config's upstream socket is closed, this one open
                assert time.monotonic() < deadline, "the old config's upstream socket stayed open"
                time.sleep(0.02)
        assert fast.requests and fast.requests[-1].path == "/v1/chat/completions", "the new config served it"
        assert len(sockets) == 1
    finally:
        gw.stop()
        fast.stop()
        standard.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A gateway with gateway keys, two sockets per key, 2 KiB messages and a one-second idle limit."""
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(config=EmulatorConfig.for_tier("standard", ttft=0.02, tps=500))
    limits = {"websocket": {"sockets_per_key": 2, "max_message_bytes": 2048, "idle": 1.0}}
    auth = {"metrics": SCRAPE, "keys": [{"name": "agent", "sha256": digest(KEY)}]}
    gw, _ = start_gateway(ws_config(fast.base_url, standard.base_url, limits=limits, auth=auth),
                          tmp_path_factory.mktemp("keyed"))
    yield gw
    gw.stop()
    fast.stop()
    standard.stop()


@pytest.mark.parametrize("key", [None, "tg-not-a-key"])
def test_the_key_is_checked_at_the_handshake(keyed: Proc, key: str | None) -> None:
    with pytest.raises(InvalidStatus) as err:
        if key is None:  # no key at all: the SDK refuses to start without one, so the library it connects with
            connect(f"ws://127.0.0.1:{keyed.port}/v1/responses").close()
        else:
            client(keyed.port, key).responses.connect().enter().close()
    response = err.value.response
    assert response.status_code == 401
    assert json.loads(response.body)["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert sample(scraped(keyed.port), "tiergate_websocket_refusals_total", reason="unauthorized") >= 1
    with client(keyed.port, KEY).responses.connect() as conn:
        conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate tokens=2]]")
        assert until_done(conn)[-1].type == "response.completed"


def test_a_message_over_the_limit_closes_the_socket_with_1009(keyed: Proc) -> None:
    with client(keyed.port, KEY).responses.connect() as conn:
        conn.response.create(model="gpt-5.6-sol-fast", input="x" * 4096)
        with pytest.raises(ConnectionClosed) as err:
            conn.recv()
    assert err.value.rcvd is not None and err.value.rcvd.code == 1009
    with client(keyed.port, KEY).responses.connect() as conn:  # a message under it is served
        conn.response.create(model="gpt-5.6-sol-fast", input="x" * 1000)
        assert until_done(conn)[-1].type == "response.completed"


def test_a_key_holds_at_most_its_sockets(keyed: Proc) -> None:
    one = client(keyed.port, KEY).responses.connect().enter()
    two = client(keyed.port, KEY).responses.connect().enter()
    try:
        with pytest.raises(InvalidStatus) as err:
            client(keyed.port, KEY).responses.connect().enter()
        assert err.value.response.status_code == 429
        assert json.loads(err.value.response.body)["error"]["code"] == "websocket_connection_limit_reached"
        one.close()
        deadline = time.monotonic() + 5
        while True:  # the gateway sees the close a moment later
            try:
                three = client(keyed.port, KEY).responses.connect().enter()
                break
            except InvalidStatus:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        three.close()
    finally:
        two.close()


def test_an_idle_socket_is_closed(keyed: Proc) -> None:
    with client(keyed.port, KEY).responses.connect() as conn:
        sent = time.monotonic()  # the idle time starts after the response, so no sooner than a second after this
        conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate tokens=2]]")
        until_done(conn)
        assert list(conn) == []  # the close (1000) ends the iteration
        idle = time.monotonic() - sent
        assert conn._connection.close_code == 1000 and conn._connection.close_reason == "idle_timeout"
    assert 1.0 <= idle < 10


def test_turns_of_one_socket_are_routed_each_and_are_steps_of_its_session(
        stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    gw, fast, standard = stack
    fast_before, std_before = len(fast.requests), len(standard.requests)
    sdk = client(gw.port)
    with sdk.responses.connect(extra_headers={"x-tiergate-session": "ws-run-1"}) as conn:
        for model in ("gpt-5.6", "gpt-5.6-sol-fast", "gpt-5.6"):
            conn.response.create(model=model, input="step [[emulate tokens=3]]")
            assert until_done(conn)[-1].type == "response.completed"
    served = [r for r in standard.requests[std_before:] if r.method == "WS"]
    assert len(served) == 2 and len(fast.requests) - fast_before == 1
    run = httpx.get(f"http://127.0.0.1:{gw.port}/v1/tiergate/sessions/ws-run-1", timeout=5).json()
    assert run["steps"] == 3 and run["last_upstream"] == "emu-standard"


async def test_one_keys_sockets_keep_at_most_its_share_of_the_processs_socket_memory() -> None:
    """The attack read in the config: a key may hold 64 sockets of 8 MiB of responses each (512 MiB, the shipped
    container's whole limit). Every socket of a process now counts against ``memory_bytes_total``, a key's sockets
    against ``limits.key_share`` of it: past its share, the key's largest socket drops its oldest; past the total, the
    largest socket of the key that keeps the most."""
    from gateway.responses.store import OVERHEAD, Bridged, MemoryResponseStore, SocketMemory, SocketStore, encode

    def turn(owner: str, i: int) -> Bridged:
        return Bridged({"output": [{"type": "message", "text": f"{i:04d}" + "x" * 1000}]}, [], None, owner)
    one = len(encode(turn("hog", 0))) + OVERHEAD
    memory = SocketMemory(max_bytes=40 * one, key_share=0.25)  # ten responses a key

    def socket(owner: str) -> SocketStore:
        return SocketStore(MemoryResponseStore(10_000, 1 << 20, 60.0), MemoryResponseStore(1, 1, 60.0), memory, owner)
    quiet = socket("quiet")
    for i in range(5):
        assert await quiet.put(f"q{i}", turn("quiet", i))
    hogs = [socket("hog") for _ in range(8)]
    for i in range(200):
        await hogs[i % 8].put(f"h{i}", turn("hog", i))
    assert memory.by_key["hog"] <= memory.key_bytes and memory.bytes <= memory.max_bytes
    assert all([await quiet.get(f"q{i}", "quiet") for i in range(5)])  # the other key's responses are all kept
    assert await hogs[199 % 8].get("h199", "hog") is not None  # each hog socket keeps its newest
    for h in hogs:
        h.close()
    assert memory.by_key.get("hog") is None and memory.bytes == quiet.local.bytes > 0
    # five busy keys, each up to its share, fill the total: room is made from the key that keeps the most, not from
    # the quiet one (before, whichever socket put a response past the total dropped its own)
    busy = [socket(f"busy{k}") for k in range(5)]
    for i in range(10):
        for k, store in enumerate(busy):
            await store.put(f"b{k}-{i}", turn(f"busy{k}", i))
    assert await quiet.put("q-late", turn("quiet", 5))  # past the total: the quiet key (six) keeps the least
    assert memory.bytes <= memory.max_bytes
    assert all([await quiet.get(f"q{i}", "quiet") for i in range(5)]) and await quiet.get("q-late", "quiet")


def test_queued_messages_count_against_the_keys_bytes_in_flight(tmp_path: Path) -> None:
    """The second attack: messages queued behind a slow one were held parsed and counted against nothing (two
    sockets' 30 MB of queued messages took the gateway from 80 to 425 MB). A queued message now holds its bytes
    against ``limits.max_bytes_in_flight`` and the key's share of it, and past that it is refused (429)."""
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(config=EmulatorConfig.for_tier("standard", ttft=0.01, tps=2000))
    limits = {"max_bytes_in_flight": 64 * 1024, "key_share": 0.25}  # 16 KiB a key
    auth = {"metrics": SCRAPE, "keys": [{"name": "agent", "sha256": digest(KEY)}]}
    gw, _ = start_gateway(ws_config(fast.base_url, standard.base_url, limits=limits, auth=auth), tmp_path)
    try:
        with connect(f"ws://127.0.0.1:{gw.port}/v1/responses",
                     additional_headers={"authorization": f"Bearer {KEY}"}) as ws:
            def message(text: str) -> str:
                return json.dumps({"type": "response.create", "model": "gpt-5.6", "max_output_tokens": 4,
                                   "input": text + " " + "x" * 6000})
            ws.send(message("[[emulate ttft_ms=3000]]"))  # served: holds its ~6 KB while it waits upstream
            ws.send(message("second"))  # queued: ~6 KB more
            ws.send(message("third"))  # queued: past 16 KiB
            refused = None
            deadline = time.monotonic() + 10
            while refused is None and time.monotonic() < deadline:
                event = json.loads(ws.recv(timeout=10))
                if event["type"] == "error":
                    refused = event
            assert refused is not None and refused["status"] == 429
            assert refused["error"]["code"] == "request_bytes_in_flight"
            done = 0
            while done < 2:  # the first two are served whole, and their bytes given back
                event = json.loads(ws.recv(timeout=10))
                done += event["type"] in ("response.completed", "response.incomplete")  # 4 tokens: incomplete
            ws.send(message("fourth"))
            while (event := json.loads(ws.recv(timeout=10)))["type"] not in ("response.incomplete", "error"):
                pass
            assert event["type"] == "response.incomplete"
    finally:
        gw.stop()
        fast.stop()
        standard.stop()


def _rss(pid: int) -> int:
    """Bytes: the resident set of process ``pid`` (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _ping_flood(port: int, key: str, pings: int = 1_000_000, seconds: float = 15.0, stall: float = 1.0,
                rcvbuf: int | None = None) -> tuple[socket.socket, int, bool]:
    """A raw WebSocket (the handshake by hand, on loopback) that sends masked 125-byte pings without ever reading:
    at most ``pings`` of them and ``seconds`` long, ending early once its sends stayed blocked ``stall`` seconds.
    Returns the socket (still open, unread), the bytes the kernel took from it, and whether it ended blocked."""
    sock = socket.socket()
    if rcvbuf is not None:  # a small receive window: the pongs back up into the server's buffer sooner
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                 f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 65536:
        got = sock.recv(4096)
        assert got, head
        head += got
    assert head.startswith(b"HTTP/1.1 101"), head
    mask = os.urandom(4)
    frame = bytes([0x89, 0x80 | 125]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(os.urandom(125)))
    batch = memoryview(frame * 64)
    sock.setblocking(False)
    sent = offset = 0
    start = time.monotonic()
    blocked_since: float | None = None
    while sent < pings * len(frame) and time.monotonic() - start < seconds:
        try:
            n = sock.send(batch[offset:])
        except BlockingIOError:
            now = time.monotonic()
            blocked_since = blocked_since or now
            if now - blocked_since >= stall:
                return sock, sent, True
            select.select([], [sock], [], stall / 10)
            continue
        blocked_since = None
        sent += n
        offset = (offset + n) % len(batch)
    return sock, sent, False


@pytest.fixture(scope="module")
def flooded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A gateway with gateway keys and the default WebSocket limits (idle 300 s: no close during a flood)."""
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(config=EmulatorConfig.for_tier("standard", ttft=0.02, tps=500))
    auth = {"metrics": SCRAPE, "keys": [{"name": "agent", "sha256": digest(KEY)}]}
    gw, _ = start_gateway(ws_config(fast.base_url, standard.base_url, auth=auth), tmp_path_factory.mktemp("flood"))
    yield gw
    gw.stop()
    fast.stop()
    standard.stop()


def test_a_ping_flood_that_never_reads_is_not_read_either(flooded: Proc) -> None:
    """The attack: one socket sent 1,000,000 pings of 125 bytes and read nothing; uvicorn wrote every pong to the
    transport, which never stopped reading, and the gateway's RSS grew without bound (89 to 204 MB in 18 s). Past the
    transport's high-water mark the gateway now stops reading that client: its sends block (TCP back-pressure) once
    the kernel's buffers are full, and what the gateway holds for it stays bounded."""
    gw = flooded
    with client(gw.port, KEY).responses.connect() as conn:  # warm: the first socket's imports are not the flood's
        conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate tokens=2]]")
        assert until_done(conn)[-1].type == "response.completed"
    before = _rss(gw.popen.pid)
    flood, sent, blocked = _ping_flood(gw.port, KEY)
    try:
        time.sleep(0.5)  # what the gateway read last is answered
        grown = _rss(gw.popen.pid) - before
        print(f"ping flood: {sent} bytes ({sent // 131} pings) sent, blocked={blocked}, RSS +{grown / 2**20:.1f} MiB")
        assert blocked, f"the client's sends never blocked: {sent} bytes taken"
        # what the kernel's buffers on loopback hold (the client's send and receive buffers, the gateway's): 9-10 MB
        # measured, RSS +1.7 MiB; the unfixed gateway took all 1,000,000 pings (131 MB) in 8 s, RSS +119 MiB
        assert sent < 32 * 2**20, sent
        assert grown < 16 * 2**20, f"the gateway grew {grown} bytes"
        with client(gw.port, KEY).responses.connect() as conn:  # another socket of the same key is served meanwhile
            conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate tokens=2]]")
            assert until_done(conn)[-1].type == "response.completed"
    finally:
        flood.close()  # unread bytes in its receive buffer: the kernel resets the connection
    deadline = time.monotonic() + 10
    while sample(scraped(gw.port), "tiergate_websocket_sockets") > 0:  # the gateway let the flooding socket go
        assert time.monotonic() < deadline, "the flooding socket is still open in the gateway"
        time.sleep(0.1)


def test_a_socket_that_never_reads_is_aborted_when_its_close_cannot_flush() -> None:
    """uvicorn's keep-alive closes a socket that answers no ping (1011), but uvloop's ``close()`` waits for the write
    buffer to flush: for a client that reads nothing, forever (measured on the gateway: the flooding socket was still
    open 70 s on, its keep-alive close at 40 s). One still unflushed ``close_timeout`` into its close is aborted. Here
    uvicorn serves the gateway's protocol in-process with the keep-alive and ``close_timeout`` shortened."""
    gone = threading.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (await receive())["type"] != "websocket.disconnect":
            pass
        gone.set()

    class Quick(GuardedWebSocketsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.close_timeout = 0.5

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", ws=Quick, lifespan="off",
                                           log_level="warning", ws_ping_interval=3.0, ws_ping_timeout=0.5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        flood, sent, blocked = _ping_flood(port, "unused", seconds=10, rcvbuf=4096)
        try:
            assert blocked, sent  # the server's buffer is past its mark: the keep-alive's close cannot flush
            # the keep-alive closes 3.5 s after the handshake, the abort comes within two checks of 0.5 s
            assert gone.wait(10), "the socket is still open"
        finally:
            flood.close()
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_failed_turn_is_evicted_from_its_socket_and_an_orphan_tool_output_refused(
        stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    """As OpenAI's WebSocket mode: continuing a turn that failed is ``previous_response_not_found`` on the socket
    (before, the bridge continued it), and a tool output answering no call is a 400; the socket lives on."""
    gw, _, _ = stack
    with client(gw.port).responses.connect() as conn:
        conn.response.create(model="gpt-5.6-sol-fast", input="hi [[emulate tokens=20 drop_after=4]]", store=True)
        failed = until_done(conn)[-1]
        assert failed.type == "response.failed", failed
        conn.response.create(model="gpt-5.6-sol-fast", input="go on", previous_response_id=failed.response.id)
        refused = until_done(conn)[-1]
        assert refused.type == "error" and refused.status == 400
        assert refused.error.code == "previous_response_not_found"
        conn.response.create(model="gpt-5.6-sol-fast", input=[
            {"type": "function_call_output", "call_id": "call_nowhere", "output": "sunny"}])
        orphan = until_done(conn)[-1]
        assert orphan.type == "error" and orphan.status == 400 and orphan.error.param == "input"
        assert orphan.error.message == "No tool call found for function call output with call_id call_nowhere."
        first, second = tool_loop(conn, "gpt-5.6-sol-fast", store=False)  # and the socket still serves
        assert second[-1].type == "response.completed"
