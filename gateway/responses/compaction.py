"""Compaction on the bridge: ``POST /v1/responses/compact`` served by a chat-only upstream, and the compaction item it
makes read back on later requests (OpenAI API reference, "Compact a response"; docs/responses.md#compaction).

OpenAI answers a ``response.compaction`` whose ``output`` is every user message of the conversation followed by one
``compaction`` item, whose ``encrypted_content`` only OpenAI can read. The bridge asks the chat upstream for a summary
of the conversation and puts it in the item's ``encrypted_content`` as :data:`PREFIX` and base64url of zlib'd JSON:
opaque to the client as OpenAI's is, though not encrypted (it holds only what the client's own conversation said).
On a later request, the bridge (and a held conversation sent to a native upstream) reads such an item as a message
carrying the summary; another upstream's compaction item is that upstream's to read (the request goes native)."""

from __future__ import annotations

import base64
import binascii
import functools
import time
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from gateway.responses.ids import ID_PREFIX, new_id

PREFIX = "tgc1."  # the gateway's compaction content, version 1
ITEM_PREFIX = "cmp_tg"  # its items' ids
SUMMARY_TOKENS = 4096  # the summary's most tokens (max_output_tokens of the bridged request)
# characters of a compaction item's content read back at most: a SUMMARY_BYTES summary that does not compress at all,
# sealed (base64 adds a third); also what bounds the decode cache's keys
MAX_CONTENT = 96 * 1024
# what the gateway's own summaries stay within: SUMMARY_TOKENS tokens are ~16-20 KB of text, which zlib shrinks ~3x;
# an item past either bound is not one the gateway made
SUMMARY_BYTES = 64 * 1024  # decompressed, at most
RATIO = 8  # decompressed bytes per compressed byte, at most (plus 4 KiB)
MAX_EXPANDED = 1 << 20  # bytes a request's conversation (held and sent) may expand to from compaction items
INSTRUCTIONS = (
    "You are compacting a conversation between a user and an AI assistant (an agent that may call tools) so that it "
    "can continue in a smaller context. Write a summary that lets the assistant carry on as if it had the whole "
    "conversation: the user's goals and constraints, decisions made, what the tools were called with and what they "
    "returned that still matters (file names, identifiers, numbers, errors), what is done and what remains. Be "
    "complete and specific; leave out pleasantries. Answer with the summary only.")
ASK = "Write the summary of the conversation above now."
HEADER = "Summary of the earlier conversation (compacted):\n\n"


def seal(summary: str) -> str:
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(orjson.dumps({"s": summary}))).decode()


def summary_of(item: Mapping[str, Any]) -> str | None:
    """The summary a compaction item made by the gateway holds; None for any other item (another upstream's, or what
    does not parse as ours, or inflates past what the gateway writes: :data:`SUMMARY_BYTES`, :data:`RATIO`)."""
    if item.get("type") != "compaction":
        return None
    content = item.get("encrypted_content")
    if not isinstance(content, str) or not content.startswith(PREFIX) or len(content) > MAX_CONTENT:
        return None
    return _opened(content)


# a conversation's items are read at admission and again as the request is built; keys of at most MAX_CONTENT
# characters: the cache holds at most 64 x 96 KiB, whatever a tenant sends
@functools.lru_cache(maxsize=64)
def _opened(content: str) -> str | None:
    try:
        packed = base64.urlsafe_b64decode(content[len(PREFIX):])
        inflate = zlib.decompressobj()
        data = inflate.decompress(packed, SUMMARY_BYTES + 1)
        if len(data) > SUMMARY_BYTES or inflate.unconsumed_tail or len(data) > RATIO * len(packed) + 4096:
            return None  # not what the gateway writes: a bomb would cost every request that expands it
        summary = orjson.loads(data).get("s")
    except (ValueError, binascii.Error, zlib.error, AttributeError):
        return None
    return summary if isinstance(summary, str) else None


def expanded_bytes(items: Iterable[Any]) -> int:
    """The bytes the gateway's compaction items among ``items`` expand to (their summaries, UTF-8)."""
    total = 0
    for item in items:
        if isinstance(item, dict) and item.get("type") == "compaction":
            summary = summary_of(item)
            total += len(summary.encode()) if summary is not None else 0
    return total


def as_message(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """The gateway's compaction item as the input message it stands for; None for any other item."""
    summary = summary_of(item)
    if summary is None:
        return None
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": HEADER + summary}]}


def request(body: Mapping[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """The bridged Responses request that asks for the summary of ``items`` (the held conversation and the compact
    request's input): no tools, the summary's own instructions, then the ask."""
    out: dict[str, Any] = {"model": body["model"], "instructions": INSTRUCTIONS,
                           "input": [*items, {"type": "message", "role": "user", "content": ASK}],
                           "max_output_tokens": SUMMARY_TOKENS}
    for key in ("prompt_cache_key", "service_tier", "safety_identifier", "user"):
        if body.get(key) is not None:
            out[key] = body[key]
    if isinstance(body.get("instructions"), str) and body["instructions"]:  # what the agent was told is context too
        out["input"] = [{"type": "message", "role": "developer", "content": body["instructions"]}, *out["input"]]
    return out


def compacted(items: Iterable[dict[str, Any]], summary: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's ``CompactedResponse``: every user message of the conversation, then one compaction item."""
    users = [{**i, "content": [{"type": "input_text", "text": i["content"]}]} if isinstance(i.get("content"), str)
             else i for i in items if i.get("type", "message") == "message" and i.get("role", "user") == "user"]
    item = {"id": new_id(ITEM_PREFIX), "type": "compaction", "encrypted_content": seal(summary)}
    return {"id": new_id(ID_PREFIX), "object": "response.compaction", "created_at": int(time.time()),
            "output": [*users, item], "usage": usage}
