"""Tenants who cannot hurt each other: each test is one way a hostile or careless gateway key tried to spend past its
limits, reach what another key stored, or rest an upstream for everyone, over real sockets, with the keys and limits
it needs (the attack's findings; every test failed on the gateway before its fix).

A real gateway process in front of in-process emulators (``EmulatorThread``, which record every request they get).
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect

from gateway.tenancy.keys import digest, new_key
from gateway.tools.emulator import EmulatorConfig, EmulatorThread

from conftest import SCRAPE, SCRAPE_TOKEN, Proc, RedisServer, needs_redis, sample, scraped, start_gateway

KEYS = {name: new_key() for name in ("a", "b", "tpm", "hostile", "victim", "leaver", "flood", "kept", "saver",
                                     "streamer")}
PRICE = {"input": 1.0, "output": 2.0}  # USD per million tokens


def _config(fast: EmulatorThread, standard: EmulatorThread, **extra: Any) -> dict[str, Any]:
    def key(name: str, **kw: Any) -> dict[str, Any]:
        return {"name": name, "sha256": digest(KEYS[name]), **kw}
    return {
        "default_tier": "standard",
        "upstreams": [
            {"name": "emu-fast", "tier": "fast", "base_url": fast.base_url, "dialect": "cerebras",
             "models": {"gpt-5.6": "gpt-5.6-wse", "wse-only": "wse-only"}, "prices": PRICE,
             "health": {"failures": 4, "open_seconds": 30}},
            {"name": "emu-standard", "tier": "standard", "base_url": standard.base_url, "dialect": "openai",
             "models": {"gpt-5.6": "gpt-5.6-2026-10-01"}, "prices": PRICE,
             "model_prices": {"gpt-image-1": {"input": 5.0, "output": 40.0}},
             "health": {"failures": 4, "open_seconds": 30}},
        ],
        "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"}},
        "auth": {"metrics": SCRAPE, "keys": [key("a"), key("b"), key("tpm", limits={"tokens_per_minute": 20_000}),
                          key("hostile"), key("victim"), key("leaver", limits={"tokens_per_minute": 6_000}),
                          key("flood"), key("kept"), key("saver", limits={"usd_per_day": 0.10}),
                          key("streamer", limits={"tokens_per_minute": 6_000})]},
        **extra,
    }


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[EmulatorThread, EmulatorThread]]:
    quick = {"ttft": 0.005, "tps": 5000.0}
    fast = EmulatorThread(config=EmulatorConfig(dialect="cerebras", **quick))
    standard = EmulatorThread(config=EmulatorConfig(dialect="openai", **quick))
    yield fast, standard
    fast.stop()
    standard.stop()


@pytest.fixture(scope="module")
def gateway(upstreams: tuple[EmulatorThread, EmulatorThread],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc, _ = start_gateway(_config(*upstreams), tmp_path_factory.mktemp("tenancy"))
    yield proc
    proc.stop()


def _h(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def _url(gw: Proc) -> str:
    return f"http://127.0.0.1:{gw.port}"


def _metrics(gw: Proc) -> str:
    return scraped(gw.port)


def _sdk(gw: Proc, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(gw) + "/v1", api_key=KEYS[name], max_retries=0)


def _raw(gw: Proc, method: str, path: str, name: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request with ``path`` exactly as given (no client normalises it), for the path tricks."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={**_h(name), "content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _fresh_minute(need: float = 20.0) -> None:
    """Wait, if needed, until the current UTC minute has ``need`` seconds left (a limit test stays in one window)."""
    left = 60 - time.time() % 60
    if left < need:
        time.sleep(left + 0.1)


def _seen(upstreams: tuple[EmulatorThread, EmulatorThread]) -> int:
    return sum(len(u.requests) for u in upstreams)


# --- 1. a key's limits hold on every path ----------------------------------------------------------------------------

def test_a_path_with_an_empty_segment_reaches_no_upstream_whatever_its_spelling(
        gateway: Proc, upstreams: tuple[EmulatorThread, EmulatorThread]) -> None:
    """The double slash: the hot path matched the path exactly, so /v1//chat/completions fell to the passthrough,
    which the servers in front of an upstream serve as chat completions, outside the key's limits and accounting."""
    _fresh_minute(6)
    body = b'{"model": "gpt-5.6", "max_tokens": 50000, "messages": [{"role": "user", "content": "hi"}]}'
    status, answer = _raw(gateway, "POST", "/v1/chat/completions", "tpm", body)
    assert status == 429 and b"tokens_per_minute" in answer  # the routed path refuses it
    before = _seen(upstreams)
    for path in ("/v1//chat/completions", "/v1/%2Fchat/completions", "/v1/chat//completions",
                 "/v1/chat/%2Fcompletions", "/v1//responses", "/v1///embeddings"):
        status, answer = _raw(gateway, "POST", path, "tpm", body)
        assert status == 404 and b'"unknown_url"' in answer, (path, status, answer)
    assert _seen(upstreams) == before  # none of them reached an upstream


def test_the_passthrough_reserves_a_json_bodys_tokens_and_counts_any_usage_it_answers(
        gateway: Proc, upstreams: tuple[EmulatorThread, EmulatorThread]) -> None:
    """The passthrough reserved one request and counted usage for embeddings and legacy completions only."""
    _fresh_minute(6)
    over = httpx.post(_url(gateway) + "/v1/completions", headers=_h("tpm"), timeout=10,
                      json={"model": "gpt-5.6", "prompt": "hi", "max_tokens": 50_000})
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded", over.text
    before = _metrics(gateway)
    image = _sdk(gateway, "a").images.generate(model="gpt-image-1", prompt="a lighthouse at dawn", n=2)
    assert image.usage is not None and image.usage.output_tokens == 544
    after = _metrics(gateway)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)
    assert grew("tiergate_key_tokens_total", key="a", token_type="output") == 544
    assert grew("tiergate_tokens_total", token_type="output", usage="reported", model="other") == 544
    expected = (image.usage.input_tokens * 5.0 + 544 * 40.0) / 1e6  # gpt-image-1's model_prices
    assert grew("tiergate_key_cost_usd_total", key="a") == pytest.approx(expected, rel=1e-9)


def test_a_streamed_passthrough_answer_without_usage_is_charged_what_it_relayed(gateway: Proc) -> None:
    """Legacy completions streamed without ``max_tokens`` or ``include_usage``: the passthrough kept only the tail
    for a usage that never came, so a 6,000 TPM key got all eight 2,000-token streams and was charged nothing."""
    _fresh_minute(12)
    body = {"model": "gpt-5.6", "stream": True, "prompt": "[[emulate tokens=2000 tps=20000]] go on"}
    before = _metrics(gateway)
    statuses, relayed = [], []
    for _ in range(8):
        with httpx.stream("POST", _url(gateway) + "/v1/completions", headers=_h("streamer"), json=body,
                          timeout=20) as resp:
            statuses.append(resp.status_code)
            events = [line for line in resp.iter_lines() if line.startswith('data: {"id"')]
            if resp.status_code == 200:
                relayed.append(len(events))
    admitted = statuses.count(200)
    assert relayed == [2000] * admitted  # whole answers, bytes untouched
    assert 3 <= admitted <= 4 and statuses[admitted:] == [429] * (8 - admitted), statuses
    after = _metrics(gateway)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)
    assert grew("tiergate_key_tokens_total", key="streamer", token_type="output") == 2000 * admitted
    assert grew("tiergate_key_tokens_total", key="streamer", token_type="input") >= admitted  # the prompt estimate
    assert grew("tiergate_tokens_total", token_type="output", usage="estimated", upstream="emu-standard") \
        == 2000 * admitted
    assert grew("tiergate_usage_estimated_total", upstream="emu-standard") == admitted
    assert grew("tiergate_key_cost_usd_total", key="streamer") > 0
    # a client that leaves mid-stream is charged at least what reached it
    cut = {**body, "prompt": "[[emulate tokens=5000 tps=2000]] go on"}
    with httpx.stream("POST", _url(gateway) + "/v1/completions", headers=_h("a"), json=cut, timeout=20) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith('data: {"id"')
            if seen >= 500:
                break
    deadline = time.monotonic() + 5
    while sample(_metrics(gateway), "tiergate_key_tokens_total", key="a", token_type="output") - sample(
            after, "tiergate_key_tokens_total", key="a", token_type="output") < 500:
        assert time.monotonic() < deadline, "the stream the client left was not charged what it relayed"
        time.sleep(0.05)


# --- 2. stored responses belong to their key -------------------------------------------------------------------------

def test_a_response_is_found_only_by_the_key_that_made_it(gateway: Proc,
                                                          upstreams: tuple[EmulatorThread, EmulatorThread]) -> None:
    a, b = _sdk(gateway, "a"), _sdk(gateway, "b")
    secret = "the launch code is 0000"
    bridged = a.responses.create(model="gpt-5.6-sol-fast", input=secret)  # the fast tier, through the bridge
    assert bridged.id.startswith("resp_tg")
    native = a.responses.create(model="gpt-5.6", input=secret)  # the standard tier's own Responses API
    assert not native.id.startswith("resp_tg")
    before = _seen(upstreams)
    for rid in (bridged.id, native.id, "resp_never_made_here"):
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            b.responses.input_items.list(rid)
        with pytest.raises(openai.BadRequestError) as info:  # continuing it: never a fresh start, never A's history
            b.responses.create(model="gpt-5.6-sol-fast", input="go on", previous_response_id=rid)
        assert info.value.code == "previous_response_not_found"
    assert _seen(upstreams) == before  # none of it reached an upstream (the native one would answer any key)
    # the owner still has both, untouched by the other key's delete
    assert a.responses.retrieve(bridged.id).id == bridged.id
    assert a.responses.retrieve(native.id).id == native.id
    follow = a.responses.create(model="gpt-5.6-sol-fast", input="and?", previous_response_id=bridged.id)
    assert follow.previous_response_id == bridged.id
    sent = upstreams[0].requests[-1].body
    assert secret.encode() in sent  # the owner's follow-up carries its own history


@needs_redis
def test_two_replicas_sharing_redis_keep_each_response_to_its_key(
        upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    cfg = _config(*upstreams, state={"redis_url": redis.url, "timeout": 0.5})
    gateways = [start_gateway(cfg, tmp_path)[0] for _ in range(2)]
    try:
        for gw in gateways:
            deadline = time.monotonic() + 10
            while sample(_metrics(gw), "tiergate_shared_state_up") != 1:
                assert time.monotonic() < deadline, "a replica never reached Redis"
                time.sleep(0.05)
        made = _sdk(gateways[0], "a").responses.create(model="gpt-5.6-sol-fast", input="hello")
        assert _sdk(gateways[1], "a").responses.retrieve(made.id).id == made.id  # its key, on the other replica
        with pytest.raises(openai.NotFoundError):
            _sdk(gateways[1], "b").responses.retrieve(made.id)
        with pytest.raises(openai.BadRequestError):
            _sdk(gateways[1], "b").responses.create(model="gpt-5.6-sol-fast", input="x",
                                                    previous_response_id=made.id)
        with pytest.raises(openai.NotFoundError):
            _sdk(gateways[0], "b").responses.delete(made.id)
        assert _sdk(gateways[1], "a").responses.create(model="gpt-5.6-sol-fast", input="more",
                                                       previous_response_id=made.id).previous_response_id == made.id
    finally:
        for gw in gateways:
            gw.stop()
        redis.kill()


def test_a_file_and_a_batch_are_reached_only_by_the_key_that_made_them(
        gateway: Proc, upstreams: tuple[EmulatorThread, EmulatorThread]) -> None:
    """Every key's passthrough request reaches the same upstream account, which answers any id it holds: key B listed
    and downloaded key A's files and could run a batch on them."""
    a, b = _sdk(gateway, "a"), _sdk(gateway, "b")
    line = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-5.6"}}\n'
    made = a.files.create(file=("a-secrets.jsonl", line), purpose="batch")
    batch = a.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h")
    before = _seen(upstreams)
    for call in (lambda: b.files.retrieve(made.id), lambda: b.files.content(made.id), lambda: b.files.delete(made.id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert _seen(upstreams) == before  # refused before the upstream was asked
    assert made.id not in [f.id for f in b.files.list()]  # the list shows B's own only
    assert batch.id not in [x.id for x in b.batches.list()]
    mine = b.files.create(file=("b.jsonl", line), purpose="batch")
    assert [f.id for f in b.files.list()] == [mine.id]
    # the owner reaches all of it
    assert a.files.retrieve(made.id).filename == "a-secrets.jsonl" and a.files.content(made.id).content == line
    assert {made.id} <= {f.id for f in a.files.list()} and mine.id not in {f.id for f in a.files.list()}
    assert a.batches.retrieve(batch.id).id == batch.id


def test_a_model_call_reads_only_the_objects_its_key_made(gateway: Proc,
                                                         upstreams: tuple[EmulatorThread, EmulatorThread]) -> None:
    """A chat completion, a Responses request and a WebSocket message reach the upstream with the gateway's one
    credential, which reads any file, vector store or conversation of the account: key B summarised key A's file by
    naming its id in a content part, and searched a vector store nobody made through the gateway."""
    a, b = _sdk(gateway, "a"), _sdk(gateway, "b")
    made = a.files.create(file=("a-notes.txt", b"A's secret notes"), purpose="user_data")
    chat_file = [{"role": "user", "content": [{"type": "file", "file": {"file_id": made.id}},
                                              {"type": "text", "text": "summarise"}]}]
    resp_file = [{"role": "user", "content": [{"type": "input_file", "file_id": made.id},
                                              {"type": "input_text", "text": "summarise"}]}]
    before = _seen(upstreams)
    calls = [
        lambda: b.chat.completions.create(model="gpt-5.6", max_tokens=2, messages=chat_file),
        lambda: b.chat.completions.create(model="gpt-5.6-sol-fast", max_tokens=2, messages=chat_file, stream=True),
        lambda: b.responses.create(model="gpt-5.6", max_output_tokens=2, input=resp_file),
        lambda: b.responses.create(model="gpt-5.6", max_output_tokens=2, input="find it",
                                   tools=[{"type": "file_search", "vector_store_ids": ["vs_nobodys"]}]),
        lambda: b.responses.create(model="gpt-5.6", max_output_tokens=2, input="go on",
                                   conversation="conv_nobodys"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.code == "object_not_found"
    # a name spelled with JSON escapes is the same name once parsed: it is not hidden from the check
    escaped = (b'{"model": "gpt-5.6", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "file", '
               b'"file": {"file\\u005fid": "' + made.id.encode() + b'"}}]}]}')
    status, answer = _raw(gateway, "POST", "/v1/chat/completions", "b", escaped)
    assert status == 404 and orjson.loads(answer)["error"]["code"] == "object_not_found"
    with connect(f"ws://127.0.0.1:{gateway.port}/v1/responses", additional_headers=_h("b")) as ws:
        ws.send(orjson.dumps({"type": "response.create", "model": "gpt-5.6", "input": resp_file}).decode())
        event = orjson.loads(ws.recv(timeout=10))
    assert event["type"] == "error" and event["status"] == 404 and event["error"]["code"] == "object_not_found"
    assert _seen(upstreams) == before  # refused before any upstream was asked
    # the key that made the file may name it, on either tier
    assert a.chat.completions.create(model="gpt-5.6", max_tokens=2, messages=chat_file).choices
    answer = a.responses.create(model="gpt-5.6", max_output_tokens=2, input=resp_file)
    assert answer.status in ("completed", "incomplete")
    assert _seen(upstreams) == before + 2


def test_no_path_around_the_object_check(gateway: Proc, upstreams: tuple[EmulatorThread, EmulatorThread]) -> None:
    """The second attack, after the check above: an object's id echoed in an answer's ``metadata`` was claimed for
    the key that sent it (and A lost its own file); a prompt variable named ``tool_calls`` was not walked; an
    ``item_reference`` and a compressed passthrough body were not read; the passthrough looked 3 levels down; its
    ``service_tier`` was not checked."""
    a, b = _sdk(gateway, "a"), _sdk(gateway, "b")
    secret = a.files.create(file=("a.txt", b"A's secret"), purpose="user_data")
    line = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-5.6"}}\n'
    own = b.files.create(file=("b.jsonl", line), purpose="batch")
    b.batches.create(input_file_id=own.id, endpoint="/v1/chat/completions", completion_window="24h",
                     metadata={"id": secret.id})
    with pytest.raises(openai.NotFoundError):
        b.files.content(secret.id)
    assert a.files.content(secret.id).content == b"A's secret"  # still A's
    before = _seen(upstreams)
    hidden = [
        ("/v1/responses", {"model": "gpt-5.6", "prompt": {"id": "pmpt_x", "variables": {
            "tool_calls": {"type": "input_file", "file_id": secret.id}}}}),
        ("/v1/responses", {"model": "gpt-5.6", "input": [{"type": "item_reference", "id": "msg_of_another_key"}]}),
        ("/v1/threads", {"messages": [{"role": "user", "content": "x", "attachments": [{"file_id": secret.id}]}]}),
        ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": [
            {"type": "input_file", "file_id": secret.id}]}]}),
    ]
    for path, body in hidden:
        status, answer = _raw(gateway, "POST", path, "b", orjson.dumps(body))
        assert status == 404 and orjson.loads(answer)["error"]["code"] == "object_not_found", (path, answer)
    packed = gzip.compress(orjson.dumps({"input_file_id": secret.id, "endpoint": "/v1/chat/completions",
                                         "completion_window": "24h"}))
    r = httpx.post(_url(gateway) + "/v1/batches", content=packed, timeout=10, headers={
        **_h("b"), "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_encoding"
    r = httpx.post(_url(gateway) + "/v1/embeddings", headers=_h("b"), timeout=10,
                   json={"model": "text-embedding-3-small", "input": "x", "service_tier": "FLEX" * 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier"
    assert _seen(upstreams) == before  # none of it reached an upstream


async def test_one_keys_objects_never_push_another_keys_out_of_the_registry() -> None:
    from gateway.tenancy.objects import MemoryOwners

    owners = MemoryOwners(max_items=100, ttl=60, key_share=0.25)
    for i in range(10):
        await owners.claim(f"file-a{i}", "a")
    for i in range(1000):  # a key that makes objects without end keeps its own newest 25
        await owners.claim(f"file-h{i}", "hostile")
    assert [await owners.owner(f"file-a{i}") for i in range(10)] == ["a"] * 10
    assert await owners.owner("file-h999") == "hostile" and await owners.owner("file-h974") is None
    full = MemoryOwners(max_items=8, ttl=60, key_share=0.5)  # full of others' ids, a newcomer takes room from the
    for owner, n in (("quiet", 2), ("busy", 6), ("newcomer", 4)):  # largest holder, never from a key in its share
        for i in range(n):
            await full.claim(f"file-{owner}{i}", owner)
    assert [await full.owner(f"file-quiet{i}") for i in range(2)] == ["quiet"] * 2 and len(full._owners) == 8


# --- 3. a client that leaves is still charged ----------------------------------------------------------------------

def _cut_stream(gw: Proc, name: str, tokens: int, read: int, tps: int = 20000) -> int:
    """A stream of ``tokens`` without ``max_tokens``, closed after ``read`` content chunks (before the usage chunk);
    returns its status."""
    body = {"model": "gpt-5.6-sol-fast", "stream": True,
            "messages": [{"role": "user", "content": f"[[emulate tokens={tokens} tps={tps}]] go"}]}
    with httpx.Client(timeout=20) as client, client.stream("POST", _url(gw) + "/v1/chat/completions",
                                                           headers=_h(name), json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code
        seen = 0
        for line in resp.iter_lines():
            if '"content":"' in line:
                seen += 1
                if seen >= read:
                    break
        assert seen >= read
    return 200


def _recorded(gw: Proc, name: str, before: float) -> None:
    """Wait until a request of key ``name`` past ``before`` was recorded (and charged): once the gateway saw its
    client go and read on for the usage."""
    deadline = time.monotonic() + 10
    while sample(_metrics(gw), "tiergate_key_requests_total", key=name) <= before:
        assert time.monotonic() < deadline, "the stream was never recorded"
        time.sleep(0.02)


def test_a_client_that_leaves_before_the_usage_is_charged_what_was_relayed(gateway: Proc) -> None:
    _fresh_minute(20)
    statuses = []
    for _ in range(8):  # 6,000 tokens a minute; each stream relays ~1,500 (and ~2,000 more are read) before it ends
        before = sample(_metrics(gateway), "tiergate_key_requests_total", key="leaver")
        statuses.append(_cut_stream(gateway, "leaver", 20_000, 1500, tps=2000))
        _recorded(gateway, "leaver", before)
    admitted = statuses.count(200)
    assert 1 <= admitted <= 4 and statuses[admitted:] == [429] * (8 - admitted), statuses  # not all eight
    metrics = _metrics(gateway)
    assert sample(metrics, "tiergate_key_tokens_total", key="leaver", token_type="output") >= 1500 * admitted
    assert sample(metrics, "tiergate_usage_estimated_total", tier="fast") >= admitted
    assert sample(metrics, "tiergate_cost_usd_total", tier="fast", usage="estimated") > 0


def test_a_client_that_leaves_before_the_finish_is_charged_the_usage_that_follows(gateway: Proc) -> None:
    """The grace read for the usage after the client left was only for a finished stream: a client that closed it
    a moment before its finish chunk was charged an estimate of what had reached it, though the usage came soon."""
    before = _metrics(gateway)
    assert _cut_stream(gateway, "b", 400, 40, tps=1000) == 200  # leaves after ~0.04 s of a 0.4 s answer
    _recorded(gateway, "b", sample(before, "tiergate_key_requests_total", key="b"))
    after = _metrics(gateway)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)
    assert grew("tiergate_key_tokens_total", key="b", token_type="output") == 400  # the upstream's own usage
    assert grew("tiergate_tokens_total", tier="fast", token_type="output", usage="reported") == 400
    assert grew("tiergate_usage_estimated_total", tier="fast") == 0
    assert grew("tiergate_key_requests_total", key="b", outcome="client_disconnect") == 1


# --- 4. one key cannot rest an upstream for everyone -------------------------------------------------------------

def _breaker(gw: Proc, upstream: str) -> float:
    return sample(_metrics(gw), "tiergate_upstream_state", upstream=upstream, state="open")


def test_one_keys_failing_requests_open_no_breaker_for_the_others(gateway: Proc) -> None:
    """Five requests that every upstream answers 500 (a body their parser rejects) opened both tiers' breakers, so
    every other key got 503 upstreams_resting for 30 s."""
    bad = {"model": "gpt-5.6", "messages": [{"role": "user", "content": "[[emulate status=500]] \\ud800"}]}
    before = _metrics(gateway)
    for _ in range(8):  # each fails on both tiers: the request's fault, not theirs
        r = httpx.post(_url(gateway) + "/v1/chat/completions", headers=_h("hostile"), json=bad, timeout=10)
        assert r.status_code == 500
    assert _breaker(gateway, "emu-fast") == 0 and _breaker(gateway, "emu-standard") == 0
    after = _metrics(gateway)
    assert sample(after, "tiergate_key_requests_total", key="hostile", outcome="client_error") - sample(
        before, "tiergate_key_requests_total", key="hostile", outcome="client_error") == 8
    for model in ("gpt-5.6", "gpt-5.6-sol-fast"):
        ok = httpx.post(_url(gateway) + "/v1/chat/completions", headers=_h("victim"), timeout=10,
                        json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and "x-tiergate-fallback" not in ok.headers, (model, ok.headers)
    # on a model only one upstream serves, a key's failures rest that upstream for that key alone
    only = {"model": "wse-only", "messages": [{"role": "user", "content": "[[emulate status=500]] x"}]}
    codes = [httpx.post(_url(gateway) + "/v1/chat/completions", headers=_h("hostile"), json=only,
                        timeout=10).status_code for _ in range(6)]
    assert codes[:4] == [500] * 4 and codes[4:] == [503, 503], codes  # rested for it after four
    assert _breaker(gateway, "emu-fast") == 0
    ok = httpx.post(_url(gateway) + "/v1/chat/completions", headers=_h("victim"), timeout=10,
                    json={"model": "wse-only", "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text


# --- 5. budgets survive restarts, of the gateway and of Redis ----------------------------------------------------

DEAR = {"input": 1000.0, "output": 1000.0}  # USD per million tokens: a 25-token request costs ~0.025, four fit in 0.10


def _spend(gw: Proc) -> int:
    """One request of the budgeted key: its status."""
    return httpx.post(_url(gw) + "/v1/chat/completions", headers=_h("saver"), timeout=10, json={
        "model": "gpt-5.6", "max_tokens": 10, "messages": [{"role": "user", "content": "[[emulate tokens=10]] hi"}]
    }).status_code


def _dear(upstreams: tuple[EmulatorThread, EmulatorThread], **extra: Any) -> dict[str, Any]:
    cfg = _config(*upstreams, **extra)
    for up in cfg["upstreams"]:
        up["prices"] = DEAR
    return cfg


def test_a_keys_day_spend_survives_a_restart_of_the_gateway(upstreams: tuple[EmulatorThread, EmulatorThread],
                                                              tmp_path: Path) -> None:
    """Without Redis a restart set every key's day and month spend back to zero."""
    state = {"GATEWAY_STATE_DIR": str(tmp_path / "state")}
    gw, _ = start_gateway(_dear(upstreams), tmp_path, env=state)
    try:
        codes = [_spend(gw) for _ in range(8)]
        admitted = codes.count(200)
        assert 2 <= admitted <= 5 and codes[admitted:] == [429] * (8 - admitted), codes  # the budget bit
        deadline = time.monotonic() + 10  # written within a second or so
        while b"saver/all/usd/day" not in ((tmp_path / "state" / "ledger.json").read_bytes()
                                           if (tmp_path / "state" / "ledger.json").exists() else b""):
            assert time.monotonic() < deadline, "the spend was never written"
            time.sleep(0.05)
        gw.popen.kill()  # a crash: what it wrote is what the next start finds
    finally:
        gw.stop()
    again, _ = start_gateway(_dear(upstreams), tmp_path, env=state)
    try:
        assert _spend(again) == 429  # still spent after the restart
        spent = sample(_metrics(again), "tiergate_key_cost_usd_total", key="saver")
        assert spent == 0  # this process was charged nothing: the refusal came from what the last one kept
    finally:
        again.stop()  # a clean stop
    third, _ = start_gateway(_dear(upstreams), tmp_path, env=state)
    try:
        assert _spend(third) == 429
    finally:
        third.stop()


@needs_redis
def test_a_budget_counts_what_was_spent_while_redis_was_away_and_survives_its_restart(
        upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    """During an outage each replica's ledger started at zero and its spend was never written back; a Redis that
    restarted without its data (as the shipped one did) forgot every counter."""
    redis = RedisServer(tmp_path)
    cfg = _dear(upstreams, state={"redis_url": redis.url, "timeout": 0.2, "retry": 0.2})
    gws = [start_gateway(cfg, tmp_path)[0] for _ in range(2)]

    def up(want: float) -> None:
        for gw in gws:
            deadline = time.monotonic() + 10
            while sample(_metrics(gw), "tiergate_shared_state_up") != want:
                assert time.monotonic() < deadline, "the replica never saw Redis come or go"
                time.sleep(0.05)
    try:
        up(1)
        admitted = [_spend(gws[0]), _spend(gws[1])]  # both replicas see the key's counters
        redis.kill()
        up(0)
        admitted += [_spend(gws[1]), _spend(gws[0])]  # spent while Redis is away: each counts on from what it saw
        redis.start()  # without its data
        up(1)
        for _ in range(12):
            got = _spend(gws[len(admitted) % 2])
            admitted.append(got)
            if got == 429:
                break
        total = sum(sample(_metrics(gw), "tiergate_key_cost_usd_total", key="saver") for gw in gws)
        # one budget over the outage and the restart: it would have let ~4 more through from zero
        assert admitted[-1] == 429 and total <= 0.10 + 0.03, (admitted, total)
        assert admitted.count(200) <= 5, admitted
    finally:
        for gw in gws:
            gw.stop()
        redis.kill()


def _day_spend(gw: Proc, name: str) -> float:
    """What the replica ``gw`` knows of key ``name``'s spend today: its local ledger, as it keeps it on disk
    (``gateway.state.ledger_file``; what it counts on from while Redis is away)."""
    path = gw.log.with_suffix(".state") / "ledger.json"
    try:
        counts = orjson.loads(path.read_bytes())["counts"]
    except (OSError, ValueError, KeyError):
        return 0.0
    entry = counts.get(f"{name}/all/usd/day")
    return float(entry[1]) if isinstance(entry, list) else 0.0


@needs_redis
def test_a_replica_that_never_served_a_key_counts_on_from_its_shared_spend_while_redis_is_away(
        upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    """A replica seeded its local ledger only from its own reservations: three spends on replica 0, Redis killed,
    and replica 1 admitted three more from zero ($0.138 on a $0.10 budget)."""
    redis = RedisServer(tmp_path)
    cfg = _dear(upstreams, state={"redis_url": redis.url, "timeout": 0.2, "retry": 0.2})
    gws = [start_gateway(cfg, tmp_path)[0] for _ in range(2)]

    def up(want: float) -> None:
        for gw in gws:
            deadline = time.monotonic() + 10
            while sample(_metrics(gw), "tiergate_shared_state_up") != want:
                assert time.monotonic() < deadline, "the replica never saw Redis come or go"
                time.sleep(0.05)
    try:
        up(1)
        assert [_spend(gws[0]) for _ in range(3)] == [200] * 3  # replica 1 serves the key nothing
        spent = sample(_metrics(gws[0]), "tiergate_key_cost_usd_total", key="saver")
        deadline = time.monotonic() + 10  # it learns the shared spend within a second or so (and keeps it on disk)
        while _day_spend(gws[1], "saver") < spent * 0.999 and time.monotonic() < deadline:
            time.sleep(0.05)
        redis.kill()
        up(0)
        codes = [_spend(gws[1]) for _ in range(6)]
        total = sum(sample(_metrics(gw), "tiergate_key_cost_usd_total", key="saver") for gw in gws)
        # three spends cost ~0.075: one more fits the budget, and a request's estimate may pass it by one request
        assert codes.count(200) <= 1 and codes[codes.count(200):] == [429] * (6 - codes.count(200)), codes
        assert total <= 0.10 + spent / 3, (codes, total)
    finally:
        for gw in gws:
            gw.stop()
        redis.kill()


# --- 6. the response store is bounded by the memory it takes, and by key -----------------------------------------

def _rss(gw: Proc) -> float:
    return sample(_metrics(gw), "process_resident_memory_bytes", missing_ok=False)


def test_one_key_cannot_fill_the_memory_or_push_out_the_others_responses(
        upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    """100 Responses requests of 1 MiB each moved the gateway's RSS from 87 MB to 1,276 MB and it stayed: the store
    counted JSON bytes but held parsed objects (~3.7x), and its default bound was half the container's limit."""
    from gateway.responses.request import input_items
    from gateway.responses.store import OVERHEAD, Bridged, encode

    cfg = _config(*upstreams, response_store={"max_bytes": 64 * 2**20, "key_share": 0.5})  # 32 MiB for one key
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        kept = _sdk(gw, "kept").responses.create(model="gpt-5.6-sol-fast", input="mine")
        flood = _sdk(gw, "flood")
        # 1 MiB of JSON in 10,000 small items: what an agent's long history looks like, and what parsing inflates most
        request: Any = {"model": "gpt-5.6-sol-fast", "max_output_tokens": 4,
                        "input": [{"role": "user", "content": f"turn {i}: " + "x" * 70} for i in range(10_000)]}
        body = orjson.dumps(request)
        answers: list[Any] = []

        async def send(n: int) -> None:  # httpx: the openai SDK takes ~5 s to build a request of 10,000 items
            async with httpx.AsyncClient(timeout=30, headers={**_h("flood"), "content-type": "application/json"}) as c:
                for _ in range(n):
                    answer = await c.post(_url(gw) + "/v1/responses", content=body)
                    assert answer.status_code == 200
                    answers.append(answer.json())
        asyncio.run(send(3))  # the allocator's arenas grow to one request's working set first
        base = _rss(gw)
        asyncio.run(send(12))  # all kept: 15 records are within the key's share
        # what the store counts for each (and holds: a record's JSON, its input items with the ids it gives them)
        record = len(encode(Bridged(answers[-1], input_items(request), None, "flood"))) + OVERHEAD
        stored, grown = 12 * record, _rss(gw) - base
        print(f"RSS grew by {grown / 2**20:.1f} MiB for {stored / 2**20:.1f} MiB of records")
        # serialised, a record takes about its JSON's bytes (measured: 1.1x); parsed objects took ~3.7x them
        assert grown < 1.5 * stored, f"RSS grew by {grown / 2**20:.1f} MiB for {stored / 2**20:.1f} MiB of records"
        asyncio.run(send(30))  # 74 MiB in all, past the whole store's 64: the key's share bounds it, not the store
        grown = _rss(gw) - base
        print(f"RSS grew by {grown / 2**20:.1f} MiB for the key's 32 MiB share")
        assert grown < 1.5 * 32 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
        assert _sdk(gw, "kept").responses.retrieve(kept.id).id == kept.id  # never pushed out by another key
        assert flood.responses.create(model="gpt-5.6-sol-fast", input="still served").status == "completed"
    finally:
        gw.stop()


def test_small_responses_take_about_the_memory_the_store_counts_for_them(
        upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    """What ``orjson.dumps`` returns keeps its output buffer's allocation: the store kept each 1.6 KB record in ~8 KiB
    more than it counted, so 2,500 small records of one key (its share of ``max_items``) took ~42 MiB, not ~5."""
    from gateway.responses.request import input_items
    from gateway.responses.store import OVERHEAD, Bridged, encode

    gw, _ = start_gateway(_config(*upstreams), tmp_path)  # the default store: 10,000 records, a key's share 2,500
    try:
        request = {"model": "gpt-5.6-sol-fast", "input": "one more small turn", "max_output_tokens": 40}
        answers: list[Any] = []

        async def send(n: int) -> None:
            async with httpx.AsyncClient(timeout=30, headers=_h("kept")) as c:
                async def worker() -> None:
                    for _ in range(n // 4):
                        answer = await c.post(_url(gw) + "/v1/responses", json=request)
                        assert answer.status_code == 200
                        answers.append(answer.json())
                await asyncio.gather(*(worker() for _ in range(4)))
        asyncio.run(send(200))  # the allocator's arenas and the live estimates fill first
        base = _rss(gw)
        asyncio.run(send(2000))  # 2,200 records: all kept
        record = len(encode(Bridged(answers[-1], input_items(request), None, "kept"))) + OVERHEAD
        stored, grown = 2000 * record, _rss(gw) - base
        print(f"RSS grew by {grown / 2**20:.1f} MiB for {stored / 2**20:.1f} MiB of records")
        assert grown < 1.5 * stored, f"RSS grew by {grown / 2**20:.1f} MiB for {stored / 2**20:.1f} MiB of records"
    finally:
        gw.stop()


@needs_redis
def test_one_keys_records_in_redis_never_evict_another_keys_response_or_counters(
        upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    """With shared state, a 1 MiB request became a 3.1 MB record in Redis; under the replicas overlay's ``maxmemory``
    and ``volatile-ttl``, 90 of one key's requests evicted 26 keys, another key's response among them. Redis holds
    each key's share of the store as a process does (here 2 MiB), so the flood evicts nothing."""
    import redis

    server = RedisServer(tmp_path, args=("--maxmemory", "16mb", "--maxmemory-policy", "volatile-ttl"))
    cfg = _config(*upstreams, state={"redis_url": server.url, "timeout": 0.5},
                  response_store={"max_bytes": 8 * 2**20, "key_share": 0.25})
    gateways = [start_gateway(cfg, tmp_path)[0] for _ in range(2)]
    client = redis.Redis(port=server.port)
    try:
        for gw in gateways:
            deadline = time.monotonic() + 10
            while sample(_metrics(gw), "tiergate_shared_state_up") != 1:
                assert time.monotonic() < deadline, "a replica never reached Redis"
                time.sleep(0.05)
        kept = _sdk(gateways[0], "tpm").responses.create(model="gpt-5.6-sol-fast", input="mine")  # with a limit
        deadline = time.monotonic() + 5
        while list(client.scan_iter(match="tiergate:{key:tpm}:hold:*")):  # settled (not awaited by the request)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        counters = sorted(client.scan_iter(match="tiergate:{key:tpm}:all:*"))
        before = client.mget(counters)
        assert counters and all(v is not None for v in before)
        body = orjson.dumps({"model": "gpt-5.6-sol-fast", "max_output_tokens": 4, "input": "x" * 2**20})
        ids: list[str] = []

        async def flood(n: int) -> None:
            async with httpx.AsyncClient(timeout=30, headers={**_h("flood"), "content-type": "application/json"}) as c:
                for _ in range(n):
                    answer = await c.post(_url(gateways[0]) + "/v1/responses", content=body)
                    assert answer.status_code == 200
                    ids.append(answer.json()["id"])
        asyncio.run(flood(24))  # 24 MiB of records: past the maxmemory
        info = client.info()
        print(f"used_memory {info['used_memory'] / 2**20:.1f} MiB, evicted {info['evicted_keys']} keys")
        assert info["evicted_keys"] == 0 and client.mget(counters) == before
        other = gateways[1]  # its own copy holds none of them: it reads Redis
        assert _sdk(other, "tpm").responses.retrieve(kept.id).id == kept.id
        assert _sdk(other, "flood").responses.retrieve(ids[-1]).id == ids[-1]  # the flood's newest, in its share
        with pytest.raises(openai.NotFoundError):
            _sdk(other, "flood").responses.retrieve(ids[0])  # its oldest went
    finally:
        for gw in gateways:
            gw.stop()
        client.close()
        server.kill()


def test_one_keys_bodies_in_flight_are_bounded_and_the_others_are_served(
        upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    """Request bodies are read whole to route on them: a key with many large ones in flight at once (16 MiB each by
    default) could take the process past its memory limit for everyone."""
    cfg = _config(*upstreams, limits={"max_bytes_in_flight": 8 * 2**20, "key_share": 0.5})  # 4 MiB for one key
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        def body(tokens: int) -> bytes:  # ~1.5 MiB, streamed slowly: it stays in flight (held) while it streams
            return orjson.dumps({"model": "gpt-5.6-sol-fast", "stream": True, "messages": [
                {"role": "user", "content": f"[[emulate tokens={tokens} tps=20]] " + "x" * (3 * 2**19)}]})

        async def go() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                async def send(name: str, tokens: int) -> httpx.Response:
                    return await c.post(_url(gw) + "/v1/chat/completions", content=body(tokens),
                                        headers={**_h(name), "content-type": "application/json"})
                floods = [asyncio.create_task(send("flood", 40)) for _ in range(3)]
                await asyncio.sleep(0.5)  # the three are in flight (or refused)
                other = await send("kept", 2)
                return list(await asyncio.gather(*floods)), other
        floods, other = asyncio.run(go())
        codes = sorted(r.status_code for r in floods)
        assert codes == [200, 200, 429], codes  # two fit the key's 4 MiB, the third does not
        refused = next(r for r in floods if r.status_code == 429)
        assert refused.json()["error"]["code"] == "request_bytes_in_flight" and refused.headers["retry-after"] == "1"
        assert other.status_code == 200  # another key's request is read and served meanwhile
    finally:
        gw.stop()


# --- /metrics names every key and its spend: a scrape token's, not a tenant's ----------------------------------------

def test_metrics_are_read_with_a_scrape_token_never_with_a_gateway_key(
        gateway: Proc, upstreams: tuple[EmulatorThread, EmulatorThread], tmp_path: Path) -> None:
    for headers in ({}, _h("a"), {"authorization": "Bearer tg-not-a-scrape-token-0123456789"}):
        r = httpx.get(_url(gateway) + "/metrics", headers=headers, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert b"tiergate_key_" not in r.content and r.headers["www-authenticate"].startswith("Bearer")
    ok = httpx.get(_url(gateway) + "/metrics", headers={"authorization": f"Bearer {SCRAPE_TOKEN}"}, timeout=5)
    assert ok.status_code == 200 and 'tiergate_key_requests_total{key="a"' in ok.text
    assert httpx.get(_url(gateway) + "/healthz", timeout=5).status_code == 200  # probes need nothing
    cfg = _config(*upstreams)
    cfg["auth"]["metrics"] = {"public": True}  # every tenant reads it then: the API's port is the metrics port
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        assert httpx.get(_url(gw) + "/metrics", timeout=5).status_code == 200
    finally:
        gw.stop()
