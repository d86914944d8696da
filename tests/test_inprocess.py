"""The request path in-process: the gateway's ASGI app driven by hand-written ``receive``/``send`` (as Starlette's own
tests drive theirs), its upstreams played from scripted plans by ``gateway.tools.scripted`` (no sockets).

These run in the test process, so the request path (``api``, ``exchange``, ``failover``, ``upstream.Attempt``,
``relay``) is measured by coverage here too; the real-socket suites stay the judges of bytes on the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.app import create_app
from gateway.config.load import LoadedConfig
from gateway.config.schema import GatewayConfig
from gateway.http.dispatch import HotPath
from gateway.tools.emulator import Plan, Received
from gateway.tools.scripted import ScriptedTransport

from conftest import chunk, sample, sse

OK = sse(chunk(role=True), chunk("Hel"), chunk("lo"), chunk(finish="stop"), chunk(usage=True))
OK_JSON = (b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":'
           b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,'
           b'"completion_tokens":1,"total_tokens":2}}')
JSON = {"content-type": "application/json"}


def _config(**fast_timeouts: Any) -> LoadedConfig:
    timeouts = {"connect": 1, "idle": 0.3, "total": 5, "finish_grace": 0.1}
    cfg = GatewayConfig.model_validate({
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": "http://fast.invalid/v1", "dialect": "cerebras",
             "timeouts": {**timeouts, **fast_timeouts}, "prices": {"input": 1, "output": 2}, "models": {"m": "m-f"}},
            {"name": "std", "tier": "standard", "base_url": "http://std.invalid/v1", "timeouts": timeouts,
             "health": {"cooldown_default": 5}, "models": {"m": "m-s"}},
        ],
        "aliases": {"m-fast": {"model": "m", "tier": "fast"}},
    })
    return LoadedConfig(Path("inprocess.yaml"), cfg, {})


class Asgi:
    """One request through the app: what it sent back, message by message."""

    def __init__(self, app: HotPath) -> None:
        self.app = app
        self.messages: list[dict[str, Any]] = []
        self.disconnect = asyncio.Event()

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.messages[0]["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    async def post(self, path: str, body: dict[str, Any] | bytes, *, leave_when: Callable[[bytes], bool] | None = None,
                   headers: dict[str, str] | None = None) -> Asgi:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "method": "POST",
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 9),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(raw)),
                             *((k.encode(), v.encode()) for k, v in (headers or {}).items())]}
        pending = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            await self.disconnect.wait()  # like uvicorn's: only the client leaving ends this wait
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if self.disconnect.is_set():
                return  # uvicorn drops what is sent after the client left
            self.messages.append(message)
            if leave_when is not None and leave_when(self.body):
                self.disconnect.set()

        async with asyncio.timeout(10):
            await self.app(scope, receive, send)
        return self


@pytest.fixture
async def rig() -> Any:
    plans: dict[str, list[Plan]] = {}

    def handler(req: Received) -> Plan:
        body = orjson.loads(req.body)
        # by "<upstream model>:<x_case>" (one upstream) or "<x_case>" (any)
        queue = plans.get(f"{body['model']}:{body.get('x_case', '')}") or plans.get(body.get("x_case", ""), [])
        return queue.pop(0) if len(queue) > 1 else (queue[0] if queue else Plan(parts=[(0, OK)]))

    transport = ScriptedTransport(handler)
    registry = CollectorRegistry()
    app = create_app(_config(), registry=registry, transport=transport)
    await transport.start()

    class Rig:
        def __init__(self) -> None:
            self.app, self.transport, self.plans = app, transport, plans

        def metrics(self) -> str:
            return generate_latest(registry).decode()

        async def post(self, case: str = "", path: str = "/v1/chat/completions", **kw: Any) -> Asgi:
            body = {"model": "m", "stream": True, "x_case": case, "messages": [{"role": "user", "content": "x"}]}
            body.update(kw.pop("body", {}))
            return await Asgi(app).post(path, body, **kw)

    yield Rig()
    await transport.stop()


async def test_a_stream_is_relayed_and_recorded(rig: Any) -> None:
    got = await rig.post()
    assert got.status == 200 and got.headers["x-tiergate-tier"] == "standard"
    assert got.body == OK.replace(b"data: " + chunk(usage=True).encode() + b"\n\n", b"")  # usage metered, not shown
    assert got.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    sent = orjson.loads(rig.transport.requests[-1].body)
    assert sent["model"] == "m-s" and sent["stream_options"] == {"include_usage": True}
    m = rig.metrics()
    assert sample(m, "tiergate_requests_total", missing_ok=False, tier="standard", outcome="success") == 1
    assert sample(m, "tiergate_tokens_total", missing_ok=False, tier="standard", token_type="output") == 3
    assert sample(m, "tiergate_in_flight_requests", tier="standard") == 0
    assert rig.transport.answers[-1].released and not rig.transport.answers[-1].closed  # read to its end: pooled


async def test_a_whole_answer_and_bad_input(rig: Any) -> None:
    rig.plans["whole"] = [Plan(headers=JSON, parts=[(0, OK_JSON)], chunked=False)]
    got = await rig.post("whole", body={"stream": False})
    assert got.status == 200 and got.body == OK_JSON and got.headers["content-length"] == str(len(OK_JSON))
    bad = await Asgi(rig.app).post("/v1/chat/completions", b"{bad json")
    assert bad.status == 400 and orjson.loads(bad.body)["error"]["code"] == "invalid_json"
    unknown = await rig.post(body={"model": "nope"})
    assert unknown.status == 404 and orjson.loads(unknown.body)["error"]["code"] == "model_not_found"
    assert sample(rig.metrics(), "tiergate_requests_total", outcome="client_error") == 2


@pytest.mark.parametrize(("plan", "reason"), [
    (Plan(status=503, headers=JSON, parts=[(0, b'{"error":{"message":"busy","type":"server_error"}}')],
          chunked=False), "upstream_5xx"),
    (Plan(drop=True), "upstream_unavailable"),
    (Plan(parts=[(0, sse('{"error":{"message":"overloaded","type":"server_error"}}'))]), "upstream_5xx"),
    (Plan(parts=[(0, sse(chunk(role=True), done=False))], end="reset"), "upstream_stream_interrupted"),
    (Plan(parts=[(0, sse(chunk(role=True), done=False)), (3.0, sse(chunk("late")))]), "upstream_idle_timeout"),
    # the role chunk a tenth of the idle timeout in, then silence: at the hold's bound the stream has been quiet for
    # nine tenths of it, which is dying, not alive (committing it was a 200 ending in an in-band error)
    (Plan(parts=[(0.03, sse(chunk(role=True), done=False)), (3.0, sse(chunk("late")))]), "upstream_idle_timeout"),
])
async def test_a_failure_before_the_first_token_fails_over(rig: Any, plan: Plan, reason: str) -> None:
    rig.plans["m-f:fault"] = [plan]
    got = await rig.post("fault", body={"model": "m-fast"})
    assert got.status == 200 and got.headers["x-tiergate-tier"] == "standard"
    assert got.headers["x-tiergate-fallback"] == reason
    assert [orjson.loads(r.body)["model"] for r in rig.transport.requests] == ["m-f", "m-s"]
    # every answer ended by its attempt: read to its end and released (the 503's error body), else closed
    assert all(a.released != a.closed for a in rig.transport.answers)
    assert all(a.closed for a in rig.transport.answers if a.status == 200 and a is not rig.transport.answers[-1])
    m = rig.metrics()
    assert sample(m, "tiergate_fallbacks_total", missing_ok=False, to_tier="standard", reason=reason) == 1
    assert sample(m, "tiergate_upstream_errors_total", missing_ok=False, upstream="fast", reason=reason) == 1


async def test_no_first_token_by_the_ttft_deadline_fails_over(rig: Any) -> None:
    transport = ScriptedTransport(lambda req: Plan(parts=[(0, sse(chunk(role=True), done=False)),
                                                          (0.5, sse(chunk("late")))]) if b'"m-f"' in req.body
                                  else Plan(parts=[(0, OK)]))
    app = create_app(_config(ttft=0.1), registry=CollectorRegistry(), transport=transport)
    got = await Asgi(app).post("/v1/chat/completions", {"model": "m-fast", "stream": True, "messages": [
        {"role": "user", "content": "x"}]})
    assert got.status == 200 and got.headers["x-tiergate-fallback"] == "upstream_ttft_timeout"


async def test_an_error_event_first_is_its_status_and_not_retried(rig: Any) -> None:
    rig.plans["m-f:bad"] = [Plan(parts=[(0, b'event: error\ndata: {"error":{"message":"invalid request",'
                                              b'"type":"invalid_request_error","code":400}}\n\n')])]
    got = await rig.post("bad", body={"model": "m-fast"})
    assert got.status == 400 and orjson.loads(got.body)["error"]["type"] == "invalid_request_error"
    assert len(rig.transport.requests) == 1 and got.headers["x-tiergate-tier"] == "fast"


async def test_an_error_after_the_first_token_is_in_band(rig: Any) -> None:
    rig.plans["cut"] = [Plan(parts=[(0, sse(chunk(role=True), chunk("a"), done=False))], end="eof")]
    got = await rig.post("cut")
    events = [e for e in got.body.split(b"\n\n") if e]
    assert orjson.loads(events[-1][6:])["error"]["code"] == "upstream_stream_interrupted"
    assert b"[DONE]" not in got.body
    assert sample(rig.metrics(), "tiergate_requests_total", outcome="stream_error") == 1


async def test_the_client_leaving_mid_stream_closes_the_upstream(rig: Any) -> None:
    rig.plans["long"] = [Plan(parts=[(0, sse(chunk(role=True), chunk("a"), done=False)),
                                     *((0.02, sse(chunk("b"), done=False)) for _ in range(50))])]
    got = await rig.post("long", leave_when=lambda body: b'"b"' in body)
    assert got.status == 200
    assert rig.transport.answers[-1].closed
    m = rig.metrics()
    assert sample(m, "tiergate_requests_total", missing_ok=False, outcome="client_disconnect") == 1
    assert sample(m, "tiergate_in_flight_requests", tier="standard") == 0


async def test_the_client_leaving_after_the_finish_still_counts_the_usage(rig: Any) -> None:
    rig.plans["late_usage"] = [Plan(parts=[(0, sse(chunk(role=True), chunk("a"), chunk(finish="stop"), done=False)),
                                           (0.05, sse(chunk(usage=True)))])]
    await rig.post("late_usage", leave_when=lambda body: b'"finish_reason":"stop"' in body)
    m = rig.metrics()
    assert sample(m, "tiergate_requests_total", missing_ok=False, outcome="success") == 1
    assert sample(m, "tiergate_tokens_total", missing_ok=False, token_type="output") == 3


async def test_the_drain_ends_a_stream_in_band(rig: Any) -> None:
    rig.plans["slow"] = [Plan(parts=[(0, sse(chunk(role=True), chunk("a"), done=False)),
                                     *((0.05, sse(chunk("b"), done=False)) for _ in range(40))])]
    request = asyncio.ensure_future(rig.post("slow"))
    await asyncio.sleep(0.1)
    rig.app.begin_drain(0.1)
    got = await request
    events = [e for e in got.body.split(b"\n\n") if e]
    assert orjson.loads(events[-1][6:])["error"]["code"] == "gateway_draining"
    assert sample(rig.metrics(), "tiergate_requests_total", missing_ok=False, outcome="gateway_draining") == 1


async def test_every_candidate_cooling_down_is_a_429(rig: Any) -> None:
    limited = Plan(status=429, headers={**JSON, "retry-after": "3"},
                   parts=[(0, b'{"error":{"message":"slow down","type":"rate_limit_error"}}')], chunked=False)
    rig.plans["limited"] = [limited]
    first = await rig.post("limited", body={"model": "m-fast"})
    assert first.status == 429 and first.headers["x-should-retry"] == "false"  # both tiers tried
    n = len(rig.transport.requests)
    again = await rig.post("limited", body={"model": "m-fast"})
    assert again.status == 429 and orjson.loads(again.body)["error"]["code"] == "rate_limit_exceeded"
    assert again.headers["retry-after"] == "3" and len(rig.transport.requests) == n


async def test_a_bug_is_a_500_envelope_and_a_gateway_error(rig: Any) -> None:
    def broken(req: Received) -> Plan:
        raise RuntimeError("a bug in the upstream client")
    rig.transport.handler = broken
    got = await rig.post()
    assert got.status == 500 and orjson.loads(got.body)["error"]["type"] == "server_error"
    assert "Traceback" not in got.body.decode()
    assert sample(rig.metrics(), "tiergate_requests_total", missing_ok=False, outcome="gateway_error") == 1


async def test_a_responses_stream_is_relayed_without_done(rig: Any) -> None:
    events = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
              b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi",'
              b'"sequence_number":1}\n\n'
              b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,"response":'
              b'{"usage":{"input_tokens":3,"output_tokens":1}}}\n\n')
    rig.plans["resp"] = [Plan(parts=[(0, events)])]
    got = await rig.post("resp", path="/v1/responses", body={"input": "hi"})
    assert got.status == 200 and got.body == events
    assert sample(rig.metrics(), "tiergate_tokens_total", missing_ok=False, token_type="input") == 3


async def test_a_request_leaves_no_reference_cycle_for_the_garbage_collector(tmp_path: Path) -> None:
    """Every object a request makes is freed by reference counting when it ends: cyclic garbage would make the
    collector run (and pause the event loop) inside later requests (bench.trace found its gen-0 passes in most of
    the slowest 1 % of TTFTs, from the watcher task's CancelledError traceback)."""
    import gc

    from bench import layers, procs

    cfg = tmp_path / "gw.yaml"
    cfg.write_text(procs.gateway_config(9))
    await layers.own_us(cfg, {"plain": 40, "stream": 20})  # warm: caches, imports, first-use allocations
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await layers.own_us(cfg, {"plain": 100, "stream": 40})
        gc.collect()
        garbage = [type(o).__qualname__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    # a fresh app per call makes a little of its own (its registry, its config): none of it per request
    assert len(garbage) < 100, sorted(set(garbage))


def test_hangup_calls_back_once_and_also_when_the_client_left_before_the_watch() -> None:
    from gateway.http.server import Hangup

    calls: list[str] = []
    h = Hangup()
    h.watch(lambda: calls.append("a"))
    h.fire()
    h.fire()  # connection_lost after a refusal: never a second call
    assert calls == ["a"]
    late = Hangup()
    late.fire()  # lost while a streamed upload was still being read: nothing watched yet
    late.watch(lambda: calls.append("late"))
    assert calls == ["a", "late"]
    stopped = Hangup()
    stopped.watch(lambda: calls.append("stopped"))
    stopped.watch(None)
    stopped.fire()
    assert calls == ["a", "late"]
