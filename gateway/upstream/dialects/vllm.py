"""The ``vllm`` dialect: self-hosted OpenAI-compatible servers (vLLM, SGLang, llama.cpp's ``llama-server`` and
``llama-cpp-python``). Facts (their server docs; the ``vllm_*`` and ``llamacpp_*`` fixtures): ``llama-cpp-python``
reads ``max_tokens`` only and refuses a null ``content`` beside ``tool_calls``; ``llama-server`` runs a ``tool_choice``
naming a function as ``auto``; no rate-limit headers; the Responses API is partial (bridged)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import EmptyStream, GatewayError, UpstreamStatusError
from gateway.upstream.dialects.base import Dialect
from gateway.wire.body import dumps, replace_top_level


class VLLM(Dialect):
    """OpenAI's rules; a body is rewritten only where it has what these servers misread (module docstring)."""

    name = "vllm"
    member = "timings"  # llama.cpp's llama-server: on the last chunk it sends
    prompt_cache_key = False  # vLLM's and llama.cpp's prefix caches are keyed by the prompt alone

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        limit = body.get("max_completion_tokens")
        if limit is not None and body.get("max_tokens") is None:
            if "max_tokens" in body:  # null: replaced, never a second member the parser would read instead
                raw = replace_top_level(raw, b"max_tokens", dumps(limit))
            else:  # a member added in front: the client's bytes stay as they are
                start = raw.index(b"{") + 1
                raw = raw[:start] + b'"max_tokens":' + dumps(limit) + b"," + raw[start:]
            body = {**body, "max_tokens": limit}
        named = _named_tools(body)
        if named is not None:  # llama-server reads tool_choice as a string only: "required" with that tool alone
            raw = replace_top_level(replace_top_level(raw, b"tool_choice", b'"required"'), b"tools", dumps(named))
            body = {**body, "tool_choice": "required", "tools": named}
        if b"null" in raw and _null_beside_calls(body.get("messages")):  # the bytes test spares the scan
            messages = [{**m, "content": ""} if _null_turn(m) else m for m in body["messages"]]
            raw = replace_top_level(raw, b"messages", dumps(messages))
            body = {**body, "messages": messages}
        return super().body(raw, body, upstream_model, ask_usage)

    def member_facts(self, value: Any) -> tuple[dict[str, Any] | None, dict[str, float] | None]:
        """llama-server's ``timings``: ``predicted_n`` and ``prompt_n`` are tokens; its milliseconds are not read."""
        if isinstance(value, dict) and "predicted_n" in value:
            return {"prompt_tokens": value.get("prompt_n", 0), "completion_tokens": value["predicted_n"]}, None
        return None, None

    def cause(self, exc: GatewayError, upstream: UpstreamConfig, need_tokens: int) -> GatewayError:
        """An empty 200 stream from a server whose ``context_window`` the prompt overflows (llama-cpp-python answers
        a streamed over-long prompt so) is the client's 400: tried nowhere else, resting nobody."""
        window = upstream.context_window
        if isinstance(exc, EmptyStream) and window is not None and need_tokens > window:
            return UpstreamStatusError(400, f"This model's maximum context length is {window} tokens, and the request "
                                       f"needs about {need_tokens} (the upstream answered an empty stream).",
                                       error_type="invalid_request_error", param="messages",
                                       code="context_length_exceeded")
        return exc

    def status_error(self, status: int, data: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
        """A 500 in pydantic's validation words (llama-cpp-python refusing a body) is the client's 400; a server's
        file paths are not passed on."""
        err = super().status_error(status, data, headers)
        message = _PATHS.sub("<server file>", err.message)
        if err.status == 500 and _VALIDATION.search(message):
            return UpstreamStatusError(400, message, error_type="invalid_request_error", param=err.param,
                                       code=err.code if err.code and not err.code.isdigit() else "invalid_request",
                                       headers=err.headers)
        if message != err.message:
            return UpstreamStatusError(err.status, message, error_type=err.error_type, param=err.param,
                                       code=err.code, headers=err.headers)
        return err


# pydantic's validation wording (what llama-cpp-python's FastAPI server answers 500 with for a body it refuses)
_VALIDATION = re.compile(r"validation error|Input should be|Field required|Extra inputs are not permitted")
# a server-side source path in an error message (a Python traceback's file): not the client's business
_PATHS = re.compile(r"(?:/[\w.+-]+){2,}\.(?:py|cpp|c|h|hpp)\b")


def _named_tools(body: Mapping[str, Any]) -> list[Any] | None:
    """None for any other choice, or a name no tool has: the server then says so."""
    choice = body.get("tool_choice")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(body.get("tools"), list):
        return None
    named = [t for t in body["tools"] if isinstance(t, dict) and isinstance(t.get("function"), dict)
             and t["function"].get("name") == name]
    return named or None


def _null_turn(message: Any) -> bool:
    return (isinstance(message, dict) and message.get("role") == "assistant" and "content" in message
            and message["content"] is None and bool(message.get("tool_calls")))


def _null_beside_calls(messages: Any) -> bool:
    return isinstance(messages, list) and any(_null_turn(m) for m in messages)
