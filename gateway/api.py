"""The HTTP surface of the hot path and the one orchestrating function: read -> decide -> send -> relay -> record.

``POST /v1/chat/completions`` is a bare ASGI endpoint (no FastAPI body model, dependency machinery or
Starlette request object on the hot path): the body is parsed once with orjson, routing reads a few facts,
and the client's bytes go upstream. One watcher task per request awaits the client's ``http.disconnect``
and cancels the request wherever it is (waiting for the upstream's headers, for the first token,
mid-stream, or in a non-streaming call); the upstream response is then closed, never pooled half-read, and
the request is counted once with outcome ``client_disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.config import GatewayConfig
from gateway.errors import (
    GatewayDraining,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    UnsupportedMediaType,
    UpstreamBadResponse,
    UpstreamsResting,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    error_body,
    event_error,
    upstream_error,
)
from gateway.health import SOFT_REASONS, Health, UpstreamHealth, retry_wait
from gateway.health import monotonic as health_clock
from gateway.metrics import Metrics
from gateway.policy import Candidate, Decision, Policy, RequestFacts
from gateway.relay import Relay
from gateway.upstream import UpstreamPool, UpstreamResponse
from gateway.wire import chat_usage, client_wants_usage, parse_chat_request, parse_responses_request, upstream_body

log = logging.getLogger("tiergate")

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream; charset=utf-8"
STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
CLOSE = (b"connection", b"close")
# a streamed answer labelled with one of these is not an event stream; any other label (text/plain, none, ...)
# on a 200 to a stream request is relayed as one (issue 10 case 6: mislabelled streams)
NOT_A_STREAM = ("application/json", "text/html")


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class Exchange:
    """Per-request state: labels for metrics, the open upstream response, and whether it was recorded.

    Times are ``time.perf_counter()`` seconds; ``t0`` is the request's arrival at the endpoint.
    """

    __slots__ = ("t0", "rid", "kind", "tier", "upstream", "model", "stream", "recorded", "resp", "metrics",
                 "in_flight", "health", "on_start", "answered", "relay", "task", "cut")

    def __init__(self, metrics: Metrics, rid: str, kind: str = "chat") -> None:
        self.t0 = time.perf_counter()
        self.rid = rid
        self.kind = kind
        self.metrics = metrics
        self.tier = "none"
        self.upstream = "none"
        self.model = "other"
        self.stream = False
        self.recorded = False
        self.resp: UpstreamResponse | None = None
        self.in_flight: Any = None
        self.health: UpstreamHealth | None = None
        self.on_start: Callable[[], None] | None = None
        self.answered = False  # the status line went to the client
        self.relay: Relay | None = None
        self.task: asyncio.Task[Any] | None = None
        self.cut = False  # the gateway's drain time ran out: the request is being ended by the gateway

    def started(self) -> None:
        """The answer starts to reach the client: run the attempt's ``on_start`` hook once."""
        self.answered = True
        if self.on_start is not None:
            self.on_start()
            self.on_start = None

    def record(self, outcome: str, *, ended: float | None = None, **kw: Any) -> None:
        """Record the request once; later calls are ignored. ``ended``: when it ended for the client
        (``perf_counter`` seconds; default now); ``kw`` as :meth:`Metrics.record`."""
        if self.recorded:
            return
        self.recorded = True
        if self.in_flight is not None:
            self.in_flight.dec()
        duration = (time.perf_counter() if ended is None else ended) - self.t0
        self.metrics.record(tier=self.tier, upstream=self.upstream, model=self.model, outcome=outcome,
                            stream=self.stream, duration=duration, **kw)

    def stream_figures(self) -> dict[str, Any]:
        """What the relay measured so far, as :meth:`Metrics.record` keywords (empty before any relay)."""
        if self.relay is None:
            return {}
        stats = self.relay.stats
        first, last = stats.t_first_token, stats.t_last_token
        return {"ttft": first - self.t0 if first is not None else None,
                "decode_time": last - first if first is not None and last is not None else None,
                "token_chunks": stats.token_chunks, "usage": stats.usage, "time_info": stats.time_info}

    def take(self, health: UpstreamHealth, need_tokens: int) -> None:
        """An attempt starts on the upstream of ``health`` (the previous attempt's slot is given back)."""
        self.release_health()
        self.relay = None
        health.start(health_clock(), need_tokens)
        self.health = health

    def health_headers(self, headers: dict[str, str]) -> None:
        """The upstream answered: update its quota estimate from its rate-limit headers."""
        if self.health is not None:
            self.health.observe_headers(headers, health_clock())

    def health_ok(self) -> None:
        """The attempt's answer reached the client: the upstream works (closes its breaker)."""
        if self.health is not None:
            self.health.success()

    def health_failed(self, exc: GatewayError) -> None:
        """The attempt failed with ``exc``: a 429 starts a cooldown, a 5xx or a failure without a status (connect,
        timeout, bad or broken answer) counts against the breaker; another 4xx is the request's fault (the
        upstream is up)."""
        h = self.health
        if h is None:
            return
        now = health_clock()
        if not isinstance(exc, UpstreamStatusError) or exc.status >= 500:
            h.failure(now)
        elif exc.status == 429:
            h.rate_limited(exc.headers, now, exhausted=exc.quota_exhausted)
        else:
            h.success()

    def release_health(self) -> None:
        """The attempt is over: free its concurrency slot."""
        if self.health is not None:
            self.health.finish()
            self.health = None

    def close_upstream(self) -> None:
        """Close the upstream response if one is still open (its connection is not reused)."""
        if self.resp is not None:
            self.resp.close()
            self.resp = None


class Gateway:
    """The request path of one app: config, policy, upstream pool and metrics, built by ``create_app``.

    Attributes:
        draining: the process is shutting down (``/readyz`` answers 503); see :meth:`begin_drain`.
    """

    def __init__(self, config: GatewayConfig, policy: Policy, pool: UpstreamPool, metrics: Metrics,
                 health: Health) -> None:
        self.config = config
        self.policy = policy
        self.pool = pool
        self.metrics = metrics
        self.health = health
        self.draining = False
        self._active: set[Exchange] = set()

    def begin_drain(self, timeout: float) -> None:
        """Shutting down: from now on ``/readyz`` fails; requests in flight run to their end for up to ``timeout``
        seconds, then each one still running ends: a started stream with an in-band error event
        (``gateway_draining``), anything else with a 503. Call from the event loop's thread."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(timeout, self._cut_all)

    def _cut_all(self) -> None:
        for ex in list(self._active):
            if ex.task is not None and not ex.recorded:
                ex.cut = True
                ex.task.cancel()

    async def handle(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        """Serve one ASGI request of ``kind`` ``chat`` (``POST /v1/chat/completions``, OpenAI API reference
        "Create chat completion") or ``responses`` (``POST /v1/responses``, "Create a model response")."""
        headers = _headers(scope)
        ex = Exchange(self.metrics, _request_id(headers.get("x-request-id")), kind)
        try:
            raw = await _read_body(headers, receive, self.config.limits.max_request_bytes)
        except ClientGone:
            return
        except GatewayError as exc:
            ex.record("client_error")
            # the body was not read to its end: close the connection after the answer, so that its rest can
            # never be read as the next request (issue 10 case 13: one request, one response)
            await _send_error(send, exc, [(b"x-request-id", ex.rid.encode()), CLOSE])
            return
        task = ex.task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        self._active.add(ex)
        try:
            await self._handle(raw, headers, ex, send)
        except asyncio.CancelledError:
            if not gone and not ex.cut:
                raise
            task.uncancel()
            if gone:
                await self._client_left(ex)
            else:
                await self._cut_off(ex, send)
        except Exception:  # a bug: answer like the rest of the app, never with a stack trace
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            ex.record("upstream_error")
            if not ex.answered:
                with contextlib.suppress(RuntimeError):  # uvicorn refuses a second status line: nothing to add
                    await _send_error(send, GatewayError("The gateway had an internal error; it has been logged."),
                                      [(b"x-request-id", ex.rid.encode())])
        finally:
            self._active.discard(ex)
            watcher.cancel()
            ex.close_upstream()
            ex.release_health()

    async def _client_left(self, ex: Exchange) -> None:
        """The client disconnected. When it had the whole answer (every choice finished: SDK loops often ``break``
        on ``finish_reason``), read on briefly for the usage that follows so tokens and cost are counted, and
        count a success; else a ``client_disconnect``. Either way the duration ends when the client left."""
        relay = ex.relay
        if relay is None or not relay.stats.finished or relay.stats.error:
            ex.record("client_disconnect", **ex.stream_figures())
            return
        left = time.perf_counter()
        if ex.resp is not None:
            await relay.tail(ex.resp)
        ex.record("success", ended=left, **ex.stream_figures())

    async def _cut_off(self, ex: Exchange, send: Send) -> None:
        """The drain time ran out while the request was in flight: end it (see :meth:`begin_drain`)."""
        message = "The gateway is shutting down and its drain time ran out; retry the request."
        with contextlib.suppress(Exception):  # the client may be gone too: nothing more to tell it
            if ex.answered and ex.stream:
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + error_body(message, "server_error", None, "gateway_draining")
                            + b"\n\n"})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif not ex.answered:
                await _send_error(send, GatewayDraining(message, headers={"retry-after": "1"}),
                                  [(b"x-request-id", ex.rid.encode()), CLOSE])
        ex.record("gateway_draining", **ex.stream_figures())

    async def _handle(self, raw: bytes, headers: dict[str, str], ex: Exchange, send: Send) -> None:
        try:
            body = parse_chat_request(raw) if ex.kind == "chat" else parse_responses_request(raw)
            ex.model = self.metrics.model_label(body["model"])
            facts = RequestFacts(body, headers, len(raw))
            decision = self.policy.decide(facts)
            if ex.kind == "responses":
                decision = _responses_only(decision)
        except GatewayError as exc:
            ex.record("client_error")
            await _send_error(send, exc, [(b"x-request-id", ex.rid.encode())])
            return
        ex.model = decision.model
        ex.stream = body.get("stream") is True
        self.metrics.child(self.metrics.decisions, decision.rule, decision.tier).inc()
        await self._serve(raw, body, decision, facts, ex, send)

    async def _serve(self, raw: bytes, body: dict[str, Any], decision: Decision, facts: RequestFacts, ex: Exchange,
                     send: Send) -> None:
        """Try the available candidates in order (failover only before the first byte), then answer."""
        chat_stream = ex.kind == "chat" and ex.stream
        strip_usage = chat_stream and not client_wants_usage(body)
        path = "/chat/completions" if ex.kind == "chat" else "/responses"
        need = facts.prompt_tokens + (facts.max_tokens or 0)
        attempts, reason, refusal, queued = self._available(decision, need)
        if refusal is not None:
            ex.record("upstream_unavailable")
            await _send_error(send, refusal, [(b"x-request-id", ex.rid.encode())])
            return
        last: GatewayError | None = None  # built only when needed: the common path never fails
        tried = 0
        for i, cand in enumerate(attempts):
            up = cand.upstream
            h = self.health[up.name]
            if up.name in queued and not await h.wait_for_slot():
                self.metrics.spillovers.labels(up.tier, up.name, "concurrency").inc()
                reason = reason or "spillover_concurrency"
                last = UpstreamsResting("Every upstream for this model stayed at its concurrency limit.",
                                        headers={"retry-after": "1"})
                continue
            tried += 1
            ex.tier, ex.upstream = up.tier, up.name
            payload = upstream_body(raw, body, cand.upstream_model, up.dialect, strip_usage and up.dialect == "openai")
            self.metrics.child(self.metrics.overhead, up.tier).observe(time.perf_counter() - ex.t0)
            ex.take(h, need)
            ttft = up.timeouts.ttft if ex.stream else None
            first_token_by = asyncio.get_running_loop().time() + ttft if ttft else None
            ex.on_start = self._on_start(decision, up.tier, tried, reason)
            try:
                try:
                    async with asyncio.timeout_at(first_token_by):
                        ex.resp = await self.pool.send(up, payload, stream=ex.stream, request_id=ex.rid, path=path)
                except TimeoutError as err:
                    raise UpstreamTimeout(f"No first token from the upstream within {ttft:g} s.",
                                          code="upstream_ttft_timeout") from err
                if ex.resp.stale_retried:
                    self.metrics.upstream_errors.labels(up.tier, up.name, "stale_connection").inc()
                ex.health_headers(ex.resp.headers)
                if ex.resp.status != 200:
                    raise await _status_failure(ex, first_token_by)
                hdrs = _route_headers(decision, cand, ex.rid, reason)
                hdrs += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in ex.resp.headers.items()]
                if ex.stream:
                    if ex.resp.content_type.split(";", 1)[0].strip().lower() in NOT_A_STREAM:
                        raise await _not_a_stream(ex, first_token_by)
                    await self._relay(ex, hdrs, strip_usage, send, first_token_by, facts.n, up.timeouts.finish_grace)
                else:
                    await self._whole(ex, hdrs, send)
                return
            except GatewayError as err:
                if ex.answered:
                    raise  # pragma: no cover - nothing raises a GatewayError after the first byte
                exc = err
            ex.close_upstream()
            ex.health_failed(exc)
            last = exc
            self.metrics.upstream_errors.labels(up.tier, up.name, _reason(exc)).inc()
            nxt = attempts[i + 1] if i + 1 < len(attempts) else None
            if nxt is None or not _retryable(exc, up.tier != nxt.upstream.tier):
                break
            reason = _reason(exc)
        if last is None:
            last = UpstreamUnavailable("No upstream is configured for this model.")
        self.metrics.attempts.observe(tried)
        outcome = "upstream_timeout" if isinstance(last, UpstreamTimeout) else (
            "upstream_error" if isinstance(last, UpstreamStatusError) else "upstream_unavailable")
        ex.record(outcome)
        final = next((c for c in reversed(attempts) if c.upstream.name == ex.upstream), None)
        extra = _route_headers(decision, final, ex.rid, reason) if final is not None else [
            (b"x-request-id", ex.rid.encode())]
        if tried > 1 or (isinstance(last, UpstreamStatusError) and last.quota_exhausted):
            # the gateway already retried, or waiting will not help (an exhausted quota): the SDK should not retry
            extra.append((b"x-should-retry", b"false"))
        await _send_error(send, last, extra)

    def _on_start(self, decision: Decision, tier: str, tried: int, reason: str | None) -> Callable[[], None]:
        """What to count once an attempt's answer starts to reach the client (it can no longer fail over)."""
        def count() -> None:
            self.metrics.attempts.observe(tried)
            if reason is not None:  # set only by a fallback: tier lacks the model, spillover, or failover
                self.metrics.fallbacks.labels(decision.tier, tier, reason).inc()
        return count

    def _available(self, decision: Decision,
                   need: int) -> tuple[list[Candidate], str | None, GatewayError | None, set[str]]:
        """Candidates that can take the request now (spillover), the first spillover reason, a refusal, and
        the upstreams among them to wait on for a concurrency slot (``health.queue_seconds``).

        When every candidate is unavailable only because of a quota estimate or its concurrency limit, the
        first of them is tried anyway (the upstream is the judge). When all are resting, the refusal is 429
        ``rate_limit_exceeded`` with ``retry-after`` if every one of them is cooling down after a 429 of its
        own (``insufficient_quota`` with ``x-should-retry: false`` if every one's quota is exhausted), else 503
        ``upstreams_resting`` (a breaker is open) with ``retry-after``.
        """
        now = self.health.clock()
        usable: list[Candidate] = []
        soft: list[Candidate] = []
        queued: set[str] = set()
        spill: str | None = None
        resting: list[UpstreamHealth] = []
        for cand in self.health.order(decision.candidates):
            h = self.health[cand.upstream.name]
            why = h.unavailable(now, need)
            if why == "concurrency" and h.can_queue():
                queued.add(cand.upstream.name)  # waits for a slot, then spills over if none comes in time
                why = None
            if why is None:
                usable.append(cand)
                continue
            self.metrics.spillovers.labels(cand.upstream.tier, cand.upstream.name, why).inc()
            if not usable and spill is None:
                spill = f"spillover_{why}"
            if why in SOFT_REASONS:
                soft.append(cand)
            else:
                resting.append(h)
        if not usable and soft:
            return soft[:1], decision.fallback, None, set()
        if not usable:
            return [], None, _resting_refusal(resting, now), set()
        return usable[: self.config.max_attempts], spill or decision.fallback, None, queued

    async def _relay(self, ex: Exchange, hdrs: list[tuple[bytes, bytes]], strip_usage: bool, send: Send,
                     first_token_by: float | None, choices: int, finish_grace: float) -> None:
        """Relay an SSE answer; the status line and headers leave with the first relayed bytes.

        Raises:
            GatewayError: the stream failed before its first token (see :meth:`Relay.run`); nothing was sent,
                so the caller may fail over.
        """
        assert ex.resp is not None
        resp = ex.resp
        ctype = resp.content_type.encode("latin-1")
        if not ctype.startswith(b"text/event-stream"):
            ctype = EVENT_STREAM  # a stream mislabelled text/plain (or not at all): it is one (issue 10 case 6)
        start = {"type": "http.response.start", "status": 200,
                 "headers": [*hdrs, *STREAM_HEADERS, (b"content-type", ctype)]}
        started = False

        async def write(data: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                ex.started()
                ex.in_flight = self.metrics.child(self.metrics.in_flight, ex.tier, ex.upstream)
                ex.in_flight.inc()
                await send(start)
            await send({"type": "http.response.body", "body": data, "more_body": True})

        relay = Relay(strip_usage_chunk=strip_usage, max_event_bytes=self.config.limits.max_event_bytes,
                      responses=ex.kind == "responses", choices=choices, finish_grace=finish_grace)
        ex.relay = relay
        stats = await relay.run(resp, write, first_token_by)
        kw = ex.stream_figures()
        if stats.error:
            self.metrics.upstream_errors.labels(ex.tier, ex.upstream, stats.error).inc()
        if stats.error and stats.error != "upstream_error_event":
            # a broken or stalled stream is the upstream's failure; an error event it sent may be the request's
            # fault (Groq's tool_use_failed carries status_code 400), so it opens no breaker
            if ex.health is not None:
                ex.health.failure(health_clock())
        else:
            ex.health_ok()
        if stats.complete:
            resp.release()
            ex.resp = None
        else:
            ex.close_upstream()
        ex.record("stream_error" if stats.error else "success", **kw)
        if not started:
            ex.started()
            await send(start)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _whole(self, ex: Exchange, hdrs: list[tuple[bytes, bytes]], send: Send) -> None:
        """Relay a non-streaming answer untouched after checking it is a JSON object and reading its usage.

        Raises:
            UpstreamTimeout, UpstreamUnavailable: the body did not arrive; UpstreamBadResponse: it is not a JSON
                object. Nothing was sent to the client yet, so the caller may fail over.
        """
        assert ex.resp is not None
        resp = ex.resp
        data = await resp.read()
        resp.release()
        ex.resp = None
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise UpstreamBadResponse("The upstream answered 200 with a body that is not a JSON object.")
        usage = parsed.get("usage")
        time_info = parsed.get("time_info")
        ex.health_ok()
        ex.record("success", usage=chat_usage(usage) if isinstance(usage, dict) else None,
                  time_info=time_info if isinstance(time_info, dict) else None,
                  processing_ms=resp.headers.get("openai-processing-ms"))
        ex.started()
        await _send_body(send, 200, data, hdrs)

    async def route(self, request: Request) -> Response:
        """``POST /v1/tiergate/route``: the decision and its trace for a chat-completions body; no upstream call."""
        try:
            headers = {k.lower(): v for k, v in request.headers.items()}
            raw = await _read_body(headers, request.receive, self.config.limits.max_request_bytes)
            body = parse_chat_request(raw)
            facts = RequestFacts(body, headers, len(raw))
            decision = self.policy.decide(facts, explain=True)
        except GatewayError as exc:
            return Response(exc.body(), exc.status, exc.headers, media_type="application/json")
        except ClientGone:
            return Response(b"", 400)
        out = {
            "tier": decision.tier,
            "rule": decision.rule,
            "reason": decision.reason,
            "model": decision.model,
            "fallback": decision.fallback,
            "candidates": [{"upstream": c.upstream.name, "tier": c.upstream.tier, "model": c.upstream_model}
                           for c in decision.candidates],
            "skipped": [{"upstream": name, "reason": why} for name, why in decision.skipped],
            "facts": facts.as_dict(),
            "trace": list(decision.trace),
        }
        return Response(orjson.dumps(out), 200, media_type="application/json")


class Endpoint:
    """A bare ASGI endpoint (Starlette's ``Route`` calls non-function endpoints with scope/receive/send)."""

    def __init__(self, gateway: Gateway, kind: str) -> None:
        self.gateway = gateway
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gateway.handle(scope, receive, send, self.kind)


def _responses_only(decision: Decision) -> Decision:
    """Keep the candidates that speak the Responses API (OpenAI dialect; Cerebras has no ``/v1/responses``).

    Raises:
        ModelNotFound: none of the model's upstreams does.
    """
    kept = tuple(c for c in decision.candidates if c.upstream.dialect == "openai")
    if not kept:
        raise ModelNotFound(f"No upstream serves the Responses API for `{decision.model}`; use /v1/chat/completions.",
                            param="model")
    fallback = decision.fallback
    if kept[0].upstream.tier != decision.tier and fallback is None:
        fallback = "no_responses_api"
    skipped = (*decision.skipped, *((c.upstream.name, "no_responses_api") for c in decision.candidates
                                    if c not in kept))
    return dataclasses.replace(decision, candidates=kept, fallback=fallback, skipped=skipped)


def _request_id(given: str | None) -> str:
    """The client's ``x-request-id`` when it is 1-200 printable ASCII characters, else a new ``req_<32 hex>``.

    Bounded and plain so it can be echoed in headers, logs and upstream requests as it came."""
    if given and len(given) <= 200 and given.isascii() and given.isprintable():
        return given
    return f"req_{os.urandom(16).hex()}"  # uuid4's randomness without building a UUID (2.8 -> 0.7 us)


def _headers(scope: Scope) -> dict[str, str]:
    """Request headers with lower-case names (ASGI already lower-cases them); the last value wins."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


async def _read_body(headers: dict[str, str], receive: Receive, limit: int) -> bytes:
    """The request body, refusing non-JSON content types (415) and bodies over ``limit`` bytes (413).

    Raises:
        UnsupportedMediaType, PayloadTooLarge; ClientGone when the client leaves mid-body.
    """
    ctype = headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaType(f"Unsupported content type {ctype!r}; send application/json.")
    declared = headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is over the {limit}-byte limit.")
    parts: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        part = message.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"The request body is over the {limit}-byte limit.")
            parts.append(part)
        if not message.get("more_body", False):
            break
    if not parts:
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _send_body(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-type", JSON), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, exc: GatewayError, headers: list[tuple[bytes, bytes]]) -> None:
    """Answer ``exc`` as OpenAI's error envelope with its status and headers (``application/json``)."""
    extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    await _send_body(send, exc.status, exc.body(), [*headers, *extra])


def error_response(exc: GatewayError, headers: dict[str, str]) -> Response:
    """``exc`` as a Starlette response (for the non-hot-path handlers in ``app``)."""
    return Response(exc.body(), exc.status, {**exc.headers, **headers}, media_type="application/json")


def _route_headers(decision: Decision, cand: Candidate, rid: str, fallback: str | None) -> list[tuple[bytes, bytes]]:
    out = [
        (b"x-request-id", rid.encode("latin-1")),
        (b"x-tiergate-tier", cand.upstream.tier.encode()),
        (b"x-tiergate-upstream", cand.upstream.name.encode()),
        (b"x-tiergate-rule", decision.rule.encode()),
    ]
    if fallback:
        out.append((b"x-tiergate-fallback", fallback.encode()))
    return out


async def _status_failure(ex: Exchange, deadline: float | None) -> GatewayError:
    """The upstream's non-200 answer as an error to relay or fail over on, with its status and headers even when
    its body does not arrive (stalls, breaks, or outlasts the first-token ``deadline``, a loop time): the status
    line already said what happened, and one failure counts once in the upstream's health. A 429 without a
    retry hint gets ``retry-after`` from the reset of the window it exhausted (:func:`health.retry_wait`)."""
    assert ex.resp is not None
    resp = ex.resp
    try:
        async with asyncio.timeout_at(deadline):
            data = await resp.read_error()
    except (GatewayError, TimeoutError):
        resp.close()
        data = b""
    else:
        resp.release()
    ex.resp = None
    err = upstream_error(resp.status, data, resp.headers)
    if err.status == 429 and "retry-after" not in err.headers and "retry-after-ms" not in err.headers:
        wait = retry_wait(resp.headers)
        if wait is not None:
            err.headers["retry-after"] = str(max(1, math.ceil(wait)))
    return err


async def _not_a_stream(ex: Exchange, deadline: float | None) -> GatewayError:
    """A stream request answered 200 with a JSON (or HTML) body: the error it holds, with the status it names
    (some upstreams answer an error this way), or :class:`UpstreamBadResponse`. Nothing was sent yet."""
    assert ex.resp is not None
    resp = ex.resp
    try:
        async with asyncio.timeout_at(deadline):
            data = await resp.read_error()
    except (GatewayError, TimeoutError):
        data = b""
    ex.close_upstream()
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and parsed.get("error"):
        return event_error(parsed)
    return UpstreamBadResponse("The upstream answered a stream request without an event stream.")


def _resting_refusal(resting: list[UpstreamHealth], now: float) -> GatewayError:
    """The answer when every candidate rests (see :meth:`Gateway._available`)."""
    retry = max(1, math.ceil(min((h.resting_until() - now for h in resting), default=1.0)))
    headers = {"retry-after": str(retry)}
    if resting and all(h.open_until <= now and h.cooldown_until > now for h in resting):
        if all(h.exhausted for h in resting):
            return RateLimited("Every upstream for this model reported its quota exhausted; check the upstream "
                               "accounts' plans and billing.", code="insufficient_quota",
                               headers={**headers, "x-should-retry": "false"})
        return RateLimited(f"Every upstream for this model is rate-limited; retry in {retry} s.", headers=headers)
    return UpstreamsResting("Every upstream for this model is resting (circuit breaker open or rate-limit "
                            f"cooldown); retry in {retry} s.", headers=headers)


def _retryable(exc: GatewayError, other_tier: bool) -> bool:
    """Fail over only where it is safe, and always before any byte was sent: connect and timeout failures,
    429 and 5xx; a context-length 400 only when the next candidate is on the other tier (whose window may be
    larger). Other 4xx are the request's fault and would fail the same way anywhere."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status == 429 or exc.status >= 500 or (other_tier and _context_length(exc))
    return True


def _context_length(exc: UpstreamStatusError) -> bool:
    return exc.context_overflow


def _reason(exc: GatewayError) -> str:
    if isinstance(exc, UpstreamStatusError):
        if _context_length(exc):
            return "context_length"
        return "upstream_429" if exc.status == 429 else f"upstream_{exc.status // 100}xx"
    return exc.code or "upstream_error"
