"""gateway.wire.body: request checks and the upstream body per dialect (docs/reference/wire.md#request-bodies,
docs/reference/wire.md#errors-the-gateway-answers-itself, docs/reference/wire.md#conformance-checks check 12)."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.upstream.dialects import DIALECTS
from gateway.wire.body import (
    client_wants_usage,
    parse_chat_request,
    parse_responses_request,
    replace_top_level,
)

MSGS = '[{"role":"user","content":"hi"}]'


def _req(**fields: Any) -> bytes:
    return orjson.dumps({"model": "gpt-alias", "messages": [{"role": "user", "content": "hi"}], **fields})


def upstream_body(raw: bytes, body: Any, upstream_model: str, dialect: str, ask_usage: bool) -> bytes:
    """The bytes an attempt sends (the dialect's rules: ``gateway.upstream.dialects``)."""
    return DIALECTS[dialect].body(raw, body, upstream_model, ask_usage)


def _prepare(raw: bytes, upstream_model: str, dialect: str = "openai", ask_usage: bool = False) -> bytes:
    return upstream_body(raw, parse_chat_request(raw), upstream_model, dialect, ask_usage)


# ------------------------------------------------------------------------------------ parse_chat_request


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{bad json", None, "invalid_json"),
        (b"", None, "invalid_json"),
        (b'{"model": "m", "messages": [1],}', None, "invalid_json"),
        (b"\xff\xfe{}", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (b'"a string"', None, "invalid_json"),
        (b"null", None, "invalid_json"),
        (b"42", None, "invalid_json"),
        (b"{}", "model", "missing_required_parameter"),
        (b'{"messages": ' + MSGS.encode() + b"}", "model", "missing_required_parameter"),
        (b'{"model": null, "messages": ' + MSGS.encode() + b"}", "model", "missing_required_parameter"),
        (b'{"model": "", "messages": ' + MSGS.encode() + b"}", "model", "invalid_type"),
        (b'{"model": 4, "messages": ' + MSGS.encode() + b"}", "model", "invalid_type"),
        (b'{"model": true, "messages": ' + MSGS.encode() + b"}", "model", "invalid_type"),
        (b'{"model": ["m"], "messages": ' + MSGS.encode() + b"}", "model", "invalid_type"),
        (b'{"model": {"id": "m"}, "messages": ' + MSGS.encode() + b"}", "model", "invalid_type"),
        (b'{"model": "m"}', "messages", "missing_required_parameter"),
        (b'{"model": "m", "messages": null}', "messages", "missing_required_parameter"),
        (b'{"model": "m", "messages": []}', "messages", "invalid_type"),
        (b'{"model": "m", "messages": {"role": "user"}}', "messages", "invalid_type"),
        (b'{"model": "m", "messages": "hi"}', "messages", "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "stream": "true"}', "stream", "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "stream": 1}', "stream", "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "stream": 0}', "stream", "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "stream": {}}', "stream", "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "stream_options": []}', "stream_options",
         "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "stream_options": true}', "stream_options",
         "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "stream_options": "x"}', "stream_options",
         "invalid_type"),
        # the limits: routing, quota estimates and key budgets read them (a negative one once made them negative)
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "max_tokens": -1000000000}', "max_tokens",
         "integer_below_min_value"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "max_completion_tokens": 0}', "max_completion_tokens",
         "integer_below_min_value"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "max_tokens": "100"}', "max_tokens", "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "max_tokens": 1.5}', "max_tokens", "invalid_type"),
        (b'{"model": "m", "messages": ' + MSGS.encode() + b', "max_tokens": true}', "max_tokens", "invalid_type"),
    ],
)
def test_parse_errors(raw: bytes, param: str | None, code: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(raw)
    exc = info.value
    assert type(exc) is InvalidRequest
    assert (exc.status, exc.error_type, exc.param, exc.code) == (400, "invalid_request_error", param, code)
    assert exc.message
    assert orjson.loads(exc.body()) == {"error": {"message": exc.message, "type": "invalid_request_error",
                                                  "param": param, "code": code}}


@pytest.mark.parametrize(
    "extra",
    [{}, {"stream": True}, {"stream": False}, {"stream": None}, {"stream_options": None}, {"max_tokens": None},
     {"max_tokens": 1}, {"max_completion_tokens": 100000},
     {"stream_options": {}}, {"stream": True, "stream_options": {"include_usage": True}}, {"unknown": [1, {"a": 2}]}],
)
def test_parse_accepts_valid_bodies(extra: dict[str, Any]) -> None:
    raw = _req(**extra)
    assert parse_chat_request(raw) == orjson.loads(raw)


def test_parse_reads_the_model_through_escapes_and_whitespace() -> None:
    raw = b' \n{ "messages" : ' + MSGS.encode() + b' ,\n\t"model"\n:\n"gpt\\u002dalias" } \n'
    assert parse_chat_request(raw)["model"] == "gpt-alias"


@pytest.mark.parametrize(
    ("options", "want"),
    [(None, False), ({}, False), ({"include_usage": True}, True), ({"include_usage": False}, False),
     ({"include_usage": "true"}, False), ({"include_usage": 1}, False), ({"include_obfuscation": True}, False),
     ({"include_usage": True, "include_obfuscation": False}, True)],
)
def test_client_wants_usage(options: dict[str, Any] | None, want: bool) -> None:
    assert client_wants_usage({"model": "m", "stream_options": options}) is want
    if options is None:
        assert client_wants_usage({"model": "m"}) is False


# ------------------------------------------------------------------------------ openai: model rewrite

# Bodies as clients really write them. "@M@" marks the top-level model value: the only bytes that may change.
TEMPLATES = {
    "compact": b'{"model":@M@,"messages":[{"role":"user","content":"hi"}],"stream":true}',
    "whitespace": b' \r\n{\n\t"model" :\t@M@ ,\n  "messages" : [ { "role" : "user" , "content" : "hi" } ]\n}\n',
    "messages_first": b'{"messages":[{"role":"user","content":"hi"}],"temperature":0.7,"model":@M@}',
    "unicode_escapes": b'{"messages":[{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00 caf\xc3\xa9 \\n \\"q\\""}],'
                       b'"model":@M@,"user":"\\u00fc"}',
    "nested_model_keys": (
        b'{"tools":[{"type":"function","function":{"name":"pick","parameters":{"type":"object","properties":'
        b'{"model":{"type":"string","enum":["model"]},"cfg":{"type":"object","properties":{"model":'
        b'{"type":"string"}}}},"required":["model"]}}}],"metadata":{"model":"x","nested":{"model":"y"}},'
        b'"response_format":{"type":"json_schema","json_schema":{"name":"s","schema":{"properties":'
        b'{"model":{"type":"string"}}}}},"messages":[{"role":"user","content":"hi"}],"model":@M@}'
    ),
    "model_text_in_content": (
        b'{"messages":[{"role":"user","content":"set \\"model\\": \\"x\\" please"},'
        b'{"role":"assistant","content":"{\\"model\\": \\"x\\"}"}],"model":@M@,'
        b'"stop":["\\"model\\":"]}'
    ),
    "model_as_a_value": b'{"messages":[{"role":"user","content":"model"}],"name":"model","x":["model",{"model":1}],'
                        b'"model":@M@}',
    "escaped_model_key": b'{"messages":[{"role":"user","content":"hi"}],"\\u006dodel":@M@}',
    "escaped_model_value": b'{"model":@M@,"messages":[{"role":"user","content":"hi"}]}',
    "unknown_fields": b'{"model":@M@,"messages":[{"role":"user","content":"hi"}],"prompt_cache_options":{"a":[1,2.50,'
                      b'-0.0,1e3,true,false,null]},"moderation":null,"n":2}',
}
ALIAS = {"escaped_model_value": b'"gpt\\u002dalias"'}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_openai_body_is_the_clients_bytes_except_the_model_value(name: str) -> None:
    template = TEMPLATES[name]
    assert template.count(b"@M@") == 1
    raw = template.replace(b"@M@", ALIAS.get(name, b'"gpt-alias"'))
    body = parse_chat_request(raw)
    assert body["model"] == "gpt-alias"
    out = upstream_body(raw, body, "gpt-5.6-2026-10-01", "openai", False)
    assert out == template.replace(b"@M@", b'"gpt-5.6-2026-10-01"')
    assert orjson.loads(out) == {**body, "model": "gpt-5.6-2026-10-01"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_openai_body_is_untouched_when_the_model_does_not_change(name: str) -> None:
    raw = TEMPLATES[name].replace(b"@M@", ALIAS.get(name, b'"gpt-alias"'))
    assert _prepare(raw, "gpt-alias") == raw


def test_openai_model_id_is_json_encoded() -> None:
    raw = _req()
    out = _prepare(raw, 'odd "id" \\ \u00e9 \u2028')
    assert orjson.loads(out)["model"] == 'odd "id" \\ \u00e9 \u2028'
    assert out.replace(orjson.dumps('odd "id" \\ \u00e9 \u2028'), b'"gpt-alias"') == raw


def test_openai_repeated_model_key_is_rewritten_everywhere() -> None:
    # JSON parsers keep the last copy: the gateway routed on it, the upstream must not see the alias
    raw = b'{"model":"other","messages":[{"role":"user","content":"hi"}],"model":"gpt-alias"}'
    assert parse_chat_request(raw)["model"] == "gpt-alias"
    out = _prepare(raw, "up-1")
    assert out == b'{"model":"up-1","messages":[{"role":"user","content":"hi"}],"model":"up-1"}'
    assert orjson.loads(out)["model"] == "up-1"
    raw = b'{"model":"other","messages":[],"\\u006dodel":"gpt-alias"}'.replace(b"[]", MSGS.encode())
    assert orjson.loads(_prepare(raw, "up-1"))["model"] == "up-1"


# ------------------------------------------------------------------------------ openai: usage injection


def _others(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "stream_options"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_usage_injected_without_stream_options(name: str) -> None:
    raw = TEMPLATES[name].replace(b"@M@", ALIAS.get(name, b'"gpt-alias"'))
    body = parse_chat_request(raw)
    out = upstream_body(raw, body, "gpt-alias", "openai", True)
    doc = orjson.loads(out)
    assert doc["stream_options"] == {"include_usage": True}
    assert _others(doc) == body
    assert out.count(b"stream_options") == 1
    # the client's bytes are all there, in order, around the inserted member
    start = raw.index(b"{") + 1
    inserted = len(out) - len(raw)
    assert out[:start] == raw[:start] and out[start + inserted :] == raw[start:]


@pytest.mark.parametrize(
    ("options", "want"),
    [
        (b"{}", {"include_usage": True}),
        (b'{ "include_usage" : false }', {"include_usage": True}),
        (b'{"include_obfuscation":false}', {"include_obfuscation": False, "include_usage": True}),
        (b'{"include_obfuscation":true,"include_usage":false,"future":[1]}',
         {"include_obfuscation": True, "include_usage": True, "future": [1]}),
        (b"null", {"include_usage": True}),
    ],
)
def test_usage_injected_into_existing_stream_options(options: bytes, want: dict[str, Any]) -> None:
    raw = (b'{"model":"gpt-alias","stream_options":' + options + b' \n,"messages":' + MSGS.encode()
           + b',"stream":true,"metadata":{"stream_options":{"include_usage":false}}}')
    body = parse_chat_request(raw)
    before = copy.deepcopy(body)
    out = upstream_body(raw, body, "gpt-alias", "openai", True)
    doc = orjson.loads(out)
    assert doc["stream_options"] == want
    assert _others(doc) == _others(body)
    assert body == before  # the parsed request is not modified
    assert out.count(b'"stream_options":') == 2  # the top-level one (once) and the metadata one, untouched
    head = b'{"model":"gpt-alias","stream_options":'
    tail = raw[len(head) + len(options) :]
    assert out.startswith(head) and out.endswith(tail)


def test_usage_injection_and_model_rewrite_together() -> None:
    raw = b'{"messages":' + MSGS.encode() + b', "stream": true, "model": "gpt-alias", "stream_options": {"a": 1}}'
    out = _prepare(raw, "up-1", ask_usage=True)
    assert orjson.loads(out) == {"messages": json.loads(MSGS), "stream": True, "model": "up-1",
                                 "stream_options": {"a": 1, "include_usage": True}}
    assert out.startswith(b'{"messages":' + MSGS.encode() + b', "stream": true, "model": "up-1", "stream_options": ')


def test_no_usage_asked_no_stream_options_added() -> None:
    raw = _req(stream=True)
    assert _prepare(raw, "gpt-alias", ask_usage=False) == raw
    assert b"stream_options" not in _prepare(raw, "up-1", ask_usage=False)


# ---------------------------------------------------------------------------------------------- cerebras

CEREBRAS_DROPPED = ("metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier")


def test_cerebras_drops_the_fields_it_rejects_and_keeps_the_rest() -> None:
    request = {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi \u2028"}],
        "model": "gpt-alias",
        "metadata": {"workload": "interactive"},
        "store": True,
        "service_tier": "priority",
        "parallel_tool_calls": True,
        "prompt_cache_key": "k",
        "safety_identifier": "sid",
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "temperature": 1.2,
        "top_p": 0.9,
        "max_tokens": 256,
        "max_completion_tokens": 300,
        "user": "u-1",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"model": {}}}}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_object"},
        "reasoning_format": "parsed",
        "seed": 7,
    }
    raw = orjson.dumps(request)
    body = parse_chat_request(raw)
    before = copy.deepcopy(body)
    out = upstream_body(raw, body, "gpt-oss-120b", "cerebras", False)
    doc = orjson.loads(out)
    for key in CEREBRAS_DROPPED:
        assert key not in doc
    assert doc["stream_options"] == {"include_usage": True}
    assert doc["model"] == "gpt-oss-120b"
    kept = {k: v for k, v in request.items() if k not in (*CEREBRAS_DROPPED, "stream_options", "model")}
    assert {k: v for k, v in doc.items() if k not in ("stream_options", "model")} == kept
    assert doc["temperature"] == 1.2 and doc["user"] == "u-1"
    assert list(doc) == [k for k in request if k not in CEREBRAS_DROPPED]  # order kept
    assert body == before


@pytest.mark.parametrize(
    ("options", "want"),
    [({"include_obfuscation": True}, {}), ({"include_usage": False}, {"include_usage": False}),
     ({"include_usage": True, "include_obfuscation": False}, {"include_usage": True})],
)
def test_cerebras_stream_options(options: dict[str, Any], want: dict[str, Any]) -> None:
    raw = _req(stream=True, stream_options=options)
    assert orjson.loads(_prepare(raw, "llama", "cerebras"))["stream_options"] == want


def test_cerebras_adds_no_stream_options_of_its_own() -> None:
    assert "stream_options" not in orjson.loads(_prepare(_req(stream=True), "llama", "cerebras"))


def test_cerebras_body_without_dropped_fields_is_equal_json() -> None:
    raw = b'{ "model": "gpt-alias", "messages": ' + MSGS.encode() + b', "temperature": 0.5 }'
    assert orjson.loads(_prepare(raw, "llama", "cerebras")) == {
        "model": "llama", "messages": json.loads(MSGS), "temperature": 0.5}


# ---------------------------------------------------------------------------------- replace_top_level

_KEYS = st.one_of(st.sampled_from(["model", "messages", "stream_options", "x", "Model", "model ", "mod\"el"]),
                  st.text(max_size=8))
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(['"model": "x"', '{"model":"x"}', "\\", '\\"', "model", "\u2028", "\x00", "}", "]", ":"]),
)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
                     max_leaves=12)
_PLACEHOLDER = "__tiergate_top_model__"


@settings(max_examples=200, deadline=None)
@given(
    others=st.dictionaries(_KEYS.filter(lambda k: k != "model"), _JSON, max_size=5),
    old=_JSON,
    new=_JSON,
    position=st.integers(min_value=0, max_value=6),
    indent=st.sampled_from([None, 0, 2]),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
    ensure_ascii=st.booleans(),
    escaped_key=st.booleans(),
)
def test_replace_top_level_changes_only_the_top_level_value(
    others: dict[str, Any], old: Any, new: Any, position: int, indent: int | None,
    separators: tuple[str, str], ensure_ascii: bool, escaped_key: bool,
) -> None:
    items = list(others.items())
    items.insert(min(position, len(items)), (_PLACEHOLDER, old))
    text = json.dumps(dict(items), indent=indent, separators=separators, ensure_ascii=ensure_ascii)
    assume(text.count(_PLACEHOLDER) == 1)
    raw = text.replace(f'"{_PLACEHOLDER}"', '"\\u006dodel"' if escaped_key else '"model"').encode()
    value = orjson.dumps(new)

    out = replace_top_level(raw, b"model", value)

    want = {k: v for k, v in items if k != _PLACEHOLDER}
    want_items = [(("model", new) if k == _PLACEHOLDER else (k, v)) for k, v in items]
    assert orjson.loads(out) == dict(want_items)
    assert {k: v for k, v in orjson.loads(out).items() if k != "model"} == want
    # byte level: raw = prefix + old value + suffix and out = prefix + value + suffix
    old_len = len(raw) - len(out) + len(value)
    assert any(
        raw[:i] == out[:i] and raw[i + old_len :] == out[i + len(value) :]
        and raw[i : i + old_len].strip() == raw[i : i + old_len] and orjson.loads(raw[i : i + old_len]) == old
        for i in range(len(out) - len(value) + 1)
        if out.startswith(value, i)
    )


def test_a_body_nested_past_the_parsers_depth_is_a_400_not_a_crash() -> None:
    deep = b'{"model":"m","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    for parse in (parse_chat_request, parse_responses_request):
        with pytest.raises(InvalidRequest) as info:
            parse(deep)
        assert info.value.code == "invalid_json"


def test_route_matches_are_remembered_only_for_the_tables_own_paths() -> None:
    """``gateway.wire.routes.match`` keeps a path without ids: a client's ids and paths under ``{rest}`` never grow
    it."""
    from gateway.wire import routes

    first = routes.match("POST", "chat/completions")
    assert routes.match("POST", "chat/completions") is first and first.serves == "chat"
    size = len(routes._FIXED)
    for i in range(50):
        assert routes.match("GET", f"files/file-{i}").ids == (f"file-{i}",)
        assert routes.match("GET", f"tiergate/sessions/run-{i}/x").route is not None
        assert routes.match("GET", f"nothing-{i}").endpoint == "other"
    assert len(routes._FIXED) == size
