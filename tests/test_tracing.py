"""OpenTelemetry traces (``gateway.observability.tracing``), captured with the SDK's in-memory exporter in-process (the
app driven by hand, its upstream scripted): the span tree, the GenAI attributes, the first-token event, the client's
``traceparent`` continued and the attempt's sent upstream; and over real sockets, ``traceparent`` received by the
upstream from a gateway process with ``OTEL_TRACES_EXPORTER=console``. Off, nothing is traced."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry
from test_inprocess import Asgi, _config

from gateway.app import create_app
from gateway.observability import tracing
from gateway.tools.emulator import EmulatorThread, Plan, Received
from gateway.tools.scripted import ScriptedTransport

from conftest import chunk, default_config, sse, start_gateway

OK = sse(chunk(role=True), chunk("Hel"), chunk("lo"), chunk(finish="stop"), chunk(usage=True))
CLIENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ERR = b'{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}'


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.configure(None, span_exporter=exporter)
    yield exporter
    tracing.shutdown()
    tracing.TRACING.tracer = None  # off again for the other tests of this process


async def _app(handler: Any) -> tuple[Any, ScriptedTransport]:
    transport = ScriptedTransport(handler)
    app = create_app(_config(), registry=CollectorRegistry(), transport=transport)
    await transport.start()
    return app, transport


async def test_a_request_is_a_server_span_with_one_client_span_per_attempt(spans: InMemorySpanExporter) -> None:
    def handler(req: Received) -> Plan:
        if "std.invalid" in req.path and orjson.loads(req.body).get("x_case") == "failover":
            return Plan(status=503, headers={"content-type": "application/json"}, chunked=False, parts=[(0, ERR)])
        return Plan(parts=[(0, OK)])
    app, transport = await _app(handler)
    try:
        got = await Asgi(app).post("/v1/chat/completions", {
            "model": "m", "stream": True, "x_case": "failover", "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "x"}]}, headers={"traceparent": CLIENT_TRACE,
                                                                     "tracestate": "vendor=abc"})
        assert got.status == 200 and got.headers["x-tiergate-upstream"] == "fast"
    finally:
        await transport.stop()
    finished = spans.get_finished_spans()
    server = [s for s in finished if s.kind == SpanKind.SERVER]
    clients = [s for s in finished if s.kind == SpanKind.CLIENT]
    assert len(server) == 1 and len(clients) == 2
    req = server[0]
    assert req.resource.attributes["service.name"] == "tiergate"  # unless OTEL_SERVICE_NAME says otherwise
    assert req.name == "chat m" and format(req.context.trace_id, "032x") == CLIENT_TRACE.split("-")[1]
    assert req.parent is not None and format(req.parent.span_id, "016x") == CLIENT_TRACE.split("-")[2]
    a = dict(req.attributes or {})
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    assert a["http.request.method"] == "POST" and a["url.path"] == "/v1/chat/completions"
    assert a["http.response.status_code"] == 200 and a["tiergate.outcome"] == "success"
    assert a["tiergate.upstream"] == "fast" and a["tiergate.fallback"] == "upstream_5xx"
    failed, served = sorted(clients, key=lambda s: s.start_time or 0)
    for span, upstream, model in ((failed, "std", "m-s"), (served, "fast", "m-f")):
        assert span.parent is not None and span.parent.span_id == req.context.span_id
        assert span.context.trace_id == req.context.trace_id
        attrs = dict(span.attributes or {})
        assert attrs["tiergate.upstream"] == upstream and attrs["gen_ai.request.model"] == model
        assert attrs["server.address"] == f"{upstream}.invalid"
    assert failed.status.status_code == StatusCode.ERROR and dict(failed.attributes or {})["error.type"]
    s = dict(served.attributes or {})
    assert s["gen_ai.provider.name"] == "cerebras" and s["gen_ai.usage.input_tokens"] == 5
    assert s["gen_ai.usage.output_tokens"] == 3
    assert [e.name for e in served.events] == ["gen_ai.first_token"]
    # each attempt's own context went upstream as traceparent (W3C Trace Context)
    assert {r.headers.get("tracestate") for r in transport.requests} == {"vendor=abc"}  # passed on with it
    sent = [r.headers.get("traceparent") for r in transport.requests]
    assert sent == [f"00-{failed.context.trace_id:032x}-{failed.context.span_id:016x}-01",
                    f"00-{served.context.trace_id:032x}-{served.context.span_id:016x}-01"]


async def test_a_client_error_is_an_error_span_and_whole_answers_carry_the_response_model(
        spans: InMemorySpanExporter) -> None:
    whole = (b'{"id":"x","object":"chat.completion","created":1,"model":"m-f-2026","choices":[{"index":0,"message":'
             b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":4,'
             b'"completion_tokens":1,"total_tokens":5}}')
    app, transport = await _app(lambda req: Plan(headers={"content-type": "application/json"}, chunked=False,
                                                 parts=[(0, whole)]))
    try:
        bad = await Asgi(app).post("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                           "content": "x"}]})
        assert bad.status == 404
        ok = await Asgi(app).post("/v1/chat/completions", {"model": "m-fast", "messages": [{"role": "user",
                                                                                            "content": "x"}]})
        assert ok.status == 200
    finally:
        await transport.stop()
    server = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [dict(s.attributes or {})["tiergate.outcome"] for s in server] == ["client_error", "success"]
    assert server[0].status.status_code == StatusCode.ERROR
    assert dict(server[0].attributes or {})["http.response.status_code"] == 404
    client = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.CLIENT)
    assert dict(client.attributes or {})["gen_ai.response.model"] == "m-f-2026"
    assert client.parent is not None and client.parent.span_id == server[1].context.span_id


async def test_off_nothing_is_traced() -> None:
    assert tracing.TRACING.tracer is None and not tracing.configure(None) and not tracing.configure("none")
    app, transport = await _app(lambda req: Plan(parts=[(0, OK)]))
    try:
        got = await Asgi(app).post("/v1/chat/completions", {"model": "m", "stream": True,
                                                             "messages": [{"role": "user", "content": "x"}]},
                                   headers={"traceparent": CLIENT_TRACE})
        assert got.status == 200
    finally:
        await transport.stop()
    assert "traceparent" not in transport.requests[-1].headers  # nothing made up, nothing passed on


def test_traceparent_reaches_the_upstream_over_sockets(tmp_path: Any) -> None:
    up = EmulatorThread(lambda req: Plan(parts=[(0, OK)]))
    try:
        cfg = default_config(up.base_url, up.base_url)
        proc, _ = start_gateway(cfg, tmp_path, env={"OTEL_TRACES_EXPORTER": "console"})
        try:
            r = httpx.post(f"http://127.0.0.1:{proc.port}/v1/chat/completions", timeout=5,
                           headers={"traceparent": CLIENT_TRACE},
                           json={"model": "gpt-5.6", "stream": True, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200
            got = up.requests[-1].headers["traceparent"]
            assert got.startswith("00-" + CLIENT_TRACE.split("-")[1] + "-") and got != CLIENT_TRACE  # a child span
        finally:
            proc.stop()
        assert '"name": "chat gpt-5.6"' in proc.log.read_text()  # the console exporter flushed at shutdown
    finally:
        up.stop()


async def test_a_client_that_left_is_a_cancelled_attempt_not_an_error(spans: InMemorySpanExporter) -> None:
    app, transport = await _app(lambda req: Plan(parts=[(0, OK.split(b"\n\n", 1)[0] + b"\n\n"),
                                                        (0.01, OK.split(b"\n\n", 2)[1] + b"\n\n")], end="stall"))
    try:
        got = await Asgi(app).post("/v1/chat/completions", {"model": "m", "stream": True,
                                                             "messages": [{"role": "user", "content": "x"}]},
                                   leave_when=lambda body: b"Hel" in body)
        assert got.status == 200
    finally:
        await transport.stop()
    client = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.CLIENT)
    assert dict(client.attributes or {})["tiergate.cancelled"] is True
    assert client.status.status_code != StatusCode.ERROR
    server = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert dict(server.attributes or {})["tiergate.outcome"] == "client_disconnect"


def test_a_sampler_that_drops_the_trace_still_serves_every_request(tmp_path: Any) -> None:
    """``OTEL_TRACES_SAMPLER`` (the SDK's own variable) dropping a request's span: it is served as ever, and the
    upstream is told the trace is not sampled (the W3C trace flags' sampled bit off). It once failed every request
    that was not sampled."""
    up = EmulatorThread(lambda req: Plan(parts=[(0, OK)]) if b'"stream":true' in req.body else Plan(
        headers={"content-type": "application/json"}, chunked=False,
        parts=[(0, b'{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
                   b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}')]))
    try:
        cfg = default_config(up.base_url, up.base_url)
        proc, _ = start_gateway(cfg, tmp_path, env={"OTEL_TRACES_EXPORTER": "console",
                                                     "OTEL_TRACES_SAMPLER": "always_off"})
        try:
            for stream in (True, False):
                r = httpx.post(f"http://127.0.0.1:{proc.port}/v1/chat/completions", timeout=5,
                               json={"model": "gpt-5.6", "stream": stream,
                                     "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 200, r.text
                assert r.text.rstrip().endswith("data: [DONE]") if stream else r.json()["object"] == "chat.completion"
                flags = int(up.requests[-1].headers["traceparent"].rsplit("-", 1)[1], 16)
                assert flags & 1 == 0  # the sampled bit (W3C Trace Context: 02 is "random" alone)
        finally:
            proc.stop()
        assert "Traceback" not in proc.log.read_text()
    finally:
        up.stop()
