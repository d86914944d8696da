"""OpenTelemetry traces, optional (``pip install 'tiergate[otel]'``), following the GenAI semantic conventions ("GenAI
spans") and the HTTP ones (docs/operations.md#traces): a ``SERVER`` span per chat-completions or Responses request,
continued from the client's W3C ``traceparent``, and a ``CLIENT`` child per upstream attempt, whose context goes
upstream. On when ``OTEL_TRACES_EXPORTER`` is ``otlp`` or ``console``; off, a request pays one ``is None`` test per span
it would have had."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from gateway import __version__

log = logging.getLogger("tiergate")


class _Tracing:
    __slots__ = ("tracer", "propagator", "provider", "api")

    def __init__(self) -> None:
        self.tracer: Any = None  # an opentelemetry Tracer once configured; None: tracing is off
        self.propagator: Any = None
        self.provider: Any = None
        self.api: Any = None  # the opentelemetry.trace module


TRACING = _Tracing()


def configure(exporter: str | None, span_exporter: Any = None) -> bool:
    """``span_exporter``: tests' ``InMemorySpanExporter``, exported at once. Returns whether tracing is on; without the
    ``otel`` extra a configured exporter is logged once and tracing stays off."""
    if span_exporter is None and exporter in (None, "", "none"):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=%s but the otel extra is not installed (pip install 'tiergate[otel]'): "
                    "no traces", exporter)
        return False
    provider = TracerProvider(resource=resource())
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    elif exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        log.warning("OTEL_TRACES_EXPORTER=%s is not one the gateway knows (otlp, console, none): no traces", exporter)
        return False
    TRACING.provider = provider
    TRACING.tracer = provider.get_tracer("tiergate", __version__)
    TRACING.propagator = TraceContextTextMapPropagator()
    TRACING.api = trace
    return True


def resource(**attributes: str) -> Any:
    """The OpenTelemetry resource: ``service.name`` tiergate unless ``OTEL_SERVICE_NAME`` (or ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES``) names another. ``Resource.create`` puts the attributes given over the environment's,
    so the default is merged in only where the environment named none (the SDK's own is ``unknown_service:...``)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    found = Resource.create(attributes)
    if str(found.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        found = found.merge(Resource({SERVICE_NAME: "tiergate"}))
    return found


def shutdown() -> None:
    if TRACING.provider is not None:
        TRACING.provider.shutdown()


def start_request(headers: dict[str, str], method: str, path: str, operation: str) -> Any:
    """``headers``: lower-case names."""
    t = TRACING
    parent = t.propagator.extract(headers)
    return t.tracer.start_span(operation, context=parent, kind=t.api.SpanKind.SERVER, attributes={
        "http.request.method": method, "url.path": path, "gen_ai.operation.name": operation})


def end_request(span: Any, ex: Any) -> None:
    """``ex``: the request's ``gateway.observability.recorder.Recorder``. A span the sampler dropped
    (``OTEL_TRACES_SAMPLER``) is a ``NonRecordingSpan``, without a name or attributes: it only ends."""
    if not span.is_recording():
        span.end()
        return
    model = ex.request.requested
    if model:
        span.update_name(f"{span.name} {model}")
        span.set_attribute("gen_ai.request.model", model)
    span.set_attributes({"tiergate.tier": ex.tier, "tiergate.upstream": ex.upstream,
                         "tiergate.outcome": ex.outcome or "none"})
    if ex.status:  # none when the client left before any answer
        span.set_attribute("http.response.status_code", ex.status)
    if ex.rule:
        span.set_attribute("tiergate.rule", ex.rule)
    if ex.fallback:
        span.set_attribute("tiergate.fallback", ex.fallback)
    if ex.outcome not in ("success", None):
        span.set_attribute("error.type", ex.outcome)
        span.set_status(TRACING.api.Status(TRACING.api.StatusCode.ERROR))
    span.end()


def start_attempt(parent: Any, operation: str, upstream: Any, model: str) -> tuple[Any, dict[str, str]]:
    """Also the W3C Trace Context headers to send upstream."""
    t = TRACING
    url = urlsplit(upstream.base_url)  # validated at start-up (gateway.config.schema): its port is a port
    span = t.tracer.start_span(f"{operation} {model}", context=t.api.set_span_in_context(parent),
                               kind=t.api.SpanKind.CLIENT, attributes={
                                   "gen_ai.operation.name": operation, "gen_ai.provider.name": upstream.dialect,
                                   "gen_ai.request.model": model, "server.address": url.hostname or "",
                                   "server.port": url.port or (443 if url.scheme == "https" else 80),
                                   "tiergate.upstream": upstream.name, "tiergate.tier": upstream.tier})
    carrier: dict[str, str] = {}
    t.propagator.inject(carrier, context=t.api.set_span_in_context(span))
    return span, carrier


def context_headers(span: Any) -> dict[str, str]:
    """The W3C Trace Context headers of ``span`` (a dropped one's too: its trace id, the sampled bit off)."""
    carrier: dict[str, str] = {}
    TRACING.propagator.inject(carrier, context=TRACING.api.set_span_in_context(span))
    return carrier


def first_token(span: Any) -> None:
    span.add_event("gen_ai.first_token")


def usage(span: Any, usage: dict[str, Any] | None, response_model: Any) -> None:
    """``usage`` in chat-completions terms."""
    if isinstance(response_model, str):
        span.set_attribute("gen_ai.response.model", response_model)
    if usage:
        for key, name in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                          ("completion_tokens", "gen_ai.usage.output_tokens")):
            value = usage.get(key)
            if isinstance(value, int):
                span.set_attribute(name, value)


def end_attempt(span: Any, error: BaseException | None) -> None:
    """A cancel (the client left, a hedge lost, the drain ran out) is not the upstream's failure: it sets
    ``tiergate.cancelled``, not the ``ERROR`` status."""
    if isinstance(error, asyncio.CancelledError):
        span.set_attribute("tiergate.cancelled", True)
    elif error is not None:
        span.set_attribute("error.type", getattr(error, "code", None) or type(error).__name__)
        span.set_status(TRACING.api.Status(TRACING.api.StatusCode.ERROR))
    span.end()
