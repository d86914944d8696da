"""The ``cerebras`` dialect: Cerebras Inference (a fast tier's chat-only API).

Facts (Cerebras' OpenAI-compatibility and rate-limit docs; the recorded ``cerebras_*`` fixtures): unknown request
properties are answered 422, so the OpenAI fields it lacks are dropped; streams carry ``usage`` and ``time_info`` on
the finish chunk whether asked or not, and may end without ``[DONE]`` (the gateway adds it for the client); a 429 has
no ``retry-after`` but ``x-ratelimit-reset-{requests,tokens}-{minute,day}`` in float seconds; errors may be flat
(``{"message", "type", "param": "", "code"}``); no Responses API (served through the bridge) and no other ``/v1``
endpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.upstream.dialects.base import Dialect
from gateway.wire.body import dumps, loads_exact, needs_exact


class Cerebras(Dialect):
    """Cerebras Inference: OpenAI fields it rejects are dropped; its usage comes unasked."""

    name = "cerebras"
    drop = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier", "verbosity"})
    asks_usage = False  # its finish chunk carries usage anyway (the gateway does not rely on the option)
    ends_with_done = False

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """Always re-serialised without :attr:`drop` and without ``stream_options.include_obfuscation`` (an OpenAI
        option it answers 422); ``stream_options`` only on a stream."""
        if needs_exact(raw):
            body = loads_exact(raw)  # an integer past 64 bits must stay exact
        out = {k: v for k, v in body.items() if k not in self.drop}
        out["model"] = upstream_model
        options = out.get("stream_options")
        if body.get("stream") is not True:
            out.pop("stream_options", None)
        elif isinstance(options, dict) and "include_obfuscation" in options:
            out["stream_options"] = {k: v for k, v in options.items() if k != "include_obfuscation"}
        return dumps(out)
