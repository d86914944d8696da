"""Usage in the shape the metrics count it: chat completions' terms, whatever API reported it."""

from __future__ import annotations

from typing import Any


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses API ``ResponseUsage`` (``input_tokens``, ``output_tokens``) mapped to OpenAPI ``CompletionUsage``
    terms; chat usage as it is."""
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return usage
    inp = usage.get("input_tokens_details")
    out = usage.get("output_tokens_details")
    inp = inp if isinstance(inp, dict) else {}
    out = out if isinstance(out, dict) else {}
    return {"prompt_tokens": usage.get("input_tokens", 0), "completion_tokens": usage.get("output_tokens", 0),
            "prompt_tokens_details": {"cached_tokens": inp.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": out.get("reasoning_tokens", 0)}}
