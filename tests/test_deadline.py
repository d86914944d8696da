"""Deadline routing over real sockets with the emulators: the fast tier's TTFT steps from 50 ms to 3 s mid-test
(``POST /emulator/config``), requests with a 1.5 s deadline move to the standard tier and back once it recovers, and
every answer says what was predicted; the live estimates at ``/v1/tiergate/estimates`` and in ``/metrics``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from conftest import Proc, emulator, sample, start_gateway

DEADLINE = {"x-tiergate-deadline-ms": "1500"}


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("deadline")
    fast = emulator("fast", tmp, dialect="openai")  # 750 tokens/s, 50 ms TTFT
    standard = emulator("standard", tmp)  # 50 tokens/s, 400 ms TTFT
    timeouts = {"connect": 2, "idle": 10, "total": 30}
    cfg = {
        "default_tier": "standard",
        "upstreams": [
            {"name": "emu-fast", "tier": "fast", "base_url": f"http://127.0.0.1:{fast.port}/v1", "timeouts": timeouts,
             "models": {"gpt-5.6": "gpt-5.6-sol-fast"}, "prices": {"input": 2.5, "output": 15.0}},
            {"name": "emu-standard", "tier": "standard", "base_url": f"http://127.0.0.1:{standard.port}/v1",
             "timeouts": timeouts, "models": {"gpt-5.6": "gpt-5.6"}, "prices": {"input": 1.25, "output": 10.0}},
        ],
        # estimates reflect 4 s of traffic: the 3 s samples age out 4 s after the fast tier recovers
        "estimates": {"window": 4, "samples": 8, "explore": 0, "probe": 1},
        "rules": [{"name": "header", "match": {"headers": {"x-tiergate-tier": "standard"}},
                   "route": {"tier": "standard"}},
                  {"name": "agent", "match": {"metadata": {"workload": ["agent"]}}, "route": {"tier": "fast"}}],
    }
    gw, _ = start_gateway(cfg, tmp)
    yield gw, fast, standard
    for p in (gw, fast, standard):
        p.stop()


def _ask(gw: Proc, headers: dict[str, str] | None = None, stream: bool = True, **body: Any) -> httpx.Response:
    """A streamed agent request for 60 tokens (fast: ~0.13 s; standard: ~1.6 s, which misses a 1.5 s deadline)."""
    payload = {"model": "gpt-5.6", "stream": stream, "max_tokens": 60, "metadata": {"workload": "agent"},
               "messages": [{"role": "user", "content": "plan the next step"}], **body}
    payload = {k: v for k, v in payload.items() if v is not None}
    with httpx.stream("POST", f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=payload,
                      headers=headers or {}, timeout=20) as r:
        r.read()
    return r


def _set_ttft(up: Proc, ms: float) -> None:
    r = httpx.post(f"http://127.0.0.1:{up.port}/emulator/config", json={"ttft_ms": ms}, timeout=5)
    assert r.status_code == 200 and r.json()["ttft_ms"] == ms


def test_a_deadline_moves_requests_off_a_slowed_fast_tier_and_back(tiers: tuple[Proc, Proc, Proc]) -> None:
    gw, fast, _ = tiers
    # unmeasured: each tier is probed once, then the fast tier is the one that meets 1.5 s
    seen = [_ask(gw, DEADLINE) for _ in range(3)]
    assert [r.headers["x-tiergate-deadline"] for r in seen[:2]] == ["probe", "probe"]
    assert {r.headers["x-tiergate-upstream"] for r in seen[:2]} == {"emu-fast", "emu-standard"}
    r = seen[2]
    assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "emu-fast"
    assert r.headers["x-tiergate-deadline"] == "meets" and int(r.headers["x-tiergate-predicted-ms"]) < 1500
    assert r.headers["x-tiergate-rule"] == "agent" and "x-tiergate-fallback" not in r.headers

    _set_ttft(fast, 3000)  # the fast tier queues up
    served = []
    for _ in range(4):
        r = _ask(gw, DEADLINE)
        assert r.status_code == 200
        served.append(r.headers["x-tiergate-upstream"])
        if served[-1] == "emu-standard":
            break
    assert served[-1] == "emu-standard" and len(served) <= 3, served  # moved within a bounded number of requests
    # the fastest, or (its estimate aged out while the slow request ran) the probe that re-measured it
    assert r.headers["x-tiergate-fallback"] == "deadline" and r.headers["x-tiergate-deadline"] in ("fastest", "probe")
    # the explanation names the prediction
    route = httpx.post(f"http://127.0.0.1:{gw.port}/v1/tiergate/route", headers=DEADLINE, timeout=5, json={
        "model": "gpt-5.6", "max_tokens": 60, "metadata": {"workload": "agent"},
        "messages": [{"role": "user", "content": "plan the next step"}]}).json()
    assert route["rule"] == "agent" and route["tier"] == "fast"  # the rule's; the deadline moved it:
    assert route["fallback"] == "deadline"
    dl = route["deadline"]
    assert dl["chosen"] == "emu-standard" and dl["deadline_ms"] == 1500 and dl["verdict"] == "fastest"
    assert "predicted" in dl["reason"] and "emu-standard" in dl["reason"]
    fast_pred = next(p for p in dl["predictions"] if p["upstream"] == "emu-fast")
    assert fast_pred["predicted_ttft_ms"] > 1500 and fast_pred["meets"] is False
    assert route["candidates"][0]["upstream"] == "emu-standard"

    _set_ttft(fast, 50)  # it recovers: noticed once its slow samples aged out (window 4 s) and it is re-measured
    back = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        r = _ask(gw, DEADLINE)
        back.append((r.headers["x-tiergate-upstream"], r.headers["x-tiergate-deadline"]))
        if back[-1] == ("emu-fast", "meets"):
            break
    assert back[-1] == ("emu-fast", "meets") and len(back) <= 8, back
    assert ("emu-fast", "probe") in back  # the re-measure that noticed it

    text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    assert sample(text, "tiergate_deadline_decisions_total", upstream="emu-standard", verdict="fastest",
                  missing_ok=False) >= 1
    assert sample(text, "tiergate_fallbacks_total", reason="deadline", missing_ok=False) >= 1
    assert sample(text, "tiergate_estimated_ttft_seconds", upstream="emu-fast", stat="p90",
                  missing_ok=False) < 0.5


def test_estimates_are_served_as_json_and_gauges(tiers: tuple[Proc, Proc, Proc]) -> None:
    gw = tiers[0]
    _set_ttft(tiers[1], 50)  # as the emulator starts (whatever an earlier test left)
    for _ in range(3):  # three samples: their median is the fast estimate's (one stalled request cannot move it)
        _ask(gw)
    _ask(gw, {"x-tiergate-tier": "standard"})
    snap = httpx.get(f"http://127.0.0.1:{gw.port}/v1/tiergate/estimates", timeout=5).json()
    assert snap["object"] == "tiergate.estimates" and snap["window_s"] == 4
    by = {e["upstream"]: e for e in snap["latency"]}
    fast, std = by["emu-fast"], by["emu-standard"]
    assert fast["measured"] and std["measured"]
    # the emulators' 50 ms and 400 ms: the standard tier's estimate is over 300 ms (a delay only adds to it), and the
    # fast tier's under half of it, a ratio of the two measured in this run (a loaded machine adds to both; it leaves
    # 150 ms for delays on the fast tier alone, where the tiers' estimates swapped or mixed would fail)
    fast_p50, std_p50 = (e["ttft"]["at_prompt_tokens"]["1000"]["p50_s"] for e in (fast, std))
    assert std_p50 > 0.3 and fast_p50 < std_p50 / 2, (fast_p50, std_p50)
    assert fast["tokens_per_second"]["p50"] == pytest.approx(750, rel=0.2)
    assert std["tokens_per_second"]["p50"] == pytest.approx(50, rel=0.2)
    # lengths come from requests without max_tokens only (the emulator's default answer is 48 tokens)
    assert not any(e["rule"] == "agent" for e in snap["completion_tokens"])
    _ask(gw, max_tokens=None)
    snap = httpx.get(f"http://127.0.0.1:{gw.port}/v1/tiergate/estimates", timeout=5).json()
    assert [(e["rule"], e["p50"]) for e in snap["completion_tokens"]] == [("agent", 48)]
    text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    assert sample(text, "tiergate_estimated_output_tokens_per_second", upstream="emu-standard", stat="p50",
                  missing_ok=False) == pytest.approx(50, rel=0.2)
    assert sample(text, "tiergate_estimate_samples", upstream="emu-fast", missing_ok=False) >= 1


def test_without_a_budget_nothing_changes(tiers: tuple[Proc, Proc, Proc]) -> None:
    r = _ask(tiers[0])
    assert r.headers["x-tiergate-upstream"] == "emu-fast"
    assert "x-tiergate-deadline" not in r.headers and "x-tiergate-predicted-ms" not in r.headers


def test_a_budget_in_metadata_applies_to_non_streaming_requests_too(tiers: tuple[Proc, Proc, Proc]) -> None:
    gw = tiers[0]
    _ask(gw)  # keeps the fast tier measured
    r = _ask(gw, stream=False, metadata={"workload": "agent", "deadline_ms": "60000"})
    assert r.status_code == 200 and r.headers["x-tiergate-deadline"] in ("meets", "probe")
    if r.headers["x-tiergate-deadline"] == "meets":  # a minute is enough for both: the cheaper one serves
        assert r.headers["x-tiergate-upstream"] == "emu-standard"


@pytest.mark.parametrize(("where", "value"), [("header", "soon"), ("header", "-1"), ("metadata", "0")])
def test_a_bad_budget_is_a_400_naming_it(tiers: tuple[Proc, Proc, Proc], where: str, value: str) -> None:
    gw = tiers[0]
    if where == "header":
        r = _ask(gw, {"x-tiergate-deadline-ms": value})
        param = "x-tiergate-deadline-ms"
    else:
        r = _ask(gw, metadata={"workload": "agent", "ttft_deadline_ms": value})
        param = "metadata.ttft_deadline_ms"
    assert r.status_code == 400
    err = orjson.loads(r.content)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == "invalid_value"
