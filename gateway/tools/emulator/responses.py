"""The Responses API form of a :class:`~gateway.tools.emulator.generation.Generation`: its ``response`` object as it
starts and as it ends, its stream of named, numbered events, and a warm-up's (``generate: false``, WebSocket mode)."""

from __future__ import annotations

import base64
import time
from typing import Any

import orjson

from gateway.responses.request import input_items, listed_item, orphan_output
from gateway.responses.whole import Draft
from gateway.tools.emulator.generation import Generation


def output_item(gen: Generation, status: str, sent: int | None = None) -> dict[str, Any]:
    """``sent``: the tokens it got to, for an item the answer's failure cut."""
    text = gen.text(0, gen.tokens if sent is None else sent) if status != "in_progress" else ""
    if gen.tool is not None:
        name, call_id = gen.tool
        return {"id": "fc_emu", "type": "function_call", "status": status, "call_id": call_id, "name": name,
                "arguments": text}
    # ``logprobs`` is required on output text (OpenAI's OpenAPI ``ResponseOutputText``): empty unless asked for
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] \
        if status != "in_progress" else []
    return {"id": "msg_emu", "type": "message", "status": status, "role": "assistant", "content": content}


CHAIN = 64  # earlier responses an orphan check walks at most


def orphan(body: dict[str, Any], *kept: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """OpenAI's 400 for a tool output in ``input`` that answers no call in it or in the outputs of the responses it
    continues (``kept``: where made responses are held), as its error body; None when every output has its call."""
    history: list[Any] = []
    previous = body.get("previous_response_id")
    for _ in range(CHAIN):
        found = next((k[previous] for k in kept if isinstance(previous, str) and previous in k), None)
        if found is None:
            break
        history[:0] = found.get("output") or []
        previous = found.get("previous_response_id")
    call_id = orphan_output(history, body)
    if call_id is None:
        return None
    return {"error": {"message": f"No tool call found for function call output with call_id {call_id}.",
                      "type": "invalid_request_error", "param": "input", "code": None}}


COMPACTION = "emu1."  # the emulator's compaction content: what it made, and alone can read


def compacted(body: dict[str, Any], raw: bytes, inputs: dict[str, list[dict[str, Any]]],
              made: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``POST /v1/responses/compact`` (OpenAI API reference, "Compact a response"): every user message of the
    conversation (the responses it continues, then its input), then one compaction item only the emulator reads."""
    chain: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    for _ in range(CHAIN):
        if not isinstance(previous, str) or previous not in made:
            break
        chain[:0] = inputs.get(previous, [])
        previous = made[previous].get("previous_response_id")
    items = [*chain, *(listed_item(i) for i in input_items(body))]
    users = [i for i in items if i.get("type") == "message" and i.get("role", "user") == "user"]
    prompt = max(1, len(raw) // 4)
    summary = base64.urlsafe_b64encode(f"{len(items)} items summarised".encode()).decode()
    return {"id": f"resp_emu{int(time.time() * 1e6)}", "object": "response.compaction", "created_at": int(time.time()),
            "output": [*users, {"id": "cmp_emu", "type": "compaction", "encrypted_content": COMPACTION + summary}],
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 32,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + 32}}


def foreign_compaction(body: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's 400 for a compaction item whose content it cannot read (another's, or the gateway's own sent on)."""
    given = body.get("input")
    for i, item in enumerate(given if isinstance(given, list) else []):
        if isinstance(item, dict) and item.get("type") == "compaction" and not str(
                item.get("encrypted_content", "")).startswith(COMPACTION):
            return {"error": {"message": f"The encrypted content for item input[{i}] could not be verified.",
                              "type": "invalid_request_error", "param": f"input[{i}]",
                              "code": "invalid_encrypted_content"}}
    return None


def fails_at(gen: Generation) -> int | None:
    """The ``fail_after`` directive, Responses streams only, at least one token: the failure comes after the first,
    when a relay can no longer fail over."""
    if not gen.responses or gen.body.get("stream") is not True or "fail_after" not in gen.d:
        return None
    return max(1, min(gen.tokens, int(gen.d["fail_after"])))


def final_response(gen: Generation) -> dict[str, Any]:
    if fails_at(gen) is not None:
        return response(gen, "failed")
    return response(gen, "incomplete" if gen.finish == "length" else "completed")


def response(gen: Generation, status: str) -> dict[str, Any]:
    """The bridge's :class:`Draft` builds it: one definition of a complete Response. A failed one carries its
    ``error`` as OpenAI's does (OpenAPI ``ResponseError``) and the output it had made, ``incomplete``."""
    draft = Draft({**gen.body, "model": gen.model.decode(), "service_tier": gen.served}, gen.response_id)
    draft.created_at = gen.created
    error = {"code": "server_error", "message": "The emulated model failed mid-response."}
    out = draft.response(status, [], None, "max_output_tokens" if status == "incomplete" else None,
                         error if status == "failed" else None)
    if status == "failed":
        out["output"] = [output_item(gen, "incomplete", fails_at(gen))]
    if status in ("completed", "incomplete"):
        out["output"] = [output_item(gen, "completed")]
        if gen.with_usage:
            out["usage"] = {"input_tokens": gen.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": gen.cached, "cache_write_tokens": 0},
                            "output_tokens": gen.tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": gen.prompt_tokens + gen.tokens}
    return out


def response_events(gen: Generation) -> list[tuple[float, bytes]]:
    """docs/reference/wire.md#responses-api-streams; with ``fail_after``, the deltas it got to, then
    ``response.failed``; every event named and numbered, no ``[DONE]``."""
    seq = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, **fields, "sequence_number": next(seq)})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    item = output_item(gen, "in_progress")
    part = {"type": "output_text", "text": "", "annotations": []}
    head = (event("response.created", response=response(gen, "in_progress"))
            + event("response.in_progress", response=response(gen, "in_progress"))
            + event("response.output_item.added", output_index=0, item=item))
    if gen.tool is None:
        head += event("response.content_part.added", item_id="msg_emu", output_index=0, content_index=0, part=part)
    items = [(gen.t0, head)]
    sent = 0
    failing = fails_at(gen)
    until = gen.tokens if failing is None else failing
    while sent < until:
        n = min(gen.per_chunk, until - sent)
        delta = gen.text(sent, n)
        at = gen.t0 + gen.ttft + sent / gen.tps
        if gen.tool is None:
            items.append((at, event("response.output_text.delta", item_id="msg_emu", output_index=0,
                                    content_index=0, delta=delta, logprobs=[])))
        else:
            items.append((at, event("response.function_call_arguments.delta", item_id="fc_emu", output_index=0,
                                    delta=delta)))
        sent += n
    if failing is not None:  # the deltas it got to, then the failure: no .done events for the cut item
        items.append((items[-1][0], event("response.failed", response=response(gen, "failed"))))
        return items
    text = gen.text(0, gen.tokens)
    status = "incomplete" if gen.finish == "length" else "completed"
    done = response(gen, status)
    if gen.tool is None:
        tail = (event("response.output_text.done", item_id="msg_emu", output_index=0, content_index=0, text=text,
                      logprobs=[])
                + event("response.content_part.done", item_id="msg_emu", output_index=0, content_index=0,
                        part={**part, "text": text}))
    else:
        tail = event("response.function_call_arguments.done", item_id="fc_emu", output_index=0,
                     name=gen.tool[0], arguments=text)  # ``name``: OpenAI's event carries it (OpenAPI schema)
    tail += (event("response.output_item.done", output_index=0, item=done["output"][0])
             + event(f"response.{status}", response=done))
    items.append((items[-1][0], tail))
    return items


def warmed_up(gen: Generation) -> dict[str, Any]:
    """``generate: false`` (WebSocket mode only): an empty ``output``, the input counted, no output tokens."""
    out = response(gen, "completed")
    out["output"] = []
    if gen.with_usage:
        out["usage"] = {**out["usage"], "output_tokens": 0, "total_tokens": gen.prompt_tokens}
    return out


def warm_up_events(gen: Generation) -> list[tuple[float, bytes]]:
    """``response.completed`` once the prompt would be read (half the time to first token)."""
    created = orjson.dumps({"type": "response.created", "response": response(gen, "in_progress"),
                            "sequence_number": 0})
    done = orjson.dumps({"type": "response.completed", "response": warmed_up(gen), "sequence_number": 1})
    return [(gen.t0, b"event: response.created\ndata: " + created + b"\n\n"),
            (gen.t0 + gen.ttft / 2, b"event: response.completed\ndata: " + done + b"\n\n")]
