"""What a client's cost tracker reads (docs/metrics.md#cost-in-answers): the real LiteLLM SDK, through its own cost
callback, prices the gateway's answers at the USD the gateway computed (its ``x-litellm-response-cost`` header on a
whole answer, ``usage.cost`` in a stream's final usage, as OpenRouter sends it), where without them it logs 0 for a
model it does not know; ``answers.model: requested`` names the model as the client asked in whole answers and in
every chunk. Over real sockets, against emulated tiers with prices."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from conftest import Proc, default_config, emulator, sample, scraped, start_gateway

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price map: no fetch from the network
litellm = pytest.importorskip("litellm")
# LiteLLM's own types warn under pydantic (ReadOnly TypedDict items) as it builds them on a first call
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

PRICES = {"fast": {"input": 0.6, "cached_input": 0.15, "output": 1.2},
          "standard": {"input": 0.35, "cached_input": 0.1, "output": 0.75}}
MESSAGES = [{"role": "user", "content": "Price this answer. [[emulate tokens=9]]"}]


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """The same priced tiers behind three gateways: ``answers`` as shipped (``cost: header``), with ``cost: usage``
    and ``model: requested``, and with ``cost: off``."""
    tmp = tmp_path_factory.mktemp("costs")
    fast, standard = emulator("fast", tmp), emulator("standard", tmp, tps=2000, ttft=0.02)
    procs: dict[str, Proc] = {}
    for name, answers in (("header", None), ("usage", {"cost": "usage", "model": "requested"}),
                          ("off", {"cost": "off"})):
        cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1")
        for up in cfg["upstreams"]:
            up["prices"] = PRICES[up["tier"]]
        if answers is not None:
            cfg["answers"] = answers
        procs[name] = start_gateway(cfg, tmp)[0]
    yield procs
    for p in (*procs.values(), fast, standard):
        p.stop()


class Costs:
    """LiteLLM's success callback: the ``response_cost`` it logged for each call (what Langfuse and the other
    trackers it feeds are given)."""

    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def __call__(self, kwargs: dict[str, Any], response: Any, start: Any, end: Any) -> None:
        if kwargs.get("stream") and "complete_streaming_response" not in kwargs:
            return  # a stream's chunk: LiteLLM calls back for each, then once for the whole stream, priced
        self.seen.append(kwargs.get("response_cost"))


@pytest.fixture
def costs() -> Iterator[Costs]:
    found = Costs()
    litellm.success_callback = [found]
    yield found
    litellm.success_callback = []


def _usd(proc: Proc) -> float:
    return sum(v for tier in ("fast", "standard")
               for v in [sample(scraped(proc.port), "tiergate_cost_usd_total", tier=tier) or 0.0])


def _wait(costs: Costs, n: int) -> None:
    """LiteLLM runs the callback in a thread of its own, after the call returns."""
    import time
    deadline = time.monotonic() + 10
    while len(costs.seen) < n:
        assert time.monotonic() < deadline, costs.seen
        time.sleep(0.02)


def test_litellm_prices_a_whole_answer_at_the_gateways_cost_from_its_header(gateways: dict[str, Proc],
                                                                             costs: Costs) -> None:
    gw = gateways["header"]
    raw = httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                     json={"model": "gpt-5.6-sol-fast", "messages": MESSAGES})
    header = float(raw.headers["x-tiergate-cost-usd"])
    assert header > 0 and raw.headers["x-litellm-response-cost"] == raw.headers["x-tiergate-cost-usd"]
    assert "cost" not in raw.json()["usage"]  # cost: header leaves the body as the upstream wrote it
    before = _usd(gw)
    reply = litellm.completion(model="openai/gpt-5.6-sol-fast", api_base=f"http://127.0.0.1:{gw.port}/v1",
                               api_key="unused", messages=MESSAGES)
    _wait(costs, 1)
    assert reply.model == "gpt-5.6-wse"  # the upstream's name: LiteLLM's price map knows neither
    assert costs.seen[0] == pytest.approx(_usd(gw) - before, rel=1e-6) and costs.seen[0] == pytest.approx(header)


def test_without_the_gateways_cost_litellm_logs_nothing_for_the_model(gateways: dict[str, Proc],
                                                                      costs: Costs) -> None:
    """The issue's symptom, kept as the control: ``answers.cost: off``."""
    gw = gateways["off"]
    litellm.completion(model="openai/gpt-5.6-sol-fast", api_base=f"http://127.0.0.1:{gw.port}/v1",
                       api_key="unused", messages=MESSAGES)
    _wait(costs, 1)
    assert not costs.seen[0]  # 0.0 or None: a model its price map does not know


def test_litellm_prices_a_stream_from_usage_cost_and_sees_the_requested_model(gateways: dict[str, Proc],
                                                                               costs: Costs) -> None:
    gw = gateways["usage"]
    before = _usd(gw)
    stream = litellm.completion(model="openai/gpt-5.6", api_base=f"http://127.0.0.1:{gw.port}/v1",
                                api_key="unused", messages=MESSAGES, stream=True,
                                stream_options={"include_usage": True})
    models = {chunk.model for chunk in stream}
    _wait(costs, 1)
    assert models == {"gpt-5.6"}  # as the client asked, in every chunk (the upstream said gpt-5.6-2026-10-01)
    assert costs.seen[0] == pytest.approx(_usd(gw) - before, rel=1e-6) and costs.seen[0] > 0


def test_the_raw_answers_carry_the_cost_and_the_name_as_configured(gateways: dict[str, Proc],
                                                                   tmp_path: Path) -> None:
    gw = f"http://127.0.0.1:{gateways['usage'].port}/v1"
    whole = httpx.post(f"{gw}/chat/completions", json={"model": "gpt-5.6-sol-fast", "messages": MESSAGES}).json()
    assert whole["model"] == "gpt-5.6-sol-fast" and whole["usage"]["cost"] > 0
    with httpx.stream("POST", f"{gw}/chat/completions", json={
            "model": "gpt-5.6-sol-fast", "stream": True, "stream_options": {"include_usage": True},
            "messages": MESSAGES}) as resp:
        events = [orjson.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert {e["model"] for e in events} == {"gpt-5.6-sol-fast"}
    assert events[-1]["usage"]["cost"] == pytest.approx(whole["usage"]["cost"])  # the same answer, the same price
    # without include_usage the client gets no usage chunk, so no cost either (the gateway's own usage is stripped)
    with httpx.stream("POST", f"{gw}/chat/completions", json={
            "model": "gpt-5.6-sol-fast", "stream": True, "messages": MESSAGES}) as resp:
        assert b'"cost"' not in b"".join(resp.iter_raw())
    response = httpx.post(f"{gw}/responses", json={"model": "gpt-5.6-sol-fast", "input": "hi [[emulate tokens=4]]"})
    assert response.json()["model"] == "gpt-5.6-sol-fast" and response.json()["usage"]["cost"] > 0
