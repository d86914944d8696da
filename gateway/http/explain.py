"""The gateway explaining itself, off the hot path: ``POST /v1/tiergate/route`` (what a request would get, and why,
without calling any upstream, counting or reserving anything) and ``GET /v1/tiergate/estimates`` (the live estimates
deadline routing and hedging read).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.admission.body import ClientGone, read_body
from gateway.admission.request import KEY_SCOPE
from gateway.errors import GatewayError
from gateway.http.errors import error_response
from gateway.observability.estimates import bucket
from gateway.pipeline.gateway import Gateway
from gateway.routing import deadline
from gateway.routing.facts import Decision, RequestFacts
from gateway.tenancy.keys import Key
from gateway.wire.body import dumps, loads, parse_chat_request, parse_responses_request


async def route(gateway: Gateway, request: Request) -> Response:
    """Narrowed to the tiers of the caller's gateway key (a 403 where serving would answer one)."""
    key: Key | None = request.scope.get(KEY_SCOPE)
    try:
        facts, decision, session = await _decide(gateway, request, key)
    except GatewayError as exc:
        return error_response(exc, {})
    except ClientGone:
        return Response(b"", 400)
    out: dict[str, Any] = {
        "api": "responses" if facts.responses else "chat",
        "tier": decision.tier,
        "rule": decision.rule,
        "reason": decision.reason,
        "model": decision.model,
        "fallback": decision.fallback,
        "candidates": [{"upstream": c.upstream.name, "tier": c.upstream.tier, "model": c.upstream_model,
                        **({"responses": c.upstream.responses_mode} if facts.responses else {})}
                       for c in decision.candidates],
        "skipped": [{"upstream": name, "reason": why} for name, why in decision.skipped],
        "facts": facts.as_dict(),
        "key": None if key is None else {"name": key.name, "tiers": list(key.cfg.tiers)},
        "session": session,
        "trace": list(decision.trace),
        # tier and rule stay the rule's; the first candidate is what serves
        "deadline": None if (choice := decision.deadline) is None else {
            **choice.as_dict(), "reason": deadline.describe(choice), "fallback": choice.fallback},
        "estimates": _estimates_of(gateway, decision, facts),
    }
    return Response(dumps(out), 200, media_type="application/json")


async def _decide(gateway: Gateway, request: Request,
                  key: Key | None) -> tuple[RequestFacts, Decision, dict[str, Any] | None]:
    """As :meth:`gateway.admission.sequence.Admission.preview` decides. Raises GatewayError (what serving would
    answer) or ClientGone."""
    headers = {k.lower(): v for k, v in request.headers.items()}
    raw = await read_body(headers, request.receive, gateway.config.limits.max_request_bytes)
    try:
        probe = loads(raw)
    except ValueError:
        probe = None  # the parser below says what is wrong with it
    responses = not (isinstance(probe, dict) and "messages" in probe)  # which API's body it is
    body = parse_responses_request(raw) if responses else parse_chat_request(raw)
    return await gateway.admission.preview(body, raw, headers, key, responses)


def _estimates_of(gateway: Gateway, decision: Decision, facts: RequestFacts) -> list[dict[str, Any]]:
    now, out = gateway.health.clock(), []
    for c in decision.candidates:
        est = gateway.estimates.latency(c.upstream.name, bucket(c.upstream_model, c.upstream.asks(facts.service_tier)),
                                        now)
        out.append({"upstream": c.upstream.name, "measured": est is not None, **({} if est is None else {
            "ttft_p50_ms": round(est.ttft(facts.prompt_tokens, tail=False) * 1000, 1),
            "ttft_p90_ms": round(est.ttft(facts.prompt_tokens) * 1000, 1),
            "tokens_per_second_p50": None if est.speed is None else round(est.speed.central, 1),
            "tokens_per_second_p10": None if est.speed is None else round(est.speed.tail, 1),
            "samples": est.samples, "age_s": round(est.age(now), 3)})})
    return out


def estimates(gateway: Gateway) -> bytes:
    """Every live estimate (``gateway.observability.estimates``), the gauges refreshed."""
    now = gateway.health.clock()
    gateway.metrics.set_estimates(gateway.estimates.latencies(now))
    return dumps({"object": "tiergate.estimates", **gateway.estimates.snapshot(now),
                  "explore": gateway.explorer.share, "probe_s": gateway.explorer.probe})


def capacity(gateway: Gateway) -> bytes:
    """Each fast upstream's buckets as its headers last reported them and each priority class's use of them
    (``scheduling:``; without it, the buckets alone). Read-only: it reserves nothing."""
    now = gateway.health.clock()
    scheduler = gateway.scheduler
    if scheduler is None:
        view = [{"upstream": n, "state": h.state(now), "buckets": [
            {"bucket": b, "limit": lim, "window_s": length,
             "remaining": round(q.remaining, 1) if (q := h.quota.get(b)) and q.resets_at > now else None}
            for b, (lim, length) in h.limits.items()]} for n, h in gateway.health.by_name.items() if h.tier == "fast"]
        return dumps({"object": "tiergate.capacity", "scheduling": False, "upstreams": view})
    return dumps({"object": "tiergate.capacity", "scheduling": True, "default_class": scheduler.cfg.default_class,
                  "upstreams": scheduler.view(gateway.health.by_name, now)})
