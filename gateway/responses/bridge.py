"""The Responses API bridge: a ``POST /v1/responses`` request served by a chat-completions upstream, and its answer
turned back into a Response object, or into the typed Responses event stream as each chunk arrives.

Request side (:func:`chat_request`), OpenAI API reference "Create a model response" -> "Create chat completion":

==========================================  =============================================================
Responses                                   chat completions
==========================================  =============================================================
``instructions``                            a first ``system`` message (this turn's only, as the API does)
``input`` string                            one ``user`` message
``message`` items (``input_text``,          messages (``text``, ``image_url``, ``file`` parts; an assistant's
``input_image``, ``input_file``,            ``output_text`` as its content, ``refusal`` as its refusal);
``output_text``, ``refusal``)               ``developer`` as ``system``
``function_call`` items                     the assistant message's ``tool_calls`` (consecutive calls: one)
``function_call_output`` items              ``tool`` messages
``reasoning`` items                         dropped (chat upstreams take no reasoning input)
function ``tools`` (flat)                   ``tools`` (nested under ``function``)
``tool_choice``, ``parallel_tool_calls``    the same (a named function nested)
``max_output_tokens``                       ``max_completion_tokens``
``temperature``, ``top_p``, ``user``,       the same
``safety_identifier``, ``service_tier``,
``prompt_cache_key``
``text.format`` ``json_schema`` /           ``response_format`` ``json_schema`` / ``json_object``
``json_object``; ``text.verbosity``         ``verbosity``
``reasoning.effort``                        ``reasoning_effort``
``top_logprobs``, include                   ``logprobs`` and ``top_logprobs``
``message.output_text.logprobs``
==========================================  =============================================================

The upstream's dialect rules then apply (``gateway.wire.body.upstream_body``: Cerebras gets its allowlist). Dropped on
purpose, because a chat upstream cannot act on them and they change no output: ``store`` and ``metadata`` (kept
by the gateway, echoed in the response), ``reasoning.summary`` (no summaries come from chat), caching hints
(``prompt_cache_retention``, ``prompt_cache_options``), ``stream_options``, ``truncation: "disabled"``. Anything
else the bridge cannot serve (:func:`unbridgeable`: built-in tools such as ``web_search``, ``file_search``,
``computer_use``, ``code_interpreter``; ``background``; ``include`` values a chat upstream cannot produce, such as
``reasoning.encrypted_content``; ``truncation: "auto"``; stored ``prompt`` templates; images by ``file_id``; tool
outputs with images or files; unknown fields and item types; values of the wrong type) is never dropped: the
policy sends the request to an upstream that serves it natively, or answers 400 naming the parameter.

Response side: a chat completion becomes a Response object (:func:`whole_response`); a chat stream becomes the
Responses event stream (:class:`BridgeRelay`): ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, ``response.content_part.added``, the deltas (``response.output_text.delta``,
``response.refusal.delta``, ``response.reasoning_text.delta``, ``response.function_call_arguments.delta``), their
``.done`` events and ``response.output_item.done``, and exactly one terminal event: ``response.completed``,
``response.incomplete`` (``finish_reason: "length"`` -> ``max_output_tokens``, ``content_filter``) or
``response.failed`` (an upstream failure after the first token). Every event is ``event: <type>`` plus its data,
numbered by ``sequence_number``; no ``[DONE]``. Usage maps to ``input_tokens`` / ``output_tokens`` with their
details (wire contract §5).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from gateway.errors import UpstreamBadResponse, event_error
from gateway.stream.relay import Relay, Write, delta_has_token
from gateway.stream.sse import SSEEvent
from gateway.wire.body import dumps, loads

ID_PREFIX = "resp_tg"  # the ids of responses the gateway made: it knows an unknown one of these expired
# fields of a Responses request the bridge maps or may drop (module docstring); anything else is not bridged
_BRIDGED_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "text", "reasoning", "stream", "stream_options", "user", "safety_identifier", "metadata",
    "store", "previous_response_id", "include", "truncation", "service_tier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "top_logprobs", "background"})
_INCLUDES = frozenset({"message.output_text.logprobs", "message.input_image.image_url"})
_ITEMS = frozenset({"message", "function_call", "function_call_output", "reasoning"})
_PARTS = frozenset({"input_text", "output_text", "input_image", "input_file", "refusal", "text"})


def new_id(prefix: str) -> str:
    """A fresh id: ``resp_tg<32 hex>`` for responses, ``msg_tg...``, ``fc_tg...``, ``rs_tg...`` for items."""
    return f"{prefix}{os.urandom(16).hex()}"


# ---- request side ---------------------------------------------------------------------------------------------

def unbridgeable(body: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(param, why, error code) of the first thing in a Responses request that the bridge cannot serve, or None:
    ``unsupported_parameter`` for what a chat-completions upstream cannot do, ``invalid_type`` for a value of the
    wrong shape (which the bridge would otherwise have to drop or guess at; a native upstream judges it itself).

    Source of the rules: the module docstring; what ``openai-agents`` and LangChain send was checked against it.
    """
    shape = _shape_problem(body)
    if shape is not None:
        return (*shape, "invalid_type")
    found = _field_problem(body) or _tool_problem(body) or _input_problem(body)
    return None if found is None else (*found, "unsupported_parameter")


_SHAPES: tuple[tuple[str, type | tuple[type, ...], str], ...] = (
    ("instructions", str, "a string"), ("tools", list, "an array"), ("tool_choice", (str, dict), "a string or an "
     "object"), ("text", dict, "an object"), ("reasoning", dict, "an object"), ("include", list, "an array"),
    ("metadata", dict, "an object"), ("parallel_tool_calls", bool, "a boolean"), ("max_output_tokens", int,
                                                                                   "an integer"))


def _shape_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    for key, kind, want in _SHAPES:
        value = body.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is int):
            return key, f"Invalid type for '{key}': expected {want}"
    if body.get("text") is not None and not isinstance(body["text"].get("format", {}), dict):
        return "text.format", "Invalid type for 'text.format': expected an object"
    for i, tool in enumerate(_list(body.get("tools"))):
        if not isinstance(tool, dict) or tool.get("type") == "function" and not isinstance(tool.get("name"), str):
            return f"tools[{i}]", f"Invalid value for 'tools[{i}]': a function tool needs a string `name`"
    for i, item in enumerate(_list(body.get("input"))):
        problem = _item_shape(item)
        if problem:
            return f"input[{i}]", f"Invalid value for 'input[{i}]': {problem}"
    return None


def _item_shape(item: dict[str, Any]) -> str | None:
    """What is wrong with the shape of one input item (``wire`` made sure it is an object), or None."""
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if not isinstance(content, str | list):
            return "`content` must be a string or an array of content parts"
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                return "content parts must be objects"
            for key in ("text", "refusal", "image_url"):
                if part.get(key) is not None and not isinstance(part[key], str):
                    return f"a content part's `{key}` must be a string"
    elif kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            return "a `function_call` needs string `call_id`, `name` and `arguments`"
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str) or not (isinstance(output, str) or isinstance(output, list) and all(
                isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in output)):
            return "a `function_call_output` needs a string `call_id` and a string (or text parts) `output`"
    return None


def _field_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    for key in body:
        if key not in _BRIDGED_FIELDS:
            return key, f"`{key}` is not part of what the gateway's Responses bridge serves"
    if body.get("background") is True:
        return "background", "background responses need the Responses API itself"
    if body.get("truncation") not in (None, "disabled"):
        return "truncation", "`truncation: auto` needs the Responses API itself"
    for value in _list(body.get("include")):
        if value not in _INCLUDES:
            return "include", f"include `{value}` cannot be produced by a chat-completions upstream"
    fmt = _dict(_dict(body.get("text")).get("format"))
    if fmt and fmt.get("type") not in ("text", "json_schema", "json_object"):
        return "text.format", f"text.format `{fmt.get('type')}` is not bridged"
    return None


def _tool_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    for tool in _list(body.get("tools")):
        kind = _dict(tool).get("type")
        if kind != "function":
            return "tools", f"the `{kind}` tool runs inside the Responses API; only function tools are bridged"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        return "tool_choice", f"tool_choice of type `{choice.get('type')}` needs the Responses API itself"
    return None


def _input_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    for i, item in enumerate(_list(body.get("input"))):
        if not isinstance(item, dict):
            return "input", "input items must be objects"
        kind = item.get("type", "message")
        if kind not in _ITEMS:
            return "input", f"input items of type `{kind}` need the Responses API itself"
        if kind == "reasoning":
            continue  # dropped whole, whatever it holds (a client sends back the reasoning it was given)
        output = item.get("output")
        if kind == "function_call_output" and isinstance(output, list) and any(
                _dict(p).get("type") not in ("input_text", "output_text", "text") for p in output):
            return f"input[{i}].output", "a tool output with images or files needs the Responses API itself (a " \
                "chat `tool` message holds text only)"
        for part in _list(item.get("content")):
            if _dict(part).get("type") not in _PARTS:
                return "input", f"content parts of type `{_dict(part).get('type')}` are not bridged"
            if _dict(part).get("type") == "input_image" and not _dict(part).get("image_url"):
                return "input", "an `input_image` by `file_id` needs the Responses API itself"  # chat takes URLs
    return None


def input_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as Responses items (a string becomes one user message), each with an ``id``."""
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    out = []
    for item in _list(raw):
        item = {"type": "message", **item} if "type" not in item else dict(item)
        item.setdefault("id", new_id({"message": "msg_tg", "function_call": "fc_tg"}.get(item["type"], "it_tg")))
        out.append(item)
    return out


OWN_ITEM_PREFIXES = ("msg_tg", "fc_tg", "rs_tg", "it_tg")  # ids of the output items the gateway made (new_id)


def native_input(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """For a native upstream: the request's ``input`` without what only the gateway knows, or None when it holds
    nothing of the gateway's. A client that resends a bridged conversation in full sends back the gateway's item
    ids, which the upstream never issued (and reasoning it cannot read): :func:`as_input` takes them off those
    items; items the upstream made keep their ids."""
    items = _list(body.get("input"))
    own = [isinstance(i, dict) and str(i.get("id", "")).startswith(OWN_ITEM_PREFIXES) for i in items]
    if not any(own):
        return None
    return [cleaned for item, mine in zip(items, own, strict=True)
            for cleaned in (as_input([item]) if mine else [item])]


def as_input(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation the gateway holds, as input items for a native Responses upstream: without the gateway's own
    item ids and statuses (the upstream never stored those items) and without reasoning items (the upstream cannot
    read reasoning another model wrote)."""
    out = []
    for item in items:
        if item.get("type") == "reasoning":
            continue
        out.append({k: v for k, v in item.items() if k not in ("id", "status")})
    return out


def chat_request(body: Mapping[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body for a bridgeable Responses request (:func:`unbridgeable` is None), continuing
    ``history`` (the held conversation's items, or ``[]``). See the module docstring for the mapping."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    messages += _messages([*history, *input_items(body)])
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    tools = [_chat_tool(t) for t in _list(body.get("tools"))]
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    for key in ("parallel_tool_calls", "temperature", "top_p", "user", "safety_identifier", "service_tier",
                "prompt_cache_key", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    _output_options(body, chat)
    return chat


def _output_options(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    """``text.format`` / ``verbosity``, ``reasoning.effort`` and logprobs into ``chat``."""
    text = _dict(body.get("text"))
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if text.get("verbosity") is not None:
        chat["verbosity"] = text["verbosity"]
    effort = _dict(body.get("reasoning")).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("top_logprobs") is not None or "message.output_text.logprobs" in _list(body.get("include")):
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _messages(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items -> chat messages; consecutive function calls join the assistant message before them."""
    out: list[dict[str, Any]] = []
    assistant_open = False  # the last message is an assistant turn that tool calls may still join
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            msg = _message(item)
            if msg["role"] == "assistant" and msg["content"] is None and "refusal" not in msg:
                continue  # nothing said (a response that failed before its text): chat APIs refuse it
            out.append(msg)
            assistant_open = msg["role"] == "assistant"
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}
            if not assistant_open:
                out.append({"role": "assistant", "content": None})
                assistant_open = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"))})
            assistant_open = False
        # reasoning items: a chat upstream takes no reasoning input
    return out


def _message(item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role", "user")
    role = "system" if role == "developer" else role
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    parts = [p for p in _list(content) if isinstance(p, dict)]
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(
            p.get("text", "") for p in parts if p.get("type") in ("output_text", "text", "input_text")) or None}
        refusal = "".join(p.get("refusal", "") for p in parts if p.get("type") == "refusal")
        if refusal:
            msg["refusal"] = refusal
        return msg
    chat = [_chat_part(p) for p in parts]
    if all(p["type"] == "text" for p in chat) and (len(chat) == 1 or role == "system"):
        # plain text as a string: what every chat server takes (several take no parts list in system messages)
        return {"role": role, "content": "\n\n".join(p["text"] for p in chat)}
    return {"role": role, "content": chat}


def _chat_part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "input_image":
        image: dict[str, Any] = {"url": part.get("image_url")}
        if part.get("detail"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        return {"type": "file", "file": {k: part[k] for k in ("file_data", "file_id", "filename") if k in part}}
    return {"type": "text", "text": part.get("text", "")}


def _text(output: Any) -> str:
    """A function call's output as text (a string, or ``input_text`` parts)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(p.get("text", "") for p in output if isinstance(p, dict))
    return orjson.dumps(output).decode()


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# ---- response side --------------------------------------------------------------------------------------------

def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat ``usage`` as a Responses ``ResponseUsage`` (OpenAPI ``CompletionUsage`` -> ``ResponseUsage``)."""
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
    """A chat message's or delta's content as text: a string, or the text of its ``text`` parts (some servers send
    parts lists in answers too)."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in _list(content) if isinstance(p, dict) and isinstance(p.get("text"), str))


_LOGPROB_KEYS = ("token", "logprob", "bytes")


def _logprobs(logprobs: Any) -> list[dict[str, Any]]:
    """Chat ``choice.logprobs.content`` as Responses ``logprobs`` (the same fields: token, logprob, bytes and
    top_logprobs; OpenAPI ``ChatCompletionTokenLogprob`` -> ``ResponseOutputText.Logprob``)."""
    out = []
    for entry in _list(_dict(logprobs).get("content")):
        if isinstance(entry, dict) and isinstance(entry.get("token"), str):
            top = [{k: t.get(k) or ([] if k == "bytes" else t.get(k)) for k in _LOGPROB_KEYS}
                   for t in _list(entry.get("top_logprobs")) if isinstance(t, dict)]
            out.append({"token": entry["token"], "logprob": entry.get("logprob", 0.0),
                        "bytes": entry.get("bytes") or [], "top_logprobs": top})
    return out


class Draft:
    """The Response object a bridged request answers with, echoing the request (OpenAPI ``Response``).

    Args:
        body: the Responses request; response_id: its id (:func:`new_id` with :data:`ID_PREFIX`).
    """

    def __init__(self, body: dict[str, Any], response_id: str) -> None:
        self.id = response_id
        self.body = body
        self.created_at = int(time.time())
        self.model: str = body["model"]

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        text = _dict(b.get("text"))
        reasoning = _dict(b.get("reasoning"))
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": None},
            "service_tier": b.get("service_tier"), "store": b.get("store", True),
            "temperature": b.get("temperature"), "text": {"format": text.get("format") or {"type": "text"},
                                                          "verbosity": text.get("verbosity")},
            "tool_choice": b.get("tool_choice") or "auto", "tools": _list(b.get("tools")), "top_p": b.get("top_p"),
            "truncation": b.get("truncation", "disabled"), "usage": usage, "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def whole_response(completion: dict[str, Any], draft: Draft) -> dict[str, Any]:
    """A chat completion (non-streaming) as the Response object: reasoning, then the message (text and refusal
    parts), then one ``function_call`` item per tool call; ``finish_reason: "length"`` -> ``incomplete``."""
    choices = _list(completion.get("choices"))
    choice = _dict(choices[0]) if choices else {}
    message = choice.get("message")
    if "error" in completion or not isinstance(message, dict):
        raise UpstreamBadResponse("The upstream answered 200 without a chat completion message.")
    if isinstance(completion.get("model"), str):
        draft.model = completion["model"]
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
        output.append({"id": new_id("fc_tg"), "type": "function_call", "status": status,
                       "call_id": _str(call.get("id")) or new_id("call_tg"), "name": _str(fn.get("name")),
                       "arguments": _str(fn.get("arguments"))})
    return draft.response(status, output,
                          response_usage(completion.get("usage")), incomplete)


class _Item:
    """One output item being streamed: its index, id, kind and what it accumulated."""

    __slots__ = ("index", "id", "kind", "pieces", "refusals", "logprobs", "text_part", "refusal_part", "call_id",
                 "name", "done", "status", "heads")

    def __init__(self, index: int, kind: str, prefix: str) -> None:
        self.index = index
        self.id = new_id(prefix)
        self.kind = kind
        # joined when done: ``+=`` on an attribute copies the whole text per delta (quadratic in its length)
        self.pieces: list[str] = []  # message: output text; reasoning: reasoning text; function_call: arguments
        self.refusals: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # of the output text, when the request asked for them
        self.text_part: int | None = None  # content index of the output_text (or reasoning_text) part, once opened
        self.refusal_part: int | None = None
        self.call_id = ""
        self.name = ""
        self.done = False
        self.status = "in_progress"  # completed or incomplete once done
        self.heads: dict[str, bytes] = {}  # delta event type -> its bytes up to the delta (see BridgeRelay._delta)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def seal(self, status: str = "completed") -> None:
        """The item is done (``status``): its text joined once (``text`` is then the string itself)."""
        self.done = True
        self.status = status
        self.pieces = ["".join(self.pieces)]
        self.refusals = ["".join(self.refusals)]

    @property
    def refusal(self) -> str:
        return "".join(self.refusals)

    def item(self, status: str) -> dict[str, Any]:
        """The output item: empty while ``in_progress``; with what it holds when ``completed`` or ``incomplete`` (a
        stream that failed keeps the text it had sent); message parts in the order they were opened."""
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id,
                    "name": self.name, "arguments": self.text}
        held = status != "in_progress"
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}] if held else []
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        parts: list[tuple[int, dict[str, Any]]] = []
        if held and self.text_part is not None:
            parts.append((self.text_part, {"type": "output_text", "text": self.text, "annotations": [],
                                           "logprobs": self.logprobs}))
        if held and self.refusal_part is not None:
            parts.append((self.refusal_part, {"type": "refusal", "refusal": self.refusal}))
        return {"id": self.id, "type": "message", "status": status, "role": "assistant",
                "content": [p for _, p in sorted(parts, key=lambda p: p[0])]}


class BridgeRelay(Relay):
    """The relay of a bridged stream: reads a chat-completions stream, writes the Responses event stream.

    It keeps the relay's contract (``gateway.stream.relay``): nothing is written before the first token, so an error
    before it is still an HTTP error; usage, first and last token and the finish are observed per chunk; the stream ends
    at ``[DONE]``, at EOF, or ``finish_grace`` after every choice finished. What it writes is translated, per chunk as
    it arrives (module docstring). ``output`` holds the finished output items, ``response`` the final Response object.
    """

    def __init__(self, draft: Draft, *, max_event_bytes: int, finish_grace: float,
                 hold_seconds: float | None = None) -> None:
        super().__init__(strip_usage_chunk=True, max_event_bytes=max_event_bytes, finish_grace=finish_grace,
                         hold_seconds=hold_seconds)
        self.draft = draft
        self.response: dict[str, Any] | None = None
        self._seq = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None  # the message or reasoning item taking deltas
        self._calls: dict[int, _Item] = {}  # chat tool-call index -> its function_call item
        self._finish: str | None = None
        self._started = False

    def _emit(self, out: list[bytes], kind: str, **fields: Any) -> None:
        data = dumps({"type": kind, **fields, "sequence_number": self._seq})  # echoes may hold a lone surrogate
        self._seq += 1
        out.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    def _delta(self, out: list[bytes], kind: str, item: _Item, text: str, content_index: int | None) -> None:
        """One delta event, the same bytes :meth:`_emit` would write for ``type, item_id, output_index,
        [content_index,] delta[, logprobs], sequence_number``, from a head built once per item and event type:
        the delta is the one part that changes per chunk (measured: bench/bridge.py)."""
        head = item.heads.get(kind)
        if head is None:
            fields: dict[str, Any] = {"type": kind, "item_id": item.id, "output_index": item.index}
            if content_index is not None:
                fields["content_index"] = content_index
            head = item.heads[kind] = (b"event: " + kind.encode() + b"\ndata: " + dumps(fields)[:-1]
                                       + b',"delta":')
        tail = b',"logprobs":[],"sequence_number":%d}\n\n' if kind == "response.output_text.delta" else \
            b',"sequence_number":%d}\n\n'
        out.append(head + dumps(text) + tail % self._seq)
        self._seq += 1

    def _start(self, out: list[bytes]) -> None:
        if not self._started:
            self._started = True
            head = self.draft.response("in_progress", [])
            self._emit(out, "response.created", response=head)
            self._emit(out, "response.in_progress", response=head)

    def _process(self, events: list[SSEEvent], now: float) -> bytes:
        stats = self.stats
        out: list[bytes] = []
        for _raw, data, event in events:
            if stats.done or data is None:  # keep-alive comments are not relayed: events carry the stream
                continue
            if data.startswith(b"[DONE]"):
                self._terminal(out)
                continue
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                try:
                    chunk = loads(data)  # e.g. a lone surrogate escape (an emoji split by the upstream)
                except ValueError:
                    chunk = None
                if type(chunk) is not dict:  # nothing can be translated from it: never a silent gap
                    stats.error = "upstream_bad_response"
                    self._failed(out, None, "upstream_bad_response", "The upstream sent an event that is not JSON.")
                    continue
            if type(chunk) is not dict:
                continue
            self._start(out)
            if isinstance(chunk.get("model"), str):
                self.draft.model = chunk["model"]
            had_error = stats.error
            self._observe(chunk, event, now)  # usage, first/last token, finish_reason, an error
            if stats.error and not had_error:
                self._failed(out, chunk)
                continue
            for choice in _list(chunk.get("choices")):
                if isinstance(choice, dict):
                    self._choice(choice, out)
        return b"".join(out)

    def _choice(self, choice: dict[str, Any], out: list[bytes]) -> None:
        if choice.get("index", 0) != 0:
            return  # the bridge asks for one choice; an upstream that sends more gets its first one relayed
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta_has_token(delta):
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self._reasoning(reasoning, out)
            content = delta.get("content")
            text = content if type(content) is str else _content_text(content)  # per chunk: the common case first
            if text:
                self._text(text, out, _logprobs(choice["logprobs"]) if choice.get("logprobs") else None)
            if isinstance(delta.get("refusal"), str) and delta["refusal"]:
                self._refusal(delta["refusal"], out)
            for call in _list(delta.get("tool_calls")):
                if isinstance(call, dict):
                    self._tool_call(call, out)
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]

    def _item(self, kind: str, prefix: str, out: list[bytes]) -> _Item:
        item = _Item(len(self._items), kind, prefix)
        self._items.append(item)
        self._emit(out, "response.output_item.added", output_index=item.index, item=item.item("in_progress"))
        return item

    def _message(self, out: list[bytes]) -> _Item:
        if self._open is None or self._open.kind != "message":
            self._close_open(out)
            self._close_calls(out)
            self._open = self._item("message", "msg_tg", out)
        return self._open

    def _text(self, text: str, out: list[bytes], logprobs: list[dict[str, Any]] | None = None) -> None:
        item = self._message(out)
        if item.text_part is None:
            item.text_part = (item.refusal_part is not None) + 0
            self._emit(out, "response.content_part.added", item_id=item.id, output_index=item.index,
                       content_index=item.text_part, part={"type": "output_text", "text": "", "annotations": [],
                                                           "logprobs": []})
        item.pieces.append(text)
        if logprobs:
            item.logprobs += logprobs
            self._emit(out, "response.output_text.delta", item_id=item.id, output_index=item.index,
                       content_index=item.text_part, delta=text, logprobs=logprobs)
        else:
            self._delta(out, "response.output_text.delta", item, text, item.text_part)

    def _refusal(self, text: str, out: list[bytes]) -> None:
        item = self._message(out)
        if item.refusal_part is None:
            item.refusal_part = (item.text_part is not None) + 0
            self._emit(out, "response.content_part.added", item_id=item.id, output_index=item.index,
                       content_index=item.refusal_part, part={"type": "refusal", "refusal": ""})
        item.refusals.append(text)
        self._delta(out, "response.refusal.delta", item, text, item.refusal_part)

    def _reasoning(self, text: str, out: list[bytes]) -> None:
        if self._open is None or self._open.kind != "reasoning":
            self._close_open(out)
            self._close_calls(out)
            self._open = self._item("reasoning", "rs_tg", out)
            self._open.text_part = 0
            self._emit(out, "response.content_part.added", item_id=self._open.id, output_index=self._open.index,
                       content_index=0, part={"type": "reasoning_text", "text": ""})
        item = self._open
        item.pieces.append(text)
        self._delta(out, "response.reasoning_text.delta", item, text, 0)

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        fn = _dict(call.get("function"))
        cid, name = _str(call.get("id")), _str(fn.get("name"))
        index = call.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            # no index (some servers): a new id is a new call; no id continues the last one
            known = next((i for i, c in self._calls.items() if cid and c.call_id == cid), None)
            index = known if known is not None else (len(self._calls) if cid or not self._calls else
                                                     max(self._calls))
        item = self._calls.get(index)
        if item is None or item.done:
            self._close_open(out)
            item = _Item(len(self._items), "function_call", "fc_tg")
            # a call id the stream already used would make two calls one for the client (and its SDK refuses it)
            item.call_id = cid if cid and all(c.call_id != cid for c in self._calls.values()) else new_id("call_tg")
            item.name = name
            self._items.append(item)
            self._calls[index] = item
            self._emit(out, "response.output_item.added", output_index=item.index, item=item.item("in_progress"))
        elif name and not item.name:
            item.name = name  # a name that came after the call's first delta
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments:
            item.pieces.append(arguments)
            self._delta(out, "response.function_call_arguments.delta", item, arguments, None)

    def _close_open(self, out: list[bytes], status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.seal(status)
        if item.kind == "reasoning":
            self._emit(out, "response.reasoning_text.done", item_id=item.id, output_index=item.index,
                       content_index=0, text=item.text)
            self._emit(out, "response.content_part.done", item_id=item.id, output_index=item.index,
                       content_index=0, part={"type": "reasoning_text", "text": item.text})
        else:
            if item.text_part is not None:
                part = {"type": "output_text", "text": item.text, "annotations": [], "logprobs": item.logprobs}
                self._emit(out, "response.output_text.done", item_id=item.id, output_index=item.index,
                           content_index=item.text_part, text=item.text, logprobs=item.logprobs)
                self._emit(out, "response.content_part.done", item_id=item.id, output_index=item.index,
                           content_index=item.text_part, part=part)
            if item.refusal_part is not None:
                self._emit(out, "response.refusal.done", item_id=item.id, output_index=item.index,
                           content_index=item.refusal_part, refusal=item.refusal)
                self._emit(out, "response.content_part.done", item_id=item.id, output_index=item.index,
                           content_index=item.refusal_part, part={"type": "refusal", "refusal": item.refusal})
        self._emit(out, "response.output_item.done", output_index=item.index, item=item.item(status))

    def _close_calls(self, out: list[bytes], status: str = "completed") -> None:
        for item in sorted(self._calls.values(), key=lambda i: i.index):
            if item.done:
                continue
            item.seal(status)
            self._emit(out, "response.function_call_arguments.done", item_id=item.id, output_index=item.index,
                       name=item.name, arguments=item.text)
            self._emit(out, "response.output_item.done", output_index=item.index, item=item.item(status))

    def _terminal(self, out: list[bytes]) -> None:
        """The chat stream ended well: close every item, then ``response.completed`` (or ``incomplete``)."""
        self._start(out)
        incomplete = _INCOMPLETE.get(self._finish or "")
        status = "incomplete" if incomplete else "completed"
        self._close_open(out, status)  # the items the limit cut are incomplete too, as the API marks them
        self._close_calls(out, status)
        self.response = self.draft.response(status, [i.item(i.status) for i in self._items],
                                            response_usage(self.stats.usage), incomplete)
        self._emit(out, f"response.{status}", response=self.response)
        self.stats.done = True

    def _failed(self, out: list[bytes], chunk: dict[str, Any] | None, code: str = "server_error",
                message: str = "The upstream failed mid-response.") -> None:
        """The upstream failed after the first token: ``response.failed`` with its error (never ``completed``).

        ``error.code`` is one of the Responses API's own (OpenAPI ``ResponseError``): a rate limit stays
        ``rate_limit_exceeded``, anything else the upstream or the gateway names is ``server_error``, with the
        specific code in the message."""
        self._start(out)
        if chunk is not None:
            err = event_error(chunk)
            code = err.code or err.error_type
            message = err.message
            kind = "rate_limit_exceeded" if err.status == 429 else "server_error"
        else:
            kind = "server_error"
        if code and code != kind:
            message = f"{message} ({code})"
        output = [i.item(i.status if i.done else "incomplete") for i in self._items]
        self.response = self.draft.response("failed", output, response_usage(self.stats.usage),
                                            error={"code": kind, "message": message})
        self._emit(out, "response.failed", response=self.response)
        self.stats.done = True

    async def _end(self, write: Write) -> None:
        stats = self.stats
        if stats.done:
            return
        out: list[bytes] = []
        if not stats.finished:  # an end before the answer finished truncates it: never a completed response
            stats.error = "upstream_stream_interrupted"
            self._failed(out, None, "upstream_stream_interrupted", "The upstream stream ended before the answer "
                         "was finished.")
        else:
            self._terminal(out)
        await write(b"".join(out))

    async def _broken(self, write: Write, code: str, message: str) -> None:
        stats = self.stats
        if stats.done:
            return
        if stats.finished and not stats.error:
            await self._end(write)
            return
        stats.error = code
        out: list[bytes] = []
        self._failed(out, None, code, message)
        await write(b"".join(out))

