"""One synthetic answer like a model's (:class:`Generation`): what it says and how long it takes, and its chat
completion as a timed SSE stream or one JSON body (its Responses API form: ``gateway.tools.emulator.responses``)."""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from gateway.tools.emulator.counts import prompt_of, token_limit
from gateway.tools.emulator.profiles import PROFILES
from gateway.tools.emulator.schema import schema_instance
from gateway.tools.emulator.shared import Emulator

SSE = b"text/event-stream; charset=utf-8"
WORDS = [w.encode() for w in (" Every", " token", " leaves", " the", " gateway", " the", " moment", " it",
                              " arrives", ",", " unbuffered", ",", " and", " is", " counted", " once", ".")]


def _pieces(text: str, size: int = 4) -> list[str]:
    """``text`` in pieces of about ``size`` characters: one emulated token each."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


class Generation:
    """``t0``: loop time when the request was read; its events are timed from it. It acts enough like a model for
    agents to run: with ``tools`` and no tool result yet (``tool_choice`` not ``none``), one call of the named tool
    or the first, its arguments an instance of the tool's JSON schema (:func:`schema_instance`); else text, or a JSON
    instance of a ``json_schema`` answer format (``json_object``: ``{"answer": ...}``). Its length: the ``tokens``
    directive, else that of the JSON or call, else the request's token limit (text runs until it stops it:
    ``finish_reason: "length"``), else 48. ``n`` chat choices carry the same answer."""

    def __init__(self, emulator: Emulator, body: dict[str, Any], d: dict[str, str], now: float,
                 responses: bool = False) -> None:
        self.responses = responses
        cfg = emulator.config
        self.body = body
        self.d = d
        self.profile = PROFILES[d.get("dialect", cfg.dialect)]
        self.tps = float(d.get("tps", cfg.tps))
        self.ttft = float(d.get("ttft_ms", cfg.ttft * 1000)) / 1000
        self.per_chunk = max(1, int(d.get("per_chunk", 1)))
        self.with_usage = d.get("usage") != "none"
        # the service tier it says it served (OpenAI's dialect echoes one in every chunk, body and Response): the one
        # asked (auto: default), or ``served_tier=X`` (an upstream that serves a slower tier than asked)
        asked = body.get("service_tier")
        self.served = d.get("served_tier") or (asked if isinstance(asked, str) and asked != "auto" else "default")
        self.model = str(body.get("model", "emulated")).encode()
        self.id = b"chatcmpl-emu" + os.urandom(8).hex().encode()  # unique per answer, as an agent's history needs
        self.response_id = "resp_emu" + self.id[12:].decode()
        self.created = int(time.time())
        prompt = prompt_of(body)
        self.prompt_tokens = max(1, len(prompt) // 4)
        self.cached = min(self.prompt_tokens, emulator.cached(body, prompt, now))
        if cfg.prefill_tps and "ttft_ms" not in d:  # prefill: what the cache does not hold is computed first
            self.ttft += (self.prompt_tokens - self.cached) / cfg.prefill_tps
        n = body.get("n")
        self.n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16 and not responses else 1
        self.t0 = now  # loop time: the answer's events are timed from it
        self.tool: tuple[str, str] | None = None  # (name, call id) when the answer is a tool call
        self.pieces, self.finish = self._plan(cfg.max_tokens)
        self.tokens = len(self.pieces)

    def _plan(self, cap: int) -> tuple[list[str], str]:
        body = self.body
        limit = token_limit(body)
        tool = self._tool_to_call()
        schema = self._answer_schema()
        if tool is not None:
            name, params = tool
            self.tool = (name, "call_emu" + os.urandom(8).hex())
            natural = _pieces(orjson.dumps(schema_instance(params)).decode())
        elif schema is not None:
            natural = _pieces(orjson.dumps(schema_instance(schema) if schema else {"answer": "example"}).decode())
        else:
            want = int(self.d["tokens"]) if "tokens" in self.d else min(limit or 48, cap)
            natural = [WORDS[i % len(WORDS)].decode() for i in range(max(1, want))]
            if "tokens" not in self.d and limit is not None and limit <= cap:
                return natural, "length"  # a model that talks until the limit stops it
        if "tokens" in self.d and (tool is not None or schema is not None):
            natural = natural[: max(1, int(self.d["tokens"]))]
        if limit is not None and len(natural) > limit:
            return natural[:limit], "length"
        return natural, "tool_calls" if tool is not None else "stop"

    def _tool_to_call(self) -> tuple[str, Any] | None:
        body = self.body
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
        forced = self.d.get("tool")  # call: a tool call even after tool results (an agent loop); text: never
        if not tools or body.get("tool_choice") == "none" or forced == "text":
            return None
        history = body.get("messages") if not self.responses else body.get("input")
        answered = isinstance(history, list) and any(
            isinstance(m, dict) and (m.get("role") == "tool" or m.get("type") == "function_call_output")
            for m in history)
        if answered and forced != "call":
            return None  # the tool already answered: now the model answers in text
        fns = [t.get("function", t) for t in tools]
        choice = body.get("tool_choice")
        wanted = (choice.get("function") or choice).get("name") if isinstance(choice, dict) else None
        fn = next((f for f in fns if f.get("name") == wanted), fns[0])
        return str(fn.get("name", "tool")), fn.get("parameters") or {"type": "object", "properties": {}}

    def _answer_schema(self) -> Any:
        """The JSON schema the answer must follow, ``{}`` for any JSON object, or None for text."""
        fmt = self.body.get("response_format") if not self.responses else (self.body.get("text") or {}).get("format")
        if not isinstance(fmt, dict):
            return None
        if fmt.get("type") == "json_schema":
            return (fmt.get("json_schema") or {}).get("schema") if not self.responses else fmt.get("schema") or {}
        return {} if fmt.get("type") == "json_object" else None

    def text(self, start: int, n: int) -> str:
        return "".join(self.pieces[start:start + n])

    def usage(self) -> dict[str, Any]:
        completion = self.tokens * self.n
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached},
                "completion_tokens_details": {"reasoning_tokens": 0}}

    def time_info(self) -> dict[str, Any]:
        completion = (self.tokens - 1) / self.tps
        return {"queue_time": 0.0002, "prompt_time": self.ttft / 2, "completion_time": completion,
                "total_time": self.ttft + completion, "created": time.time()}

    def chunk(self, choices: bytes, tail: bytes = b"") -> bytes:
        tier = b'","service_tier":"' + self.served.encode() if self.profile.service_tier else b""
        return (b'data: {"id":"' + self.id + b'","object":"chat.completion.chunk","created":%d,"model":"' % self.created
                + self.model + tier + b'","choices":[' + choices + b"]" + tail + b"}\n\n")

    def _choice(self, index: int, delta: bytes, finish: bytes = b"null") -> bytes:
        if self.profile.openai_chunks:
            return b'{"index":%d,"delta":%s,"finish_reason":%s}' % (index, delta, finish)
        if finish == b"null":  # Cerebras omits finish_reason until the last chunk
            return b'{"delta":%s,"index":%d}' % (delta, index)
        return b'{"delta":%s,"finish_reason":%s,"index":%d}' % (delta, finish, index)

    def _delta(self, start: int, n: int) -> bytes:
        piece = orjson.dumps(self.text(start, n))
        if self.tool is None:
            return b'{"content":' + piece + b"}"
        name, call_id = self.tool
        head = b'"id":%s,"type":"function","function":{"name":%s,"arguments":%s}' % (
            orjson.dumps(call_id), orjson.dumps(name), piece) if start == 0 else \
            b'"function":{"arguments":%s}' % piece
        return b'{"tool_calls":[{"index":0,' + head + b"}]}"

    def events(self) -> list[tuple[float, bytes]]:
        """(loop time, SSE event) pairs in the dialect's profile, from the role chunk to the usage chunk (when asked)
        and ``[DONE]`` (when the profile, or ``done``, ends with it)."""
        profile = self.profile
        openai = profile.openai_chunks
        so = self.body.get("stream_options")
        include_usage = openai and self.with_usage and isinstance(so, dict) and so.get("include_usage") is True
        null_usage = b',"usage":null' if include_usage else b""
        role = b'{"role":"assistant","content":"","refusal":null}' if openai else b'{"role":"assistant"}'
        if self.tool is not None and openai:
            role = b'{"role":"assistant","content":null,"refusal":null}'
        t0 = self.t0
        items = [(t0, self.chunk(self._choice(c, role), null_usage)) for c in range(self.n)]
        t_first = t0 + self.ttft
        sent = 0
        while sent < self.tokens:  # chunk k leaves at ttft + k * per_chunk / tps: decode runs at exactly tps
            n = min(self.per_chunk, self.tokens - sent)
            at = t_first + sent / self.tps
            items += [(at, self.chunk(self._choice(c, self._delta(sent, n)), null_usage)) for c in range(self.n)]
            sent += n
        t_end = items[-1][0]
        finish = orjson.dumps(self.finish)
        tail = profile.finish(self) if self.with_usage else b""  # on the last choice's finish chunk
        items += [(t_end, self.chunk(self._choice(c, b"{}", finish), null_usage + (tail if c == self.n - 1
                                                                                   else b"")))
                  for c in range(self.n)]
        if include_usage:
            items.append((t_end, self.chunk(b"", b',"usage":' + orjson.dumps(self.usage()))))
        if self.d.get("done", "1" if profile.done else "0") == "1":
            items.append((t_end, b"data: [DONE]\n\n"))
        return items

    @property
    def duration(self) -> float:
        """Seconds from the request to the last token, when a whole answer is written."""
        return self.ttft + (self.tokens - 1) / self.tps

    def whole(self) -> dict[str, Any]:
        """OpenAPI ``CreateChatCompletionResponse``, in its dialect's form."""
        text = self.text(0, self.tokens)
        if self.tool is not None:
            name, call_id = self.tool
            message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}]}
        else:
            message = {"role": "assistant", "content": text, "refusal": None}
        out: dict[str, Any] = {
            "id": self.id.decode(), "object": "chat.completion", "created": self.created, "model": self.model.decode(),
            "choices": [{"index": c, "message": message, "logprobs": None, "finish_reason": self.finish}
                        for c in range(self.n)],
        }
        if self.profile.service_tier:
            out["service_tier"] = self.served
        if self.with_usage:
            out["usage"] = self.usage()
        out.update(self.profile.whole(self))
        return out
