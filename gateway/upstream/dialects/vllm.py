"""The ``vllm`` dialect: OpenAI-compatible inference servers run by the user (vLLM, SGLang, llama.cpp's
``llama-server`` and ``llama-cpp-python``), the usual open-weight standard tier and a home-grown fast one.

Facts (vLLM's and llama.cpp's server docs; the recorded ``vllm_chat_stream`` and ``llamacpp_*`` fixtures; a llama.cpp
server behind the gateway): their extra sampling fields (``chat_template_kwargs``, ``min_tokens``, ``top_k``,
``repetition_penalty``, ...) are the client's and pass through byte for byte; a stream reports usage only when
``stream_options.include_usage`` asks (the gateway asks, so every stream is counted; one that still sends none is
counted from its token chunks, marked estimated); ``llama-cpp-python`` reads ``max_tokens`` only and ignores
``max_completion_tokens`` (what the Responses bridge and newer clients send), so the limit is sent in both; it also
refuses an assistant turn whose ``content`` is null beside its ``tool_calls`` (valid OpenAI, what the bridge sends for a
tool call), so such a turn gets ``""``; ``llama-server`` reads ``tool_choice`` only as a string and runs a choice naming
a function as ``auto``, so that is sent as ``required`` with the named tool alone; a prompt over the context window is
answered 400 (vLLM, ``llama-server``) or 500 (``llama-cpp-python``, older vLLM), both read as 400
``context_length_exceeded``; an error event may put the status in an integer ``code``; no rate-limit headers; the
Responses API is partial or missing, so it is served through the bridge, and ``/v1/completions`` and ``/v1/embeddings``
by the passthrough.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import EmptyStream, GatewayError, UpstreamStatusError
from gateway.upstream.dialects.base import Dialect
from gateway.wire.body import dumps, replace_top_level


class VLLM(Dialect):
    """Self-hosted OpenAI-compatible servers: OpenAI's rules, the length limit in both fields, and no null content
    beside tool calls (both only when the request has them: other bodies are the client's bytes)."""

    name = "vllm"
    member = "timings"  # llama.cpp's llama-server: on the last chunk it sends
    prompt_cache_key = False  # vLLM's and llama.cpp's prefix caches are keyed by the prompt alone

    def body(self, raw: bytes, body: Mapping[str, Any], upstream_model: str, ask_usage: bool) -> bytes:
        """As OpenAI's, with ``max_tokens`` beside a ``max_completion_tokens`` that has none, a ``tool_choice`` naming
        a function sent as ``required`` with that tool alone, and an assistant turn's null ``content`` beside
        ``tool_calls`` sent as ``""``."""
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
        """llama-server's ``timings`` with ``predicted_n`` (tokens generated) and ``prompt_n`` (prompt tokens it
        evaluated) as usage, for a stream whose server sent no ``usage`` (one that ignores
        ``stream_options.include_usage``). Its milliseconds are not read."""
        if isinstance(value, dict) and "predicted_n" in value:
            return {"prompt_tokens": value.get("prompt_n", 0), "completion_tokens": value["predicted_n"]}, None
        return None, None

    def cause(self, exc: GatewayError, upstream: UpstreamConfig, need_tokens: int) -> GatewayError:
        """An empty 200 stream from a server whose ``context_window`` the request's estimate exceeds is the prompt
        overflowing it (llama-cpp-python answers a streamed over-long prompt so): the client's 400, which no other
        upstream is tried with and which rests nobody; a 500 that reads as the server's request validation is a
        400 too. Anything else: ``exc``."""
        window = upstream.context_window
        if isinstance(exc, EmptyStream) and window is not None and need_tokens > window:
            return UpstreamStatusError(400, f"This model's maximum context length is {window} tokens, and the request "
                                       f"needs about {need_tokens} (the upstream answered an empty stream).",
                                       error_type="invalid_request_error", param="messages",
                                       code="context_length_exceeded")
        return exc

    def status_error(self, status: int, data: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
        """As OpenAI's; a 500 whose message is the server's request validation (pydantic's words, as
        llama-cpp-python answers a body it refuses) is the client's 400, and a server's file paths are not passed
        on."""
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
    """The tools of a request whose ``tool_choice`` names one function (``{"type": "function", "function":
    {"name"}}``): that function's tool alone; None for any other choice, or a name no tool has (the server says)."""
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
