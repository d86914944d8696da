"""The OpenAI wire shapes the gateway touches: reading a request just enough to route it, and preparing the body sent
upstream by editing the client's bytes, never re-serialising what it does not have to change
(docs/reference/wire.md#request-bodies; each dialect's changes on top: ``gateway.upstream.dialects``).

Bodies are JSON as RFC 8259 defines it: a lone surrogate escape such as ``"\\ud83d"`` is valid JSON text (§8.2: its
behaviour is unpredictable, not forbidden) that orjson refuses; the standard library's parser then reads it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from gateway.errors import InvalidRequest

# A JSON string (unrolled loop) or one structural bracket; everything else is skipped by finditer.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]')
_LONG_NUMBER = re.compile(rb"\d{19}")
_WS = b" \t\r\n"


def parse_chat_request(raw: bytes) -> dict[str, Any]:
    """Raises InvalidRequest (400 naming the parameter) for a body that is not a JSON object, or whose ``model``,
    ``messages``, ``stream``, ``stream_options``, output limits or ``service_tier`` are missing or of the wrong type."""
    body = _routable(raw)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("Missing required parameter: 'messages'.", param="messages",
                             code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("Invalid 'messages': expected a non-empty array.", param="messages", code="invalid_type")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("Invalid type for 'stream_options': expected an object.", param="stream_options",
                             code="invalid_type")
    return body


def parse_responses_request(raw: bytes) -> dict[str, Any]:
    """Just enough to route it and to read the conversation it continues (OpenAI API reference, "Create a model
    response"); the rest is the upstream's to check, or the bridge's. Raises InvalidRequest (``invalid_type``, naming
    the parameter)."""
    body = _routable(raw)
    for key, ok, want in (("previous_response_id", isinstance(body.get("previous_response_id"), str), "a string"),
                          ("input", isinstance(body.get("input"), str | list), "a string or an array of items"),
                          ("store", isinstance(body.get("store"), bool), "a boolean")):
        if not ok and body.get(key) is not None:
            raise InvalidRequest(f"Invalid type for '{key}': expected {want}, got {_json_type(body[key])}.",
                                 param=key, code="invalid_type")
    for i, item in enumerate(body["input"] if isinstance(body.get("input"), list) else ()):
        if not isinstance(item, dict):
            raise InvalidRequest(f"Invalid type for 'input[{i}]': expected an object, got {_json_type(item)}.",
                                 param=f"input[{i}]", code="invalid_type")
    return body


def loads(raw: bytes) -> Any:
    """orjson, or, only when it refuses, the standard library, which reads lone surrogate escapes; ``NaN`` and
    ``Infinity`` stay refused: they are not JSON. Raises ``orjson.JSONDecodeError`` (a ``ValueError``)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            return json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
        except (ValueError, RecursionError):  # nested past orjson's 1024 levels: past the stdlib's too
            raise exc from None


def loads_exact(raw: bytes) -> Any:
    """Integers past 64 bits stay exact (orjson reads them as floats), for a body the gateway re-serialises. Only a body
    with a run of 19 digits pays for the standard library's parser."""
    if _LONG_NUMBER.search(raw) is None:
        return loads(raw)
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise orjson.JSONDecodeError("nested too deeply", raw.decode("utf-8", "replace"), 0) from None


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text} is out of range")
    return value


def dumps(value: Any) -> bytes:
    """A string holding a lone surrogate, which UTF-8 cannot encode, is escaped as ``\\uXXXX``, as the client sent
    it."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def is_json_type(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type (RFC 6839); ``application/jsonl`` and ``application/json-seq`` are
    streams of documents, not JSON."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def parse_request(kind: str, raw: bytes) -> dict[str, Any]:
    return parse_chat_request(raw) if kind == "chat" else parse_responses_request(raw)


LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SERVICE_TIER = re.compile(r"[a-z][a-z0-9_]{0,31}")  # what check_service_tier lets through


def _routable(raw: bytes) -> dict[str, Any]:
    try:
        body = loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"The request body must be a JSON object, got {_json_type(body)}.", code="invalid_json")
    model = body.get("model")
    if model is None:
        raise InvalidRequest("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(f"Invalid type for 'model': expected a non-empty string, got {_json_type(model)}.",
                             param="model", code="invalid_type")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"Invalid type for 'stream': expected a boolean, got {_json_type(stream)}.",
                             param="stream", code="invalid_type")
    check_limits(body)
    check_service_tier(body)
    return body


def check_service_tier(body: Mapping[str, Any]) -> None:
    """A short lower-case word (OpenAI's, or another provider's such as Groq's ``on_demand``): routing, billing and the
    request log read it, so a 2 MB string or an object is refused, not logged or dropped in silence. Raises
    InvalidRequest (400 ``invalid_type`` or ``invalid_value``)."""
    tier = body.get("service_tier")
    if tier is None:
        return
    if not isinstance(tier, str):
        raise InvalidRequest(f"Invalid type for 'service_tier': expected a string, got {_json_type(tier)}.",
                             param="service_tier", code="invalid_type")
    if not SERVICE_TIER.fullmatch(tier):
        raise InvalidRequest(f"Invalid value for 'service_tier': {tier[:40]!r} is no service tier (a lower-case word "
                             "such as 'auto', 'default', 'flex', 'priority', 'fast' or 'ultrafast').",
                             param="service_tier", code="invalid_value")


def check_limits(body: Mapping[str, Any]) -> None:
    """Integers >= 1, as OpenAI checks them: routing, quota estimates and key limits read them, and a negative one would
    make those negative. Raises InvalidRequest (400 ``invalid_type`` or ``integer_below_min_value``)."""
    for name in LIMIT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequest(f"Invalid type for '{name}': expected an integer, but got {_json_type(value)} "
                                 "instead.", param=name, code="invalid_type")
        if value < 1:
            raise InvalidRequest(f"Invalid '{name}': integer below minimum value. Expected a value >= 1, but got "
                                 f"{value} instead.", param=name, code="integer_below_min_value")


def client_wants_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def openai_body(raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
    """The client's ``raw`` with ``upstream_model`` as the model and, with ``ask_usage``,
    ``stream_options.include_usage: true``; every other byte, unknown fields included, as it came. ``stream_options`` is
    dropped from a request that does not stream: strict upstreams answer it 400 (OpenAI's API reference: "Only set this
    when you set ``stream: true``"). The dialects start from it."""
    if body.get("stream") is not True and "stream_options" in body:
        raw = remove_top_level(raw, b"stream_options")
    if upstream_model != body["model"]:
        raw = replace_top_level(raw, b"model", orjson.dumps(upstream_model))
    if ask_usage:
        options = body.get("stream_options")
        if "stream_options" not in body:
            start = raw.index(b"{") + 1
            raw = raw[:start] + b'"stream_options":{"include_usage":true},' + raw[start:]
        else:  # an object, or null (a second key would leave the upstream reading the client's null)
            raw = replace_top_level(raw, b"stream_options", orjson.dumps({**(options or {}), "include_usage": True}))
    return raw


def with_service_tier(raw: bytes, body: Mapping[str, Any], tier: str | None) -> tuple[bytes, dict[str, Any]]:
    """``tier`` None removes it; the client's other bytes as they came."""
    out = {k: v for k, v in body.items() if k != "service_tier"}
    if tier is None:
        return remove_top_level(raw, b"service_tier") if "service_tier" in body else raw, out
    out["service_tier"] = tier
    if "service_tier" in body:
        return replace_top_level(raw, b"service_tier", dumps(tier)), out
    start = raw.index(b"{") + 1
    return raw[:start] + b'"service_tier":' + dumps(tier) + b"," + raw[start:], out


def needs_exact(raw: bytes) -> bool:
    return _LONG_NUMBER.search(raw) is not None


def replace_top_level(raw: bytes, key: bytes, value: bytes) -> bytes:
    """Only the value's bytes change. A repeated key has every value replaced: parsers keep the last one, the scanner
    finds the first. Falls back to parsing and re-serialising when the scanner cannot locate the key."""
    spans = _value_spans(raw, key)
    if not spans:
        body = loads(raw)
        body[key.decode()] = orjson.loads(value)
        return dumps(body)
    for _, start, end in reversed(spans):
        raw = raw[:start] + value + raw[end:]
    return raw


def remove_top_level(raw: bytes, key: bytes) -> bytes:
    """Every top-level ``"key": value``, with one comma beside it; falls back to re-serialising when the scanner cannot
    locate it."""
    spans = _value_spans(raw, key)
    if not spans:
        body = loads(raw)
        body.pop(key.decode(), None)
        return dumps(body)
    for key_start, _, end in reversed(spans):
        after = _skip_ws(raw, end)
        if after < len(raw) and raw[after] == 0x2C:  # "key": value, next  ->  next
            raw = raw[:key_start] + raw[_skip_ws(raw, after + 1):]
            continue
        before = key_start  # last member: drop the comma in front of it instead
        while before > 0 and raw[before - 1] in _WS:
            before -= 1
        if before > 0 and raw[before - 1] == 0x2C:
            before -= 1
        raw = raw[:before] + raw[end:]
    return raw


def _value_spans(raw: bytes, key: bytes) -> list[tuple[int, int, int]]:
    """(key start, value start, value end) byte offsets of each top-level ``key``."""
    quoted = b'"' + key + b'"'
    spans: list[tuple[int, int, int]] = []
    depth = 0
    tokens = _TOKEN.finditer(raw)
    for m in tokens:
        tok = m.group()
        first = tok[0]
        if first == 0x22:
            if depth != 1 or not (tok == quoted or (b"\\" in tok and loads(tok) == key.decode())):
                continue
            colon = _skip_ws(raw, m.end())
            if colon >= len(raw) or raw[colon] != 0x3A:
                continue
            start = _skip_ws(raw, colon + 1)
            end = _value_end(raw, start, tokens)  # consumes the value's tokens: depth is still 1
            spans.append((m.start(), start, end))
            if raw.find(quoted, end) < 0 and raw.find(b"\\u", end) < 0:
                return spans  # no second copy of the key can follow (spelt plainly or with escapes)
            continue
        depth += 1 if first in b"{[" else -1
    return spans


def _value_end(raw: bytes, start: int, tokens: Iterator[re.Match[bytes]]) -> int:
    if raw[start] not in b'"{[':  # number, true, false, null
        end = start
        while end < len(raw) and raw[end] not in b",}" and raw[end] not in _WS:
            end += 1
        return end
    depth = 0
    for m in tokens:
        tok = m.group()
        if tok[0] == 0x22:
            if depth == 0:
                return m.end()
            continue
        depth += 1 if tok[0] in b"{[" else -1
        if depth == 0:
            return m.end()
    return len(raw)


def _skip_ws(raw: bytes, pos: int) -> int:
    while pos < len(raw) and raw[pos] in _WS:
        pos += 1
    return pos


def _json_type(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
