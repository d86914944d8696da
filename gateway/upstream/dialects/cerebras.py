"""The ``cerebras`` dialect: Cerebras Inference (a fast tier's chat-only API).

Facts (Cerebras' OpenAI-compatibility and rate-limit docs; the recorded ``cerebras_*`` fixtures): unknown request
properties are answered 422, so the OpenAI fields it lacks are dropped; streams carry ``usage`` and ``time_info`` on the
finish chunk whether asked or not (the gateway asks all the same: ``stream_options.include_usage`` is accepted), and may
end without ``[DONE]`` (the gateway adds it for the client); a 429 has no ``retry-after`` but
``x-ratelimit-reset-{requests,tokens}-{minute,day}`` in float seconds; errors may be flat (``{"message", "type",
"param": "", "code"}``); no Responses API (served through the bridge) and no other ``/v1`` endpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.upstream.dialects.base import Dialect
from gateway.wire.body import dumps, loads_exact, needs_exact

PHASES = ("queue", "prompt", "completion", "total")  # time_info's <phase>_time members, float seconds


class Cerebras(Dialect):
    """Cerebras Inference: OpenAI fields it rejects are dropped; usage is asked for (it sends it unasked too); its
    ``time_info`` is the upstream's own time."""

    name = "cerebras"
    member = "time_info"
    prompt_cache_key = False  # an unknown property is a 422; its prompt cache is keyed by the prefix alone
    # the OpenAI fields its API answers 422 (an unknown property): dropped, the body re-serialised
    drop = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier", "verbosity"})

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """Always re-serialised without :attr:`drop` and without ``stream_options.include_obfuscation`` (an OpenAI
        option it answers 422); ``stream_options`` only on a stream, with ``include_usage`` when ``ask_usage``."""
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
        """``time_info`` (``queue_time``, ``prompt_time``, ``completion_time``, ``total_time``: float seconds; Cerebras'
        chat-completions reference) as the upstream's seconds by phase; a phase that is no number, or negative, is
        left out. Its usage is OpenAI's ``usage`` member, beside it."""
        if not isinstance(value, dict):
            return None, None
        found = {phase: float(v) for phase in PHASES if isinstance(v := value.get(f"{phase}_time"), int | float)
                 and not isinstance(v, bool) and v >= 0}
        return None, found or None
