"""How the emulator sizes a request: its prompt (what its prompt cache, its token budget and its usage count) and
the token limit it asks for."""

from __future__ import annotations

from typing import Any

import orjson


def prompt_of(body: dict[str, Any]) -> bytes:
    """A token is 4 of its bytes."""
    return orjson.dumps(body.get("messages", body.get("input", [])))


def token_limit(body: dict[str, Any]) -> int | None:
    """The first of ``max_completion_tokens``, ``max_tokens``, ``max_output_tokens`` that is a positive integer."""
    return next((v for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                 if isinstance(v := body.get(k), int) and not isinstance(v, bool) and v > 0), None)
