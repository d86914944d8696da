"""The Responses bridge's whole-answer side: a chat completion as a Response object (OpenAI API reference, "The
response object"). :class:`Draft` is shared with the stream side, so that both echo a request alike."""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import UpstreamBadResponse
from gateway.responses.ids import new_id
from gateway.responses.request import _dict, _list, custom_tool_names
from gateway.stream.stats import served_tier
from gateway.wire.body import dumps, loads


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAPI ``CompletionUsage`` -> ``ResponseUsage``."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
    details = _dict(usage.get("prompt_tokens_details"))
    cached, written = _int(details.get("cached_tokens")), _int(details.get("cache_write_tokens"))
    reasoning = _int(_dict(usage.get("completion_tokens_details")).get("reasoning_tokens"))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": _int(usage.get("total_tokens")) or prompt + completion}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _content_text(content: Any) -> str:
    """A string, or a parts list: some servers send one in answers too."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in _list(content) if isinstance(p, dict) and isinstance(p.get("text"), str))


_LOGPROB_KEYS = ("token", "logprob", "bytes")


def _logprobs(logprobs: Any) -> list[dict[str, Any]]:
    """OpenAPI ``ChatCompletionTokenLogprob`` -> ``ResponseOutputText.Logprob``: the same fields."""
    out = []
    for entry in _list(_dict(logprobs).get("content")):
        if isinstance(entry, dict) and isinstance(entry.get("token"), str):
            top = [{k: t.get(k) or ([] if k == "bytes" else t.get(k)) for k in _LOGPROB_KEYS}
                   for t in _list(entry.get("top_logprobs")) if isinstance(t, dict)]
            out.append({"token": entry["token"], "logprob": entry.get("logprob", 0.0),
                        "bytes": entry.get("bytes") or [], "top_logprobs": top})
    return out


class Draft:
    """Echoes the request with the values used: every field the Open Responses specification's ``Response``
    requires, a sampling setting the client left out as the default the upstream applied. ``model`` is the upstream's
    once its answer names it, as OpenAI names the snapshot it resolved an alias to; until then, the client's."""

    def __init__(self, body: dict[str, Any], response_id: str, named: bool = False) -> None:
        """``named``: the client's model name stays (``answers.model: requested``)."""
        self.id = response_id
        self.body = body
        self.created_at = int(time.time())
        self.model: str = body["model"]
        self.named = named
        self.custom = custom_tool_names(body)  # calls of these are custom_tool_call items
        self.served: str | None = None  # the service tier the upstream said it served, once it did

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        text = _dict(b.get("text"))
        reasoning = _dict(b.get("reasoning"))
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error, "conversation": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": b.get("max_tool_calls") if isinstance(b.get("max_tool_calls"), int) else None,
            "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "previous_response_id": b.get("previous_response_id"), "prompt": None,
            "prompt_cache_key": b.get("prompt_cache_key"), "prompt_cache_retention": None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": None},
            "safety_identifier": b.get("safety_identifier"),
            "service_tier": self.served or b.get("service_tier") or "default", "store": b.get("store", True),
            "temperature": _number(b.get("temperature"), 1.0), "top_p": _number(b.get("top_p"), 1.0),
            "presence_penalty": _number(b.get("presence_penalty"), 0.0),
            "frequency_penalty": _number(b.get("frequency_penalty"), 0.0),
            "top_logprobs": b.get("top_logprobs") if isinstance(b.get("top_logprobs"), int) else 0,
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity") or "medium"},
            "tool_choice": b.get("tool_choice") or "auto",
            "tools": [_tool(t) for t in _list(b.get("tools")) if _served_tool(t)],
            "truncation": b.get("truncation", "disabled"), "usage": usage, "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }


def _number(value: Any, default: float) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else default


def _served_tool(tool: Any) -> bool:
    """Echoed: what the bridge served; a hosted tool it dropped (``droppable_tools``) was not offered to the model."""
    return not isinstance(tool, dict) or tool.get("type") in ("function", "custom", "namespace")


def _tool(tool: Any) -> Any:
    """``strict`` false unless the client set it: the bridge asks the chat upstream for no strict schema."""
    if isinstance(tool, dict) and tool.get("type") == "function" and "strict" not in tool:
        return {**tool, "strict": False}
    return tool


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def whole_response(completion: dict[str, Any], draft: Draft) -> dict[str, Any]:
    """Reasoning, then the message, then one item per tool call (``custom_tool_call`` for a freeform
    tool). Raises UpstreamBadResponse for a 200 without a chat completion message."""
    choices = _list(completion.get("choices"))
    choice = _dict(choices[0]) if choices else {}
    message = choice.get("message")
    if "error" in completion or not isinstance(message, dict):
        raise UpstreamBadResponse("The upstream answered 200 without a chat completion message.")
    if isinstance(completion.get("model"), str) and not draft.named:
        draft.model = completion["model"]
    draft.served = served_tier(completion)
    incomplete = _INCOMPLETE.get(str(choice.get("finish_reason")))
    status = "incomplete" if incomplete else "completed"  # the items the limit cut too, as the API marks them
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append({"id": new_id("rs_tg"), "type": "reasoning", "status": "completed", "summary": [],
                       "content": [{"type": "reasoning_text", "text": reasoning}]})
    parts: list[dict[str, Any]] = []
    text = _content_text(message.get("content"))
    if text:
        parts.append({"type": "output_text", "text": text, "annotations": [],
                      "logprobs": _logprobs(choice.get("logprobs"))})
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        parts.append({"type": "refusal", "refusal": message["refusal"]})
    if parts:
        output.append({"id": new_id("msg_tg"), "type": "message", "status": status, "role": "assistant",
                       "content": parts})
    for call in _list(message.get("tool_calls")):
        call = _dict(call)
        fn = _dict(call.get("function"))
        call_id, name = _str(call.get("id")) or new_id("call_tg"), _str(fn.get("name"))
        if name in draft.custom:
            output.append({"id": new_id("ctc_tg"), "type": "custom_tool_call", "status": status, "call_id": call_id,
                           "name": name, "input": custom_input(_arguments(fn.get("arguments")))})
            continue
        output.append({"id": new_id("fc_tg"), "type": "function_call", "status": status, "call_id": call_id,
                       "name": name, "arguments": _arguments(fn.get("arguments"))})
    return draft.response(status, output,
                          response_usage(completion.get("usage")), incomplete)


def _arguments(value: Any) -> str:
    """llama.cpp may send the arguments as JSON, not as a JSON string."""
    if isinstance(value, dict | list):
        return dumps(value).decode()
    return _str(value)


def custom_input(arguments: str) -> str:
    """A freeform tool is offered to a chat upstream as a function taking ``{"input": "..."}``; arguments
    that are not that object are the input as they came."""
    try:
        parsed = loads(arguments.encode())
    except ValueError:
        return arguments
    value = parsed.get("input") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments
