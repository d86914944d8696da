"""OpenTelemetry GenAI metrics (docs/metrics.md#opentelemetry) from a gateway process started with the standard
``OTEL_*`` variables, received by a minimal OTLP/HTTP receiver on loopback (an OpenTelemetry Collector is not packaged
for the machine; the receiver decodes the same protobuf a Collector's ``otlp`` receiver takes): after a streamed chat
completion and a Responses request on each tier, every client and server metric is there with its unit and the
attributes the conventions name, and the names are the installed semantic-conventions package's."""

from __future__ import annotations

import gzip
import threading
import time
import typing
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes, openai_attributes
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics

from gateway.config.upstreams import UpstreamConfig
from gateway.observability import genai

from conftest import Stack, default_config, emulator, start_gateway


class Receiver:
    """OTLP/HTTP metrics (``POST /v1/metrics``, protobuf, gzip or not): every data point kept as (metric name, unit,
    attributes, count or value)."""

    def __init__(self) -> None:
        self.points: list[tuple[str, str, dict[str, Any], float]] = []
        self.resources: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                owner.take(ExportMetricsServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, req: ExportMetricsServiceRequest) -> None:
        for rm in req.resource_metrics:
            self.resources.append({a.key: _value(a.value) for a in rm.resource.attributes})
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for dp in m.histogram.data_points:
                        self.points.append((m.name, m.unit, {a.key: _value(a.value) for a in dp.attributes},
                                            float(dp.count)))

    def names(self) -> set[str]:
        return {name for name, *_ in self.points}

    def stop(self) -> None:
        self.server.shutdown()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Receiver]]:
    tmp = tmp_path_factory.mktemp("otel")
    receiver = Receiver()
    fast, standard = emulator("fast", tmp), emulator("standard", tmp, tps=2000, ttft=0.02)
    cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1")
    gw, path = start_gateway(cfg, tmp, env={
        "OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_METRIC_EXPORT_INTERVAL": "200", "OTEL_SERVICE_NAME": "tiergate-test"})
    yield Stack(gw, {"fast": fast, "standard": standard}, path, [gw, fast, standard]), receiver
    Stack(gw, {}, path, [gw, fast, standard]).stop()
    receiver.stop()


def _traffic(base: str) -> None:
    with httpx.Client(timeout=30) as client:
        for model, tier in (("gpt-5.6-sol-fast", "fast"), ("gpt-5.6", "standard")):
            with client.stream("POST", f"{base}/chat/completions", json={
                    "model": model, "stream": True, "stream_options": {"include_usage": True},
                    "service_tier": "auto", "max_completion_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.headers["x-tiergate-tier"] == tier
                assert b"[DONE]" in b"".join(resp.iter_raw())
            r = client.post(f"{base}/responses", json={"model": model, "input": "hi", "max_output_tokens": 8})
            assert r.status_code == 200 and r.headers["x-tiergate-tier"] == tier, r.text


def test_the_genai_metrics_reach_an_otlp_receiver_with_their_units_and_attributes(
        stack: tuple[Stack, Receiver]) -> None:
    s, receiver = stack
    _traffic(s.base_url)
    wanted = {genai.CLIENT_DURATION, genai.CLIENT_TTFC, genai.CLIENT_TPOC, genai.CLIENT_TOKENS,
              genai.SERVER_DURATION, genai.SERVER_TTFT, genai.SERVER_TPOT}
    deadline = time.monotonic() + 15
    while not wanted <= receiver.names() or not _both_tiers(receiver):
        assert time.monotonic() < deadline, (sorted(receiver.names()), receiver.points[-5:])
        time.sleep(0.1)
    assert receiver.resources[-1]["service.name"] == "tiergate-test"
    for name, unit, attrs, count in receiver.points:
        assert unit == ("{token}" if name == genai.CLIENT_TOKENS else "s"), (name, unit)
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["tiergate.tier"] in ("fast", "standard")
        assert count >= 1
    def one(name: str, tier: str, **match: Any) -> dict[str, Any]:
        found = [a for n, _, a, _ in receiver.points if n == name and a["tiergate.tier"] == tier
                 and all(a.get(k) == v for k, v in match.items())]
        assert found, (name, tier, match)
        return found[-1]
    fast = one(genai.CLIENT_DURATION, "fast")
    assert fast["gen_ai.provider.name"] == "cerebras" and fast["gen_ai.request.model"] == "gpt-5.6-wse"
    assert fast["gen_ai.response.model"] == "gpt-5.6-wse" and fast["tiergate.upstream"] == "emu-fast"
    assert fast["server.address"] == "127.0.0.1" and isinstance(fast["server.port"], int)
    std = one(genai.CLIENT_TTFC, "standard")
    assert std["gen_ai.provider.name"] == "openai" and std["gen_ai.request.model"] == "gpt-5.6-2026-10-01"
    assert std["openai.request.service_tier"] == "auto" and std["openai.response.service_tier"] == "default"
    server = one(genai.SERVER_TTFT, "fast")
    assert server["gen_ai.request.model"] == "gpt-5.6-sol-fast"  # as the client asked; the client side: as sent
    assert "server.address" not in server and "error.type" not in server
    for kind in ("input", "output"):
        one(genai.CLIENT_TOKENS, "standard", **{"gen_ai.token.type": kind})
    one(genai.SERVER_TPOT, "standard")


def _both_tiers(receiver: Receiver) -> bool:
    return {(n, a["tiergate.tier"]) for n, _, a, _ in receiver.points} >= {
        (genai.CLIENT_DURATION, "fast"), (genai.CLIENT_TTFC, "standard"), (genai.SERVER_TTFT, "fast"),
        (genai.SERVER_TPOT, "standard"), (genai.CLIENT_TOKENS, "standard")}


def test_the_names_are_the_installed_semantic_conventions(tmp_path: Path) -> None:
    """A newer opentelemetry-semantic-conventions that renames them fails here first (docs/metrics.md#opentelemetry
    names the version followed)."""
    assert (genai.CLIENT_DURATION, genai.CLIENT_TTFC, genai.CLIENT_TPOC, genai.CLIENT_TOKENS, genai.SERVER_DURATION,
            genai.SERVER_TTFT, genai.SERVER_TPOT) == (
        gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION, gen_ai_metrics.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK,
        gen_ai_metrics.GEN_AI_CLIENT_OPERATION_TIME_PER_OUTPUT_CHUNK, gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE,
        gen_ai_metrics.GEN_AI_SERVER_REQUEST_DURATION, gen_ai_metrics.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
        gen_ai_metrics.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN)
    assert {genai.OPERATION, "gen_ai.provider.name", "gen_ai.request.model", "gen_ai.response.model",
            "openai.request.service_tier", "openai.response.service_tier", "gen_ai.token.type"} == {
        gen_ai_attributes.GenAiOperationNameValues.CHAT.value, gen_ai_attributes.GEN_AI_PROVIDER_NAME,
        gen_ai_attributes.GEN_AI_REQUEST_MODEL, gen_ai_attributes.GEN_AI_RESPONSE_MODEL,
        openai_attributes.OPENAI_REQUEST_SERVICE_TIER, openai_attributes.OPENAI_RESPONSE_SERVICE_TIER,
        gen_ai_attributes.GEN_AI_TOKEN_TYPE}
    # gen_ai.provider.name is the upstream's dialect: where the conventions name the provider, the same word
    dialects = set(typing.get_args(UpstreamConfig.model_fields["dialect"].annotation))
    assert {gen_ai_attributes.GenAiProviderNameValues.OPENAI.value,
            gen_ai_attributes.GenAiProviderNameValues.GROQ.value} <= dialects


def test_off_without_the_variable() -> None:
    assert genai.configure(None) is None and genai.configure("none") is None and genai.GENAI.on is None


class _Kept:
    """An exporter that keeps what it is given (the SDK's ``MetricExporter`` interface, as the gateway calls it)."""

    def __init__(self) -> None:
        self.exported: list[Any] = []

    def export(self, data: Any, **_: Any) -> None:
        self.exported.append(data)

    def shutdown(self, **_: Any) -> None:
        pass


def test_a_client_cannot_grow_the_series_without_bound() -> None:
    """Each attribute is from a bounded set: a service tier the client made up is ``other``, an unknown model is not
    an attribute (the rules never routed it), and past ``MAX_SERIES`` new attribute sets are dropped, counted."""
    from types import SimpleNamespace

    kept = _Kept()
    g = genai.GenAIMetrics(kept, None, 3600)
    try:
        for i in range(50):
            rec = SimpleNamespace(tier="none", upstream="none", response_model=None, billed_tier=f"tier{i}",
                                  model="other", request=SimpleNamespace(requested=f"model-{i}"), sent_at=None, t0=0.0,
                                  upstream_model=None)
            g.record(rec, "client_error", 0.001, {"service_tier": f"served{i}"})
        assert len(g.series) == 1
        (name, attrs), = g.series
        assert name == genai.SERVER_DURATION and dict(attrs)["openai.request.service_tier"] == "other"
        assert "gen_ai.request.model" not in dict(attrs)
        g.series.update({(genai.SERVER_DURATION, (("n", i),)): genai._Series(3) for i in range(genai.MAX_SERIES)})
        g.observe(genai.SERVER_DURATION, 1.0, (("n", -1),))
        assert g.dropped == 1 and len(g.series) == genai.MAX_SERIES + 1
    finally:
        g.shutdown()
    assert kept.exported and g.thread.is_alive() is False  # what it held went out as it stopped
