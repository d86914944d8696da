"""The Responses bridge's stream side: a chat-completions stream relayed as the typed Responses event stream,
translated chunk by chunk as it arrives. What crosses, what is dropped and what is refused: docs/responses.md#request;
the events: docs/responses.md#answer; usage: docs/reference/wire.md#responses-usage-and-timing."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import event_error
from gateway.responses.ids import new_id
from gateway.responses.request import _dict, _list
from gateway.responses.whole import _INCOMPLETE, Draft, _content_text, _logprobs, _str, custom_input, response_usage
from gateway.stream.relay import Relay
from gateway.stream.sse import SSEEvent
from gateway.stream.stats import Extra, Write, delta_has_token
from gateway.wire.body import dumps, loads


class _Item:
    __slots__ = ("index", "id", "kind", "pieces", "refusals", "logprobs", "text_part", "refusal_part", "call_id",
                 "source_id", "name", "done", "status", "heads")

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
        self.source_id = ""  # the call id the upstream gave (call_id is a new one if that was used already)
        self.name = ""
        self.done = False
        self.status = "in_progress"  # completed or incomplete once done
        self.heads: dict[str, bytes] = {}  # delta event type -> its bytes up to the delta (see BridgeRelay._delta)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def seal(self, status: str = "completed") -> None:
        """Joined once, so that ``text`` costs nothing after."""
        self.done = True
        self.status = status
        self.pieces = ["".join(self.pieces)]
        self.refusals = ["".join(self.refusals)]

    @property
    def refusal(self) -> str:
        return "".join(self.refusals)

    def item(self, status: str) -> dict[str, Any]:
        """Empty while ``in_progress``; a failed stream's items keep the text they had sent."""
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id,
                    "name": self.name, "arguments": self.text}
        if self.kind == "custom_tool_call":
            return {"id": self.id, "type": "custom_tool_call", "status": status, "call_id": self.call_id,
                    "name": self.name, "input": custom_input(self.text) if status != "in_progress" else ""}
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
    """Keeps the relay's contract (``gateway.stream.relay``): nothing is written before the first token, so
    an error before it is still an HTTP error. ``response``: the final Response object."""

    def __init__(self, draft: Draft, *, max_event_bytes: int, finish_grace: float,
                 hold_seconds: float | None = None, extra: Extra | None = None) -> None:
        super().__init__(strip_usage_chunk=True, max_event_bytes=max_event_bytes, finish_grace=finish_grace,
                         hold_seconds=hold_seconds, extra=extra)
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
        """The bytes :meth:`_emit` would write, from a head built once per item and event type: the
        delta is the one part that changes per chunk (measured: bench/bridge.py)."""
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
            if not self._started and not self.draft.named and isinstance(chunk.get("model"), str):
                self.draft.model = chunk["model"]  # one name throughout: the one its first chunk gives (the rule)
            self._start(out)
            had_error = stats.error
            self._observe(chunk, event, now)  # usage, first/last token, finish_reason, an error
            self.draft.served = stats.service_tier or self.draft.served  # the tier served, as the chunks say it
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
        if item is not None and cid and item.source_id and cid != item.source_id:
            # a new id on an index in use (two parallel calls both sent as index 0): a new call, never one call with
            # two JSON objects back to back; the earlier one keeps its place among the calls to close
            self._calls[-1 - len(self._items)] = item
            item = None
        if item is None or item.done:
            self._close_open(out)
            custom = name in self.draft.custom
            item = _Item(len(self._items), "custom_tool_call" if custom else "function_call",
                         "ctc_tg" if custom else "fc_tg")
            # a call id the stream already used would make two calls one for the client (and its SDK refuses it)
            item.call_id = cid if cid and all(c.call_id != cid for c in self._calls.values()) else new_id("call_tg")
            item.source_id = cid
            item.name = name
            self._items.append(item)
            self._calls[index] = item
            self._emit(out, "response.output_item.added", output_index=item.index, item=item.item("in_progress"))
        elif name and not item.name:
            item.name = name  # a name that came after the call's first delta
        arguments = fn.get("arguments")
        if isinstance(arguments, dict | list):  # llama.cpp may send the arguments as JSON, not as a JSON string
            arguments = dumps(arguments).decode()
        if isinstance(arguments, str) and arguments:
            item.pieces.append(arguments)
            if item.kind == "function_call":  # a freeform call's input is whole only once its JSON is (at the end)
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
            if item.kind == "custom_tool_call":
                text = custom_input(item.text)
                self._emit(out, "response.custom_tool_call_input.delta", item_id=item.id, output_index=item.index,
                           delta=text)
                self._emit(out, "response.custom_tool_call_input.done", item_id=item.id, output_index=item.index,
                           input=text)
            else:
                self._emit(out, "response.function_call_arguments.done", item_id=item.id, output_index=item.index,
                           name=item.name, arguments=item.text)
            self._emit(out, "response.output_item.done", output_index=item.index, item=item.item(status))

    def _terminal(self, out: list[bytes]) -> None:
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
        """``error.code`` is one of the Responses API's own (OpenAPI ``ResponseError``): a rate limit
        stays ``rate_limit_exceeded``, anything else is ``server_error``, the specific code in the message."""
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
