"""The emulated OpenAI-compatible upstream: one engine for the demo, the tests and the soak (``tiergate emulate``).

It answers in two ways:

* **like a model** (the default): it streams ``/v1/chat/completions`` with one SSE event per token (or
  ``per_chunk`` tokens per event) at a set rate after a set time to first token, in its dialect's profile
  (:data:`PROFILES`, one row per dialect): OpenAI (role chunk, content chunks, finish chunk, a ``choices: []`` usage
  chunk only with ``stream_options.include_usage``, ``[DONE]``), vLLM (the same), Groq (the same, and
  ``x_groq.usage`` on the finish chunk) or Cerebras (usage and ``time_info`` on the finish chunk, no ``[DONE]``);
  answers non-streaming requests after the same simulated generation time (OpenAI: with an ``openai-processing-ms``
  header); serves ``/v1/responses`` the same way (OpenAI only: the gateway bridges the others; a
  ``previous_response_id`` it did not make is a 400 ``previous_response_not_found``, as OpenAI's;
  ``GET`` / ``DELETE /v1/responses/{id}`` read and remove the responses it made; a ``store: false`` response is not
  kept, as OpenAI keeps none: it is a 404 there and a 400 as a ``previous_response_id``; ``GET /v1/responses``
  upgraded to a WebSocket serves its WebSocket mode, where a socket also remembers its own responses, ``store: false``
  included: ``gateway.tools.emulator_ws``);
  acts enough like a model for agents to run (tool calls, JSON answers, ``n``, token limits: :class:`Generation`);
  and replays a recorded transcript from ``tests/fixtures/upstream`` at the configured pace;
* **by script**: a ``handler(Received) -> Plan | None`` given in Python (tests: :class:`EmulatorThread`) plays
  a :class:`Plan` byte for byte: status, headers, body parts each written after its delay, then a clean end, a
  close inside the body, a TCP reset, silence, or a connection closed without an answer.

It is a bare asyncio protocol over httptools' C parser, with loop timers instead of a task per answer, so that it
costs a few microseconds per event and is not the bottleneck of what it serves. The benchmark's own upstream
(``bench/upstream.py``) is kept apart on purpose: it stamps every chunk with the clock at the moment of its write,
and the instrument must not change when the gateway's tools do.

Per-request directives ride in the request body (so they cross the gateway untouched), anywhere in it, as
``[[emulate key=value ...]]`` (the last one counts: a conversation's latest turn):

============  ==========================================================================
tokens        completion tokens to generate (default: max_tokens / max_completion_tokens, capped, else 48)
tps           tokens per second; ttft_ms: time to first token in milliseconds
per_chunk     tokens per SSE event (default 1)
usage         ``none``: report no usage at all
served_tier   the ``service_tier`` an OpenAI-dialect answer says it served (default: the one asked, ``auto``:
              ``default``)
done          ``0``/``1``: end with ``data: [DONE]`` (default: the dialect's profile, cerebras 0, the others 1)
dialect       answer in this dialect's profile instead of the emulator's own
transcript    replay NAME.body from the fixtures folder (status and content-type from NAME.json)
status        answer this HTTP status with an OpenAI error body (``retry_after_ms`` adds the header)
drop_after    after N events, reset the connection; stall_after: after N events, go silent
fail_after    Responses API stream (native): after N output tokens, ``response.failed`` (``server_error``)
fault         one of :data:`FAULTS`: a fault other gateways' and SDKs' bug reports describe
tool          ``call``: with tools, call one even after tool results (an agent loop of many steps); ``text``: answer
              in text
============  ==========================================================================

``POST /emulator/config`` with ``{"ttft_ms": 3000}`` and/or ``{"tps": 50}`` changes the defaults of every later
request (an upstream that starts queueing mid-test); ``GET /emulator/config`` shows them.

With ``tokens_per_minute`` (``--tokens-per-minute``, or ``{"tokens_per_minute": N}`` on the admin endpoint; 0 turns
it off) the emulator keeps one per-minute token budget for everyone who calls it, as OpenAI and Cerebras do per
organisation: each chat-completions or Responses request is charged when it arrives (its messages' JSON bytes / 4,
plus its ``max_tokens``), every answer reports what is left in the dialect's rate-limit headers (OpenAI's form:
``x-ratelimit-*-tokens`` with resets such as ``12.5s``; Cerebras': ``x-ratelimit-*-tokens-minute`` in seconds), and a
request the rest does not cover is answered 429 in the dialect's error shape. The window starts with the first request
and restarts a minute after it started.

With ``timing_log`` (``tiergate emulate --timing-log FILE``) every streamed answer appends one JSON line when it
ends: ``{"rid", "received", "first_token", "last_token", "token_chunks"}``, times from ``time.perf_counter()``
(``CLOCK_MONOTONIC``, shared by every process of the machine): when the request was complete and when the write
holding the first / last token-bearing chunk was handed to the socket (ground truth for the metrics tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httptools
import orjson

from gateway.responses.whole import Draft
from gateway.tools.emulator_ws import EmulatorSocket, wants_socket
from gateway.tools.prompt_cache import PromptCache
from gateway.tools.surface import Surface

WORDS = [w.encode() for w in (" Every", " token", " leaves", " the", " gateway", " the", " moment", " it",
                              " arrives", ",", " unbuffered", ",", " and", " is", " counted", " once", ".")]
_DIRECTIVE = re.compile(rb"\[\[emulate ([^\]]*)\]\]")
SSE = b"text/event-stream; charset=utf-8"
_ERR_400 = (b'event: error\ndata: {"error":{"message":"invalid request","type":"invalid_request_error",'
            b'"code":400}}\n\n')
_ERR_500 = b'data: {"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}\n\n'
_QUOTA = (b'{"error":{"message":"You exceeded your current quota, please check your plan and billing details.",'
          b'"type":"insufficient_quota","param":null,"code":"insufficient_quota"}}')
_OVERFLOW = (b'{"error":{"code":500,"message":"request (9120 tokens) exceeds the available context size (8192 '
             b'tokens)","type":"server_error"}}')
_EMPTY = (b'{"status_code":500,"error":{"message":"server error, please retry","type":"server_error","param":"",'
          b'"code":"","id":""}}')
_TPM = (b'{"message":"Tokens per minute limit exceeded","type":"too_many_tokens_error","param":"quota",'
        b'"code":"token_quota_exceeded"}')
# fault=NAME (from other gateways' and SDKs' bug reports, for the soak and for tests): what the upstream does wrong
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
REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 422: b"Unprocessable Entity",
           429: b"Too Many Requests", 500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable"}


@dataclass(frozen=True)
class EmulatorConfig:
    """Defaults of one emulated tier: tokens/s, time to first token (seconds), dialect, fixtures folder (the
    checkout's ``tests/fixtures/upstream``, found from this file; an installed wheel has none: ``--fixtures``)."""

    tps: float = 750.0
    ttft: float = 0.05
    dialect: str = "cerebras"
    fixtures: Path = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "upstream"
    max_tokens: int = 4096
    tokens_per_minute: int | None = None  # one shared budget of every caller (module docstring); None: no limit
    cache_ttl: float | None = None  # seconds a prompt prefix stays cached (gateway.tools.prompt_cache); None: no cache
    prefill_tps: float | None = None  # prompt tokens prefilled per second, added to the TTFT (cached ones are not)

    @classmethod
    def for_tier(cls, tier: str, **overrides: Any) -> EmulatorConfig:
        """Defaults per tier: fast 750 tokens/s, 50 ms TTFT, Cerebras dialect; standard 50 tokens/s, 400 ms, OpenAI."""
        base = cls() if tier == "fast" else cls(tps=50.0, ttft=0.4, dialect="openai")
        return cls(**{**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}})

def _openai_429(budget: int, spent: int, cost: int) -> bytes:
    return orjson.dumps({"error": {
        "message": f"Rate limit reached for tokens per min (TPM): Limit {budget}, Used {spent}, Requested {cost}.",
        "type": "tokens", "param": None, "code": "rate_limit_exceeded"}})


def _x_groq(gen: Generation) -> bytes:
    return b',"x_groq":{"id":"req_' + gen.id[-26:] + b'","usage":' + orjson.dumps(gen._usage()) + b"}"


def _groq_whole(gen: Generation) -> dict[str, Any]:
    return {"x_groq": {"id": "req_" + gen.id.decode()[-26:]}}


def _cerebras_finish(gen: Generation) -> bytes:
    return b',"usage":' + orjson.dumps(gen._usage()) + b',"time_info":' + orjson.dumps(gen._time_info())


@dataclass(frozen=True)
class Profile:
    """How the upstreams of one dialect answer, as the emulator plays them: one row of :data:`PROFILES` per dialect
    (the names ``gateway.config.upstreams.Dialect`` admits; a new dialect adds its row, and tests/test_dialects.py
    fails while one is missing). The defaults are OpenAI's.

    Attributes:
        responses: serves ``/v1/responses`` itself; else 404 (the gateway bridges the Responses API to it).
        openai_chunks: OpenAI's chunk shape (a role chunk with ``content: ""`` and ``refusal: null``, a
            ``finish_reason`` member on every chunk, a ``choices: []`` usage chunk only when
            ``stream_options.include_usage`` asks, and ``usage: null`` on the other chunks then); False: Cerebras'
            (a bare role chunk, ``finish_reason`` on the finish chunk alone, no separate usage chunk).
        done: a stream ends with ``data: [DONE]`` (the ``done`` directive overrides it).
        finish: what the last finish chunk carries after its ``choices``, given the answer, when usage is reported.
        whole: the members a whole answer adds, given the answer.
        processing_ms: a whole answer has an ``openai-processing-ms`` header (whole milliseconds).
        window: the period suffix of the rate-limit headers of its token budget (``-minute``), or none.
        reset: how their reset is written: a Go-style duration (``%.3fs``) or float seconds (``%.3f``).
        refusal: the body of the 429 its exhausted token budget answers, given (budget, spent, cost) in tokens.
        service_tier: its answers say the ``service_tier`` that served them (every chunk, a whole answer, a Response).
    """

    responses: bool = False
    openai_chunks: bool = True
    done: bool = True
    finish: Callable[[Generation], bytes] = lambda gen: b""
    whole: Callable[[Generation], dict[str, Any]] = lambda gen: {}
    processing_ms: bool = False
    window: bytes = b""
    reset: bytes = b"%.3fs"
    refusal: Callable[[int, int, int], bytes] = _openai_429
    service_tier: bool = False


PROFILES: dict[str, Profile] = {
    "openai": Profile(responses=True, processing_ms=True, service_tier=True),
    "vllm": Profile(),
    "groq": Profile(finish=_x_groq, whole=_groq_whole),
    "cerebras": Profile(openai_chunks=False, done=False, finish=_cerebras_finish,
                        whole=lambda gen: {"time_info": gen._time_info()}, window=b"-minute", reset=b"%.3f",
                        refusal=lambda budget, spent, cost: _TPM),
}


@dataclass
class Plan:
    """A scripted answer.

    status and headers: the status line and headers (``transfer-encoding: chunked`` or ``content-length`` is
    added); head_delay: seconds before the status line; parts: (delay in seconds before the write, bytes), each
    its own write (its own HTTP chunk when ``chunked``); end: after the last part, ``ok`` (a clean end), ``eof``
    (close the connection, inside the chunked body), ``reset`` (TCP RST) or ``stall`` (silence, the connection
    kept open); chunked: chunked transfer encoding, else ``content-length`` over the joined parts; drop: close
    the connection without answering (at once: what a server does to a keep-alive connection it timed out just as a
    request arrived; after ``head_delay``: a server that read the request and then failed).
    """

    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream; charset=utf-8"})
    parts: list[tuple[float, bytes]] = field(default_factory=list)
    end: str = "ok"
    chunked: bool = True
    head_delay: float = 0.0
    drop: bool = False


@dataclass
class Received:
    """One request as the emulator saw it: header names lower-case; ``at``: ``time.monotonic()`` when it was
    complete; ``connection``: which connection (1, 2, ... in the order opened) it came on."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    connection: int = 0


Handler = Callable[[Received], "Plan | None"]


class Emulator:
    """What the connections of one emulator share: its defaults, an optional script, and what it records.

    Args:
        config: the model-like defaults.
        handler: answers each request with a :class:`Plan`, or None to answer like a model; None: always a model.
        record: keep every :class:`Received` in ``requests`` (tests), and the close time of every connection in
            ``closed_at`` (``time.monotonic()``).
        timing_log: a file to append one timing line per streamed answer to (module docstring).
    """

    def __init__(self, config: EmulatorConfig, handler: Handler | None = None, *, record: bool = False,
                 timing_log: Path | None = None) -> None:
        self.config = config
        self.handler = handler
        self.record = record
        self.requests: list[Received] = []
        self.opened = 0
        self.closed_at: list[float] = []
        # the Responses API responses made and stored (not ``store: false``), by id (newest last, bounded): a
        # follow-up to any other is refused, as OpenAI refuses it, so that a gateway that starts a conversation afresh
        # (or continues a store: false one over HTTP) is caught; GET and DELETE /v1/responses/{id} read and remove
        # them, as OpenAI's do
        self.responses_made: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.surface = Surface()  # files, batches, ... (the rest of the /v1 surface)
        self.window: tuple[float, int] = (0.0, 0)  # the token budget's window: (its start, loop time; tokens spent)
        self.cache: PromptCache | None = None  # made when config.cache_ttl is first set (it may come from the admin)
        self._log: TextIO | None = timing_log.open("a", buffering=1) if timing_log else None

    def made(self, response: dict[str, Any], kept: OrderedDict[str, dict[str, Any]] | None = None) -> None:
        """Keep a Responses API ``response`` (its final form) by id in ``kept`` (default :attr:`responses_made`; a
        WebSocket's own memory: ``gateway.tools.emulator_ws``), the oldest forgotten past 10,000."""
        kept = self.responses_made if kept is None else kept
        kept[response["id"]] = response
        if len(kept) > 10_000:
            kept.popitem(last=False)

    def cached(self, body: dict[str, Any], prompt: bytes, now: float) -> int:
        """The tokens of a request's ``prompt`` (its messages' or input's JSON) its prompt cache holds (0 without
        ``cache_ttl``), the cache keyed by the body's ``prompt_cache_key`` (gateway.tools.prompt_cache)."""
        ttl = self.config.cache_ttl
        if not ttl:
            return 0
        if self.cache is None or self.cache.ttl != ttl:
            self.cache = PromptCache(ttl)
        key = body.get("prompt_cache_key")
        return self.cache.use(key if isinstance(key, str) else "", prompt, now)

    def protocol(self) -> EmulatorProtocol:
        """A protocol for one new connection (``loop.create_server(emulator.protocol, ...)``)."""
        return EmulatorProtocol(self)

    def log_timing(self, line: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.write(json.dumps(line) + "\n")


class _Request:
    __slots__ = ("method", "url", "body", "headers", "received", "timing")

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.body: list[bytes] = []
        self.headers: dict[bytes, bytes] = {}
        self.received = 0.0
        self.timing: dict[str, Any] | None = None


_TOKEN = b'"delta":{"content":"'  # a content delta with text (the role chunk's delta starts with "role")


class EmulatorProtocol(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, one request at a time."""

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.req = _Request()
        self.current: _Request | None = None  # the request being answered
        self.timer: asyncio.TimerHandle | None = None
        self.served = 0  # requests received on this connection
        self.number = 0
        self.rate_headers: list[tuple[bytes, bytes]] = []  # the budget's headers for the answer being written
        self.upgrade: _Request | None = None  # a WebSocket handshake read, to be upgraded (gateway.tools.emulator_ws)
        self.socket: EmulatorSocket | None = None  # the connection once upgraded
        self.upgrade_played = False  # a script answered the handshake

    @property
    def cfg(self) -> EmulatorConfig:
        """The emulator's defaults as they are now (``POST /emulator/config`` changes them)."""
        return self.emulator.config

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.emulator.opened += 1
        self.number = self.emulator.opened

    def data_received(self, data: bytes) -> None:
        if self.socket is not None:
            self.socket.data_received(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded(data[exc.args[0]:] if exc.args and isinstance(exc.args[0], int) else b"")
        except httptools.HttpParserError:
            self._reply(400, b'{"error":{"message":"bad request","type":"invalid_request_error"}}')
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.socket is not None:
            self.socket.connection_lost()
        self.transport = None
        if self.emulator.record:
            self.emulator.closed_at.append(time.monotonic())

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.req.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.req.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.req.body.append(body)

    def on_message_complete(self) -> None:
        self.served += 1
        req, self.req = self.req, _Request()
        req.method = self.parser.get_method()
        req.received = time.perf_counter()
        self.current = req
        emu = self.emulator
        if wants_socket(req.method, req.url, req.headers):
            self.upgrade = req  # answered once httptools stops at the upgrade (data_received)
            got = Received("GET", req.url.decode(), {k.decode("latin-1"): v.decode("latin-1")
                                                     for k, v in req.headers.items()}, b"", time.monotonic(),
                           self.number)
            if emu.record:
                emu.requests.append(got)
            plan = emu.handler(got) if emu.handler is not None else None
            if plan is not None:  # a script answers the handshake (an upstream without WebSocket mode)
                self.upgrade = None
                self.upgrade_played = True
                self.play(plan)
            return
        try:
            if emu.handler is not None or emu.record:
                got = Received(req.method.decode(), req.url.decode(), {k.decode("latin-1"): v.decode("latin-1")
                                                                       for k, v in req.headers.items()},
                               b"".join(req.body), time.monotonic(), self.number)
                if emu.record:
                    emu.requests.append(got)
                plan = emu.handler(got) if emu.handler is not None else None
                if plan is not None:
                    self.play(plan)
                    return
            self._handle(req)
        except Exception as exc:  # a bad directive must not kill the emulator
            self._reply(500, orjson.dumps({"error": {"message": f"emulator: {exc}", "type": "server_error",
                                                     "param": None, "code": None}}))

    def _upgraded(self, rest: bytes) -> None:
        """httptools stopped at a WebSocket handshake: the Responses API's WebSocket mode (a dialect whose profile
        serves the Responses API: OpenAI's), the connection's from now on (``rest``: bytes that came after the
        handshake)."""
        req, self.upgrade = self.upgrade, None
        if self.upgrade_played:
            return  # its plan answers; nothing more is read on this connection
        if req is None or not PROFILES[self.cfg.dialect].responses:
            self._reply(404, b'{"message":"Not Found","type":"not_found_error","param":"","code":"not_found"}')
            self._close()
            return
        self.socket = EmulatorSocket(self, req.method, req.url, req.headers)
        if rest:
            self.socket.data_received(rest)

    def play(self, plan: Plan) -> None:
        """Answer with a scripted :class:`Plan`."""
        if plan.drop:
            if plan.head_delay:
                self.timer = self.loop.call_later(plan.head_delay, self._close)
            else:
                self._close()
            return
        size = sum(len(p) for _, p in plan.parts)
        head = [f"HTTP/1.1 {plan.status} {REASONS.get(plan.status, b'Status').decode()}",
                *(f"{k}: {v}" for k, v in plan.headers.items()),
                "transfer-encoding: chunked" if plan.chunked else f"content-length: {size}"]
        t = self.loop.time() + plan.head_delay
        items = []
        for delay, part in plan.parts:
            t += delay
            items.append((t, part))
        Schedule(self, items, {}, end=plan.end, head=(self.loop.time() + plan.head_delay,
                                                       ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")),
                 chunked=plan.chunked, coalesce=False).start()

    # request handling
    def _handle(self, req: _Request) -> None:
        path = req.url.split(b"?", 1)[0]
        if path == b"/emulator/config":
            self._admin(req)
            return
        under = path.split(b"/v1/", 1)[-1].decode("latin-1")
        if self._stored_response(req.method, under):
            return
        if under not in ("chat/completions", "responses") and self.emulator.surface.handle(
                self, req.method.decode(), under, req.headers, b"".join(req.body)):
            return  # the rest of the /v1 surface (gateway.tools.surface)
        if not path.endswith((b"/chat/completions", b"/responses")) or req.method != b"POST":
            self._reply(404, b'{"error":{"message":"Unknown request URL","type":"invalid_request_error",'
                             b'"param":null,"code":"unknown_url"}}')
            return
        raw = b"".join(req.body)
        body = orjson.loads(raw)
        d = _directives(raw)
        if path.endswith(b"/responses") and not PROFILES[d.get("dialect", self.cfg.dialect)].responses:
            # Cerebras' API serves chat completions only, and the others' Responses API is partial: the gateway
            # bridges the Responses API to them (gateway.config.upstreams.DIALECT_SURFACES)
            self._reply(404, b'{"message":"Not Found","type":"not_found_error","param":"","code":"not_found"}')
            return
        if "status" in d:
            self._error(int(d["status"]), d)
            return
        if self.cfg.tokens_per_minute and not self._charge(body):
            return
        previous = body.get("previous_response_id")
        if path.endswith(b"/responses") and previous is not None and previous not in self.emulator.responses_made:
            self._reply(400, orjson.dumps({"error": {"message": f"Previous response with id '{previous}' not found.",
                                                     "type": "invalid_request_error", "param": "previous_response_id",
                                                     "code": "previous_response_not_found"}}))
            return
        if "transcript" in d:
            self._replay(d["transcript"], d, stream=body.get("stream") is True)
            return
        if "fault" in d:
            self._fault(d["fault"], body, d)
            return
        gen = Generation(self, body, d, responses=path.endswith(b"/responses"))
        if gen.responses and body.get("store") is not False:  # OpenAI keeps no store: false response
            self.emulator.made(gen.final_response())
        gen.start()

    def _stored_response(self, method: bytes, under: str) -> bool:
        """``GET`` / ``DELETE /v1/responses/{id}`` (OpenAI API reference: retrieve and delete a model response): the
        response as its stream ended, or ``{"id", "object": "response", "deleted": true}``; 404 for an id not made
        here (or deleted). False for any other request (``under``: the path after ``/v1/``)."""
        response_id = under.removeprefix("responses/")
        if response_id == under or "/" in response_id or method not in (b"GET", b"DELETE"):
            return False
        made = self.emulator.responses_made
        found = made.get(response_id)
        if found is None:
            self._reply(404, orjson.dumps({"error": {"message": f"No response found with id '{response_id}'.",
                                                     "type": "invalid_request_error", "param": "response_id",
                                                     "code": "response_not_found"}}))
        elif method == b"GET":
            self._reply(200, orjson.dumps(found))
        else:
            del made[response_id]
            self._reply(200, orjson.dumps({"id": response_id, "object": "response", "deleted": True}))
        return True

    def _charge(self, body: dict[str, Any]) -> bool:
        """Charge the request to the token budget (module docstring); False when it was answered 429 instead."""
        budget, emu, now = self.cfg.tokens_per_minute or 0, self.emulator, self.loop.time()
        start, spent = emu.window
        if now - start >= 60.0:
            start, spent = now, 0
        limit = next((v for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                      if isinstance(v := body.get(k), int) and not isinstance(v, bool) and v > 0), 0)
        cost = len(orjson.dumps(body.get("messages", body.get("input", [])))) // 4 + limit
        fits = spent + cost <= budget
        emu.window = (start, spent + cost if fits else spent)
        left, reset = budget - emu.window[1], start + 60.0 - now
        profile = PROFILES[self.cfg.dialect]
        self.rate_headers = [(b"x-ratelimit-limit-tokens" + profile.window, b"%d" % budget),
                             (b"x-ratelimit-remaining-tokens" + profile.window, b"%d" % left),
                             (b"x-ratelimit-reset-tokens" + profile.window, profile.reset % reset)]
        if not fits:
            self._reply(429, profile.refusal(budget, spent, cost))
        return fits

    def _admin(self, req: _Request) -> None:
        """``POST /emulator/config`` with ``{"ttft_ms": 3000, "tps": 50}`` (either) changes the defaults of every
        later request (a TTFT step mid-test: the upstream queues up); ``GET`` shows them."""
        if req.method == b"POST":
            try:
                given = orjson.loads(b"".join(req.body))
                changes: dict[str, Any] = {"ttft": float(given["ttft_ms"]) / 1000} if "ttft_ms" in given else {}
                if "tps" in given:
                    changes["tps"] = float(given["tps"])
                if "tokens_per_minute" in given:
                    changes["tokens_per_minute"] = int(given["tokens_per_minute"]) or None
                    self.emulator.window = (0.0, 0)
                for name in ("cache_ttl", "prefill_tps"):  # a prompt cache and a prefill time, or (0) none
                    if name in given:
                        changes[name] = float(given[name]) or None
            except (ValueError, TypeError, KeyError):
                self._reply(400, b'{"error":{"message":"give {\"ttft_ms\": N}, {\"tps\": N} and/or '
                                 b'{\"tokens_per_minute\": N}","type":'
                                 b'"invalid_request_error","param":null,"code":null}}')
                return
            self.emulator.config = dataclasses.replace(self.emulator.config, **changes)
        cfg = self.emulator.config
        self._reply(200, orjson.dumps({"ttft_ms": cfg.ttft * 1000, "tps": cfg.tps, "dialect": cfg.dialect,
                                       "tokens_per_minute": cfg.tokens_per_minute, "cache_ttl": cfg.cache_ttl,
                                       "prefill_tps": cfg.prefill_tps}))

    def _fault(self, name: str, body: dict[str, Any], d: dict[str, str]) -> None:
        """Play one of :data:`FAULTS` (chat completions, either dialect)."""
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}")
        answers = {"quota_429": (429, _QUOTA, []), "overflow_500": (500, _OVERFLOW, []),
                   "empty_envelope": (500, _EMPTY, []),
                   "reset_only_429": (429, _TPM, [(b"x-ratelimit-remaining-tokens-minute", b"0"),
                                                  (b"x-ratelimit-reset-tokens-minute", b"1.5")])}
        if name in answers:
            status, data, extra = answers[name]
            self._reply(status, data, extra=extra)
            return
        if name == "stale" and self.served > 1:
            self._close()
            return
        gen = Generation(self, body, d)
        gen.t0 = self.loop.time()
        if body.get("stream") is not True:
            gen.start()
            return
        played = _Played(gen)
        _STREAM_FAULTS[name](played)
        self._start_chunked(200, played.ctype, played.extra)
        Schedule(self, played.items, d, end=played.end).start()

    def _error(self, status: int, d: dict[str, str]) -> None:
        extra = [(b"retry-after-ms", d["retry_after_ms"].encode())] if "retry_after_ms" in d else []
        etype = "rate_limit_error" if status == 429 else ("server_error" if status >= 500 else "invalid_request_error")
        body = orjson.dumps({"error": {"message": d.get("message", f"emulated {status}"), "type": etype,
                                       "param": None, "code": d.get("code")}})
        self._reply(status, body, extra=extra)

    def _replay(self, name: str, d: dict[str, str], stream: bool) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError("bad transcript name")
        meta = orjson.loads((self.cfg.fixtures / f"{name}.json").read_bytes())
        data = (self.cfg.fixtures / f"{name}.body").read_bytes()
        resp = meta["response"]
        ctype = _header(resp["headers"], "content-type") or "application/json"
        if not meta.get("streaming"):
            self._reply(int(resp["status"]), data, ctype=ctype.encode())
            return
        events = [e + b"\n\n" for e in data.split(b"\n\n") if e.strip(b"\n")]
        tps = float(d.get("tps", self.cfg.tps))
        ttft = float(d.get("ttft_ms", self.cfg.ttft * 1000)) / 1000
        t0 = self.loop.time()
        self._start_chunked(int(resp["status"]), ctype.encode())
        Schedule(self, [(t0 + ttft + i / tps, e) for i, e in enumerate(events)], d).start()

    # wire helpers
    def _reply(self, status: int, body: bytes, *, ctype: bytes = b"application/json",
               extra: list[tuple[bytes, bytes]] | None = None) -> None:
        if self.transport is None:
            return
        head = [b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"Status")), b"content-type: " + ctype,
                b"content-length: %d" % len(body), b"x-request-id: emu_%x" % id(body)]
        head += [k + b": " + v for k, v in [*(extra or ()), *self.rate_headers]]
        self.rate_headers = []
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)

    def _start_chunked(self, status: int, ctype: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        if self.transport is not None:
            reason = REASONS.get(status, b"OK")
            more = b"".join(k + b": " + v + b"\r\n" for k, v in [*(extra or ()), *self.rate_headers])
            self.rate_headers = []
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n"
                                 b"x-request-id: emu_%x\r\n%s\r\n" % (status, reason, ctype, id(self), more))
            req = self.current
            if req is not None and self.emulator._log is not None and ctype.startswith(b"text/event-stream"):
                rid = req.headers.get(b"x-client-request-id", b"").decode()
                req.timing = {"rid": rid, "received": req.received, "first_token": None, "last_token": None,
                              "token_chunks": 0}

    def write(self, payload: bytes, chunked: bool = True) -> None:
        """Write ``payload`` (as one HTTP chunk when ``chunked``), noting token writes for the timing log."""
        if self.transport is None or not payload:
            return
        req = self.current
        if req is not None and req.timing is not None and (n := payload.count(_TOKEN)):
            now = time.perf_counter()
            req.timing["token_chunks"] += n
            req.timing["first_token"] = req.timing["first_token"] or now
            req.timing["last_token"] = now
        self.transport.write(b"%x\r\n%s\r\n" % (len(payload), payload) if chunked else payload)

    def end_chunked(self) -> None:
        """Write the last chunk; the connection stays open for the next request."""
        if self.transport is not None:
            self.transport.write(b"0\r\n\r\n")
        req = self.current
        if req is not None and req.timing is not None:
            self.emulator.log_timing(req.timing)
            req.timing = None

    def reset(self) -> None:
        """Close the connection with a TCP RST (SO_LINGER 0)."""
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Played:
    """A generated stream being bent into a fault: its timed events, and how its answer ends and is labelled."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.items: list[tuple[float, bytes]] = gen._events(gen.t0)
        self.role: tuple[float, bytes] = self.items[0]
        self.t_first: float = gen.t0 + gen.ttft
        self.t_end: float = self.items[-1][0]
        self.answer: list[tuple[float, bytes]] = [e for e in self.items if e[1] != _DONE]  # everything but [DONE]
        self.end = "ok"
        self.ctype = SSE
        self.extra: list[tuple[bytes, bytes]] = []

    def without_usage_chunk(self) -> list[tuple[float, bytes]]:
        return [e for e in self.answer if b'"choices":[]' not in e[1]]


def _usage_on_error(p: _Played) -> None:
    last = p.gen._chunk(b'{"index":0,"delta":{},"finish_reason":"error"}', b',"error":{"code":502,"message":'
                        b'"Provider disconnected"},"usage":' + orjson.dumps(p.gen._usage()))
    p.items = [*p.items[:3], (p.items[2][0], last + _DONE)]


def _set(p: _Played, **kw: Any) -> None:
    for key, value in kw.items():
        setattr(p, key, value)


_DONE = b"data: [DONE]\n\n"
# the FAULTS played on a stream, as edits of the generated answer
_STREAM_FAULTS: dict[str, Callable[[_Played], None]] = {
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
    "usage_chunk": lambda p: _set(p, items=[*p.without_usage_chunk(), (p.t_end, p.gen._chunk(
        b"", b',"usage":' + orjson.dumps(p.gen._usage())))]),
}


class Schedule:
    """Writes timed payloads on one connection with loop timers.

    Args:
        items: (loop time, bytes) in time order.
        d: the request's directives (``drop_after`` / ``stall_after``: after that many items, reset / go silent).
        end: after the last payload, ``ok`` (the chunked terminator; the connection stays open), ``eof`` (close the
            connection inside the body), ``reset`` (TCP RST) or ``stall`` (write nothing more, keep it open).
        head: (loop time, bytes) of a status line and headers to write first (scripted plans), or None.
        chunked: frame payloads as HTTP chunks (else raw, for a ``content-length`` body).
        coalesce: all payloads due at one tick go in one write (generated streams); else each is its own write.
    """

    def __init__(self, proto: EmulatorProtocol, items: list[tuple[float, bytes]], d: dict[str, str],
                 end: str = "ok", head: tuple[float, bytes] | None = None, chunked: bool = True,
                 coalesce: bool = True) -> None:
        self.proto = proto
        self.items = items
        self.i = 0
        self.end = end
        self.head = head
        self.chunked = chunked
        self.coalesce = coalesce
        self.drop_after = int(d["drop_after"]) if "drop_after" in d else None
        self.stall_after = int(d["stall_after"]) if "stall_after" in d else None

    def start(self) -> None:
        """Schedule the first write."""
        if self.head is not None:
            self.proto.timer = self.proto.loop.call_at(self.head[0], self._write_head)
        else:
            self._next()

    def _write_head(self) -> None:
        assert self.head is not None
        if self.proto.transport is not None:
            self.proto.transport.write(self.head[1])
        self._next()

    def _next(self) -> None:
        if self.i < len(self.items):
            self.proto.timer = self.proto.loop.call_at(self.items[self.i][0], self._tick)
        else:
            self._finish()

    def _tick(self) -> None:
        now = self.proto.loop.time()
        parts: list[bytes] = []
        while self.i < len(self.items) and self.items[self.i][0] <= now + 0.0002:
            if self.i in (self.drop_after, self.stall_after):
                self.proto.write(b"".join(parts))
                if self.i == self.drop_after:
                    self.proto.reset()
                return
            parts.append(self.items[self.i][1])
            self.i += 1
            if not self.coalesce:
                break
        self.proto.write(b"".join(parts), self.chunked)
        self._next()

    def _finish(self) -> None:
        if self.end == "ok":
            if self.chunked:
                self.proto.end_chunked()
        elif self.end == "eof":
            self.proto._close()
        elif self.end == "reset":
            self.proto.reset()


def schema_instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """A JSON value that satisfies ``schema``, deterministically: the subset of JSON Schema that function tools and
    structured outputs use (OpenAI's strict mode): ``type`` (or a list of them), ``properties`` (every one is given,
    as strict mode requires), ``items`` with ``minItems``, ``enum``, ``const``, ``anyOf`` / ``oneOf`` (the first
    branch that is not null), ``allOf``, ``$ref`` into ``$defs`` / ``definitions``, string ``format`` and
    ``minLength``, numeric ``minimum`` / ``maximum``. The emulator answers with it, so an agent's tool call parses and
    validates (tests check it with the ``jsonschema`` library)."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > 20:
        return None
    if "$ref" in schema:
        target: Any = root
        for key in str(schema["$ref"]).lstrip("#/").split("/"):
            target = target.get(key, {}) if isinstance(target, dict) else {}
        return schema_instance(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            options = [o for o in schema[key] if not (isinstance(o, dict) and o.get("type") == "null")]
            return schema_instance((options or schema[key])[0], root, depth + 1)
    if isinstance(schema.get("allOf"), list):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            value = schema_instance(part, root, depth + 1)
            if isinstance(value, dict):
                merged.update(value)
        return merged
    return _typed_instance(schema, root, depth)


def _typed_instance(schema: dict[str, Any], root: Any, depth: int) -> Any:
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return {name: schema_instance(sub, root, depth + 1) for name, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [schema_instance(schema.get("items", {}), root, depth + 1)
                for _ in range(max(1, schema.get("minItems", 1)))]
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    formats = {"date-time": "2026-12-01T00:00:00Z", "date": "2026-12-01", "email": "agent@example.com",
               "uri": "https://example.com/", "uuid": "00000000-0000-4000-8000-000000000000"}
    text = formats.get(schema.get("format", ""), "example")
    text += "x" * max(0, schema.get("minLength", 0) - len(text))
    return text[: schema["maxLength"]] if isinstance(schema.get("maxLength"), int) else text


def _number(schema: dict[str, Any], integer: bool) -> int | float:
    """A number inside ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (7 when unbounded):
    the middle of both bounds, else one past the one given."""
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is not None and high is not None:
        value = (low + high) / 2
    elif low is not None:
        value = low + 1
    elif high is not None:
        value = high - 1
    else:
        value = 7
    if not integer:
        return float(value)
    whole = int(math.floor(value))
    if low is not None and (whole < low or (whole == low and "exclusiveMinimum" in schema)):
        whole += 1  # e.g. between 1 and 2 exclusive of 1: no integer fits, and none can
    return whole


def _pieces(text: str, size: int = 4) -> list[str]:
    """``text`` in pieces of about ``size`` characters: one emulated token each."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


class Generation:
    """One synthetic chat completion or Responses API response: plans the answer, builds its events, schedules them.

    The answer acts enough like a model for agents to run: when the request has ``tools`` and the conversation no
    tool result yet (and ``tool_choice`` is not ``none``), it is one call of the named tool, or the first, with
    arguments that satisfy its JSON schema (:func:`schema_instance`); after a tool result, or without tools, text.
    A ``json_schema`` answer format (``response_format`` / ``text.format``) makes the text a JSON instance of the
    schema (``json_object``: ``{"answer": ...}``). The answer's length is the ``tokens`` directive, else that of the
    JSON or tool call, else the request's token limit (``max_completion_tokens`` / ``max_tokens`` /
    ``max_output_tokens``: text runs until the limit stops it), else 48; an answer stopped by the limit ends with
    ``finish_reason: "length"`` (Responses: ``incomplete``, ``max_output_tokens``). ``n`` choices (chat) each carry
    the same answer.
    """

    def __init__(self, proto: EmulatorProtocol, body: dict[str, Any], d: dict[str, str],
                 responses: bool = False) -> None:
        self.responses = responses
        cfg = proto.cfg
        self.proto = proto
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
        prompt = orjson.dumps(body.get("messages", body.get("input", [])))
        self.prompt_tokens = max(1, len(prompt) // 4)
        self.cached = min(self.prompt_tokens, proto.emulator.cached(body, prompt, proto.loop.time()))
        if cfg.prefill_tps and "ttft_ms" not in d:  # prefill: what the cache does not hold is computed first
            self.ttft += (self.prompt_tokens - self.cached) / cfg.prefill_tps
        n = body.get("n")
        self.n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16 and not responses else 1
        self.t0 = 0.0
        self.tool: tuple[str, str] | None = None  # (name, call id) when the answer is a tool call
        self.pieces, self.finish = self._plan(cfg.max_tokens)
        self.tokens = len(self.pieces)

    def _plan(self, cap: int) -> tuple[list[str], str]:
        body = self.body
        limit = next((v for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                      if isinstance(v := body.get(k), int) and not isinstance(v, bool) and v > 0), None)
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

    def start(self) -> None:
        """Answer the request: a timed event stream, or one JSON body after the generation time."""
        t0 = self.t0 = self.proto.loop.time()
        if self.body.get("stream") is True:
            self.proto._start_chunked(200, b"text/event-stream; charset=utf-8")
            events = self._response_events(t0) if self.responses else self._events(t0)
            Schedule(self.proto, events, self.d).start()
        else:
            delay = self.ttft + (self.tokens - 1) / self.tps
            self.proto.timer = self.proto.loop.call_at(t0 + delay, self._whole)

    def _text(self, start: int, n: int) -> str:
        return "".join(self.pieces[start:start + n])

    def _usage(self) -> dict[str, Any]:
        completion = self.tokens * self.n
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached},
                "completion_tokens_details": {"reasoning_tokens": 0}}

    def _time_info(self) -> dict[str, Any]:
        completion = (self.tokens - 1) / self.tps
        return {"queue_time": 0.0002, "prompt_time": self.ttft / 2, "completion_time": completion,
                "total_time": self.ttft + completion, "created": time.time()}

    def _chunk(self, choices: bytes, tail: bytes = b"") -> bytes:
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
        piece = orjson.dumps(self._text(start, n))
        if self.tool is None:
            return b'{"content":' + piece + b"}"
        name, call_id = self.tool
        head = b'"id":%s,"type":"function","function":{"name":%s,"arguments":%s}' % (
            orjson.dumps(call_id), orjson.dumps(name), piece) if start == 0 else \
            b'"function":{"arguments":%s}' % piece
        return b'{"tool_calls":[{"index":0,' + head + b"}]}"

    def _events(self, t0: float) -> list[tuple[float, bytes]]:
        profile = self.profile
        openai = profile.openai_chunks
        so = self.body.get("stream_options")
        include_usage = openai and self.with_usage and isinstance(so, dict) and so.get("include_usage") is True
        null_usage = b',"usage":null' if include_usage else b""
        role = b'{"role":"assistant","content":"","refusal":null}' if openai else b'{"role":"assistant"}'
        if self.tool is not None and openai:
            role = b'{"role":"assistant","content":null,"refusal":null}'
        items = [(t0, self._chunk(self._choice(c, role), null_usage)) for c in range(self.n)]
        t_first = t0 + self.ttft
        sent = 0
        while sent < self.tokens:  # chunk k leaves at ttft + k * per_chunk / tps: decode runs at exactly tps
            n = min(self.per_chunk, self.tokens - sent)
            at = t_first + sent / self.tps
            items += [(at, self._chunk(self._choice(c, self._delta(sent, n)), null_usage)) for c in range(self.n)]
            sent += n
        t_end = items[-1][0]
        finish = orjson.dumps(self.finish)
        tail = profile.finish(self) if self.with_usage else b""  # on the last choice's finish chunk
        items += [(t_end, self._chunk(self._choice(c, b"{}", finish), null_usage + (tail if c == self.n - 1
                                                                                   else b"")))
                  for c in range(self.n)]
        if include_usage:
            items.append((t_end, self._chunk(b"", b',"usage":' + orjson.dumps(self._usage()))))
        if self.d.get("done", "1" if profile.done else "0") == "1":
            items.append((t_end, b"data: [DONE]\n\n"))
        return items

    def _output_item(self, status: str, sent: int | None = None) -> dict[str, Any]:
        """The Responses output item: a message with its text (the first ``sent`` tokens' when given: an item the
        answer's failure cut), or a function call."""
        text = self._text(0, self.tokens if sent is None else sent) if status != "in_progress" else ""
        if self.tool is not None:
            name, call_id = self.tool
            return {"id": "fc_emu", "type": "function_call", "status": status, "call_id": call_id, "name": name,
                    "arguments": text}
        content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
        return {"id": "msg_emu", "type": "message", "status": status, "role": "assistant", "content": content}

    @property
    def fails_at(self) -> int | None:
        """After how many output tokens a streamed answer fails (the ``fail_after`` directive: Responses API streams
        only, at least one token, so that the failure comes after the first: a relay can no longer fail over)."""
        if not self.responses or self.body.get("stream") is not True or "fail_after" not in self.d:
            return None
        return max(1, min(self.tokens, int(self.d["fail_after"])))

    def final_response(self) -> dict[str, Any]:
        """The Responses API ``response`` as it ends: ``completed``, ``incomplete`` at the token limit, or
        ``failed`` (``fail_after``)."""
        if self.fails_at is not None:
            return self._response("failed")
        return self._response("incomplete" if self.finish == "length" else "completed")

    def _response(self, status: str) -> dict[str, Any]:
        """A Responses API ``response`` object with every field OpenAI's has (the bridge's :class:`Draft` builds it:
        one definition of a complete Response). A failed one carries its ``error`` as OpenAI's does (OpenAPI
        ``ResponseError``: ``server_error`` and a message) and the output it had made, ``incomplete``."""
        draft = Draft({**self.body, "model": self.model.decode(), "service_tier": self.served}, self.response_id)
        draft.created_at = self.created
        error = {"code": "server_error", "message": "The emulated model failed mid-response."}
        out = draft.response(status, [], None, "max_output_tokens" if status == "incomplete" else None,
                             error if status == "failed" else None)
        if status == "failed":
            out["output"] = [self._output_item("incomplete", self.fails_at)]
        if status in ("completed", "incomplete"):
            out["output"] = [self._output_item("completed")]
            if self.with_usage:
                out["usage"] = {"input_tokens": self.prompt_tokens,
                                "input_tokens_details": {"cached_tokens": self.cached, "cache_write_tokens": 0},
                                "output_tokens": self.tokens, "output_tokens_details": {"reasoning_tokens": 0},
                                "total_tokens": self.prompt_tokens + self.tokens}
        return out

    def _response_events(self, t0: float) -> list[tuple[float, bytes]]:
        """Responses API stream (docs/reference/wire.md#responses-api-streams): created, in_progress, one delta per
        chunk (output text or function call arguments), the ``.done`` events, then completed (incomplete at the token
        limit) with usage; with ``fail_after``, the deltas it got to and then ``response.failed``; every event named by
        an ``event:`` line and numbered; no ``[DONE]``."""
        seq = iter(range(1 << 30))

        def event(kind: str, **fields: Any) -> bytes:
            data = orjson.dumps({"type": kind, **fields, "sequence_number": next(seq)})
            return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

        item = self._output_item("in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        head = (event("response.created", response=self._response("in_progress"))
                + event("response.in_progress", response=self._response("in_progress"))
                + event("response.output_item.added", output_index=0, item=item))
        if self.tool is None:
            head += event("response.content_part.added", item_id="msg_emu", output_index=0, content_index=0, part=part)
        items = [(t0, head)]
        sent = 0
        fails_at = self.fails_at
        until = self.tokens if fails_at is None else fails_at
        while sent < until:
            n = min(self.per_chunk, until - sent)
            delta = self._text(sent, n)
            at = t0 + self.ttft + sent / self.tps
            if self.tool is None:
                items.append((at, event("response.output_text.delta", item_id="msg_emu", output_index=0,
                                        content_index=0, delta=delta, logprobs=[])))
            else:
                items.append((at, event("response.function_call_arguments.delta", item_id="fc_emu", output_index=0,
                                        delta=delta)))
            sent += n
        if fails_at is not None:  # the deltas it got to, then the failure: no .done events for the cut item
            items.append((items[-1][0], event("response.failed", response=self._response("failed"))))
            return items
        text = self._text(0, self.tokens)
        status = "incomplete" if self.finish == "length" else "completed"
        done = self._response(status)
        if self.tool is None:
            tail = (event("response.output_text.done", item_id="msg_emu", output_index=0, content_index=0, text=text,
                          logprobs=[])
                    + event("response.content_part.done", item_id="msg_emu", output_index=0, content_index=0,
                            part={**part, "text": text}))
        else:
            tail = event("response.function_call_arguments.done", item_id="fc_emu", output_index=0, arguments=text)
        tail += (event("response.output_item.done", output_index=0, item=done["output"][0])
                 + event(f"response.{status}", response=done))
        items.append((items[-1][0], tail))
        return items

    def warmed_up(self) -> dict[str, Any]:
        """The Responses API ``response`` of a warm-up (``generate: false``, WebSocket mode only): ``completed``, an
        empty ``output``, the input counted and no output tokens."""
        out = self._response("completed")
        out["output"] = []
        if self.with_usage:
            out["usage"] = {**out["usage"], "output_tokens": 0, "total_tokens": self.prompt_tokens}
        return out

    def warm_up_events(self, t0: float) -> list[tuple[float, bytes]]:
        """A warm-up's stream (:meth:`warmed_up`): ``response.created``, then ``response.completed`` once the prompt
        would be read (half the time to first token), numbered as :meth:`_response_events` numbers its events."""
        created = orjson.dumps({"type": "response.created", "response": self._response("in_progress"),
                                "sequence_number": 0})
        done = orjson.dumps({"type": "response.completed", "response": self.warmed_up(), "sequence_number": 1})
        return [(t0, b"event: response.created\ndata: " + created + b"\n\n"),
                (t0 + self.ttft / 2, b"event: response.completed\ndata: " + done + b"\n\n")]

    def _whole(self) -> None:
        if self.responses:
            self.proto._reply(200, orjson.dumps(self.final_response()))
            return
        text = self._text(0, self.tokens)
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
            out["usage"] = self._usage()
        out.update(self.profile.whole(self))
        if not self.profile.processing_ms:
            self.proto._reply(200, orjson.dumps(out))
            return
        # OpenAI reports its own processing time of a request, in whole milliseconds
        ms = round((self.proto.loop.time() - self.t0) * 1000)
        self.proto._reply(200, orjson.dumps(out), extra=[(b"openai-processing-ms", b"%d" % ms)])


def _directives(raw: bytes) -> dict[str, str]:
    """The request's directives: the last ``[[emulate ...]]`` in the body (a conversation's latest turn)."""
    found = None
    for found in _DIRECTIVE.finditer(raw):  # noqa: B007 - the last match is the one that counts
        pass
    if found is None:
        return {}
    out = {}
    for part in found.group(1).decode().split():
        key, _, value = part.partition("=")
        out[key] = value
    return out


def _header(headers: dict[str, Any], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value if isinstance(value, str) else value[0]
    return None


async def serve(config: EmulatorConfig, host: str, port: int, **kw: Any) -> asyncio.Server:
    """Start listening; returns the server (``port=0`` picks a free port: see ``server.sockets``). ``kw`` as
    :class:`Emulator`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(Emulator(config, **kw).protocol, host, port, reuse_address=True, backlog=2048)


def run(config: EmulatorConfig, host: str, port: int, parent: int | None = None,
        timing_log: Path | None = None) -> None:
    """Run an emulator until interrupted (uses uvloop when installed); with ``parent`` (a pid), also until that
    process is gone (checked every 0.5 s), so a demo killed with SIGKILL leaves no emulator holding its port."""
    async def main() -> None:
        server = await serve(config, host, port, timing_log=timing_log)
        async with server:
            if parent is None:
                await server.serve_forever()
            else:
                while os.getppid() == parent:
                    await asyncio.sleep(0.5)

    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            asyncio.run(main())
        else:
            uvloop.run(main())


class EmulatorThread(Emulator):
    """An emulator on a free loopback port, served from a background thread with its own event loop (tests).

    It records every request (``requests``, ``opened``, ``closed_at``); ``handler`` may be replaced at any time;
    ``stop()`` when done. ``base_url`` is its OpenAI base URL (``http://127.0.0.1:PORT/v1``).
    """

    def __init__(self, handler: Handler | None = None, config: EmulatorConfig | None = None) -> None:
        super().__init__(config or EmulatorConfig(), handler, record=True)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("the emulator thread did not start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(self.loop.create_server(self.protocol, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(server.wait_closed())
        self.loop.close()

    def stop(self) -> None:
        """Stop serving and end the thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
