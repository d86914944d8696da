"""The dialect seam (``gateway.upstream.dialects``): one module per upstream kind, chosen by ``dialect:``, each
checked on the bytes it sends and on what it reads of its upstream's recorded or scripted answers; and end to end,
over loopback sockets, a gateway whose upstreams are a ``vllm`` and a ``groq`` dialect.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import typing
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import EmptyStream, InvalidRequest, UpstreamStatusError
from gateway.stream.relay import Relay
from gateway.stream.stats import StreamStats
from gateway.tenancy.keys import digest, new_key
from gateway.tools.emulator import PROFILES, EmulatorConfig, EmulatorThread, Plan
from gateway.upstream import dialects
from gateway.upstream.dialects.base import Dialect
from gateway.wire.body import parse_chat_request

from conftest import FIXTURES, SCRAPE, emulator, sample, scraped, start_gateway

DIALECT_DIR = Path(dialects.__file__).parent


def _fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.body").read_bytes()


def _relayed(data: bytes, dialect: str = "openai") -> tuple[bytes, StreamStats]:
    """``data`` (one upstream read) through the relay of an upstream of ``dialect``: what the client gets, and what
    was measured."""
    from test_relay_template import Reads

    out: list[bytes] = []

    async def write(part: bytes) -> None:
        out.append(part)

    relay = Relay(strip_usage_chunk=False, max_event_bytes=1 << 20, extra=dialects.DIALECTS[dialect])
    stats = asyncio.run(relay.run(Reads([data]), write))
    return b"".join(out), stats


def _body(dialect: str, raw: bytes, model: str = "up-model", ask_usage: bool = False) -> dict[str, Any]:
    out = dialects.DIALECTS[dialect].body(raw, parse_chat_request(raw), model, ask_usage)
    return typing.cast(dict[str, Any], orjson.loads(out))


def test_every_dialect_config_accepts_has_its_module_and_no_module_is_left_out() -> None:
    """Adding a dialect is its own module plus its name in config; a name without a module, or a module nobody can
    name, fails here."""
    accepted = set(typing.get_args(UpstreamConfig.model_fields["dialect"].annotation))
    modules = {p.stem for p in DIALECT_DIR.glob("*.py") if p.stem not in ("__init__", "base")}
    assert accepted == set(dialects.DIALECTS) == modules
    for name, dialect in dialects.DIALECTS.items():
        assert isinstance(dialect, Dialect) and dialect.name == name
        assert type(dialect).__module__ == f"gateway.upstream.dialects.{name}"
        assert type(dialect).__doc__ and (DIALECT_DIR / f"{name}.py").read_text().startswith('"""')


def test_every_dialect_has_an_emulator_profile_and_an_emulate_flag() -> None:
    """A new dialect adds its row to the emulator's profile table; ``tiergate emulate --dialect`` takes what config
    admits (read from the config's Literal, never listed again)."""
    from gateway.cli import _emulate_flags

    accepted = set(typing.get_args(UpstreamConfig.model_fields["dialect"].annotation))
    assert set(PROFILES) == accepted
    emulate = argparse.ArgumentParser()
    _emulate_flags(emulate)
    for name in accepted:
        assert emulate.parse_args(["--dialect", name]).dialect == name
    with pytest.raises(SystemExit):
        emulate.parse_args(["--dialect", "anthropic"])


GATEWAY = Path(dialects.__file__).parents[2]  # gateway/
# where a dialect's name may appear in code: its module, its name and surface in config, its emulator profile (and the
# emulated tiers' default dialects)
OWN_PLACES = {"upstream/dialects", "config/upstreams.py", "tools/emulator/profiles.py", "tools/emulator/config.py"}


def _named_in_code(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """String constants of ``path`` that are one of ``names``, docstrings aside."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and node.value in names and id(node) not in docs]


def test_no_module_outside_a_dialects_own_places_branches_on_its_name() -> None:
    """Adding a dialect touches its module, its fixtures, its emulator profile and its name in config: code elsewhere
    that names one (``if dialect == "cerebras"``) would be one more place to edit. The default, ``openai``, may be
    named (a passthrough prefers an upstream of it)."""
    names = set(typing.get_args(UpstreamConfig.model_fields["dialect"].annotation)) - {"openai"}
    modules = [p for p in sorted(GATEWAY.rglob("*.py"))
               if not any(str(p.relative_to(GATEWAY)).startswith(own) for own in OWN_PLACES)]
    assert len(modules) > 50 and GATEWAY / "cli.py" in modules  # the scan reads the runtime, not nothing
    found = [f"gateway/{path.relative_to(GATEWAY)}:{line}: {name!r}"
             for path in modules for line, name in _named_in_code(path, names)]
    assert not found, "dialect names outside the dialect's own places:\n  " + "\n  ".join(found)


# --- vllm: the client's extra fields are its own; usage is asked for ------------------------------------------------

def test_vllm_passes_its_own_sampling_fields_byte_for_byte_and_asks_a_stream_for_usage() -> None:
    raw = (b'{"model":"qwen","messages":[{"role":"user","content":"hi"}],"stream":true,'
           b'"chat_template_kwargs":{"enable_thinking":false},"min_tokens":8,"top_k":20,"repetition_penalty":1.05}')
    out = dialects.DIALECTS["vllm"].body(raw, parse_chat_request(raw), "Qwen/Qwen3-8B", True)
    doc = orjson.loads(out)
    assert doc["chat_template_kwargs"] == {"enable_thinking": False} and doc["min_tokens"] == 8 and doc["top_k"] == 20
    assert doc["stream_options"] == {"include_usage": True}  # vLLM sends usage only when asked
    # only the model value and the usage ask changed: the rest is the client's bytes
    assert out.replace(b'"stream_options":{"include_usage":true},', b"").replace(b'"Qwen/Qwen3-8B"', b'"qwen"') == raw


def test_vllm_context_overflow_answered_500_is_the_clients_400() -> None:
    """llama.cpp and older vLLM answer a prompt over the context window with 500; it is the request's fault."""
    err = dialects.DIALECTS["vllm"].status_error(
        500, b'{"error":{"code":500,"message":"the request exceeds the available context size, try increasing it",'
             b'"type":"server_error"}}', {})
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    err = dialects.DIALECTS["vllm"].status_error(
        400, b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens. However, you '
             b'requested 5000 tokens.","type":"BadRequestError","param":null,"code":400}', {})
    assert (err.status, err.code) == (400, "context_length_exceeded")


def test_vllm_recorded_stream_has_no_usage_unless_asked_and_relays_whole() -> None:
    """The recorded vLLM stream (no include_usage asked) carries no usage: the relay counts its token chunks."""
    data = _fixture("vllm_chat_stream")
    out, stats = _relayed(data, "vllm")
    assert out == data
    assert stats.usage is None and stats.token_chunks > 0 and stats.done


# --- groq: its service tiers, x_groq usage, error events ---------------------------------------------------------

@pytest.mark.parametrize(("tier", "kept"), [("priority", False), ("fast", False), ("default", False),
                                            ("flex", True), ("on_demand", True), ("auto", True)])
def test_groq_keeps_its_own_service_tiers_and_drops_openais(tier: str, kept: bool) -> None:
    raw = orjson.dumps({"model": "llama", "service_tier": tier, "messages": [{"role": "user", "content": "hi"}],
                        "temperature": 0.2})
    doc = _body("groq", raw)
    assert ("service_tier" in doc) is kept
    assert doc["temperature"] == 0.2 and doc["model"] == "up-model"


@pytest.mark.parametrize("label", ["groq", "openai"])
def test_groq_recorded_usage_in_x_groq_is_read(label: str) -> None:
    """Labelled ``groq``, or ``openai`` as an OpenAI-compatible API often is: its finish chunk's ``x_groq.usage``."""
    data = _fixture("groq_chat_stream_text")
    out, stats = _relayed(data, label)
    assert out == data
    usage = stats.usage
    assert usage is not None and usage["prompt_tokens"] == 18 and usage["completion_tokens"] == 73


def test_groq_recorded_error_event_names_its_status() -> None:
    """Groq's tool_use_failed error event says status_code 400: the request's fault, with Groq's words."""
    data = _fixture("groq_stream_error_event_tool_use_failed")
    last = [line for line in data.split(b"\n") if line.startswith(b"data: ")][-1]
    err = dialects.DIALECTS["groq"].event_error(orjson.loads(last[len(b"data: "):]))
    assert (err.status, err.code, err.error_type) == (400, "tool_use_failed", "invalid_request_error")
    assert err.message.startswith("Tool call validation failed")


def test_groq_429_waits_as_its_reset_headers_say() -> None:
    """A Groq 429 without retry-after: the exhausted window's reset (Go duration) becomes retry-after."""
    headers = {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "7.66s",
               "x-ratelimit-remaining-requests": "14", "x-ratelimit-reset-requests": "2m59.56s"}
    err = dialects.DIALECTS["groq"].status_error(
        429, b'{"error":{"message":"Rate limit reached","type":"tokens","code":"rate_limit_exceeded"}}', headers)
    assert err.status == 429 and err.headers["retry-after"] == "8"


# --- cerebras and openai: the rules that were there before the seam ------------------------------------------------

def test_cerebras_drops_what_it_rejects_and_is_asked_for_usage() -> None:
    raw = orjson.dumps({"model": "a", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                        "store": True, "metadata": {"k": "v"}, "service_tier": "priority",
                        "stream_options": {"include_obfuscation": False}})
    doc = _body("cerebras", raw, ask_usage=True)
    assert not {"store", "metadata", "service_tier"} & set(doc) and doc["stream_options"] == {"include_usage": True}
    assert _body("cerebras", raw)["stream_options"] == {}  # the client's (emptied) options, nothing asked
    whole = orjson.dumps({"model": "a", "messages": [{"role": "user", "content": "hi"}]})
    assert "stream_options" not in _body("cerebras", whole, ask_usage=True)


def test_openai_forwards_the_clients_bytes_but_the_model() -> None:
    raw = b'{"model":"alias","messages":[{"role":"user","content":"hi"}],"service_tier":"priority","x_own":[1]}'
    out = dialects.DIALECTS["openai"].body(raw, parse_chat_request(raw), "gpt-5.6", False)
    assert out == raw.replace(b'"alias"', b'"gpt-5.6"')


# --- end to end: upstreams of the new dialects behind a real gateway ------------------------------------------------

def _replaying(transcript: str) -> EmulatorThread:
    """A scripted upstream on a loopback socket answering every request with one recorded transcript; it keeps what
    it was sent (``requests``)."""
    return EmulatorThread(lambda _: Plan(headers={"content-type": "text/event-stream"},
                                         parts=[(0, _fixture(transcript))], chunked=False))


def test_a_groq_fast_tier_and_a_vllm_standard_tier_serve_through_the_gateway(tmp_path: Path) -> None:
    """Over loopback: a Groq-dialect upstream gets no OpenAI service tier and its x_groq usage is counted; a
    vLLM-dialect upstream is asked for usage and keeps the client's own fields, but a fast service tier (the request
    was sent to the standard tier: it is not asked for a faster one); both streams reach the client whole (the
    upstreams replay the recorded groq and vLLM transcripts)."""
    groq, vllm = _replaying("groq_chat_stream_text"), _replaying("vllm_chat_stream")
    cfg = {"upstreams": [
        {"name": "groq-fast", "tier": "fast", "dialect": "groq", "models": {"llama": "llama3-8b-8192"},
         "base_url": f"http://127.0.0.1:{groq.port}/openai/v1"},
        {"name": "vllm-standard", "tier": "standard", "dialect": "vllm", "models": {"llama": "facebook/opt-125m"},
         "base_url": vllm.base_url}],
        "default_tier": "standard"}
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
        for tier, transcript in (("fast", "groq_chat_stream_text"), ("standard", "vllm_chat_stream")):
            body = {"model": "llama", "stream": True, "service_tier": "priority", "min_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(url, json=body, headers={"x-tiergate-tier": tier}, timeout=10)
            assert r.status_code == 200 and r.headers["x-tiergate-tier"] == tier, r.text
            assert r.content == _fixture(transcript)  # byte for byte: both end with [DONE]
        groq_sent, vllm_sent = orjson.loads(groq.requests[0].body), orjson.loads(vllm.requests[0].body)
        assert "service_tier" not in groq_sent and groq_sent["model"] == "llama3-8b-8192"
        assert "service_tier" not in vllm_sent and vllm_sent["min_tokens"] == 4
        assert vllm_sent["stream_options"] == {"include_usage": True}
        metrics = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
        assert sample(metrics, "tiergate_tokens_total", tier="fast", token_type="output", usage="reported",
                      missing_ok=False) == 73
        assert sample(metrics, "tiergate_requests_total", upstream="vllm-standard", outcome="success") == 1
    finally:
        gw.stop()
        groq.stop()
        vllm.stop()


@pytest.mark.parametrize(("transcript", "dialect", "output_tokens"), [
    ("groq_chat_stream_text", "groq", 73),              # x_groq.usage on the last chunk
    ("llamacpp_chat_stream_reasoning", "vllm", 82),     # llama-server's timings.predicted_n
])
def test_usage_in_the_member_a_dialect_adds_is_counted_whatever_the_upstreams_label(
        transcript: str, dialect: str, output_tokens: int, tmp_path: Path) -> None:
    """Over loopback: the recorded stream's usage, which only its dialect's member holds, is counted as reported
    both when the upstream is labelled with that dialect and when it is labelled ``openai`` (a Groq upstream declared
    OpenAI-compatible, a llama.cpp server left at the default): every dialect's member is read for usage on the
    finishing chunk (docs/architecture.md#general-readers), so neither stream is counted as one without usage."""
    upstreams = {label: _replaying(transcript) for label in (dialect, "openai")}
    cfg = {"upstreams": [
        {"name": label, "tier": tier, "dialect": label, "models": {"m": "m"}, "base_url": up.base_url}
        for (label, up), tier in zip(upstreams.items(), ("fast", "standard"), strict=True)], "default_tier": "fast"}
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
        for tier in ("fast", "standard"):
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(url, json=body, headers={"x-tiergate-tier": tier}, timeout=10)
            assert r.status_code == 200 and r.content == _fixture(transcript), r.text
        metrics = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
        for tier in ("fast", "standard"):  # labelled with its own dialect, then labelled openai
            assert sample(metrics, "tiergate_tokens_total", tier=tier, token_type="output", usage="reported",
                          missing_ok=False) == output_tokens, tier
            assert sample(metrics, "tiergate_tokens_total", tier=tier, usage="estimated") == 0, tier
            assert sample(metrics, "tiergate_usage_missing_total", tier=tier) == 0, tier
    finally:
        gw.stop()
        for up in upstreams.values():
            up.stop()


@pytest.mark.parametrize("dialect", ["groq", "vllm"])
def test_the_emulators_profile_of_a_dialect_streams_as_its_upstreams_do(dialect: str, tmp_path: Path) -> None:
    """``tiergate emulate --dialect groq`` puts its usage in x_groq on the finish chunk; ``vllm`` only when asked.
    Both end with [DONE] and, like the real servers, serve no Responses API of their own."""
    emu = emulator("fast", tmp_path, dialect=dialect)
    try:
        url = f"http://127.0.0.1:{emu.port}/v1"
        body = {"model": "m", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        events = [e for e in httpx.post(url + "/chat/completions", json=body, timeout=10).text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [orjson.loads(e[len("data: "):]) for e in events[:-1]]
        assert not any("usage" in c and c["usage"] for c in chunks)  # not asked
        finish = chunks[-1]
        assert finish["choices"][0]["finish_reason"] == "length"
        if dialect == "groq":
            assert finish["x_groq"]["usage"]["completion_tokens"] == 5
        else:
            assert "x_groq" not in finish
        assert httpx.post(url + "/responses", json={"model": "m", "input": "hi"}, timeout=10).status_code == 404
    finally:
        emu.stop()


# --- found by attack -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", [["default"], {"x": 1}, 1, True, "Default", "ultra"])
def test_groq_forwards_a_service_tier_it_does_not_know_as_sent(tier: Any) -> None:
    """A list or an object once raised inside the dialect (500 and a traceback). The request parser now refuses what
    is no service tier word (400, ``gateway.wire.body.check_service_tier``); the dialect still never raises on one,
    and forwards a word it does not know (Groq judges what is not OpenAI's)."""
    raw = orjson.dumps({"model": "llama", "service_tier": tier, "messages": [{"role": "user", "content": "hi"}]})
    assert dialects.DIALECTS["groq"].body(raw, orjson.loads(raw), "llama", False) == raw  # as the client sent it
    if tier == "ultra":
        assert parse_chat_request(raw)["service_tier"] == "ultra"
    else:
        with pytest.raises(InvalidRequest) as refused:
            parse_chat_request(raw)
        assert refused.value.param == "service_tier"


def test_groq_flex_capacity_exceeded_is_the_upstreams_trouble() -> None:
    """Groq's flex tier answers 498 when it is full and says to retry later: a 503, which fails over and which the
    SDKs retry, never a client's 4xx."""
    err = dialects.DIALECTS["groq"].status_error(
        498, b'{"error":{"message":"Flex tier capacity exceeded. Please try again later.","type":"capacity_exceeded",'
             b'"code":"capacity_exceeded"}}', {})
    assert (err.status, err.code) == (503, "capacity_exceeded") and err.message.startswith("Flex tier")


@pytest.mark.parametrize("reset", ["inf", "1e999", "nan", "-inf"])
def test_a_429_whose_reset_is_no_number_gets_no_wait(reset: str) -> None:
    """``x-ratelimit-reset-tokens: inf`` once raised OverflowError (500 and a traceback)."""
    err = dialects.DIALECTS["openai"].status_error(
        429, b'{"error":{"message":"slow down","type":"rate_limit_error","code":"rate_limit_exceeded"}}',
        {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": reset, "retry-after": ""})
    assert err.status == 429 and "retry-after-ms" not in err.headers


# --- vllm: what llama.cpp's servers need -----------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [b"", b',"max_tokens":null'])
def test_vllm_sends_the_length_limit_in_both_fields(extra: bytes) -> None:
    """llama-cpp-python reads max_tokens only; the bridge and newer clients send max_completion_tokens (16 asked,
    46-2,010 tokens came back)."""
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":16' + extra + b"}"
    doc = _body("vllm", raw)
    assert doc["max_tokens"] == 16 and doc["max_completion_tokens"] == 16
    assert _body_bytes("vllm", raw).count(b'"max_tokens"') == 1  # never a second member the parser reads instead


def test_vllm_sends_an_assistant_tool_turn_with_empty_content_not_null() -> None:
    """llama-cpp-python refuses ``content: null`` beside ``tool_calls`` (valid OpenAI, what the bridge sends)."""
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}, turn,
                                                   {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]})
    doc = _body("vllm", raw)
    assert doc["messages"][1] == {**turn, "content": ""} and doc["messages"][0]["content"] == "hi"
    plain = b'{"model":"m","messages":[{"role":"user","content":"null"}]}'
    assert _body_bytes("vllm", plain, model="m") == plain  # nothing to change: the client's bytes


def _body_bytes(dialect: str, raw: bytes, model: str = "up-model") -> bytes:
    return dialects.DIALECTS[dialect].body(raw, parse_chat_request(raw), model, False)


def _vllm_upstream(window: int | None) -> UpstreamConfig:
    return UpstreamConfig.model_validate({"name": "llama", "tier": "standard", "base_url": "http://127.0.0.1:1/v1",
                                          "dialect": "vllm", "models": {"m": "m"}, "context_window": window})


def test_vllm_an_empty_stream_for_a_prompt_over_the_window_is_the_clients_400() -> None:
    """llama-cpp-python answers a streamed over-long prompt with 200 and an empty body: the gateway's estimate says
    the prompt does not fit the configured window, so it is the client's 400, not an upstream failure."""
    empty = EmptyStream("The upstream answered 200 with an empty event stream.")
    vllm = dialects.DIALECTS["vllm"]
    err = vllm.cause(empty, _vllm_upstream(512), 900)
    assert isinstance(err, UpstreamStatusError) and (err.status, err.code) == (400, "context_length_exceeded")
    assert vllm.cause(empty, _vllm_upstream(512), 100) is empty  # it fits: the upstream's trouble
    assert vllm.cause(empty, _vllm_upstream(None), 900) is empty  # no window known: nothing to say
    assert dialects.DIALECTS["openai"].cause(empty, _vllm_upstream(512), 900) is empty


def test_one_keys_empty_streams_without_a_context_window_open_no_breaker_for_the_others(tmp_path: Path) -> None:
    """llama-cpp-python answers each over-long streamed prompt 200 with an empty body; without a ``context_window``
    the gateway cannot tell that from the server's own trouble, so it is an upstream failure (502). It is
    request-shaped (``gateway.routing.blame``): charged to the key that sent it, so a careless key's prompts (each a
    different body) rest the upstream for that key alone, never open its breaker for every other key."""
    keys = {name: new_key() for name in ("careless", "other")}
    llama = EmulatorThread(lambda got: Plan(parts=[]) if b"OVERLONG" in got.body else None,
                           EmulatorConfig(dialect="vllm", ttft=0.002, tps=5000.0))
    cfg = {"default_tier": "fast", "upstreams": [
        {"name": "llama", "tier": "fast", "dialect": "vllm", "models": {"m": "m"}, "base_url": llama.base_url,
         "health": {"failures": 4, "open_seconds": 30}}],
        "auth": {"metrics": SCRAPE, "keys": [{"name": n, "sha256": digest(k)} for n, k in keys.items()]}}
    gw, _ = start_gateway(cfg, tmp_path)
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"

    def post(key: str, text: str) -> httpx.Response:
        return httpx.post(url, headers={"authorization": f"Bearer {keys[key]}"}, timeout=10, json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": text}]})

    try:
        codes = [post("careless", f"OVERLONG prompt number {i}").status_code for i in range(8)]
        assert codes[:4] == [502] * 4 and codes[4:] == [503] * 4, codes  # rested for that key after four
        assert len(llama.requests) == 4  # the rest never reached the upstream
        metrics = scraped(gw.port)
        assert sample(metrics, "tiergate_upstream_state", upstream="llama", state="open", missing_ok=False) == 0
        assert sample(metrics, "tiergate_upstream_state", upstream="llama", state="closed") == 1
        ok = post("other", "hi")
        assert ok.status_code == 200 and "data: [DONE]" in ok.text, ok.text
    finally:
        gw.stop()
        llama.stop()


def test_vllm_a_500_that_is_request_validation_is_a_400_without_server_paths() -> None:
    body = (b'{"error":{"message":"1 validation error for CreateChatCompletionRequest\\nmessages.1.content\\n  Input '
            b'should be a valid string [type=string_type]\\n  File \\"/usr/lib/python3/site-packages/llama_cpp/server/'
            b'app.py\\", line 42","type":"internal_server_error","code":500}}')
    err = dialects.DIALECTS["vllm"].status_error(500, body, {})
    assert (err.status, err.error_type) == (400, "invalid_request_error")
    assert "/usr/lib" not in err.message and "Input should be a valid string" in err.message
    other = dialects.DIALECTS["vllm"].status_error(500, b'{"error":{"message":"CUDA out of memory"}}', {})
    assert other.status == 500  # a server's own trouble stays its own
