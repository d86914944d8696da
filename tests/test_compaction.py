"""Compaction (``POST /v1/responses/compact``, OpenAI API reference "Compact a response") through the gateway with
the real ``openai`` SDK: on the bridge (a chat-only fast upstream writes the summary; the gateway makes the
compaction item and reads it back on the next request, there or on a native upstream) and natively (the emulated
standard upstream's own compaction, relayed; its item then goes only to it). The upstreams are in-process
emulators that record what they were sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.responses.compaction import ASK, HEADER, INSTRUCTIONS, PREFIX
from gateway.tools.emulator import EmulatorConfig, EmulatorThread

from conftest import Proc, default_config, start_gateway

CONVERSATION: list[Any] = [
    {"role": "user", "content": "Rename the config loader to load_settings."},
    {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "grep -rn load_config"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "gateway/config.py:12: def load_config():"},
    {"role": "assistant", "content": "It is defined in gateway/config.py."},
    {"role": "user", "content": "Good, go on. [[emulate tokens=12]]"},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, EmulatorThread, EmulatorThread]]:
    fast = EmulatorThread(config=EmulatorConfig.for_tier("fast"))
    standard = EmulatorThread(config=EmulatorConfig.for_tier("standard", ttft=0.01, tps=2000))
    gw, _ = start_gateway(default_config(fast.base_url, standard.base_url), tmp_path_factory.mktemp("compact"))
    yield gw, fast, standard
    gw.stop()
    fast.stop()
    standard.stop()


def _client(gw: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="unused", max_retries=0)


def _sent(emu: EmulatorThread, path: str) -> dict[str, Any]:
    return json.loads(next(r for r in reversed(emu.requests) if r.path == path).body)


def test_the_bridge_compacts_and_reads_its_compaction_back_there_and_natively(
        stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    gw, fast, standard = stack
    raw = _client(gw).responses.with_raw_response.compact(model="gpt-5.6-sol-fast", input=CONVERSATION,
                                                          instructions="You are a coding agent.")
    assert raw.headers["x-tiergate-tier"] == "fast"
    done = raw.parse()
    assert done.object == "response.compaction" and done.usage.output_tokens > 0
    *users, item = done.output
    assert [u.content[0].text for u in users] == [CONVERSATION[0]["content"], CONVERSATION[4]["content"]]  # type: ignore[union-attr]
    assert item.type == "compaction" and item.encrypted_content.startswith(PREFIX)  # type: ignore[union-attr]
    # the chat upstream was asked for the summary: its instructions, the agent's, the whole conversation, the ask
    asked = _sent(fast, "/v1/chat/completions")
    roles = [m["role"] for m in asked["messages"]]
    assert asked["messages"][0] == {"role": "system", "content": INSTRUCTIONS} and "tools" not in asked
    assert asked["messages"][1]["content"] == "You are a coding agent." and asked["messages"][-1]["content"] == ASK
    assert roles.count("tool") == 1 and asked["max_completion_tokens"] > 0
    summary = " Every token leaves the gateway"  # what the emulator wrote
    # the next turn on the bridge: the compacted window plus a new message; the item reads as the summary
    follow = [*raw.http_response.json()["output"], {"role": "user", "content": "and now?"}]
    again = _client(gw).responses.create(model="gpt-5.6-sol-fast", input=follow)
    assert again.status == "completed"
    texts = [m["content"] for m in _sent(fast, "/v1/chat/completions")["messages"]]
    assert any(isinstance(t, str) and t.startswith(HEADER) and summary.strip() in t for t in texts), texts
    # and on a native upstream, which cannot read the gateway's item: it gets the message the item stands for (the
    # emulator answers a compaction item it did not make 400, as OpenAI does)
    native = _client(gw).responses.create(model="gpt-5.6", input=follow)
    assert native.status == "completed"
    sent = _sent(standard, "/v1/responses")["input"]
    assert not any(i.get("type") == "compaction" for i in sent)
    assert any(HEADER.strip() in json.dumps(i) for i in sent), sent


def test_a_native_compaction_is_relayed_and_its_item_goes_only_where_it_can_be_read(
        stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    gw, fast, standard = stack
    raw = _client(gw).responses.with_raw_response.compact(model="gpt-5.6", input=CONVERSATION)
    assert raw.headers["x-tiergate-tier"] == "standard"
    done = raw.parse()
    assert done.output[-1].type == "compaction" and not done.output[-1].encrypted_content.startswith(PREFIX)  # type: ignore[union-attr]
    assert _sent(standard, "/v1/responses/compact")["input"][0]["content"] == CONVERSATION[0]["content"]
    follow = [*raw.http_response.json()["output"], {"role": "user", "content": "go on"}]
    before = len(fast.requests)
    moved = _client(gw).responses.with_raw_response.create(model="gpt-5.6-sol-fast", input=follow)
    # the bridge cannot read another upstream's compaction: the native upstream serves it (it made it)
    assert (moved.headers["x-tiergate-tier"], moved.headers["x-tiergate-fallback"]) == ("standard",
                                                                                       "responses_feature")
    assert moved.parse().status == "completed" and len(fast.requests) == before


def test_a_compaction_continues_a_held_conversation_and_takes_no_stream(
        stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    gw, fast, standard = stack
    client = _client(gw)
    first = client.responses.create(model="gpt-5.6-sol-fast", input="The first thing I asked. [[emulate tokens=3]]")
    done = client.responses.compact(model="gpt-5.6-sol-fast", previous_response_id=first.id,
                                    input=[{"role": "user", "content": "The second."}])
    assert [u.content[0].text for u in done.output[:-1]] == [  # type: ignore[union-attr]
        "The first thing I asked. [[emulate tokens=3]]", "The second."]
    bad = httpx.post(f"http://127.0.0.1:{gw.port}/v1/responses/compact", timeout=10,
                     json={"model": "gpt-5.6-sol-fast", "input": "x", "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"
    before = len(fast.requests) + len(standard.requests)
    empty = httpx.post(f"http://127.0.0.1:{gw.port}/v1/responses/compact", timeout=10,
                       json={"model": "gpt-5.6-sol-fast"})  # nothing to compact: no upstream is asked to summarise
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "missing_required_parameter"
    assert len(fast.requests) + len(standard.requests) == before
    with pytest.raises(openai.BadRequestError) as err:  # garbage that looks like the gateway's is not read as ours:
        client.responses.create(model="gpt-5.6-sol-fast", input=[  # the native upstream judges it, as OpenAI would
            {"type": "compaction", "encrypted_content": PREFIX + "not-base64!"}, {"role": "user", "content": "hi"}])
    assert err.value.code == "invalid_encrypted_content"


def test_compaction_items_cannot_inflate_a_request(stack: tuple[Proc, EmulatorThread, EmulatorThread]) -> None:
    """Forged items that look like the gateway's: one that inflates past what the gateway writes (a zlib bomb of
    ~1 KB to 1 MiB, or a summary past 64 KiB) is not the gateway's, so the bridge cannot read it and it goes to the
    native upstream, which refuses it as OpenAI does; many that each pass but together expand past 1 MiB are a 400
    before any upstream is asked."""
    import base64
    import os
    import zlib

    import orjson

    from gateway.responses.compaction import MAX_EXPANDED, SUMMARY_BYTES, seal

    gw, fast, standard = stack
    url = f"http://127.0.0.1:{gw.port}/v1/responses"
    bomb = PREFIX + base64.urlsafe_b64encode(zlib.compress(orjson.dumps({"s": "a" * (1 << 20)}), 9)).decode()
    assert len(bomb) < 4096
    before = len(fast.requests)
    r = httpx.post(url, timeout=10, json={"model": "gpt-5.6-sol-fast", "input": [
        {"type": "compaction", "encrypted_content": bomb}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encrypted_content"  # the native one's
    assert len(fast.requests) == before  # the bridge did not read it as a summary
    # each under the bounds (text that does not compress away), together past MAX_EXPANDED
    summary = base64.b64encode(os.urandom(SUMMARY_BYTES * 3 // 4 - 16)).decode()
    item = {"type": "compaction", "encrypted_content": seal(summary)}
    n = MAX_EXPANDED // len(summary) + 1
    seen = len(fast.requests) + len(standard.requests)
    r = httpx.post(url, timeout=10, json={"model": "gpt-5.6-sol-fast", "input": [
        *([item] * n), {"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("compaction_too_large", "input")
    assert len(fast.requests) + len(standard.requests) == seen
    # one such item is read, as the gateway's own
    r = httpx.post(url, timeout=10, json={"model": "gpt-5.6-sol-fast", "input": [
        item, {"role": "user", "content": "hi [[emulate tokens=2]]"}]})
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "fast"
