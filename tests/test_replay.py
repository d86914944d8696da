"""Every recorded upstream transcript (``tests/fixtures/upstream``) replayed through the gateway.

Two emulators, both speaking the OpenAI dialect, replay a transcript when the request carries
``[[emulate transcript=NAME]]``; the gateway in front of them relays it. The client reads raw bytes off the
real socket. A relayed stream must equal the recorded ``.body`` byte for byte, except where the wire
contract requires an edit; every such edit is listed in :data:`STREAM_EDITS` and asserted on its own:

* ``append_done``: a chat recording ends without ``data: [DONE]`` and carries no error, so the gateway appends one
  (a Responses API recording ends at its terminal event, on ``/v1/responses``: nothing is appended);
* ``strip_usage`` (only when the client did not ask for usage): the gateway asked upstream for usage and
  drops the ``"choices": []`` usage chunk.

The same transcripts also go through the ``openai`` SDK: it must yield every chunk, or raise ``APIError``
with the upstream's message for the two streams that carry an error. Non-streaming transcripts must reach
the client byte-identical; error transcripts keep their status and arrive in OpenAI's 4-key envelope, but OpenAI's
401 to the gateway's own key, which is the gateway's 502 ``upstream_auth_failed``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import FIXTURES, Stack, default_config, emulator, sample, start_gateway

DONE = b"data: [DONE]\n\n"
TIMEOUT = httpx.Timeout(10.0, connect=5.0)


def _meta(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _body(name: str) -> bytes:
    return (FIXTURES / f"{name}.body").read_bytes()


ALL = sorted(p.stem for p in FIXTURES.glob("*.json"))
STREAMING = [n for n in ALL if _meta(n)["streaming"]]
CHAT_STREAMING = [n for n in STREAMING if _meta(n)["request"]["path"].split("?")[0].endswith("/chat/completions")]
RESPONSES_STREAMING = [n for n in STREAMING if n not in CHAT_STREAMING]

# What the gateway must change in each recorded stream when the client replays the recorded request
# (stream_options included). Chosen by reading the recordings, not computed by the relay's own rules;
# test_stream_edit_table_matches_the_recordings checks the table against the bytes.
STREAM_EDITS: dict[str, set[str]] = {
    "azure_openai_chat_stream_prompt_filter": set(),  # its "choices":[] pre-chunk has no usage: kept
    "cerebras_chat_stream_text": set(),
    "cerebras_chat_stream_tool_call": set(),
    "groq_chat_stream_text": set(),
    "groq_stream_error_event_tool_use_failed": set(),  # no [DONE], but it ends with an error: none appended
    "llamacpp_chat_stream_reasoning": set(),
    "ollama_openai_compat_chat_stream": set(),
    "openai_chat_stream_include_usage_length": set(),
    "openai_chat_stream_n2_include_usage": set(),
    "openai_chat_stream_parallel_tool_calls": set(),
    "openai_chat_stream_refusal": set(),
    "openai_chat_stream_text": set(),
    "openai_chat_stream_tool_call": set(),
    "openai_responses_stream_text": set(),  # Responses API: ends at response.completed, no [DONE]
    "openai_responses_stream_tool_call": set(),
    "openrouter_stream_comments_and_error_chunk": set(),  # error chunk, then the upstream's own [DONE]: kept
    "vllm_chat_stream": set(),
}
# Streams that carry an upstream error in band, and the message the SDK must raise.
STREAM_ERRORS = {
    "groq_stream_error_event_tool_use_failed": "Tool call validation failed: tool call validation failed: parameters "
    "for tool get_something_by_name did not match schema: errors: [missing properties: 'name', "
    "additionalProperties 'invalid_param' not allowed]",
    "openrouter_stream_comments_and_error_chunk": "Token limit reached",
}
NONSTREAM_CHAT = ["cerebras_chat_nonstream", "groq_chat_nonstream", "openai_chat_nonstream_basic",
                  "openai_chat_nonstream_refusal"]
ERRORS: dict[str, tuple[int, type[openai.APIStatusError]]] = {
    "openai_error_400_invalid_image_url": (400, openai.BadRequestError),
    "openai_error_404_model_not_found_stream_request": (404, openai.NotFoundError),
    "ollama_openai_compat_error_404": (404, openai.NotFoundError),
    "openrouter_error_429_upstream_rate_limited": (429, openai.RateLimitError),
}


@pytest.fixture(scope="module")
def openai_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Both tiers OpenAI dialect, no fallback: each request reaches exactly one emulator, once."""
    tmp: Path = tmp_path_factory.mktemp("replay")
    procs = []
    try:
        fast = emulator("fast", tmp, dialect="openai")
        procs.append(fast)
        standard = emulator("standard", tmp, dialect="openai")
        procs.append(standard)
        cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1",
                             fallback=False)
        cfg["upstreams"][0]["dialect"] = "openai"
        gw, path = start_gateway(cfg, tmp)
        procs.append(gw)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    s = Stack(gw, {"fast": fast, "standard": standard}, path, [gw, fast, standard])
    yield s
    s.stop()


# helpers


def replay_request(name: str, *, client_usage: bool | None = None) -> dict[str, Any]:
    """The recorded request body, model ``gpt-5.6``, with the replay directive in the last message's text.

    client_usage: None keeps the recorded ``stream_options``; False removes ``include_usage`` from them.
    """
    req = copy.deepcopy(_meta(name)["request"]["json"])
    req["model"] = "gpt-5.6"
    directive = f" [[emulate transcript={name} tps=5000 ttft_ms=1]]"
    messages = req.get("messages")
    if "input" in req:  # a Responses API request
        req["input"] = [{"role": "user", "content": directive.strip()}]
    else:
        content = messages[-1].get("content")
        texts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"] if isinstance(
            content, list) else []
        if isinstance(content, str):
            messages[-1]["content"] = content + directive
        elif texts:
            texts[-1]["text"] += directive
        else:
            messages.append({"role": "user", "content": directive.strip()})
    if client_usage is False:
        options = {k: v for k, v in (req.get("stream_options") or {}).items() if k != "include_usage"}
        req.pop("stream_options", None)
        if options:
            req["stream_options"] = options
    return req


def events(body: bytes) -> list[bytes]:
    """The LF-framed events of a recorded body, each with its blank line (every fixture is LF-only)."""
    out = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    assert b"".join(out) == body, "the recording is not a sequence of LF-framed events"
    return out


def data_of(event: bytes) -> bytes | None:
    lines = [line[5:].removeprefix(b" ") for line in event.rstrip(b"\n").split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def is_usage_chunk(event: bytes) -> bool:
    data = data_of(event)
    if data is None or data.startswith(b"[DONE]"):
        return False
    chunk = json.loads(data)
    return chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)


def has_error(event: bytes) -> bool:
    data = data_of(event)
    if event.startswith(b"event: error\n") or b"\nevent: error\n" in event:
        return True
    return data is not None and not data.startswith(b"[DONE]") and "error" in json.loads(data)


def stream_raw(stack: Stack, body: dict[str, Any]) -> tuple[httpx.Response, bytes, list[bytes]]:
    """POST ``body`` (to ``/v1/responses`` when it has ``input``, else ``/v1/chat/completions``) and read the raw
    response bytes (no decoding) as they come off the socket."""
    path = "/responses" if "input" in body else "/chat/completions"
    with httpx.Client(timeout=TIMEOUT) as client, client.stream("POST", stack.base_url + path, json=body) as resp:
        reads = list(resp.iter_raw())
    return resp, b"".join(reads), reads


# the table of edits


def test_stream_edit_table_matches_the_recordings() -> None:
    assert set(STREAM_EDITS) == set(STREAMING), "classify every streaming fixture in STREAM_EDITS"
    assert len(STREAMING) == 17 and len(RESPONSES_STREAMING) == 2
    for name in STREAMING:
        evs = events(_body(name))
        done = any(e == DONE for e in evs)
        errored = any(has_error(e) for e in evs)
        chat = name in CHAT_STREAMING
        assert ("append_done" in STREAM_EDITS[name]) == (chat and not done and not errored), name
        assert (name in STREAM_ERRORS) == errored, name


# streams, byte for byte


@pytest.mark.parametrize("name", STREAMING)
def test_stream_relayed_byte_for_byte(openai_stack: Stack, name: str) -> None:
    meta = _meta(name)
    fixture = _body(name)
    resp, got, reads = stream_raw(openai_stack, replay_request(name))
    assert resp.status_code == 200
    assert resp.headers["x-tiergate-tier"] == "standard"
    recorded_ctype = next(v for k, v in meta["response"]["headers"].items() if k.lower() == "content-type")
    assert resp.headers["content-type"] == recorded_ctype
    assert "content-length" not in resp.headers
    assert resp.headers["transfer-encoding"] == "chunked"
    assert reads and all(reads)
    if "append_done" in STREAM_EDITS[name]:
        # (a) no [DONE] and no error in the recording: exactly one [DONE] appended, nothing else changed
        assert DONE not in fixture
        assert got == fixture + DONE
    else:
        assert got == fixture
    if name in STREAM_ERRORS:
        # an errored stream never gets a [DONE] of the gateway's own
        assert got.count(DONE) == fixture.count(DONE)


USAGE_FIXTURES = [n for n in CHAT_STREAMING if any(is_usage_chunk(e) for e in events(_body(n)))]


def test_usage_fixtures_are_the_four_openai_include_usage_streams() -> None:
    assert USAGE_FIXTURES == ["openai_chat_stream_include_usage_length", "openai_chat_stream_n2_include_usage",
                              "openai_chat_stream_refusal", "openai_chat_stream_tool_call"]
    for name in USAGE_FIXTURES:
        assert _meta(name)["request"]["json"]["stream_options"]["include_usage"] is True


@pytest.mark.parametrize("name", USAGE_FIXTURES)
def test_usage_chunk_stripped_when_client_did_not_ask(openai_stack: Stack, name: str) -> None:
    fixture = _body(name)
    body = replay_request(name, client_usage=False)
    assert "include_usage" not in (body.get("stream_options") or {})
    _, got, _ = stream_raw(openai_stack, body)
    evs = events(fixture)
    usage = [e for e in evs if is_usage_chunk(e)]
    assert len(usage) == 1
    # (b) exactly the usage-only chunk is gone; every other byte, [DONE] included, is relayed in order
    assert got == fixture.replace(usage[0], b"")
    assert usage[0] not in got and got.endswith(DONE)


def test_usage_chunk_kept_when_client_asked(openai_stack: Stack) -> None:
    name = "openai_chat_stream_tool_call"
    body = replay_request(name)
    assert body["stream_options"] == {"include_usage": True}
    _, got, _ = stream_raw(openai_stack, body)
    assert sum(is_usage_chunk(e) for e in events(got)) == 1


# streams through the SDK


def _sdk_create(client: openai.OpenAI, body: dict[str, Any]) -> Any:
    """``chat.completions.create`` with the body's own ``stream``; every other field rides in ``extra_body``."""
    rest = {k: v for k, v in body.items() if k not in ("model", "messages", "stream")}
    return client.chat.completions.create(model=body["model"], messages=body["messages"],
                                          stream=body.get("stream") is True, extra_body=rest)


@pytest.mark.parametrize("name", CHAT_STREAMING)
def test_stream_through_sdk(openai_stack: Stack, name: str) -> None:
    evs = events(_body(name))
    data = [d for e in evs if (d := data_of(e)) is not None]
    client = openai.OpenAI(base_url=openai_stack.base_url, api_key="unused", max_retries=0, timeout=10)
    stream = _sdk_create(client, replay_request(name))
    chunks: list[Any] = []
    if name not in STREAM_ERRORS:
        chunks.extend(stream)
        assert len(chunks) == len([d for d in data if not d.startswith(b"[DONE]")])
        assert [c.id for c in chunks] == [json.loads(d)["id"] for d in data if not d.startswith(b"[DONE]")]
        return
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            chunks.append(chunk)
    assert type(info.value) is openai.APIError  # in band: not an APIStatusError
    assert info.value.message == STREAM_ERRORS[name]
    before_error = next(i for i, e in enumerate([e for e in evs if data_of(e) is not None]) if has_error(e))
    assert len(chunks) == before_error


# non-streaming and errors


@pytest.mark.parametrize("name", NONSTREAM_CHAT)
def test_nonstream_body_byte_identical(openai_stack: Stack, name: str) -> None:
    body = replay_request(name)
    assert body.get("stream") is not True
    resp = httpx.post(openai_stack.base_url + "/chat/completions", json=body, timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    assert resp.content == _body(name)
    client = openai.OpenAI(base_url=openai_stack.base_url, api_key="unused", max_retries=0, timeout=10)
    completion = _sdk_create(client, body)
    assert completion.id == json.loads(_body(name))["id"]


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_keeps_status_in_openai_envelope_and_sdk_class(openai_stack: Stack, name: str) -> None:
    status, cls = ERRORS[name]
    assert _meta(name)["response"]["status"] == status
    body = replay_request(name)
    # A 429 makes its upstream rest (health cooldown), which would answer the next requests with 503: the
    # one 429 of this module goes to the fast-tier upstream, which no other test here uses.
    headers = {"x-tiergate-tier": "fast"} if status == 429 else {}
    client = openai.OpenAI(base_url=openai_stack.base_url, api_key="unused", max_retries=0, timeout=10,
                           default_headers=headers)
    with pytest.raises(openai.APIStatusError) as info:
        _sdk_create(client, body)
    exc = info.value
    assert type(exc) is cls
    assert exc.status_code == status
    assert exc.response.headers["content-type"] == "application/json"
    envelope = exc.response.json()
    assert list(envelope) == ["error"] and set(envelope["error"]) == {"message", "type", "param", "code"}
    upstream = json.loads(_body(name))
    if name == "openrouter_error_429_upstream_rate_limited":
        # no type, an integer code and extra keys: the envelope has the status's type and a string code
        assert upstream["error"]["code"] == 429 and "type" not in upstream["error"]
        assert envelope == {"error": {"message": "Provider returned error", "type": "rate_limit_error",
                                      "param": None, "code": "429"}}
    else:
        # already OpenAI's envelope upstream (pretty-printed or compact): the same four values
        assert envelope == upstream
    assert isinstance(exc.body, dict) and exc.body["message"] == upstream["error"]["message"]


def test_openais_401_to_the_gateways_key_is_a_502_without_its_words(openai_stack: Stack) -> None:
    """OpenAI's recorded 401 (``invalid_api_key``, quoting part of the key) refused the gateway's key, not the
    client's: the SDK gets the gateway's 502 ``upstream_auth_failed``, never ``AuthenticationError``, and nothing of the
    upstream's message."""
    name = "openai_error_401_invalid_api_key_stream_request"
    upstream = json.loads(_body(name))["error"]
    assert _meta(name)["response"]["status"] == 401 and "invalid-*****2345" in upstream["message"]
    client = openai.OpenAI(base_url=openai_stack.base_url, api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as info:
        _sdk_create(client, replay_request(name))
    exc = info.value
    assert type(exc) is openai.InternalServerError and exc.status_code == 502
    assert exc.response.json() == {"error": {
        "message": "The upstream 'emu-standard' refused the gateway's credential for it (HTTP 401): the gateway's "
                   "operator must fix that key. Neither the request nor its API key is at fault.",
        "type": "server_error", "param": None, "code": "upstream_auth_failed"}}
    assert "2345" not in exc.response.text and "Incorrect API key" not in exc.response.text


@pytest.mark.parametrize(("name", "output_tokens"), [
    ("cerebras_chat_stream_text", 35),                # usage on the finish_reason chunk
    ("openai_chat_stream_include_usage_length", 100),  # the choices: [] usage chunk
    ("vllm_chat_stream", None),                       # no usage at all: counted as missing, never invented
    ("ollama_openai_compat_chat_stream", None),
])
def test_usage_is_read_wherever_openais_shape_puts_it(stack: Stack, name: str, output_tokens: int | None) -> None:
    """OpenAI's ``usage`` member, on a usage chunk or a finish chunk, through an ``openai``-dialect upstream; the
    members other dialects add (``x_groq``, llama-server's ``timings``): tests/test_dialects.py."""
    body = {"model": "gpt-5.6", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"x [[emulate transcript={name} tps=5000 ttft_ms=1]]"}]}
    lab = {"tier": "standard", "model": "gpt-5.6"}
    before = stack.metrics()
    assert httpx.post(stack.base_url + "/chat/completions", json=body, timeout=10).status_code == 200
    after = stack.metrics()
    grew = sample(after, "tiergate_tokens_total", token_type="output", usage="reported", **lab) - sample(
        before, "tiergate_tokens_total", token_type="output", usage="reported", **lab)
    missing = sample(after, "tiergate_usage_missing_total", **lab) - sample(
        before, "tiergate_usage_missing_total", **lab)
    assert (grew, missing) == ((output_tokens, 0) if output_tokens else (0, 1))
