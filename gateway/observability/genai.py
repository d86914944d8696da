"""OpenTelemetry GenAI metrics over OTLP, optional (``pip install 'tiergate[otel]'``; docs/metrics.md#opentelemetry):
the gateway as the client of its upstreams (``gen_ai.client.*``) and as the server its clients call
(``gen_ai.server.*``), named as opentelemetry-semantic-conventions 0.66b2 names them (the newest in the registry the
project installs from; ``tests/test_otel_metrics.py`` holds the names to that package's constants). On when
``OTEL_METRICS_EXPORTER`` is ``otlp`` or ``console``, with the SDK's own variables for the rest
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_SERVICE_NAME``, ...); off, a request pays one
``is None`` test. Aggregated here (:class:`GenAIMetrics`), exported by the SDK's exporter. Fed by the request's one
record (``Recorder.record``), never per chunk: a stream's chunk and token times are its means, one observation per
request, as the Prometheus families'."""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from gateway import __version__
from gateway.config.upstreams import SERVICE_TIERS
from gateway.observability import tracing
from gateway.observability.metrics import decode_speed

log = logging.getLogger("tiergate")

CLIENT_DURATION = "gen_ai.client.operation.duration"
CLIENT_TTFC = "gen_ai.client.operation.time_to_first_chunk"
CLIENT_TPOC = "gen_ai.client.operation.time_per_output_chunk"
CLIENT_TOKENS = "gen_ai.client.token.usage"
SERVER_DURATION = "gen_ai.server.request.duration"
SERVER_TTFT = "gen_ai.server.time_to_first_token"
SERVER_TPOT = "gen_ai.server.time_per_output_token"

# bucket boundaries the conventions advise for each (semantic conventions, "Metrics for GenAI operations")
_DURATION = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_FIRST = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
_INSTRUMENTS = {  # name: (unit, description, buckets)
    CLIENT_DURATION: ("s", "GenAI operation duration: the gateway's request to an upstream, sent to last byte.",
                      _DURATION),
    CLIENT_TTFC: ("s", "Time to the first chunk of an upstream's stream, from the request sent.", _FIRST),
    CLIENT_TPOC: ("s", "Time per output chunk after the first, a stream's mean.", _PER_TOKEN),
    CLIENT_TOKENS: ("{token}", "Input and output tokens an upstream reported.", _TOKENS),
    SERVER_DURATION: ("s", "The gateway's request duration, arrival to last byte.", _DURATION),
    SERVER_TTFT: ("s", "Time to the first token the gateway relayed, from the request's arrival.", _FIRST),
    SERVER_TPOT: ("s", "Time per output token after the first, a stream's mean.", _PER_TOKEN),
}
OPERATION = "chat"  # chat completions and the Responses API alike (gen_ai.operation.name)


class _Series:
    """One histogram's data point for one attribute set, cumulative since the process started (OTLP's explicit bucket
    histogram: ``buckets[i]`` counts values in (bounds[i-1], bounds[i]])."""

    __slots__ = ("count", "sum", "min", "max", "buckets")

    def __init__(self, size: int) -> None:
        self.count = 0
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")
        self.buckets = [0] * (size + 1)


SHUTDOWN_S = 2.0  # seconds the last export and the exporter's shutdown may take at most
MAX_SERIES = 10_000  # attribute sets kept at most (each bounded: configured models, known tiers); past it, dropped


class GenAIMetrics:
    """The histograms, aggregated here and handed to the SDK's exporter every ``interval`` seconds from a thread of
    its own. The SDK's instruments cost ~10 us of CPU per record with these attributes (96 us per request for the
    eight; measured with opentelemetry-sdk 1.45), a sixth of the gateway's own per-request work; this aggregation
    costs ~1 us per record, and the exporter (OTLP, its retries, headers and variables) is still the SDK's."""

    def __init__(self, exporter: Any, resource: Any, interval: float) -> None:
        self.exporter = exporter
        self.resource = resource
        self.interval = interval
        self.series: dict[tuple[str, tuple[tuple[str, Any], ...]], _Series] = {}
        self.dropped = 0  # observations of attribute sets past MAX_SERIES
        self.upstreams: dict[str, tuple[tuple[str, Any], ...]] = {}
        self.started = time.time_ns()
        self.lock = threading.Lock()  # the export thread reads what the event loop's thread writes
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tiergate-otel-metrics", daemon=True)
        self.thread.start()

    def configure(self, upstreams: Iterable[Any]) -> None:
        """``upstreams``: ``UpstreamConfig`` objects."""
        out: dict[str, tuple[tuple[str, Any], ...]] = {}
        for up in upstreams:
            url = urlsplit(up.base_url)
            # gen_ai.provider.name: the dialect's name, the conventions' well-known value where there is one
            # (openai, groq; tests/test_otel_metrics.py)
            out[up.name] = (("gen_ai.provider.name", up.dialect),
                            ("server.address", url.hostname or ""),
                            ("server.port", url.port or (443 if url.scheme == "https" else 80)),
                            ("tiergate.upstream", up.name))
        self.upstreams = out

    def observe(self, name: str, value: float, attrs: tuple[tuple[str, Any], ...]) -> None:
        key = (name, attrs)
        with self.lock:
            s = self.series.get(key)
            if s is None:
                if len(self.series) >= MAX_SERIES:
                    self.dropped += 1
                    return
                s = self.series[key] = _Series(len(_INSTRUMENTS[name][2]))
            s.count += 1
            s.sum += value
            s.min = min(s.min, value)
            s.max = max(s.max, value)
            s.buckets[bisect.bisect_left(_INSTRUMENTS[name][2], value)] += 1

    def record(self, rec: Any, outcome: str, duration: float, kw: Mapping[str, Any]) -> None:
        """``rec``: the request's ``Recorder``; ``duration`` in seconds; ``kw`` as ``Metrics.record`` took them."""
        common = _common(rec, outcome, kw.get("service_tier"))
        upstream = self.upstreams.get(rec.upstream)
        server = common
        if upstream is not None:
            server = (*server, upstream[0])
        if rec.model != "other" and rec.request.requested:  # a configured model or alias: a bounded set
            server = (*server, ("gen_ai.request.model", rec.request.requested))
        ok = outcome == "success"
        ttft, decode, chunks = kw.get("ttft"), kw.get("decode_time"), kw.get("token_chunks") or 0
        usage = kw.get("usage") if isinstance(kw.get("usage"), dict) else None
        self.observe(SERVER_DURATION, duration, server)
        if ok and ttft is not None:
            self.observe(SERVER_TTFT, ttft, server)
        completion = usage.get("completion_tokens") if usage is not None else None
        if ok and decode is not None and isinstance(completion, int):
            speed = decode_speed(decode, chunks, completion)
            if speed is not None:
                self.observe(SERVER_TPOT, 1.0 / speed, server)
        if upstream is not None and rec.sent_at is not None:  # else no upstream was asked (refused; the gateway's own)
            client = (*common, *upstream, ("gen_ai.request.model", rec.upstream_model or rec.request.requested or ""))
            self._client(client, rec.sent_at - rec.t0, duration, ttft if ok else None,
                         decode if ok and chunks >= 2 else None, chunks, None if kw.get("estimated") else usage)

    def _client(self, attrs: tuple[tuple[str, Any], ...], before: float, duration: float, ttft: float | None,
                decode: float | None, chunks: int, usage: dict[str, Any] | None) -> None:
        """``before``: seconds the gateway took before the request went upstream."""
        self.observe(CLIENT_DURATION, max(0.0, duration - before), attrs)
        if ttft is not None:
            self.observe(CLIENT_TTFC, max(0.0, ttft - before), attrs)
        if decode is not None:
            self.observe(CLIENT_TPOC, decode / (chunks - 1), attrs)
        for key, kind in (("prompt_tokens", "input"), ("completion_tokens", "output")):
            n = usage.get(key) if usage is not None else None
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                self.observe(CLIENT_TOKENS, n, (*attrs, ("gen_ai.token.type", kind)))

    def collect(self) -> Any:
        """The SDK's ``MetricsData`` of every series so far (cumulative temporality)."""
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            Histogram,
            HistogramDataPoint,
            Metric,
            MetricsData,
            ResourceMetrics,
            ScopeMetrics,
        )
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        now = time.time_ns()
        points: dict[str, list[Any]] = {}
        with self.lock:
            for (name, attrs), s in self.series.items():
                points.setdefault(name, []).append(HistogramDataPoint(
                    attributes=dict(attrs), start_time_unix_nano=self.started, time_unix_nano=now, count=s.count,
                    sum=s.sum, bucket_counts=list(s.buckets), explicit_bounds=list(_INSTRUMENTS[name][2]),
                    min=s.min, max=s.max))
        metrics = [Metric(name=name, description=_INSTRUMENTS[name][1], unit=_INSTRUMENTS[name][0],
                          data=Histogram(data_points=found, aggregation_temporality=AggregationTemporality.CUMULATIVE))
                   for name, found in points.items()]
        scope = ScopeMetrics(scope=InstrumentationScope("tiergate", __version__), metrics=metrics, schema_url="")
        return MetricsData(resource_metrics=[ResourceMetrics(resource=self.resource, scope_metrics=[scope],
                                                             schema_url="")])

    def export(self, timeout_ms: float | None = None) -> None:
        """``timeout_ms``: the exporter's bound (its default, ``OTEL_EXPORTER_OTLP_TIMEOUT``, is 10 s)."""
        if self.series:
            try:
                if timeout_ms is None:
                    self.exporter.export(self.collect())
                else:
                    self.exporter.export(self.collect(), timeout_millis=timeout_ms)
            except Exception:  # an exporter that fails (a Collector away) never stops the next export
                log.warning("exporting the OpenTelemetry metrics failed", exc_info=True)

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.export()

    def shutdown(self) -> None:
        """Exports what is held, once more, and stops the thread, within :data:`SHUTDOWN_S` seconds however the
        Collector answers (it runs on the event loop at the drain's end: a hung Collector must not take the time the
        drain left for the logs and the process's end)."""
        self.stopping.set()
        self.thread.join(timeout=SHUTDOWN_S / 2)
        self.export(timeout_ms=SHUTDOWN_S * 500)
        try:
            self.exporter.shutdown(timeout_millis=SHUTDOWN_S * 500)
        except TypeError:  # an exporter whose shutdown takes no bound
            self.exporter.shutdown()


def _tier(value: str | None) -> str:
    """A service tier as an attribute: a client may send any short word, so only the known ones are kept apart."""
    return value if value in SERVICE_TIERS else "other"


def _common(rec: Any, outcome: str, served: str | None) -> tuple[tuple[str, Any], ...]:
    """The attributes the client and server metrics share, as a key."""
    out: list[tuple[str, Any]] = [("gen_ai.operation.name", OPERATION), ("tiergate.tier", rec.tier)]
    if rec.response_model:
        out.append(("gen_ai.response.model", rec.response_model))
    if rec.billed_tier:
        out.append(("openai.request.service_tier", _tier(rec.billed_tier)))
    if served:
        out.append(("openai.response.service_tier", _tier(served)))
    if outcome != "success":
        out.append(("error.type", outcome))
    return tuple(out)


class _Holder:
    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on: GenAIMetrics | None = None


GENAI = _Holder()  # one per process, as tracing's


def configure(exporter: str | None, metric_exporter: Any = None) -> GenAIMetrics | None:
    """``metric_exporter``: a test's own. None when off; without the ``otel`` extra a configured exporter is logged
    once and the metrics stay off. ``OTEL_METRIC_EXPORT_INTERVAL``: milliseconds between exports (the SDK's
    variable and default, 60,000)."""
    if metric_exporter is None and exporter in (None, "", "none"):
        return None
    try:
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
    except ImportError:
        log.warning("OTEL_METRICS_EXPORTER=%s but the otel extra is not installed (pip install 'tiergate[otel]'): "
                    "no OpenTelemetry metrics", exporter)
        return None
    if metric_exporter is None:
        if exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            metric_exporter = OTLPMetricExporter()  # OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT, _HEADERS, ...
        elif exporter == "console":
            metric_exporter = ConsoleMetricExporter()
        else:
            log.warning("OTEL_METRICS_EXPORTER=%s is not one the gateway knows (otlp, console, none): no OpenTelemetry "
                        "metrics", exporter)
            return None
    try:
        interval = max(0.05, float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "60000")) / 1000)
    except ValueError:
        interval = 60.0
    # service.instance.id: each process (a --workers N worker too) exports its own cumulative series
    GENAI.on = GenAIMetrics(metric_exporter, tracing.resource(**{"service.instance.id": uuid.uuid4().hex}), interval)
    return GENAI.on


def shutdown() -> None:
    if GENAI.on is not None:
        GENAI.on.shutdown()
        GENAI.on = None
