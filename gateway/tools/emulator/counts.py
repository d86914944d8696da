"""How the emulator sizes a request: its prompt (what its prompt cache, its token budget and its usage count) and
the token limit it asks for."""

from __future__ import annotations

from typing import Any

import orjson


def prompt_of(body: dict[str, Any]) -> bytes:
    """The prompt of a chat completion or Responses request: its messages' (or input's) JSON; a token is 4 of its
    bytes (``gateway.tools.emulator.prompt_cache``)."""
    return orjson.dumps(body.get("messages", body.get("input", [])))


def token_limit(body: dict[str, Any]) -> int | None:
    """The output token limit a request asks for (``max_completion_tokens``, ``max_tokens``, ``max_output_tokens``:
    the first that is a positive integer), or None."""
    return next((v for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                 if isinstance(v := body.get(k), int) and not isinstance(v, bool) and v > 0), None)
