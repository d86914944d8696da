"""A JSON value that satisfies a JSON schema: what the emulator's tool calls and structured answers hold, so that an
agent's tool call parses and validates."""

from __future__ import annotations

import math
from typing import Any


def schema_instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """Deterministic, for the subset of JSON Schema that function tools and structured outputs use (OpenAI's strict
    mode): ``type`` (or a list), ``properties`` (all given, as strict mode requires), ``items`` / ``minItems``,
    ``enum``, ``const``, ``anyOf`` / ``oneOf`` (the first non-null branch), ``allOf``, ``$ref`` into ``$defs`` /
    ``definitions``, string ``format`` / ``minLength``, numeric bounds. Tests validate it with ``jsonschema``."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > 20:
        return None
    if "$ref" in schema:
        target: Any = root
        for key in str(schema["$ref"]).lstrip("#/").split("/"):
            target = target.get(key, {}) if isinstance(target, dict) else {}
        return schema_instance(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            options = [o for o in schema[key] if not (isinstance(o, dict) and o.get("type") == "null")]
            return schema_instance((options or schema[key])[0], root, depth + 1)
    if isinstance(schema.get("allOf"), list):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            value = schema_instance(part, root, depth + 1)
            if isinstance(value, dict):
                merged.update(value)
        return merged
    return _typed_instance(schema, root, depth)


def _typed_instance(schema: dict[str, Any], root: Any, depth: int) -> Any:
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return {name: schema_instance(sub, root, depth + 1) for name, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [schema_instance(schema.get("items", {}), root, depth + 1)
                for _ in range(max(1, schema.get("minItems", 1)))]
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    formats = {"date-time": "2026-12-01T00:00:00Z", "date": "2026-12-01", "email": "agent@example.com",
               "uri": "https://example.com/", "uuid": "00000000-0000-4000-8000-000000000000"}
    text = formats.get(schema.get("format", ""), "example")
    text += "x" * max(0, schema.get("minLength", 0) - len(text))
    return text[: schema["maxLength"]] if isinstance(schema.get("maxLength"), int) else text


def _number(schema: dict[str, Any], integer: bool) -> int | float:
    """The middle of both bounds, else one past the one given (7 when unbounded). A ``number`` that is whole is
    written as an integer (``7``, not ``7.0``: both are JSON numbers, but a client that declares ``number`` and
    parses an integer, as Codex CLI does ``timeout_ms``, fails on ``7.0``)."""
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is not None and high is not None:
        value = (low + high) / 2
    elif low is not None:
        value = low + 1
    elif high is not None:
        value = high - 1
    else:
        value = 7
    if not integer:
        return int(value) if float(value).is_integer() else float(value)
    whole = int(math.floor(value))
    if low is not None and (whole < low or (whole == low and "exclusiveMinimum" in schema)):
        whole += 1  # e.g. between 1 and 2 exclusive of 1: no integer fits, and none can
    return whole
