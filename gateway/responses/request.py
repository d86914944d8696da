"""The Responses bridge's request side: a Responses API request as a chat-completions one for an upstream that
serves only chat, and a held conversation as input for a native one. The mapping, and what is refused and why:
docs/responses.md#request (OpenAI API reference, "Create a model response")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from gateway.responses import compaction
from gateway.responses.ids import new_id

# fields of a Responses request the bridge maps or may drop (docs/responses.md#request); anything else is not bridged
_BRIDGED_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "text", "reasoning", "stream", "stream_options", "user", "safety_identifier", "metadata",
    "store", "previous_response_id", "include", "truncation", "service_tier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "top_logprobs", "background", "presence_penalty",
    "frequency_penalty",
    "client_metadata",  # Codex CLI's per-request metadata (installation and session ids): for logs, no output
    # "the maximum number of total calls to built-in tools that can be processed in a response" (OpenAI API
    # reference, Create a model response): the bridge runs no built-in tool (a request offering one is not
    # bridged), so the limit has nothing to limit; echoed in the Response, not sent
    "max_tool_calls",
    # WebSocket mode's warm-up (``generate: false``): answered by the gateway itself (gateway.pipeline.warmup)
    "generate",
})


# include values the bridge serves: the logprobs (mapped), and those that ask for what a chat upstream never makes
# (encrypted reasoning, the results of built-in tools the bridge does not run): accepted and answered without it, as
# OpenAI answers a model without the feature (pydantic-ai and Codex CLI always send reasoning.encrypted_content)
_INCLUDES = frozenset({"message.output_text.logprobs", "message.input_image.image_url", "reasoning.encrypted_content",
                       "web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs",
                       "computer_call_output.output.image_url", "file_search_call.results"})


_ITEMS = frozenset({"message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
                    "custom_tool_call_output", "additional_tools", "compaction"})
# tool types the bridge offers a chat upstream: functions, freeform ``custom`` tools (as a function taking one string,
# ``input``), and ``namespace`` groups of those (Codex CLI sends its tools so, in an ``additional_tools`` input item)
_TOOLS = frozenset({"function", "custom", "namespace"})


_PARTS = frozenset({"input_text", "output_text", "input_image", "input_file", "refusal", "text"})


def unbridgeable(body: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(param, why, error code), or None. ``invalid_type`` for a value of the wrong shape, which the bridge
    would have to drop or guess at (a native upstream judges it itself); ``unsupported_parameter`` for the rest of
    docs/responses.md#refused, checked against what ``openai-agents`` and LangChain send."""
    shape = _shape_problem(body)
    if shape is not None:
        return (*shape, "invalid_type")
    found = _field_problem(body) or _tool_problem(body) or _input_problem(body)
    return None if found is None else (*found, "unsupported_parameter")


_SHAPES: tuple[tuple[str, type | tuple[type, ...], str], ...] = (
    ("instructions", str, "a string"), ("tools", list, "an array"), ("tool_choice", (str, dict), "a string or an "
     "object"), ("text", dict, "an object"), ("reasoning", dict, "an object"), ("include", list, "an array"),
    ("metadata", dict, "an object"), ("parallel_tool_calls", bool, "a boolean"), ("max_output_tokens", int,
                                                                                   "an integer"),
    ("max_tool_calls", int, "an integer"), ("generate", bool, "a boolean"),
    ("presence_penalty", (int, float), "a number"),
    ("frequency_penalty", (int, float), "a number"))


def _shape_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    for key, kind, want in _SHAPES:
        value = body.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
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
    """``wire`` made sure it is an object."""
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
    for tool in offered_tools(body, flat=False):
        kind = _dict(tool).get("type")
        if kind not in _TOOLS:
            return "tools", f"the `{kind}` tool runs inside the Responses API; function and custom tools are bridged"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in ("function", "custom"):
        return "tool_choice", f"tool_choice of type `{choice.get('type')}` needs the Responses API itself"
    return None


def droppable_tools(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The types of the hosted tools (``web_search``, ...) the request offers, when none is forced and the bridge
    could serve it without them; else ``()``. Codex CLI offers ``web_search`` beside its function tools for any
    model; on a model only bridged upstreams serve, the tool is dropped rather than the request refused
    (docs/responses.md#hosted-tools). Forced (a ``tool_choice`` naming it, or ``required`` with no other tool left):
    not droppable, the request stays a 400."""
    hosted = sorted({str(_dict(t).get("type")) for t in offered_tools(body, flat=False)
                     if _dict(t).get("type") not in _TOOLS})
    if not hosted:
        return ()
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in ("function", "custom"):
        return ()
    rest = without_hosted_tools(body)
    if choice == "required" and not offered_tools(rest):
        return ()
    return tuple(hosted) if unbridgeable(rest) is None else ()


def without_hosted_tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` offering only the tools the bridge serves (in ``tools`` and in ``additional_tools`` items)."""
    out = dict(body)
    if isinstance(body.get("tools"), list):
        out["tools"] = [t for t in body["tools"] if _dict(t).get("type") in _TOOLS]
    if isinstance(body.get("input"), list):
        out["input"] = [{**i, "tools": [t for t in _list(i.get("tools")) if _dict(t).get("type") in _TOOLS]}
                        if isinstance(i, dict) and i.get("type") == "additional_tools" else i for i in body["input"]]
    return out


def _input_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    for i, item in enumerate(_list(body.get("input"))):
        if not isinstance(item, dict):
            return "input", "input items must be objects"
        kind = item.get("type", "message")
        if kind not in _ITEMS:
            return "input", f"input items of type `{kind}` need the Responses API itself"
        if kind == "reasoning":
            continue  # dropped whole, whatever it holds (a client sends back the reasoning it was given)
        if kind == "compaction" and compaction.summary_of(item) is None:
            return "input", "a compaction item another upstream made can be read only by that upstream"
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
    """Each with an ``id``: as the store keeps a turn."""
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    out = []
    for item in _list(raw):
        item = {"type": "message", **item} if "type" not in item else dict(item)
        item.setdefault("id", new_id({"message": "msg_tg", "function_call": "fc_tg"}.get(item["type"], "it_tg")))
        out.append(item)
    return out


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as "List input items" answers it (OpenAI API reference): a message's string content as one text
    part, and its ``status``."""
    if item.get("type") != "message":
        return item
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {**item, "content": content, "status": item.get("status", "completed")}


_CALLS = {"function_call_output": "function_call", "custom_tool_call_output": "custom_tool_call"}


def orphan_output(history: Iterable[Mapping[str, Any]], body: Mapping[str, Any]) -> str | None:
    """The ``call_id`` of the first tool output in the input that answers no call before it (in the conversation or
    this input), or None. OpenAI answers such a request 400 ("No tool call found for function call output with
    call_id ..."); a chat upstream would be sent a ``tool`` message that follows no ``tool_calls``. Input holding an
    ``item_reference`` is not judged: what it names is the upstream's."""
    raw = body.get("input")
    if not isinstance(raw, list) or not any(isinstance(i, dict) and i.get("type") in _CALLS for i in raw):
        return None  # the common turn: no tool output in it, nothing to scan
    called: set[Any] = set()
    for item in [*history, *raw]:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == "item_reference":
            return None
        if kind in ("function_call", "custom_tool_call"):
            called.add(item.get("call_id"))
        elif kind in _CALLS and item.get("call_id") not in called:
            return str(item.get("call_id"))
    return None


# ids of the items the gateway made (new_id)
OWN_ITEM_PREFIXES = ("msg_tg", "fc_tg", "rs_tg", "it_tg", compaction.ITEM_PREFIX)


def native_input(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """None when it holds nothing of the gateway's. A client that resends a bridged conversation in full
    sends back the gateway's item ids, which the upstream never issued; items the upstream made keep theirs."""
    items = _list(body.get("input"))
    own = [isinstance(i, dict) and (str(i.get("id", "")).startswith(OWN_ITEM_PREFIXES)
                                    or compaction.summary_of(i) is not None) for i in items]
    if not any(own):
        return None
    return [cleaned for item, mine in zip(items, own, strict=True)
            for cleaned in (as_input([item]) if mine else [item])]


def as_input(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without the gateway's item ids and statuses (the upstream never stored those items), and without
    reasoning, which the upstream cannot read from another model."""
    out = []
    for item in items:
        if item.get("type") == "reasoning":
            continue
        item = compaction.as_message(item) or item  # the gateway's compaction: the summary it holds, as a message
        out.append({k: v for k, v in item.items() if k not in ("id", "status")})
    return out


def chat_request(body: Mapping[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """Only for a bridgeable request (:func:`unbridgeable` is None). ``history``: the held conversation's
    items, or ``[]``."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    messages += _messages([*history, *input_items(body)])
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    # a hosted tool here was only offered and is dropped (droppable_tools): the bridge offers what it serves
    tools = [_chat_tool(t) for t in offered_tools(body) if t.get("type") in _TOOLS]
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    for key in ("parallel_tool_calls", "temperature", "top_p", "presence_penalty", "frequency_penalty", "user",
                "safety_identifier", "service_tier", "prompt_cache_key", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    _output_options(body, chat)
    return chat


def _output_options(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
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
    if tool.get("type") == "custom":  # freeform: the model writes the tool's input as one string
        fmt = _dict(tool.get("format"))
        about = tool.get("description") or ""
        if fmt.get("type") == "grammar":
            about += f"\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt.get('definition', '')}"
        return {"type": "function", "function": {"name": tool.get("name"), "description": about, "parameters": {
            "type": "object", "properties": {"input": {"type": "string", "description": "the tool's whole input"}},
            "required": ["input"]}}}
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def offered_tools(body: Mapping[str, Any], flat: bool = True) -> list[dict[str, Any]]:
    """``additional_tools`` input items are Codex CLI's form; with ``flat`` a ``namespace``'s tools stand
    in its place, since chat has no namespaces."""
    found = [*_list(body.get("tools"))]
    for item in _list(body.get("input")):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            found += _list(item.get("tools"))
    out: list[dict[str, Any]] = []
    for tool in found:
        if flat and _dict(tool).get("type") == "namespace":
            out += [t for t in _list(tool.get("tools")) if isinstance(t, dict)]
        elif isinstance(tool, dict):
            out.append(tool)
    return out


def custom_tool_names(body: Mapping[str, Any]) -> frozenset[str]:
    """Their calls are answered as ``custom_tool_call``."""
    return frozenset(t["name"] for t in offered_tools(body) if t.get("type") == "custom" and isinstance(t.get("name"),
                                                                                                          str))


def _messages(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive function calls join the assistant message before them, as chat carries them."""
    out: list[dict[str, Any]] = []
    assistant_open = False  # the last message is an assistant turn that tool calls may still join
    for item in items:
        kind = item.get("type", "message")
        if kind == "compaction":  # only the gateway's reach here (_input_problem): the summary it holds
            item, kind = compaction.as_message(item) or {"role": "user", "content": ""}, "message"
        if kind == "message":
            msg = _message(item)
            if msg["role"] == "assistant" and msg["content"] is None and "refusal" not in msg:
                continue  # nothing said (a response that failed before its text): chat APIs refuse it
            out.append(msg)
            assistant_open = msg["role"] == "assistant"
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments") or "" if kind == "function_call" else orjson.dumps(
                {"input": item.get("input") or ""}).decode()  # a freeform call as the function it was offered as
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": arguments}}
            if not assistant_open:
                out.append({"role": "assistant", "content": None})
                assistant_open = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"))})
            assistant_open = False
        # reasoning items: a chat upstream takes no reasoning input; additional_tools: offered as chat tools
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
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(p.get("text", "") for p in output if isinstance(p, dict))
    return orjson.dumps(output).decode()


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
