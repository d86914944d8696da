"""HTTP routes and the one orchestrating function: read -> decide -> send -> relay -> record.

``POST /v1/chat/completions`` is a plain Starlette route (no FastAPI body model or dependency machinery on
the hot path): the body is parsed once with orjson, routing reads a few facts, and the client's bytes go
upstream. Streams are written by :class:`RelayResponse`, which watches for the client's disconnect and
closes the upstream on every exit path.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.config import GatewayConfig
from gateway.errors import (
    GatewayError,
    PayloadTooLarge,
    UnsupportedMediaType,
    UpstreamBadResponse,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.metrics import Metrics
from gateway.policy import Candidate, Decision, Policy, RequestFacts
from gateway.relay import Relay, StreamStats
from gateway.upstream import UpstreamPool, UpstreamResponse, status_error
from gateway.wire import client_wants_usage, parse_chat_request, upstream_body

log = logging.getLogger("tiergate")

STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Gateway:
    """The request path of one app: config, policy, upstream pool and metrics, built by ``create_app``."""

    def __init__(self, config: GatewayConfig, policy: Policy, pool: UpstreamPool, metrics: Metrics) -> None:
        self.config = config
        self.policy = policy
        self.pool = pool
        self.metrics = metrics

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``, streaming or not (OpenAI API reference, "Create chat completion")."""
        t0 = time.perf_counter()
        rid = request.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
        body: dict[str, Any] | None = None
        try:
            raw = await read_body(request, self.config.limits.max_request_bytes)
            body = parse_chat_request(raw)
            decision = self.policy.decide(RequestFacts.from_request(body, request.headers))
        except GatewayError as exc:
            model = body.get("model") if body is not None else None
            self.metrics.record(tier="none", upstream="none", model=self.metrics.model_label(model),
                                outcome="client_error", stream=False, duration=time.perf_counter() - t0)
            return error_response(exc, {"x-request-id": rid})
        self.metrics.decisions.labels(decision.rule, decision.tier).inc()
        return await self._serve(raw, body, decision, rid, t0)

    async def _serve(self, raw: bytes, body: dict[str, Any], decision: Decision, rid: str, t0: float) -> Response:
        stream = body.get("stream") is True
        ask_usage = stream and not client_wants_usage(body)
        model = decision.model
        last: GatewayError | None = None
        reason = decision.fallback
        attempts = decision.candidates[: self.config.max_attempts]
        tried = 0
        for cand in attempts:
            up = cand.upstream
            tried += 1
            gateway_asks = ask_usage and up.dialect == "openai"
            payload = upstream_body(raw, body, cand.upstream_model, up.dialect, gateway_asks)
            self.metrics.overhead.labels(up.tier).observe(time.perf_counter() - t0)
            try:
                resp = await self.pool.send(up, payload, stream=stream, request_id=rid)
                if resp.status != 200:
                    raise await _status_failure(resp)
                if stream and not resp.content_type.startswith("text/event-stream"):
                    resp.close()
                    raise UpstreamBadResponse("The upstream answered a stream request without an event stream.")
            except GatewayError as exc:
                last = exc
                self.metrics.upstream_errors.labels(up.tier, up.name, _reason(exc)).inc()
                if not _retryable(exc) or tried == len(attempts):
                    break
                reason = _reason(exc)
                continue
            fell_back = tried > 1 or decision.fallback is not None
            headers = self._route_headers(decision, cand, rid, reason if fell_back else None)
            if fell_back and reason:
                self.metrics.fallbacks.labels(decision.tier, up.tier, reason).inc()
            headers.update(resp.headers)
            if stream:
                relay = Relay(strip_usage_chunk=gateway_asks, max_event_bytes=self.config.limits.max_event_bytes)
                return RelayResponse(resp, relay, headers, self._stream_recorder(cand, model, t0))
            return await self._whole(resp, cand, model, headers, t0)
        if last is None:  # no candidate at all (policy guarantees one; kept for safety)
            last = UpstreamUnavailable("No upstream is configured for this model.")
        outcome = "upstream_timeout" if isinstance(last, UpstreamTimeout) else (
            "upstream_error" if isinstance(last, UpstreamStatusError) else "upstream_unavailable")
        final = attempts[tried - 1] if tried else None
        self.metrics.record(tier=final.upstream.tier if final else decision.tier,
                            upstream=final.upstream.name if final else "none",
                            model=model, outcome=outcome, stream=stream, duration=time.perf_counter() - t0)
        extra = self._route_headers(decision, final, rid, None) if final else {"x-request-id": rid}
        if tried > 1:
            extra["x-should-retry"] = "false"  # the gateway already retried; the SDK should not multiply it
        return error_response(last, extra)

    async def _whole(self, resp: UpstreamResponse, cand: Candidate, model: str, headers: dict[str, str],
                     t0: float) -> Response:
        up = cand.upstream
        labels = {"tier": up.tier, "upstream": up.name, "model": model, "stream": False}
        try:
            data = await resp.read()
            resp.release()
            parsed = orjson.loads(data)
            if not isinstance(parsed, dict):
                raise orjson.JSONDecodeError("not an object", "", 0)
        except orjson.JSONDecodeError:
            exc: GatewayError = UpstreamBadResponse("The upstream answered 200 with a body that is not a JSON object.")
            self.metrics.record(**labels, outcome="upstream_error", duration=time.perf_counter() - t0)
            return error_response(exc, headers)
        except GatewayError as exc:
            resp.close()
            outcome = "upstream_timeout" if isinstance(exc, UpstreamTimeout) else "upstream_unavailable"
            self.metrics.record(**labels, outcome=outcome, duration=time.perf_counter() - t0)
            return error_response(exc, headers)
        usage = parsed.get("usage")
        self.metrics.record(**labels, outcome="success", duration=time.perf_counter() - t0,
                            usage=usage if isinstance(usage, dict) else None,
                            time_info=parsed.get("time_info") if isinstance(parsed.get("time_info"), dict) else None,
                            processing_ms=resp.headers.get("openai-processing-ms"))
        return Response(data, 200, headers, media_type="application/json")

    def _stream_recorder(self, cand: Candidate, model: str, t0: float) -> Callable[[StreamStats, str], None]:
        up = cand.upstream
        gauge = self.metrics.in_flight.labels(up.tier, up.name)
        gauge.inc()

        def finish(stats: StreamStats, outcome: str) -> None:
            gauge.dec()
            if stats.error:
                self.metrics.upstream_errors.labels(up.tier, up.name, stats.error).inc()
            ttft = stats.t_first_token - t0 if stats.t_first_token is not None else None
            decode = (stats.t_last_token - stats.t_first_token) if stats.t_first_token is not None else None
            self.metrics.record(tier=up.tier, upstream=up.name, model=model, outcome=outcome, stream=True,
                                duration=time.perf_counter() - t0, ttft=ttft, decode_time=decode, usage=stats.usage,
                                time_info=stats.time_info)

        return finish

    @staticmethod
    def _route_headers(decision: Decision, cand: Candidate, rid: str, fallback: str | None) -> dict[str, str]:
        headers = {
            "x-request-id": rid,
            "x-tiergate-tier": cand.upstream.tier,
            "x-tiergate-upstream": cand.upstream.name,
            "x-tiergate-rule": decision.rule,
        }
        if fallback:
            headers["x-tiergate-fallback"] = fallback
        return headers

    async def route(self, request: Request) -> Response:
        """``POST /v1/tiergate/route``: the decision and its trace for a chat-completions body; no upstream call."""
        try:
            body = parse_chat_request(await read_body(request, self.config.limits.max_request_bytes))
            facts = RequestFacts.from_request(body, request.headers)
            decision = self.policy.decide(facts)
        except GatewayError as exc:
            return error_response(exc, {})
        out = {
            "tier": decision.tier,
            "rule": decision.rule,
            "reason": decision.reason,
            "model": decision.model,
            "fallback": decision.fallback,
            "candidates": [{"upstream": c.upstream.name, "tier": c.upstream.tier, "model": c.upstream_model}
                           for c in decision.candidates],
            "facts": {"model": facts.model, "stream": facts.stream, "service_tier": facts.service_tier,
                      "workload": facts.workload, "tier_header": facts.tier_header},
            "trace": list(decision.trace),
        }
        return Response(orjson.dumps(out), 200, media_type="application/json")


class RelayResponse(Response):
    """Streams an upstream SSE body to the client through a :class:`Relay`.

    The status line and headers go out with the first relayed bytes. A watcher task awaits the client's
    ``http.disconnect`` and cancels the relay; in every case the upstream response is closed (or released
    when fully read) and ``finish(stats, outcome)`` is called exactly once.
    """

    def __init__(self, upstream: UpstreamResponse, relay: Relay, headers: dict[str, str],
                 finish: Callable[[StreamStats, str], None]) -> None:
        self.status_code = 200
        self.background = None
        ctype = upstream.content_type or "text/event-stream"
        hdrs = {**headers, **STREAM_HEADERS, "content-type": ctype}
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs.items()]
        self._upstream = upstream
        self._relay = relay
        self._finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        gone = False
        task = asyncio.current_task()
        assert task is not None

        async def write(data: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        outcome = "success"
        try:
            stats = await self._relay.run(self._upstream.chunks(), write)
            if stats.error:
                outcome = "stream_error"
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            outcome = "client_disconnect"
        finally:
            watcher.cancel()
            if outcome == "success":
                self._upstream.release()
            else:
                self._upstream.close()
            self._finish(self._relay.stats, outcome)
        if not gone:
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing non-JSON content types (415) and bodies over ``limit`` bytes (413)."""
    ctype = request.headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaType(f"Unsupported content type {ctype!r}; send application/json.")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is over the {limit}-byte limit.")
    parts = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"The request body is over the {limit}-byte limit.")
        parts.append(part)
    return b"".join(parts)


def error_response(exc: GatewayError, headers: dict[str, str]) -> Response:
    """Render ``exc`` as OpenAI's error envelope with its status and headers (``application/json``)."""
    return Response(exc.body(), exc.status, {**exc.headers, **headers}, media_type="application/json")


async def _status_failure(resp: UpstreamResponse) -> GatewayError:
    try:
        data = await resp.read()
        resp.release()
    except GatewayError as exc:
        resp.close()
        return exc
    return status_error(resp.status, data, resp.headers)


def _retryable(exc: GatewayError) -> bool:
    """Fail over only where it is safe: connect/timeout failures, 429 and 5xx, before any byte was sent."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status == 429 or exc.status >= 500
    return True


def _reason(exc: GatewayError) -> str:
    if isinstance(exc, UpstreamStatusError):
        return "upstream_429" if exc.status == 429 else f"upstream_{exc.status // 100}xx"
    return exc.code or "upstream_error"
