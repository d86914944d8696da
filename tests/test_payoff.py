"""What the fast tier saved an agent run (docs/sessions.md#payoff): the gateway's estimate against the same runs
measured side by side by ``tiergate bench --agent-loop`` over real sockets, and "not enough data" instead of a
number while the standard tier's estimate rests on too few samples."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.tenancy.sessions import MIN_SAMPLES, Payoff, SessionRecord, Step

from conftest import ROOT, RedisServer, Stack, default_config, emulator, start_gateway


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Both tiers with a prompt cache and a prefill time, as ``tiergate demo`` runs them; the standard one quicker
    than the default (200 tokens/s after 200 ms) to keep the runs short, still far slower than the fast one."""
    tmp = tmp_path_factory.mktemp("payoff")
    fast = emulator("fast", tmp, extra=("--cache-ttl", "300", "--prefill-tps", "20000"))
    standard = emulator("standard", tmp, tps=200, ttft=0.2, extra=("--cache-ttl", "300", "--prefill-tps", "2000"))
    gw, path = start_gateway(default_config(f"http://127.0.0.1:{fast.port}/v1",
                                            f"http://127.0.0.1:{standard.port}/v1"), tmp)
    stack = Stack(gw, {"fast": fast, "standard": standard}, path, [gw, fast, standard])
    yield stack
    stack.stop()


def test_a_fast_step_is_not_priced_on_one_standard_sample(tiers: Stack) -> None:
    """One streamed answer on the standard tier, then an agent run on the fast tier: the session view says not
    enough data, with no number, rather than a saving extrapolated from one answer's luck. Runs first: the module's
    standard tier has no other samples yet."""
    base = f"{tiers.base_url}/chat/completions"
    with httpx.Client(timeout=30) as client:
        one = client.post(base, json={"model": "gpt-5.6", "stream": True, "max_completion_tokens": 8,
                                      "messages": [{"role": "user", "content": "hi"}]})
        assert one.status_code == 200 and one.headers["x-tiergate-tier"] == "standard"
        messages: list[dict[str, str]] = []
        for k in range(3):
            messages.append({"role": "user", "content": f"step {k}"})
            r = client.post(base, headers={"x-tiergate-session": "one-sample"},
                            json={"model": "gpt-5.6-sol-fast", "max_completion_tokens": 8, "messages": messages})
            assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "fast"
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        view = client.get(f"{tiers.base_url}/tiergate/sessions/one-sample").json()
    assert view["steps_by_tier"] == {"fast": 3}
    assert view["fast_tier_saved_seconds"] is None and view["fast_tier_saved_steps"] == 0
    saved = view["fast_tier_saved"]
    assert saved["seconds"] is None and saved["interval_seconds"] is None
    assert (saved["priced_steps"], saved["unpriced_steps"]) == (0, 3)
    assert saved["note"].startswith("not enough data")


def test_the_estimate_agrees_with_the_measured_difference_of_a_side_by_side_run(tiers: Stack,
                                                                                  tmp_path: Path) -> None:
    """The same streamed agent loop on each tier, one run at a time, the standard model first so that the
    estimate has samples when the fast runs come, with a context long enough that the cache matters (pricing each
    step's whole prompt as uncached says 3x): the seconds the session records say the fast tier saved each run
    are within 20 % of the difference the bench measured, and inside the estimate's own interval's reach; the chart
    is written in agent-loop mode too."""
    out, js = tmp_path / "agent.html", tmp_path / "agent.json"
    proc = subprocess.run([sys.executable, "-m", "gateway", "bench", "--base-url", tiers.base_url,
                           "--agent-loop", "6", "--runs", "3", "--concurrency", "1", "--max-tokens", "24",
                           "--context-tokens", "1500",
                           "--mix", "gpt-5.6,gpt-5.6-sol-fast", "--out", str(out), "--json", str(js)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = orjson.loads(js.read_bytes())
    measured = report["measured_saving_s"]
    est = report["tiers"]["fast"]["estimate"]
    assert measured > 1.0, report["premium"]  # six steps of 24 tokens at 200/s after 200 ms, against 750/s
    # the first fast run comes after one standard run: six samples, fewer than the estimate needs
    assert MIN_SAMPLES > 6 and est["runs"] == 3 and est["runs_priced"] == 2, est
    assert est["fewest_samples"] >= MIN_SAMPLES
    assert est["seconds_per_run"] == pytest.approx(measured, rel=0.2), (est, measured)
    lo, hi = est["interval_seconds_per_run"]
    assert lo <= est["seconds_per_run"] <= hi
    lines = [line for line in proc.stdout.splitlines() if line.startswith("estimate:")]
    assert lines and "x the measured" in lines[0], proc.stdout
    page = out.read_text()
    assert "Seconds the fast tier saved per run" in page and "Step TTFT p50 by step" in page
    assert f"{est['seconds_per_run']:.4g}" in page and f"{measured:.4g}" in page


def test_a_run_prices_only_its_steps_with_data_and_keeps_the_fewest_samples() -> None:
    record = SessionRecord(None, "r", "header", 0.0)
    for saved in (Payoff(None, samples=3), Payoff(1.0, 0.5, 1.5, 12), Payoff(2.0, 1.0, 3.0, 9), None):
        record.add(Step("u", "fast" if saved is not None else "standard", 0.1, 0.0, 10, 0, 5, saved), 1.0, 0)
    view = record.as_dict()["fast_tier_saved"]
    assert view == {"seconds": 3.0, "interval_seconds": [1.5, 4.5], "priced_steps": 2, "unpriced_steps": 1,
                    "samples": 9, "note": "covers 2 of the 3 fast-tier steps (the rest: not enough data)"}


def test_what_the_fast_tier_saved_is_kept_in_redis_as_in_a_process(tmp_path: Path) -> None:
    """``session_step.lua`` on a real ``redis-server``: priced steps add their seconds and interval and keep the fewest
    samples, an unpriced one is counted, a step off the fast tier leaves both alone; ``decode`` reads back what a
    process's own record holds."""
    import redis as redis_py

    from gateway.state.scripts import SESSION_STEP
    from gateway.state.sessions import decode

    server = RedisServer(tmp_path)
    try:
        client = redis_py.Redis(port=server.port)
        step = client.register_script(SESSION_STEP)
        h = "t:session:{k}"
        local = SessionRecord(None, "r", "header", 1.0)
        for saved in (Payoff(1.0, 0.5, 1.5, 12), Payoff(None, samples=2), Payoff(2.0, 1.0, 3.0, 9), None):
            tier = "standard" if saved is None else "fast"
            local.add(Step("u", tier, 0.1, 0.0, 10, 0, 5, saved), 2.0, 0)
            step(keys=[h, h + ":moves", h + ":holds"], args=[
                60000, "2.0", "", "r", "header", "1.0", "u", tier, "0.1", "0.0", 10, 0, 5,
                "" if saved is None else saved.wire(), "", 0, ""])
        shared = decode(client.hgetall(h), [])
        assert shared is not None
        assert shared.as_dict()["fast_tier_saved"] == local.as_dict()["fast_tier_saved"] == {
            "seconds": 3.0, "interval_seconds": [1.5, 4.5], "priced_steps": 2, "unpriced_steps": 1, "samples": 9,
            "note": "covers 2 of the 3 fast-tier steps (the rest: not enough data)"}
    finally:
        server.kill()
