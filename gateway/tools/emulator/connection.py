"""One HTTP/1.1 connection of the emulator (:class:`EmulatorProtocol`): keep-alive, one request at a time, httptools'
C parser and loop timers (no task per answer)."""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import time
import urllib.parse
from typing import Any

import httptools
import orjson

from gateway.responses.request import input_items, listed_item
from gateway.tools.emulator.budget import TokenBudget
from gateway.tools.emulator.config import EmulatorConfig
from gateway.tools.emulator.directives import directives
from gateway.tools.emulator.faults import ANSWERS, FAULTS, bent
from gateway.tools.emulator.generation import SSE, Generation
from gateway.tools.emulator.plans import Plan, Received
from gateway.tools.emulator.profiles import PROFILES
from gateway.tools.emulator.responses import compacted, final_response, foreign_compaction, orphan, response_events
from gateway.tools.emulator.schedule import Schedule
from gateway.tools.emulator.shared import Emulator
from gateway.tools.emulator.websocket import EmulatorSocket, wants_socket

REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 422: b"Unprocessable Entity",
           429: b"Too Many Requests", 500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable"}
_NOT_FOUND = b'{"message":"Not Found","type":"not_found_error","param":"","code":"not_found"}'


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
        self.upgrade: _Request | None = None  # a WebSocket handshake read, to be upgraded (module docstring)
        self.socket: EmulatorSocket | None = None  # the connection once upgraded
        self.upgrade_played = False  # a script answered the handshake

    @property
    def cfg(self) -> EmulatorConfig:
        """``POST /emulator/config`` changes them."""
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
            self.reply(400, b'{"error":{"message":"bad request","type":"invalid_request_error"}}')
            self.close()

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
            self.reply(500, orjson.dumps({"error": {"message": f"emulator: {exc}", "type": "server_error",
                                                    "param": None, "code": None}}))

    def _upgraded(self, rest: bytes) -> None:
        """The connection is the WebSocket mode's from now on (``rest``: bytes after the handshake), where the
        dialect's profile serves the Responses API."""
        req, self.upgrade = self.upgrade, None
        if self.upgrade_played:
            return  # its plan answers; nothing more is read on this connection
        if req is None or not PROFILES[self.cfg.dialect].responses:
            self.reply(404, _NOT_FOUND)
            self.close()
            return
        self.socket = EmulatorSocket(self, req.method, req.url, req.headers)
        if rest:
            self.socket.data_received(rest)

    def play(self, plan: Plan) -> None:
        if plan.drop:
            if plan.head_delay:
                self.timer = self.loop.call_later(plan.head_delay, self.close)
            else:
                self.close()
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
        if self._stored_response(req.method, under, req.url):
            return
        if under not in ("chat/completions", "responses") and self.emulator.surface.handle(
                self, req.method.decode(), under, req.headers, b"".join(req.body)):
            return  # the rest of the /v1 surface (gateway.tools.emulator.surface)
        if not path.endswith((b"/chat/completions", *_RESPONSES)) or req.method != b"POST":
            self.reply(404, b'{"error":{"message":"Unknown request URL","type":"invalid_request_error",'
                            b'"param":null,"code":"unknown_url"}}')
            return
        raw = b"".join(req.body)
        body = orjson.loads(raw)
        d = directives(raw)
        if path.endswith(_RESPONSES) and not PROFILES[d.get("dialect", self.cfg.dialect)].responses:
            # Cerebras' API serves chat completions only, and the others' Responses API is partial: the gateway
            # bridges the Responses API to them (gateway.config.upstreams.DIALECT_SURFACES)
            self.reply(404, _NOT_FOUND)
            return
        if "status" in d:
            self._error(int(d["status"]), d)
            return
        if self.cfg.tokens_per_minute and not self._charge(body):
            return
        if path.endswith(_RESPONSES) and self._answered_here(path, body, raw):
            return
        if "transcript" in d:
            self._replay(d["transcript"], d, stream=body.get("stream") is True)
            return
        if "fault" in d:
            self._fault(d["fault"], body, d)
            return
        gen = Generation(self.emulator, body, d, self.loop.time(), responses=path.endswith(b"/responses"))
        if gen.responses and body.get("store") is not False:  # OpenAI keeps no store: false response
            self.emulator.made(final_response(gen), inputs=[listed_item(i) for i in input_items(body)])
        self.answer(gen)

    def _answered_here(self, path: bytes, body: dict[str, Any], raw: bytes) -> bool:
        """A Responses request refused as OpenAI refuses it, or a compaction (answered whole, at once)."""
        refused = self._continuation_refused(body)
        if refused is not None:
            self.reply(400, orjson.dumps(refused))
            return True
        if path.endswith(b"/compact"):
            self.reply(200, orjson.dumps(compacted(body, raw, self.emulator.inputs_made, self.emulator.responses_made)))
            return True
        return False

    def _continuation_refused(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """OpenAI's 400 for a ``previous_response_id`` it does not hold, a tool output that answers no call, or a
        compaction item it did not make (the gateway's own must reach it as the message it stands for)."""
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.emulator.responses_made:
            return {"error": {"message": f"Previous response with id '{previous}' not found.",
                              "type": "invalid_request_error", "param": "previous_response_id",
                              "code": "previous_response_not_found"}}
        return foreign_compaction(body) or orphan(body, self.emulator.responses_made)

    def _stored_response(self, method: bytes, under: str, url: bytes) -> bool:
        """OpenAI API reference: retrieve and delete a model response, list its input items. False for any other
        request."""
        response_id = under.removeprefix("responses/")
        listing = response_id.endswith("/input_items") and method == b"GET"
        response_id = response_id.removesuffix("/input_items") if listing else response_id
        if response_id == under or "/" in response_id or method not in (b"GET", b"DELETE"):
            return False
        made = self.emulator.responses_made
        found = made.get(response_id)
        if found is None:
            self.reply(404, orjson.dumps({"error": {"message": f"No response found with id '{response_id}'.",
                                                    "type": "invalid_request_error", "param": "response_id",
                                                    "code": "response_not_found"}}))
        elif listing:
            self.reply(200, orjson.dumps(_items_page(self.emulator.inputs_made.get(response_id, []), url)))
        elif method == b"GET":
            self.reply(200, orjson.dumps(found))
        else:
            del made[response_id]
            self.emulator.inputs_made.pop(response_id, None)
            self.reply(200, orjson.dumps({"id": response_id, "object": "response", "deleted": True}))
        return True

    def _charge(self, body: dict[str, Any]) -> bool:
        """False when it was answered 429 instead (``gateway.tools.emulator.budget``)."""
        profile = PROFILES[self.cfg.dialect]
        self.rate_headers, refusal = self.emulator.budget.charge(body, self.cfg.tokens_per_minute or 0,
                                                                 self.loop.time(), profile)
        if refusal is not None:
            self.reply(429, refusal)
        return refusal is None

    def _admin(self, req: _Request) -> None:
        """``POST /emulator/config`` (:meth:`EmulatorConfig.changed`) changes the defaults of every later request;
        ``GET`` shows them."""
        emu = self.emulator
        if req.method == b"POST":
            try:
                given = orjson.loads(b"".join(req.body))
                changed = emu.config.changed(given)
            except (ValueError, TypeError, KeyError):
                self.reply(400, b'{"error":{"message":"give {\"ttft_ms\": N}, {\"tps\": N} and/or '
                                b'{\"tokens_per_minute\": N}","type":'
                                b'"invalid_request_error","param":null,"code":null}}')
                return
            if "tokens_per_minute" in given:
                emu.budget = TokenBudget()  # a new budget starts a new window
            emu.config = changed
        self.reply(200, orjson.dumps(emu.config.shown()))

    def _fault(self, name: str, body: dict[str, Any], d: dict[str, str]) -> None:
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}")
        if name in ANSWERS:
            status, data, extra = ANSWERS[name]
            self.reply(status, data, extra=extra)
            return
        if name == "stale" and self.served > 1:
            self.close()
            return
        gen = Generation(self.emulator, body, d, self.loop.time())
        if body.get("stream") is not True:
            self.answer(gen)
            return
        played = bent(gen, name)
        self.start_chunked(200, played.ctype, played.extra)
        Schedule(self, played.items, d, end=played.end).start()

    def _error(self, status: int, d: dict[str, str]) -> None:
        extra = [(b"retry-after-ms", d["retry_after_ms"].encode())] if "retry_after_ms" in d else []
        etype = "rate_limit_error" if status == 429 else ("server_error" if status >= 500 else "invalid_request_error")
        body = orjson.dumps({"error": {"message": d.get("message", f"emulated {status}"), "type": etype,
                                       "param": None, "code": d.get("code")}})
        self.reply(status, body, extra=extra)

    def _replay(self, name: str, d: dict[str, str], stream: bool) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError("bad transcript name")
        meta = orjson.loads((self.cfg.fixtures / f"{name}.json").read_bytes())
        data = (self.cfg.fixtures / f"{name}.body").read_bytes()
        resp = meta["response"]
        ctype = _header(resp["headers"], "content-type") or "application/json"
        if not meta.get("streaming"):
            self.reply(int(resp["status"]), data, ctype=ctype.encode())
            return
        events = [e + b"\n\n" for e in data.split(b"\n\n") if e.strip(b"\n")]
        tps = float(d.get("tps", self.cfg.tps))
        ttft = float(d.get("ttft_ms", self.cfg.ttft * 1000)) / 1000
        t0 = self.loop.time()
        self.start_chunked(int(resp["status"]), ctype.encode())
        Schedule(self, [(t0 + ttft + i / tps, e) for i, e in enumerate(events)], d).start()

    def answer(self, gen: Generation) -> None:
        """A timed event stream, or one JSON body once the answer would be generated."""
        if gen.body.get("stream") is True:
            self.start_chunked(200, SSE)
            Schedule(self, response_events(gen) if gen.responses else gen.events(), gen.d).start()
        else:
            self.timer = self.loop.call_at(gen.t0 + gen.duration, self._whole, gen)

    def _whole(self, gen: Generation) -> None:
        if gen.responses:
            self.reply(200, orjson.dumps(final_response(gen)))
        elif not gen.profile.processing_ms:
            self.reply(200, orjson.dumps(gen.whole()))
        else:  # OpenAI reports its own processing time of a request, in whole milliseconds
            ms = round((self.loop.time() - gen.t0) * 1000)
            self.reply(200, orjson.dumps(gen.whole()), extra=[(b"openai-processing-ms", b"%d" % ms)])

    # wire helpers
    def reply(self, status: int, body: bytes, *, ctype: bytes = b"application/json",
               extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """With the token budget's headers, if any."""
        if self.transport is None:
            return
        head = [b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"Status")), b"content-type: " + ctype,
                b"content-length: %d" % len(body), b"x-request-id: emu_%x" % id(body)]
        head += [k + b": " + v for k, v in [*(extra or ()), *self.rate_headers]]
        self.rate_headers = []
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)

    def start_chunked(self, status: int, ctype: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Notes an event stream's times for the timing log."""
        if self.transport is not None:
            reason = REASONS.get(status, b"OK")
            more = b"".join(k + b": " + v + b"\r\n" for k, v in [*(extra or ()), *self.rate_headers])
            self.rate_headers = []
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n"
                                 b"x-request-id: emu_%x\r\n%s\r\n" % (status, reason, ctype, id(self), more))
            req = self.current
            if req is not None and self.emulator.timed and ctype.startswith(b"text/event-stream"):
                rid = req.headers.get(b"x-client-request-id", b"").decode()
                req.timing = {"rid": rid, "received": req.received, "first_token": None, "last_token": None,
                              "token_chunks": 0}

    def write(self, payload: bytes, chunked: bool = True) -> None:
        """Token writes are noted for the timing log."""
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
        """The connection stays open for the next request."""
        if self.transport is not None:
            self.transport.write(b"0\r\n\r\n")
        req = self.current
        if req is not None and req.timing is not None:
            self.emulator.log_timing(req.timing)
            req.timing = None

    def reset(self) -> None:
        """A TCP RST (SO_LINGER 0)."""
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


_RESPONSES = (b"/responses", b"/responses/compact")


def _items_page(items: list[dict[str, Any]], url: bytes) -> dict[str, Any]:
    """A page of "List input items" by its ``order`` (default ``desc``), ``limit`` (default 20) and ``after``."""
    query = urllib.parse.parse_qs(url.partition(b"?")[2].decode("latin-1"))
    order, after = query.get("order", ["desc"])[0], query.get("after", [None])[0]
    limit = int(query.get("limit", ["20"])[0]) if query.get("limit", ["20"])[0].isdigit() else 20
    ordered = items if order == "asc" else items[::-1]
    ids = [i.get("id") for i in ordered]
    rest = ordered[ids.index(after) + 1:] if after in ids else ordered
    page = rest[:max(1, min(limit, 100))]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(rest) > len(page)}


def _header(headers: dict[str, Any], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value if isinstance(value, str) else value[0]
    return None
