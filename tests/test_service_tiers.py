"""OpenAI's speed service tiers over real sockets: which tier a request's ``service_tier`` asks for, an upstream that is
a service tier of its model (``service_tier: ultrafast`` set on the way up), and billing by the tier the upstream says
it served (its answer's ``service_tier``, in a JSON body, in stream chunks, in a Response object), with a long-context
price step, a slower tier than asked counted and logged, and the live estimates kept apart per served tier."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.tools.emulator import EmulatorConfig, EmulatorThread

from conftest import Proc, sample, scraped, start_gateway

DEFAULT = {"input": 1.0, "cached_input": 0.1, "output": 2.0}  # USD per million tokens
ULTRA = {"input": 6.0, "cached_input": 0.6, "output": 12.0}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, dict[str, EmulatorThread]]]:
    cfg = EmulatorConfig(dialect="openai", ttft=0.005, tps=5000.0)
    ups = {"ultra": EmulatorThread(config=cfg), "cerebras": EmulatorThread(config=EmulatorConfig(
        dialect="cerebras", ttft=0.005, tps=5000.0)), "std": EmulatorThread(config=cfg)}

    def up(name: str, tier: str, **kw: Any) -> dict[str, Any]:
        return {"name": name, "tier": tier, "base_url": ups[name].base_url, "models": {"m": f"m-{name}"},
                "timeouts": {"connect": 2, "idle": 5, "total": 30}, **kw}
    gw, _ = start_gateway({
        "default_tier": "standard",
        "upstreams": [
            up("ultra", "fast", service_tier="ultrafast", prices={**DEFAULT, "service_tiers": {"ultrafast": ULTRA}}),
            up("cerebras", "fast", dialect="cerebras", prices=DEFAULT),
            up("std", "standard", prices={**DEFAULT, "long_context": {"above": 2000, "input": 3.0, "output": 4.0}}),
        ],
        "rules": [{"name": "service_tier", "match": {"service_tier": ["fast", "priority", "ultrafast"]},
                   "route": {"tier": "fast", "upstream": "ultra", "fallback": False}},
                  {"name": "service_tier", "match": {"service_tier": ["flex"]}, "route": {"tier": "standard"}},
                  {"name": "cerebras", "match": {"headers": {"x-tiergate-tier": "fast"}},
                   "route": {"tier": "fast", "upstream": "cerebras"}}],
        "estimates": {"window": 60, "samples": 16, "explore": 0, "probe": 60},
    }, tmp_path_factory.mktemp("service-tiers"))
    yield gw, ups
    gw.stop()
    for e in ups.values():
        e.stop()


def _post(gw: Proc, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body}
    return httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=payload, headers=headers or {},
                      timeout=10)


def _cost(gw: Proc, upstream: str) -> float:
    tier = "standard" if upstream == "std" else "fast"
    m = scraped(gw.port)
    return sum(sample(m, "tiergate_cost_usd_total", tier=tier, upstream=upstream, model="m", usage=u)
               for u in ("reported", "estimated"))


def _priced(usage: dict[str, Any], prices: dict[str, float]) -> float:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ((usage["prompt_tokens"] - cached) * prices["input"] + cached * prices.get("cached_input", prices["input"])
            + usage["completion_tokens"] * prices["output"]) / 1e6


@pytest.mark.parametrize(("tier", "served_by"), [("fast", "ultra"), ("priority", "ultra"), ("ultrafast", "ultra"),
                                                ("flex", "std"), ("auto", "std"), ("default", "std"),
                                                ("scale", "std")])
def test_every_service_tier_asks_for_the_tier_it_names(world: Any, tier: str, served_by: str) -> None:
    gw, _ = world
    r = _post(gw, {"service_tier": tier})
    assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == served_by
    assert r.headers["x-tiergate-rule"] == ("service_tier" if tier in ("fast", "priority", "ultrafast", "flex")
                                            else "default")


def test_an_upstream_that_is_a_service_tier_is_asked_for_it_and_others_drop_or_keep_the_clients(world: Any) -> None:
    gw, ups = world
    _post(gw, {"service_tier": "priority"})
    assert orjson.loads(ups["ultra"].requests[-1].body)["service_tier"] == "ultrafast"  # replaced on the way up
    _post(gw, {"service_tier": "scale"}, {"x-tiergate-tier": "fast"})  # to Cerebras: it answers the field 422
    assert "service_tier" not in orjson.loads(ups["cerebras"].requests[-1].body)
    _post(gw, {"service_tier": "flex"})
    assert orjson.loads(ups["std"].requests[-1].body)["service_tier"] == "flex"  # the client's own, kept


def test_a_request_is_billed_by_the_tier_the_upstream_says_it_served(world: Any, tmp_path: Path) -> None:
    gw, _ = world
    before = _cost(gw, "ultra")
    served = _post(gw, {"service_tier": "fast"})  # asked (and served) ultrafast
    assert served.json()["service_tier"] == "ultrafast"
    assert _cost(gw, "ultra") - before == pytest.approx(_priced(served.json()["usage"], ULTRA), rel=1e-6)
    before = _cost(gw, "ultra")
    full = [{"role": "user", "content": "[[emulate served_tier=default]]"}]  # the ultrafast tier is full
    down = _post(gw, {"service_tier": "fast", "messages": full})
    assert down.json()["service_tier"] == "default"  # it was full: the standard processing served it
    assert _cost(gw, "ultra") - before == pytest.approx(_priced(down.json()["usage"], DEFAULT), rel=1e-6)
    m = scraped(gw.port)
    assert sample(m, "tiergate_service_tier_downgrades_total", asked="ultrafast", served="default") >= 1
    line = _logged(gw, down.headers["x-request-id"])
    assert (line["service_tier"], line["service_tier_asked"], line["service_tier_echoed"]) == \
        ("default", "ultrafast", True)


def _logged(gw: Proc, request_id: str) -> dict[str, Any]:
    """The request log line of ``request_id`` (written at the end of its event-loop turn)."""
    deadline = time.monotonic() + 5
    while True:
        line = next((orjson.loads(x) for x in gw.log.read_text().splitlines()
                     if f'"{request_id}"' in x and '"outcome"' in x), None)
        if line is not None:
            return line
        assert time.monotonic() < deadline, f"no request line for {request_id}"
        time.sleep(0.02)


def test_a_streams_chunks_and_a_response_object_say_the_served_tier_too(world: Any) -> None:
    gw, _ = world
    before = _cost(gw, "ultra")
    with httpx.stream("POST", f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=10, json={
            "model": "m", "stream": True, "service_tier": "ultrafast", "max_tokens": 8,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "[[emulate served_tier=default]]"}]}) as r:
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {e["service_tier"] for e in events} == {"default"}
    usage = events[-1]["usage"]
    assert _cost(gw, "ultra") - before == pytest.approx(_priced(usage, DEFAULT), rel=1e-6)
    before = _cost(gw, "ultra")
    resp = httpx.post(f"http://127.0.0.1:{gw.port}/v1/responses", timeout=10, json={
        "model": "m", "input": "hi", "max_output_tokens": 8, "service_tier": "ultrafast"}).json()
    assert resp["service_tier"] == "ultrafast"
    chat_usage = {"prompt_tokens": resp["usage"]["input_tokens"], "completion_tokens": resp["usage"]["output_tokens"]}
    assert _cost(gw, "ultra") - before == pytest.approx(_priced(chat_usage, ULTRA), rel=1e-6)


def test_without_an_echo_the_asked_tier_is_billed_and_the_log_says_so(world: Any) -> None:
    gw, _ = world
    before = _cost(gw, "ultra")
    r = _post(gw, {"service_tier": "fast", "messages": [{"role": "user", "content": "[[emulate dialect=cerebras]]"}]},
              {"x-request-id": "no-echo-1"})
    assert r.status_code == 200 and "service_tier" not in r.json()  # a Cerebras-style answer: no tier said
    assert _cost(gw, "ultra") - before == pytest.approx(_priced(r.json()["usage"], ULTRA), rel=1e-6)  # as asked
    line = _logged(gw, "no-echo-1")
    assert (line["service_tier"], line["service_tier_asked"], line["service_tier_echoed"]) == \
        ("ultrafast", "ultrafast", False)


def test_a_long_prompt_is_billed_at_the_long_context_price(world: Any) -> None:
    gw, _ = world
    before = _cost(gw, "std")
    long = _post(gw, {"messages": [{"role": "user", "content": "word " * 3000}]})  # over 2,000 tokens
    usage = long.json()["usage"]
    assert usage["prompt_tokens"] > 2000
    assert _cost(gw, "std") - before == pytest.approx(_priced(usage, {"input": 3.0, "output": 4.0}), rel=1e-6)


def test_the_live_estimates_keep_each_served_tier_apart(world: Any) -> None:
    gw, _ = world
    for _ in range(3):
        with httpx.stream("POST", f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=10, json={
                "model": "m", "stream": True, "service_tier": "fast", "max_tokens": 8,
                "messages": [{"role": "user", "content": "[[emulate served_tier=default]]"}]}) as r:
            r.read()
        with httpx.stream("POST", f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=10, json={
                "model": "m", "stream": True, "service_tier": "fast", "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            r.read()
    est = httpx.get(f"http://127.0.0.1:{gw.port}/v1/tiergate/estimates", timeout=5).json()
    series = {(e["upstream"], e["model"]) for e in est["latency"]} if "latency" in est else set(str(est))
    text = orjson.dumps(est).decode()
    assert "m-ultra@ultrafast" in text and '"m-ultra"' in text, (series, text[:500])


@pytest.mark.parametrize(("tier", "code"), [("x" * 2_000_000, "invalid_value"), ("FLEX", "invalid_value"),
                                            ("", "invalid_value"), (123, "invalid_type"), ({"a": 1}, "invalid_type")])
def test_a_service_tier_that_is_no_tier_is_refused(world: Any, tier: Any, code: str) -> None:
    """The attack: a 2 MB ``service_tier`` was sent upstream and written twice into one request log line (4 MB);
    an object was dropped in silence and the request served at the default tier."""
    gw, ups = world
    before = sum(len(e.requests) for e in ups.values())
    r = _post(gw, {"service_tier": tier})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (code, "service_tier", "invalid_request_error")
    assert len(r.content) < 1000  # the refusal does not echo a huge value
    assert sum(len(e.requests) for e in ups.values()) == before
    assert _post(gw, {"service_tier": "on_demand"}).status_code == 200  # another provider's word passes


def test_a_bridged_response_says_the_tier_it_is_billed_at_not_the_one_the_client_wrote() -> None:
    """A fast tier asked of a standard-tier bridged upstream is not sent (and billed at its default prices), an
    upstream that is a service tier sends its own: the Response object said the client's word in both cases."""
    from types import SimpleNamespace

    from gateway.pipeline.delivery import draft

    up = SimpleNamespace(responses_mode="bridge")
    facts = SimpleNamespace(body={"model": "m", "input": "hi", "service_tier": "fast"})
    for sent, said in ((None, "default"), ("ultrafast", "ultrafast"), ("fast", "fast")):
        ex = SimpleNamespace(request=SimpleNamespace(kind="responses"), rec=SimpleNamespace(billed_tier=sent))
        made = draft(ex, up, facts)  # type: ignore[arg-type]
        assert made is not None and made.response("completed", [])["service_tier"] == said
