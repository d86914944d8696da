"""The faults the emulator plays on request (the ``fault=NAME`` directive, :data:`FAULTS`), from other gateways' and
SDKs' bug reports, for the soak and for tests: what an upstream does wrong. Some are whole answers
(:data:`ANSWERS`); the others bend a generated chat completion stream (:func:`bent`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from gateway.tools.emulator.generation import SSE, Generation
from gateway.tools.emulator.profiles import TPM_EXCEEDED

FAULTS = {
    "error_first": "200 stream whose first event after the role chunk is an error event (code 400), then [DONE]",
    "error_first_500": "200 stream whose first event after the role chunk is an overloaded error (server_error)",
    "done_held": "the role chunk and [DONE], no token, then silence on the open connection",
    "silent_after_finish": "the answer through its finish chunk, then silence (no usage, no [DONE], no end)",
    "error_fin": "a few tokens, an error event, then the connection closes inside the chunked body",
    "mislabelled": "a normal stream labelled text/plain",
    "usage_late": "the answer; its usage chunk (OpenAI dialect, when asked) 0.4 s after the finish chunk",
    "usage_on_error": "a few tokens, then a final chunk with error, finish_reason error and usage; then [DONE]",
    "quota_429": "429 insufficient_quota (the quota is exhausted)",
    "overflow_500": "500 from llama.cpp: the prompt exceeds the context size",
    "empty_envelope": "500 in Cerebras' envelope with empty param and code",
    "reset_zero": "a normal answer with x-ratelimit-remaining-requests 0 and x-ratelimit-reset-requests 0s",
    "reset_only_429": "429 with Cerebras' reset headers (float seconds) and no retry-after",
    "stale": "on a connection that already served a request: close it without answering (keep-alive race)",
    "done_no_blank": "the answer, ending with data: [DONE] without its blank line",
    "usage_chunk": "a separate choices: [] usage chunk whether or not the client asked for one",
}
_ERR_400 = (b'event: error\ndata: {"error":{"message":"invalid request","type":"invalid_request_error",'
            b'"code":400}}\n\n')
_ERR_500 = b'data: {"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}\n\n'
_QUOTA = (b'{"error":{"message":"You exceeded your current quota, please check your plan and billing details.",'
          b'"type":"insufficient_quota","param":null,"code":"insufficient_quota"}}')
_OVERFLOW = (b'{"error":{"code":500,"message":"request (9120 tokens) exceeds the available context size (8192 '
             b'tokens)","type":"server_error"}}')
_EMPTY = (b'{"status_code":500,"error":{"message":"server error, please retry","type":"server_error","param":"",'
          b'"code":"","id":""}}')
_DONE = b"data: [DONE]\n\n"
# the FAULTS that are a whole answer: status, body, extra headers
ANSWERS: dict[str, tuple[int, bytes, list[tuple[bytes, bytes]]]] = {
    "quota_429": (429, _QUOTA, []), "overflow_500": (500, _OVERFLOW, []), "empty_envelope": (500, _EMPTY, []),
    "reset_only_429": (429, TPM_EXCEEDED, [(b"x-ratelimit-remaining-tokens-minute", b"0"),
                                           (b"x-ratelimit-reset-tokens-minute", b"1.5")]),
}


class Played:
    """A generated stream being bent into a fault: its timed events, and how its answer ends and is labelled."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.items: list[tuple[float, bytes]] = gen.events()
        self.role: tuple[float, bytes] = self.items[0]
        self.t_first: float = gen.t0 + gen.ttft
        self.t_end: float = self.items[-1][0]
        self.answer: list[tuple[float, bytes]] = [e for e in self.items if e[1] != _DONE]  # everything but [DONE]
        self.end = "ok"
        self.ctype = SSE
        self.extra: list[tuple[bytes, bytes]] = []

    def without_usage_chunk(self) -> list[tuple[float, bytes]]:
        return [e for e in self.answer if b'"choices":[]' not in e[1]]


def bent(gen: Generation, name: str) -> Played:
    """``name``: one of :data:`FAULTS`, not of :data:`ANSWERS`."""
    played = Played(gen)
    _STREAM_FAULTS[name](played)
    return played


def _usage_on_error(p: Played) -> None:
    last = p.gen.chunk(b'{"index":0,"delta":{},"finish_reason":"error"}', b',"error":{"code":502,"message":'
                       b'"Provider disconnected"},"usage":' + orjson.dumps(p.gen.usage()))
    p.items = [*p.items[:3], (p.items[2][0], last + _DONE)]


def _set(p: Played, **kw: Any) -> None:
    for key, value in kw.items():
        setattr(p, key, value)


# the FAULTS played on a stream, as edits of the generated answer
_STREAM_FAULTS: dict[str, Callable[[Played], None]] = {
    "error_first": lambda p: _set(p, items=[p.role, (p.t_first, _ERR_400 + _DONE)]),
    "error_first_500": lambda p: _set(p, items=[p.role, (p.t_first, _ERR_500)]),
    "done_held": lambda p: _set(p, items=[p.role, (p.t_first, _DONE)], end="stall"),
    "silent_after_finish": lambda p: _set(p, items=p.without_usage_chunk(), end="stall"),
    "error_fin": lambda p: _set(p, items=[*p.items[:3], (p.items[2][0], _ERR_500)], end="eof"),
    "mislabelled": lambda p: _set(p, ctype=b"text/plain; charset=utf-8"),
    "usage_late": lambda p: _set(p, items=[(t + 0.4, e) if b'"choices":[]' in e or e == _DONE else (t, e)
                                           for t, e in p.items]),
    "usage_on_error": _usage_on_error,
    "reset_zero": lambda p: _set(p, extra=[(b"x-ratelimit-remaining-requests", b"0"),
                                           (b"x-ratelimit-reset-requests", b"0s")]),
    "stale": lambda p: None,  # the first request of a connection is answered normally
    "done_no_blank": lambda p: _set(p, items=[*p.answer, (p.t_end, b"data: [DONE]")]),
    "usage_chunk": lambda p: _set(p, items=[*p.without_usage_chunk(), (p.t_end, p.gen.chunk(
        b"", b',"usage":' + orjson.dumps(p.gen.usage())))]),
}
