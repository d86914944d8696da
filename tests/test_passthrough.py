"""The rest of the /v1 surface through the gateway (the passthrough), over real loopback sockets: the real ``openai``
SDK on every endpoint family against the emulated standard tier, then byte equality, header rules, failover, limits and
client disconnects against a scripted upstream that records what reached it."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import io
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.app import create_app
from gateway.config.load import LoadedConfig
from gateway.config.schema import GatewayConfig
from gateway.errors import ModelNotFound, UnknownURL
from gateway.observability.passthrough import tail_usage
from gateway.routing.facts import RequestFacts
from gateway.routing.policy import Policy
from gateway.tools.emulator import EmulatorThread, Plan, Received
from gateway.tools.emulator.surface import vector
from gateway.tools.scripted import ScriptedTransport
from gateway.wire.routes import match

from conftest import Proc, Stack, round_trip, sample, start_gateway, timely

# the real SDK, unchanged, against the emulated standard tier (passthrough.upstream defaults to it)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="client-key", max_retries=0)


def test_embeddings_floats_and_the_sdk_default_base64(client: openai.OpenAI, stack: Stack) -> None:
    before = sample(stack.metrics(), "tiergate_passthrough_requests_total", endpoint="embeddings", outcome="success")
    tokens = sample(stack.metrics(), "tiergate_tokens_total", upstream="emu-standard", token_type="input")
    default = client.embeddings.create(model="text-embedding-3-small", input=["alpha", "beta"], dimensions=16)
    floats = client.embeddings.create(model="text-embedding-3-small", input="alpha", dimensions=16,
                                      encoding_format="float")
    assert [round(v, 6) for v in default.data[0].embedding] == [round(v, 6) for v in vector("alpha", 16)]
    assert floats.data[0].embedding == pytest.approx(default.data[0].embedding, abs=1e-7)
    assert default.data[1].embedding == pytest.approx(vector("beta", 16), abs=1e-6)
    raw = httpx.post(stack.base_url + "/embeddings", json={"model": "text-embedding-3-small", "input": "alpha",
                                                           "dimensions": 4, "encoding_format": "base64"}, timeout=5)
    got = raw.json()["data"][0]["embedding"]
    assert isinstance(got, str)  # relayed untouched: the gateway never decodes base64
    assert list(struct.unpack("<4f", base64.b64decode(got))) == pytest.approx(vector("alpha", 4), abs=1e-6)
    assert raw.headers["x-tiergate-rule"] == "passthrough" and raw.headers["x-tiergate-upstream"] == "emu-standard"
    text = stack.metrics()
    assert sample(text, "tiergate_passthrough_requests_total", endpoint="embeddings", outcome="success") == before + 3
    # ~4 characters a token: alpha 2, beta 1, then alpha twice
    assert sample(text, "tiergate_tokens_total", upstream="emu-standard", token_type="input") == tokens + 7
    assert sample(text, "tiergate_passthrough_response_bytes_total", endpoint="embeddings") > 0


def test_legacy_completions_whole_and_streamed(client: openai.OpenAI, stack: Stack) -> None:
    whole = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Say", max_tokens=5)
    assert whole.choices[0].text == " Every token leaves the gateway" and whole.usage is not None
    pieces = list(client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Say", max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == " Every token leaves"
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 3
    assert sample(stack.metrics(), "tiergate_tokens_total", upstream="emu-standard", token_type="output") >= 8


def test_moderations(client: openai.OpenAI) -> None:
    result = client.moderations.create(model="omni-moderation-latest", input=["one", "two"])
    assert len(result.results) == 2 and not result.results[0].flagged


def test_audio_transcription_upload_arrives_whole(client: openai.OpenAI, tmp_path: Path) -> None:
    audio = bytes(range(256)) * 4096 + b"\r\n--not-a-boundary\r\n"  # 1 MiB of every byte value
    path = tmp_path / "speech.wav"
    path.write_bytes(audio)
    with path.open("rb") as fh:
        text = client.audio.transcriptions.create(model="whisper-1", file=fh).text
    assert text == (f"Emulated transcription of speech.wav: {len(audio)} bytes, "
                    f"sha256 {hashlib.sha256(audio).hexdigest()}.")
    translated = client.audio.translations.create(model="whisper-1", file=("a.wav", b"RIFF"), response_format="text")
    assert "4 bytes" in str(translated)


def test_speech_streams_to_a_file(client: openai.OpenAI, tmp_path: Path) -> None:
    out = tmp_path / "speech.mp3"
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="hello") as resp:
        assert resp.headers["content-type"] == "audio/mpeg"
        resp.stream_to_file(out)
    seed = hashlib.sha256(b"hello").digest()
    assert out.read_bytes() == (b"ID3" + seed * 2049)[:64 * 1024]
    wav = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input="hi", response_format="wav")
    assert wav.headers["content-type"] == "audio/wav"


def test_transcription_formats_and_stream(client: openai.OpenAI) -> None:
    verbose = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", b"RIFF"),
                                                 response_format="verbose_json")
    assert verbose.duration == 1.0 and verbose.segments and verbose.language == "english"
    events = list(client.audio.transcriptions.create(model="gpt-4o-transcribe", file=("a.wav", b"RIFF"),
                                                     stream=True))
    assert events[-1].type == "transcript.text.done" and "4 bytes" in events[-1].text
    assert "".join(e.delta for e in events[:-1]).strip() == events[-1].text


def test_files_batches_and_objects(client: openai.OpenAI, stack: Stack) -> None:
    lines = b"".join(orjson.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "gpt-5.6", "messages": []}}) + b"\n" for i in range(3))
    file = client.files.create(file=("in.jsonl", lines), purpose="batch")
    content = client.files.with_raw_response.content(file.id)
    assert file.bytes == len(lines) and content.content == lines
    assert content.headers["content-disposition"] == 'attachment; filename="in.jsonl"'
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.batches.retrieve(batch.id).input_file_id == file.id
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert any(f.id == file.id for f in client.files.list(purpose="batch"))
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError) as info:  # the upstream's 404 stays a 404, in OpenAI's envelope
        client.files.retrieve(file.id)
    assert info.value.body == {"message": f"No such File object: {file.id}", "type": "invalid_request_error",
                               "param": "id", "code": None}


def test_models_list_merges_the_upstream_and_every_id_can_be_sent(client: openai.OpenAI, stack: Stack) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[:3] == ["gpt-5.6", "gpt-5.6-sol-fast", "gpt-5.6-2026-10-01"]  # the gateway's own, then the upstream's
    assert {"text-embedding-3-small", "whisper-1"} <= set(ids) and len(ids) == len(set(ids))
    assert client.models.retrieve("gpt-5.6").owned_by == "tiergate"
    assert client.models.retrieve("whisper-1").owned_by == "tiergate-emulator"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # a model only the upstream lists is sent there unchanged, chat completions included
    others = sample(stack.metrics(), "tiergate_requests_total", model="other", outcome="success")
    resp = client.chat.completions.with_raw_response.create(model="gpt-3.5-turbo-instruct", messages=[
        {"role": "user", "content": "hi [[emulate tokens=2]]"}])
    assert resp.headers["x-tiergate-rule"] == "passthrough" and resp.parse().model == "gpt-3.5-turbo-instruct"
    text = stack.metrics()  # labelled other: a model the config does not name never becomes a label
    assert sample(text, "tiergate_requests_total", model="other", outcome="success") == others + 1
    assert 'model="gpt-3.5-turbo-instruct"' not in text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_large_upload_streams_through_with_flat_memory(client: openai.OpenAI, stack: Stack) -> None:
    pid = stack.gateway.popen.pid
    size = 48 * 1024 * 1024
    data = hashlib.sha256(b"seed").digest() * (size // 32)
    client.files.create(file=("warm.bin", data[:1024 * 1024]), purpose="user_data")  # pools and buffers warm
    base = _rss_kib(pid)
    peak = base
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_kib(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=watch)
    sampler.start()
    try:
        file = client.files.create(file=("big.bin", io.BytesIO(data)), purpose="user_data")
    finally:
        done.set()
        sampler.join()
    assert file.bytes == size
    assert peak - base < 16 * 1024, f"RSS grew {(peak - base) / 1024:.1f} MiB during a {size >> 20} MiB upload"
    assert sample(stack.metrics(), "tiergate_passthrough_request_bytes_total", endpoint="files") >= size


# a scripted upstream: what reached it, byte for byte


class Recorder:
    """A scripted upstream whose answer the test sets (``plan``); every request it got is in ``up.requests``."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.up = EmulatorThread(self._handle)

    def _handle(self, got: Received) -> Plan | None:
        return self.plan


@pytest.fixture(scope="module")
def rec() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.up.stop()


@pytest.fixture(scope="module")
def pgw(rec: Recorder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    cfg = {
        "limits": {"max_passthrough_bytes": 4 * 1024 * 1024},
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": rec.up.base_url, "dialect": "cerebras",
             "models": {"m": "m", "fast-only": "f"}, "timeouts": {"connect": 1, "idle": 3, "total": 5}},
            {"name": "primary", "tier": "standard", "base_url": rec.up.base_url, "api_key_env": "PRIMARY_KEY",
             "models": {"emb": "emb-upstream-id", "m": "m"}, "timeouts": {"connect": 1, "idle": 3, "total": 5},
             "health": {"failures": 1000}, "prices": {"input": 1000, "output": 1000},
             "model_prices": {"text-embedding-3-small": {"input": 0.02, "output": 0}}},
            {"name": "backup", "tier": "standard", "base_url": rec.up.base_url, "endpoints": ["embeddings"],
             "models": {"emb": "emb"}, "timeouts": {"connect": 1, "idle": 3, "total": 5},
             "health": {"failures": 1000}},
            {"name": "byo", "tier": "standard", "base_url": rec.up.base_url,
             "pass_client_key": True, "endpoints": ["embeddings"], "models": {"byo-model": "byo-model"}},
        ],
        "passthrough": {"upstream": "primary", "models_ttl": 0},
    }
    proc, _ = start_gateway(cfg, tmp_path_factory.mktemp("pt"), env={"PRIMARY_KEY": "upstream-secret",
                                                                     "GATEWAY_BODY_TIMEOUT": "1"})
    yield proc
    proc.stop()


def _url(gw: Proc) -> str:
    return f"http://127.0.0.1:{gw.port}/v1"


def test_json_multipart_and_binary_bodies_arrive_and_return_byte_for_byte(rec: Recorder, pgw: Proc) -> None:
    answer = bytes(range(256)) * 64 + b"\r\n0\r\n\r\n"
    rec.plan = Plan(headers={"content-type": "application/octet-stream"},
                    parts=[(0, answer[:5000]), (0.01, answer[5000:])])
    bodies = [
        ("embeddings", "application/json", b'{ "input" : ["a",1e400], "model":"unknown-model" ,"x":{"y":[]}}'),
        ("uploads/upload_1/parts", "multipart/form-data; boundary=XyZ",
         b'--XyZ\r\nContent-Disposition: form-data; name="data"; filename="p"\r\n\r\n' + answer + b"\r\n--XyZ--\r\n"),
        ("files/file-1/content", "application/octet-stream", answer[::-1]),
    ]
    for path, ctype, body in bodies:
        before = len(rec.up.requests)
        resp = httpx.post(f"{_url(pgw)}/{path}?a=1&b=%20", content=body, timeout=5, headers={"content-type": ctype})
        assert resp.status_code == 200 and resp.content == answer
        assert resp.headers["content-type"] == "application/octet-stream"
        got = rec.up.requests[before:]
        assert len(got) == 1 and got[0].body == body and got[0].path == f"/v1/{path}?a=1&b=%20"
        assert got[0].headers["content-type"] == ctype


def test_a_configured_model_is_renamed_routed_and_fails_over(rec: Recorder, pgw: Proc) -> None:
    answers = iter([Plan(status=500, headers={"content-type": "application/json"},
                         parts=[(0, b'{"error":{"message":"boom","type":"server_error"}}')]),
                    Plan(headers={"content-type": "application/json"}, parts=[(0, b'{"object":"list","data":[]}')])])
    rec.up.handler = lambda got: next(answers)
    try:
        before = len(rec.up.requests)
        resp = httpx.post(_url(pgw) + "/embeddings", json={"model": "emb", "input": "x"}, timeout=5)
    finally:
        rec.up.handler = rec._handle
    assert resp.status_code == 200 and resp.headers["x-tiergate-upstream"] == "backup"
    assert resp.headers["x-tiergate-fallback"] == "upstream_5xx"
    sent = [orjson.loads(r.body)["model"] for r in rec.up.requests[before:]]
    assert sent == ["emb-upstream-id", "emb"]  # each upstream got its own model id


def test_a_streamed_upload_is_never_sent_twice(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(status=503, headers={"content-type": "text/html"}, parts=[(0, b"<h1>busy</h1>")])
    before = len(rec.up.requests)
    resp = httpx.post(_url(pgw) + "/files", files={"file": ("a", b"x" * 1000)}, data={"purpose": "batch"},
                      timeout=5)
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "server_error"  # normalised envelope
    assert len(rec.up.requests) == before + 1


def test_an_upstream_404_stays_a_404_with_its_body_normalised(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(status=404, headers={"content-type": "application/json"}, parts=[(0, b'{"detail":"Not Found"}')])
    resp = httpx.get(_url(pgw) + "/vector_stores/vs_1", timeout=5)
    assert resp.status_code == 404
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert "Not Found" in resp.json()["error"]["message"]


def test_header_rules(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(headers={"content-type": "application/json", "set-cookie": "s=upstream", "openai-organization":
                             "org-gateway", "x-ratelimit-remaining-requests": "99", "connection": "keep-alive",
                             "content-disposition": 'attachment; filename="f.json"'}, parts=[(0, b"{}")],
                    chunked=False)
    before = len(rec.up.requests)
    resp = httpx.get(_url(pgw) + "/files/file-1", timeout=5, headers={
        "authorization": "Bearer client-key", "cookie": "c=client", "openai-organization": "org-client",
        "openai-beta": "assistants=v2", "x-forwarded-for": "10.0.0.1", "proxy-authorization": "Basic x"})
    got = rec.up.requests[before]
    assert got.headers["authorization"] == "Bearer upstream-secret"  # the upstream's key, never the client's
    assert got.headers["openai-beta"] == "assistants=v2"
    for name in ("cookie", "openai-organization", "x-forwarded-for", "proxy-authorization"):
        assert name not in got.headers
    for name in ("set-cookie", "openai-organization"):
        assert name not in resp.headers
    assert resp.headers["x-ratelimit-remaining-requests"] == "99"
    assert resp.headers["content-disposition"] == 'attachment; filename="f.json"'
    assert resp.headers["content-length"] == "2" and resp.content == b"{}"


def test_the_client_key_reaches_only_an_upstream_that_passes_it(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, b'{"object":"list","data":[]}')])
    before = len(rec.up.requests)
    for model in ("byo-model", "emb"):
        httpx.post(_url(pgw) + "/embeddings", json={"model": model, "input": "x"}, timeout=5,
                   headers={"authorization": "Bearer client-own-key"})
    httpx.post(_url(pgw) + "/embeddings", json={"model": "byo-model", "input": "x"}, timeout=5)  # no key of its own
    rec.plan = None  # chat completions follow the same rule
    httpx.post(_url(pgw) + "/chat/completions", json={"model": "byo-model", "messages": [
        {"role": "user", "content": "hi"}]}, headers={"authorization": "Bearer client-own-key"}, timeout=5)
    keys = [r.headers.get("authorization") for r in rec.up.requests[before:]]
    assert keys == ["Bearer client-own-key", "Bearer upstream-secret", None, "Bearer client-own-key"]


def test_usage_is_priced_by_model_and_never_at_the_chat_price(rec: Recorder, pgw: Proc) -> None:
    usage = b'{"object":"list","data":[],"usage":{"prompt_tokens":1000000,"total_tokens":1000000}}'
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, usage)])
    metrics = f"http://127.0.0.1:{pgw.port}/metrics"
    before = httpx.get(metrics, timeout=5).text
    for model in ("text-embedding-3-small", "text-embedding-3-large"):
        assert httpx.post(_url(pgw) + "/embeddings", json={"model": model, "input": "x"}, timeout=5).is_success
    text = httpx.get(metrics, timeout=5).text
    cost = sample(text, "tiergate_cost_usd_total", upstream="primary") - sample(before, "tiergate_cost_usd_total",
                                                                                 upstream="primary")
    assert cost == pytest.approx(0.02)  # the embedding model's price; the large one has none: unpriced, not 1000
    assert sample(text, "tiergate_unpriced_requests_total", upstream="primary") == sample(
        before, "tiergate_unpriced_requests_total", upstream="primary") + 1
    assert sample(text, "tiergate_tokens_total", upstream="primary", model="other", token_type="input") >= 2e6


def test_an_encoded_answer_is_relayed_as_it_came_with_its_headers(rec: Recorder, pgw: Proc) -> None:
    body = b'{"data":"' + b"z" * 5000 + b'"}'
    for encoding, data in (("gzip", gzip.compress(body)), ("x-custom", b"\x00opaque\xff")):
        rec.plan = Plan(headers={"content-type": "application/json", "content-encoding": encoding},
                        parts=[(0, data)], chunked=False)
        with httpx.stream("GET", _url(pgw) + "/files/file-1", timeout=5) as resp:
            raw = b"".join(resp.iter_raw())
        assert raw == data and resp.headers["content-encoding"] == encoding
        assert resp.headers["content-length"] == str(len(data))


def test_odd_upstream_statuses_and_header_values(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(status=304, headers={}, parts=[], chunked=False)
    with httpx.Client(timeout=5) as keep_alive:  # never a body on a 304: the next answer on the connection is intact
        resp = keep_alive.get(_url(pgw) + "/files/file-1")
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_bad_response"
        rec.plan = Plan(status=205, headers={"content-type": "text/plain"}, parts=[(0, b"not for you")],
                        chunked=False)
        resp = keep_alive.get(_url(pgw) + "/files/file-1")
        assert resp.status_code == 205 and resp.content == b""
        rec.plan = Plan(headers={"content-type": "application/json", "content-disposition":
                                 'attachment; filename="r\u00e9sum\u00e9.pdf"', "x-ratelimit-limit-requests": "1\x01"},
                        parts=[(0, b"{}")], chunked=False)
        resp = keep_alive.get(_url(pgw) + "/files/file-1")
    assert resp.status_code == 200 and resp.content == b"{}"
    assert resp.headers["content-disposition"] == 'attachment; filename="r\u00e9sum\u00e9.pdf"'  # the same bytes
    assert "x-ratelimit-limit-requests" not in resp.headers  # not a valid field value: dropped, answer intact


def test_methods_trailing_slashes_and_bodiless_requests(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, b"{}")], chunked=False)
    before = len(rec.up.requests)
    assert httpx.request("TRACE", _url(pgw) + "/files", timeout=5).status_code == 405
    for path in ("/chat/completions/", "/responses/"):
        resp = httpx.post(_url(pgw) + path, json={"model": "m", "messages": []}, timeout=5)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_url"
    assert len(rec.up.requests) == before  # none of those reached the upstream
    assert httpx.head(_url(pgw) + "/models", timeout=5).status_code == 200
    httpx.get(_url(pgw) + "/files/file-1", timeout=5)
    got = rec.up.requests[-1]
    assert "content-type" not in got.headers and "content-length" not in got.headers and got.body == b""
    with socket.create_connection(("127.0.0.1", pgw.port), timeout=5) as sock:  # a POST framed without a body
        sock.sendall(b"POST /v1/batches/batch_1/cancel HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    got = rec.up.requests[-1]
    assert got.path == "/v1/batches/batch_1/cancel" and got.body == b""
    assert "transfer-encoding" not in got.headers and "content-type" not in got.headers
    with socket.create_connection(("127.0.0.1", pgw.port), timeout=5) as sock:  # refused on its declared length,
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"  # unread
                     b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % (64 << 20))
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")  # no 100 Continue first


def test_a_stored_object_fetched_again_is_not_billed_again(rec: Recorder, pgw: Proc) -> None:
    usage = b'{"object":"chat.completion","usage":{"prompt_tokens":500,"completion_tokens":500}}'
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, usage)])
    metrics = f"http://127.0.0.1:{pgw.port}/metrics"
    before = sample(httpx.get(metrics, timeout=5).text, "tiergate_tokens_total", upstream="primary")
    httpx.get(_url(pgw) + "/chat/completions/chatcmpl-1", timeout=5)
    assert sample(httpx.get(metrics, timeout=5).text, "tiergate_tokens_total", upstream="primary") == before


def test_a_model_whose_upstreams_lack_the_endpoint_is_404(rec: Recorder, pgw: Proc) -> None:
    before = len(rec.up.requests)
    resp = httpx.post(_url(pgw) + "/embeddings", json={"model": "fast-only", "input": "x"}, timeout=5)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"  # Cerebras serves chat only
    assert len(rec.up.requests) == before


def test_an_oversized_upload_is_413_and_never_completed_upstream(rec: Recorder, pgw: Proc) -> None:
    before = len(rec.up.requests)
    resp = httpx.post(_url(pgw) + "/files", content=b"x" * (5 * 1024 * 1024), timeout=5,
                      headers={"content-type": "application/octet-stream"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(_url(pgw) + "/files", content=iter([b"x" * (1024 * 1024)] * 5), timeout=5,
                         headers={"content-type": "application/octet-stream"})
    assert chunked.status_code == 413
    assert len(rec.up.requests) == before  # neither body ever completed upstream
    assert httpx.get(_url(pgw) + "/files", timeout=5).status_code == 200


def _closed_within(rec: Recorder, after: float, seen: int) -> float:
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        late = [t for t in rec.up.closed_at[seen:] if t >= after]
        if late:
            return late[0] - after
        time.sleep(0.002)
    raise AssertionError("the upstream connection was never closed")


# "Within 100 ms" (docs/passthrough.md) is over the loopback floor measured before each try (conftest.round_trip), and
# a try a stall made late is run again (conftest.timely): a gateway that noticed the client only at its body timeout
# (1 s) or the upstream's idle timeout (3 s) is late on every try.

def test_client_gone_mid_upload_closes_the_upstream_within_100_ms(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, b"{}")])

    def attempt() -> tuple[float, float]:
        httpx.get(_url(pgw) + "/files", timeout=5)  # keep-alive connections settle
        floor = round_trip(pgw.port)
        seen = len(rec.up.closed_at)
        sock = socket.create_connection(("127.0.0.1", pgw.port))
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
                     b"content-length: 3000000\r\n\r\n" + b"y" * 200_000)
        time.sleep(0.3)  # the upload is under way upstream
        opened = rec.up.opened
        gone = time.monotonic()  # before the close: the gateway may see it before this thread runs again
        sock.close()
        took = _closed_within(rec, gone, seen)
        assert rec.up.opened == opened
        assert httpx.get(_url(pgw) + "/files", timeout=5).status_code == 200  # nothing else was lost
        return took, 0.1 + floor
    timely(attempt)


def test_client_gone_mid_download_closes_the_upstream_within_100_ms(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(headers={"content-type": "audio/mpeg"}, parts=[(0.02, b"a" * 1000)] * 200)

    def attempt() -> tuple[float, float]:
        floor = round_trip(pgw.port)
        seen = len(rec.up.closed_at)
        with httpx.stream("POST", _url(pgw) + "/audio/speech", json={"input": "x"}, timeout=5) as resp:
            reads = resp.iter_raw()  # held: a dropped generator closes the connection at once
            assert next(reads)
            gone = time.monotonic()  # before the close: the gateway may see it before this thread runs again
            resp.close()
        return _closed_within(rec, gone, seen), 0.1 + floor  # the upstream's answer takes 4 s
    timely(attempt)


def test_passthrough_metrics_by_endpoint_and_outcome(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(status=404, headers={"content-type": "application/json"},
                    parts=[(0, b'{"error":{"message":"no","type":"invalid_request_error"}}')])
    httpx.get(_url(pgw) + "/fine_tuning/jobs/ftjob-1", timeout=5)
    text = httpx.get(f"http://127.0.0.1:{pgw.port}/metrics", timeout=5).text
    assert sample(text, "tiergate_passthrough_requests_total", endpoint="fine_tuning", upstream="primary",
                  outcome="upstream_error") >= 1
    assert sample(text, "tiergate_passthrough_request_duration_seconds_count", endpoint="fine_tuning") >= 1


def test_the_sdk_retry_headers_and_query_strings(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, b'{"object":"list","data":[],'
                                                                             b'"has_more":false}')])
    before = len(rec.up.requests)
    sdk = openai.OpenAI(base_url=_url(pgw), api_key="client-key", max_retries=0)
    sdk.files.list(purpose="batch", limit=2, order="asc")
    got = rec.up.requests[before]
    assert got.method == "GET" and got.path.startswith("/v1/files?") and "purpose=batch" in got.path
    assert "limit=2" in got.path and got.body == b""



# the clients RAG applications run, pointed at the gateway


def test_langchain_openai_embeddings(stack: Stack) -> None:
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="text-embedding-3-small", base_url=stack.base_url, api_key="client-key",
                           dimensions=8, check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(["first doc", "second doc"])
    assert docs[1] == pytest.approx(vector("second doc", 8), abs=1e-6)
    assert emb.embed_query("a query") == pytest.approx(vector("a query", 8), abs=1e-6)


def test_llamaindex_openai_embedding(stack: Stack) -> None:
    from llama_index.embeddings.openai import OpenAIEmbedding

    emb = OpenAIEmbedding(model="text-embedding-3-small", api_base=stack.base_url, api_key="client-key",
                          dimensions=8, max_retries=0)
    assert emb.get_text_embedding("a node") == pytest.approx(vector("a node", 8), abs=1e-6)
    assert emb.get_text_embedding_batch(["x", "y"])[0] == pytest.approx(vector("x", 8), abs=1e-6)


# routing, pure, and the surface with passthrough off (in-process)


def _cfg(**over: Any) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "upstreams": [
            {"name": "cb", "tier": "fast", "base_url": "http://cb.invalid/v1", "dialect": "cerebras",
             "models": {"m": "m-cb", "fast-only": "f"}},
            {"name": "oa", "tier": "standard", "base_url": "http://oa.invalid/v1", "models": {"m": "m-oa"}},
            {"name": "emb", "tier": "standard", "base_url": "http://emb.invalid/v1", "endpoints": ["embeddings"],
             "models": {"m": "m-emb"}},
        ], **over})


def test_policy_routes_a_configured_model_among_the_upstreams_that_serve_the_endpoint() -> None:
    policy = Policy(_cfg())
    fast = RequestFacts({"model": "m", "input": "x"}, {"x-tiergate-tier": "fast"})
    d = policy.decide_passthrough("embeddings", fast, explain=True)
    assert [c.upstream.name for c in d.candidates] == ["oa", "emb"] and d.fallback == "endpoint"
    assert ("cb", "endpoint") in d.skipped and d.rule == "header"
    d = policy.decide_passthrough("audio/speech", RequestFacts({"model": "m"}, {}))
    assert [c.upstream.name for c in d.candidates] == ["oa"]  # emb serves embeddings only
    with pytest.raises(ModelNotFound):
        policy.decide_passthrough("embeddings", RequestFacts({"model": "fast-only"}, {}))
    d = policy.decide_passthrough("files/file-1", None)
    assert d.rule == "passthrough" and [c.upstream.name for c in d.candidates] == ["oa"]  # the default
    d = policy.decide_passthrough("embeddings", RequestFacts({"model": "text-embedding-3-small"}, {}))
    assert d.candidates[0].upstream_model == "text-embedding-3-small"  # unlisted: sent unchanged
    assert policy.decide_passthrough("responses/resp_1", None, owner="cb").candidates[0].upstream.name == "cb"


def test_passthrough_upstream_defaults_and_validation() -> None:
    assert _cfg().passthrough_upstream is not None and _cfg().passthrough_upstream.name == "oa"  # type: ignore[union-attr]
    assert _cfg(passthrough={"upstream": "emb"}).passthrough_upstream.name == "emb"  # type: ignore[union-attr]
    assert _cfg(passthrough={"enabled": False}).passthrough_upstream is None
    with pytest.raises(ValueError, match="passthrough.upstream"):
        _cfg(passthrough={"upstream": "nope"})
    with pytest.raises(ValueError, match="path under /v1"):
        _cfg(upstreams=[{"name": "x", "tier": "standard", "base_url": "http://x.invalid", "endpoints": ["/v1/x"],
                         "models": {"m": "m"}}])
    with pytest.raises(UnknownURL):
        Policy(_cfg(passthrough={"enabled": False})).decide_passthrough("files", None)


async def _call(app: Any, method: str, path: str) -> tuple[int, dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "method": method,
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 9)}
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], orjson.loads(b"".join(m.get("body", b"") for m in sent[1:]))


async def test_with_passthrough_off_the_rest_of_v1_is_404_and_chat_keeps_its_405() -> None:
    app = create_app(LoadedConfig(Path("x.yaml"), _cfg(passthrough={"enabled": False}), {}),
                     transport=ScriptedTransport(lambda got: Plan()))
    assert app.gateway.passthrough is None
    status, body = await _call(app, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body = await _call(app, "POST", "/v1/embeddings")
    assert status == 404 and body["error"]["code"] == "unknown_url"


def test_the_usage_of_a_tail() -> None:
    assert tail_usage(b'"data":[]],"usage":{"prompt_tokens":3,"total_tokens":3}}') == {"prompt_tokens": 3,
                                                                                         "total_tokens": 3}
    assert tail_usage(b'data: {"usage":null}\n\ndata: [DONE]\n\n') is None
    assert tail_usage(b'"usage":{"prompt_tok') is None  # cut: nothing rather than a guess
    assert match("POST", "audio/speech").endpoint == "audio/speech"
    assert match("GET", "files/f/content").endpoint == "files"
    assert match("POST", "nope").endpoint == "other"


def test_paths_are_sent_as_encoded_and_dot_segments_never(rec: Recorder, pgw: Proc) -> None:
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, b"{}")], chunked=False)
    before = len(rec.up.requests)
    sock = socket.create_connection(("127.0.0.1", pgw.port))
    try:
        for raw in (b"/v1/files/a%2Fb?q=%2x&y=%", b"/v1/files/x%3Fevil=1", b"/v1/files/../../metrics",
                    b"/v1/files/%2e%2e/%2E%2E/admin", b"/v1/files/..%2F..%2Fadmin", b"/v1/files/..;/x",
                    b"/v1/files/..%5cx", b"/v1%2Ffiles/x"):
            sock.sendall(b"GET " + raw + b" HTTP/1.1\r\nhost: x\r\n\r\n")
            head = sock.recv(65536)
            while b"\r\n\r\n" not in head:
                head += sock.recv(65536)
            bad = b".." in raw or b"%2e" in raw or b"%2F" in raw[:8]
            assert head.startswith(b"HTTP/1.1 404" if bad else b"HTTP/1.1 200"), (raw, head)
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += sock.recv(65536)
    finally:
        sock.close()
    # as the client encoded them: one segment, no query made of the path, the query's bytes untouched
    assert [r.path for r in rec.up.requests[before:]] == ["/v1/files/a%2Fb?q=%2x&y=%", "/v1/files/x%3Fevil=1"]


@pytest.mark.parametrize("ctype", [b"content-type: application/octet-stream\r\n",
                                   b"content-type: application/jsonl\r\n", b""])
def test_an_upload_that_keeps_coming_is_not_cut_by_the_body_timeout(rec: Recorder, pgw: Proc, ctype: bytes) -> None:
    rec.plan = Plan(headers={"content-type": "application/json"}, parts=[(0, b'{"id":"file-slow"}')], chunked=False)
    part = b"s" * 50_000
    with socket.create_connection(("127.0.0.1", pgw.port), timeout=10) as sock:  # GATEWAY_BODY_TIMEOUT=1 here
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nhost: x\r\n%scontent-length: %d\r\n\r\n" % (ctype, len(part) * 8))
        for _ in range(8):  # 2 s in all, never silent for 1 s
            sock.sendall(part)
            time.sleep(0.25)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"id":"file-slow"}'), answer[:200]
    assert len(rec.up.requests[-1].body) == len(part) * 8


class RawUp:
    """A misbehaving upstream on a loopback socket, in a thread: ``stall`` reads a request's head and then nothing;
    ``early`` answers 200 at once and streams an answer for 5 s while it reads the body. ``closed_at``:
    ``time.monotonic()`` of each connection's end."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.closed_at: list[float] = []
        self.ended: list[str] = []  # how each connection ended: "eof", or the error (a reset: the peer aborted)
        self.protos: list[_RawProto] = []
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(self.loop.create_server(lambda: _RawProto(self), "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()

    def resume(self) -> None:
        """Read again on every connection (a stalled one then sees how its peer ended it)."""
        for proto in self.protos:
            if proto.transport is not None:
                self.loop.call_soon_threadsafe(proto.transport.resume_reading)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class _RawProto(asyncio.Protocol):
    def __init__(self, up: RawUp) -> None:
        self.up = up
        self.head = b""
        self.transport: Any = None
        self.timer: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.up.protos.append(self)

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in self.head:
            return  # the body: read (early) or never asked for (stall pauses reading)
        self.head += data
        if b"\r\n\r\n" not in self.head:
            return
        if self.up.mode == "stall":
            self.transport.pause_reading()
        else:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: audio/mpeg\r\ntransfer-encoding: chunked\r\n\r\n")
            self._tick(100)

    def _tick(self, left: int) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(b"400\r\n" + b"a" * 1024 + b"\r\n" if left else b"0\r\n\r\n")
        if left:
            self.timer = asyncio.get_running_loop().call_later(0.05, self._tick, left - 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.up.closed_at.append(time.monotonic())
        self.up.ended.append("eof" if exc is None else type(exc).__name__)
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None


def _raw_gateway(up: RawUp, tmp: Path) -> Proc:
    cfg = {"upstreams": [{"name": up.mode, "tier": "standard", "base_url": f"http://127.0.0.1:{up.port}/v1",
                          "models": {"m": "m"}, "timeouts": {"connect": 1, "idle": 1, "total": 5}}],
           "passthrough": {"models_ttl": 60}}
    return start_gateway(cfg, tmp, env={"GATEWAY_BODY_TIMEOUT": "1"})[0]  # no longer than the upstream's idle


@pytest.fixture(scope="module")
def raw_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, RawUp, Proc, RawUp]]:
    stall, early = RawUp("stall"), RawUp("early")
    tmp = tmp_path_factory.mktemp("raw")
    gw_stall, gw_early = _raw_gateway(stall, tmp), _raw_gateway(early, tmp)
    yield gw_stall, stall, gw_early, early
    for x in (gw_stall, gw_early, stall, early):
        x.stop()


def test_an_upstream_that_stops_reading_an_upload_is_a_504(raw_gw: tuple[Proc, RawUp, Proc, RawUp]) -> None:
    proc, stall, _, _ = raw_gw
    seen = len(stall.closed_at)
    t0 = time.monotonic()
    resp = httpx.post(f"http://127.0.0.1:{proc.port}/v1/files", content=b"z" * (16 << 20), timeout=15,
                      headers={"content-type": "application/octet-stream"})
    took = time.monotonic() - t0
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
    assert 0.9 < took < 5, took  # its idle timeout (1 s) of no progress, not forever
    stall.resume()  # it reads again, and finds the connection aborted: a close would wait for the unsent body
    deadline = time.monotonic() + 2
    while len(stall.closed_at) == seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stall.ended[seen:] == ["ConnectionResetError"]


def test_a_client_gone_mid_upload_after_an_early_answer_closes_the_upstream(
        raw_gw: tuple[Proc, RawUp, Proc, RawUp]) -> None:
    _, _, proc, early = raw_gw

    def attempt() -> tuple[float, float]:
        floor = round_trip(proc.port)
        seen = len(early.closed_at)
        sock = socket.create_connection(("127.0.0.1", proc.port), timeout=5)
        sock.sendall(b'POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/form-data; '
                     b'boundary=b\r\ncontent-length: 5000000\r\n\r\n' + b"q" * 100_000)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the upstream answered before the body's end
        time.sleep(0.2)
        gone = time.monotonic()  # before the close: the gateway may see it before this thread runs again
        sock.close()
        deadline = gone + 2
        while len(early.closed_at) == seen and time.monotonic() < deadline:
            time.sleep(0.002)
        assert early.closed_at[seen:], "the upstream connection stayed open"
        # within 100 ms over the floor, not at the body timeout (1 s) nor after its 5 s answer
        return early.closed_at[seen] - gone, 0.1 + floor
    timely(attempt)
    text = httpx.get(f"http://127.0.0.1:{proc.port}/metrics", timeout=5).text
    assert sample(text, "tiergate_passthrough_requests_total", upstream="early", outcome="client_disconnect") >= 1


def test_a_large_json_body_to_an_upstream_that_stops_reading_is_a_504(raw_gw: tuple[Proc, RawUp, Proc, RawUp]) -> None:
    proc, stall, _, _ = raw_gw
    base = f"http://127.0.0.1:{proc.port}"
    fds = sample(httpx.get(base + "/metrics", timeout=5).text, "process_open_fds")
    seen = len(stall.closed_at)
    text = "x" * (12 << 20)  # more than the socket buffers hold
    for path, body in (("/v1/embeddings", {"model": "m", "input": text}),
                       ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}]}),
                       ("/v1/chat/completions", {"model": "m", "stream": True,
                                                 "messages": [{"role": "user", "content": text}]})):
        t0 = time.monotonic()
        resp = httpx.post(base + path, json=body, timeout=15)
        assert resp.status_code == 504 and time.monotonic() - t0 < 5, (path, resp.status_code, resp.text[:200])
    stall.resume()
    deadline = time.monotonic() + 3
    while len(stall.closed_at) < seen + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stall.ended[seen:] == ["ConnectionResetError"] * 3  # reset, never left holding the unsent body
    assert sample(httpx.get(base + "/metrics", timeout=5).text, "process_open_fds") <= fds


def test_a_limit_field_of_a_passthrough_body_is_checked_as_openai_checks_it() -> None:
    from gateway.admission.body import passthrough_facts
    from gateway.errors import InvalidRequest

    for body, param in ((b'{"model": "m", "prompt": "x", "max_tokens": -5}', "max_tokens"),
                        (b'{"model": "m", "prompt": "x", "max_tokens": 2.5}', "max_tokens")):
        with pytest.raises(InvalidRequest) as info:
            passthrough_facts(body, {"content-type": "application/json"})
        assert info.value.param == param and info.value.status == 400
    assert passthrough_facts(b'{"model": "m", "prompt": "x", "max_tokens": 16}', {}) is not None
