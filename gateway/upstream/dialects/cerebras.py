"""The ``cerebras`` dialect: Cerebras Inference, a fast tier's chat-only API. Facts (its OpenAI-compatibility and
rate-limit docs; the ``cerebras_*`` fixtures): an unknown request property is a 422; a finish chunk carries ``usage``
and ``time_info`` unasked; a 429 has only ``x-ratelimit-reset-*``, in float seconds; no Responses API (bridged)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.upstream.dialects.base import Dialect
from gateway.wire.body import dumps, loads_exact, needs_exact

PHASES = ("queue", "prompt", "completion", "total")  # time_info's <phase>_time members, float seconds


class Cerebras(Dialect):
    """OpenAI fields it rejects are dropped; its ``time_info`` is the upstream's own time."""

    name = "cerebras"
    member = "time_info"
    prompt_cache_key = False  # an unknown property is a 422; its prompt cache is keyed by the prefix alone
    # the OpenAI fields its API answers 422 (an unknown property): dropped, the body re-serialised
    drop = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier", "verbosity"})

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """``stream_options.include_obfuscation`` is an OpenAI option it answers 422 too."""
        if needs_exact(raw):
            body = loads_exact(raw)  # an integer past 64 bits must stay exact
        out = {k: v for k, v in body.items() if k not in self.drop}
        out["model"] = upstream_model
        options = out.get("stream_options")
        if body.get("stream") is not True:
            out.pop("stream_options", None)
        else:
            options = {k: v for k, v in options.items() if k != "include_obfuscation"} if isinstance(options, dict) \
                else {}
            if ask_usage:  # its finish chunk carries usage unasked, but an upstream of this dialect may not
                options["include_usage"] = True
            if options or "stream_options" in out:
                out["stream_options"] = options
        return dumps(out)

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        """``<phase>_time``: float seconds (Cerebras' chat-completions reference). Usage is in OpenAI's ``usage``."""
        if not isinstance(value, dict):
            return None, None
        found = {phase: float(v) for phase in PHASES if isinstance(v := value.get(f"{phase}_time"), int | float)
                 and not isinstance(v, bool) and v >= 0}
        return None, found or None
