"""``tiergate bench`` against the test stack: per-tier figures that match the emulated tiers, cost from /metrics,
the HTML chart; its mix, plan and percentile helpers; and what it says when requests fail."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.tools.loadtest import parse_mix, percentile, plan

from conftest import (
    ROOT,
    Proc,
    Stack,
    TimedEmulator,
    default_config,
    emulator,
    free_port,
    on_time,
    round_trip,
    sample,
    start_gateway,
)

PRICES = {"fast": {"input": 0.6, "cached_input": 0.15, "output": 1.2},
          "standard": {"input": 0.35, "cached_input": 0.1, "output": 0.75}}


@pytest.fixture(scope="module")
def priced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default emulated tiers (fast 750 tokens/s after 50 ms, standard 50 tokens/s after 400 ms), priced; each
    emulator logs when every streamed answer's request came and its first and last token left."""
    tmp = tmp_path_factory.mktemp("bench")
    fast, standard = TimedEmulator("fast", tmp, free_port()), TimedEmulator("standard", tmp, free_port())
    cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1")
    for up in cfg["upstreams"]:
        up["prices"] = PRICES[up["tier"]]
    gw, path = start_gateway(cfg, tmp)
    stack = Stack(gw, {"fast": fast, "standard": standard}, path, [gw, fast, standard])
    yield stack
    stack.stop()


def bench(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    out, js = tmp / "bench.html", tmp / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "gateway", "bench", "--out", str(out), "--json", str(js), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    return proc, orjson.loads(js.read_bytes()) if js.exists() else {}, out


def _truth(emu: Proc, since: int) -> list[dict[str, Any]]:
    """The timing lines ``emu`` (a :class:`TimedEmulator`) logged after its first ``since``."""
    assert isinstance(emu, TimedEmulator)
    lines = emu.records.read_text().splitlines() if emu.records.exists() else []
    return [orjson.loads(line) for line in lines[since:]]


def _figures_missed(tiers: dict[str, Any], truth: dict[str, list[dict[str, Any]]], floor: float) -> list[str]:
    """The bench's client-side figures against what the emulators logged for the same requests: each request's TTFT
    lies between the emulator's (request in -> first token out) and that plus the hops (client -> gateway ->
    emulator and back, and the gateway's work: three loopback exchanges and 10 ms), and its decode window within two
    exchanges and 5 ms of the emulator's; so each percentile lies between the same percentiles of those bounds (a
    percentile is monotone in every value). Returns the figures outside their bounds."""
    hop, jitter = 3 * floor + 0.010, 2 * floor + 0.005
    missed = []

    def within(what: str, got: float, lows: list[float], highs: list[float], q: float) -> None:
        low, high = percentile(sorted(lows), q), percentile(sorted(highs), q)
        assert low is not None and high is not None
        if not low <= got <= high:
            missed.append(f"{what} {got:.5f} outside [{low:.5f}, {high:.5f}]")

    for tier, got in tiers.items():
        ttfts = [t["first_token"] - t["received"] for t in truth[tier]]
        tpot_low = [max(t["last_token"] - t["first_token"] - jitter, 1e-6) / (t["token_chunks"] - 1)
                    for t in truth[tier]]
        tpot_high = [(t["last_token"] - t["first_token"] + jitter) / (t["token_chunks"] - 1) for t in truth[tier]]
        for q, key in ((0.5, "ttft_p50_s"), (0.95, "ttft_p95_s")):
            within(f"{tier} {key}", got[key], ttfts, [t + hop for t in ttfts], q)
        within(f"{tier} time per token p50", got["time_per_output_token_p50_s"], tpot_low, tpot_high, 0.5)
        within(f"{tier} tokens/s p50", got["tokens_per_s_p50"], [1 / t for t in tpot_high], [1 / t for t in tpot_low],
               0.5)
    return missed


def test_bench_measures_both_tiers_and_their_cost(priced: Stack, tmp_path: Path) -> None:
    runs: list[tuple[dict[str, Any], dict[str, Any], subprocess.CompletedProcess[str], Path]] = []

    def attempt() -> list[str]:
        seen = {tier: len(_truth(emu, 0)) for tier, emu in priced.upstreams.items()}
        floor = round_trip(priced.gateway.port)
        before = priced.metrics()
        proc, report, html = bench(tmp_path, "--base-url", priced.base_url, "--requests", "8", "--concurrency", "2",
                                   "--max-tokens", "40", "--mix", "gpt-5.6-sol-fast:0.5,gpt-5.6:0.5")
        after = priced.metrics()
        assert proc.returncode == 0, proc.stderr
        tiers = report["tiers"]
        assert set(tiers) == {"fast", "standard"}
        fast, std = tiers["fast"], tiers["standard"]
        assert fast["requests"] == std["requests"] == 4 and fast["errors"] == std["errors"] == 0
        assert fast["output_tokens"] == std["output_tokens"] == 4 * 40
        assert fast["ttft_p50_s"] <= fast["ttft_p95_s"] and std["ttft_p50_s"] <= std["ttft_p95_s"]
        deadline = time.monotonic() + 5  # each line is written as its answer ends: wait (bounded) for the last
        while True:
            truth = {tier: _truth(emu, seen[tier]) for tier, emu in priced.upstreams.items()}
            if [len(truth[t]) for t in ("fast", "standard")] == [4, 4] or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert [len(truth[t]) for t in ("fast", "standard")] == [4, 4], truth
        runs[:] = [(before, after, proc, html)]
        # client-side TTFT, decode speed and time per token: what the emulators did (50 / 400 ms, 750 / 50 tokens/s
        # when the machine keeps up) plus the hops, measured in this run; a stall of the machine spoils one run, a
        # figure measured at the wrong moment (TTFT at the last token: +52 ms fast, +780 ms standard) fails them all
        return _figures_missed(tiers, truth, floor)
    on_time(attempt)
    before, after, proc, html = runs[0]
    report = orjson.loads((tmp_path / "bench.json").read_bytes())
    tiers = report["tiers"]
    fast, std = tiers["fast"], tiers["standard"]
    # cost: the gateway's counter over the run, which is its usage at the configured prices
    for tier, got in (("fast", fast), ("standard", std)):
        lab = {"tier": tier}
        tokens = {t: sample(after, "tiergate_tokens_total", token_type=t, **lab)
                  - sample(before, "tiergate_tokens_total", token_type=t, **lab) for t in ("input", "output")}
        p = PRICES[tier]
        assert tokens["output"] == 160
        assert got["cost_usd"] == pytest.approx((tokens["input"] * p["input"] + tokens["output"] * p["output"]) / 1e6,
                                                rel=1e-6)
        assert got["cost_usd"] > 0 and got["unpriced_requests"] == 0
    # the printed table and the chart
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "fast" in lines and "standard" in lines and "TTFT p50 ms" in lines["tier"]
    assert f"{fast['cost_usd']:.6f}" in lines["fast"]
    # the premium question, from the run's own figures: seconds saved per extra dollar
    for got in (fast, std):
        assert got["cost_per_request_usd"] == pytest.approx(got["cost_usd"] / 4)
        assert got["cost_per_1k_output_tokens_usd"] == pytest.approx(got["cost_usd"] * 1000 / 160)
    prem = report["premium"]
    assert prem["seconds_saved_per_request"] == pytest.approx(std["duration_mean_s"] - fast["duration_mean_s"])
    assert prem["seconds_saved_per_request"] > 0.5  # 40 tokens at 50/s after 400 ms against 750/s after 50 ms
    assert prem["extra_usd_per_request"] == pytest.approx(fast["cost_per_request_usd"] - std["cost_per_request_usd"])
    assert prem["seconds_saved_per_extra_usd"] == pytest.approx(prem["seconds_saved_per_request"]
                                                                / prem["extra_usd_per_request"])
    assert "s saved per extra USD" in proc.stdout.splitlines()[-2] or "s saved per extra USD" in proc.stdout
    page = html.read_text()
    assert page.count("<svg") == 3 and "<script" not in page and "Time to first token" in page
    assert "Cost per 1,000 output tokens" in page and "s saved per extra USD" in page
    assert "Decode speed" in page and ">fast<" in page and ">standard<" in page
    assert page.count("<circle") == 16  # one dot per request in each chart
    assert "8/8 requests, 0 errors" in proc.stderr  # the progress line


def test_bench_counts_errors_and_fails_when_nothing_succeeds(priced: Stack, tmp_path: Path) -> None:
    proc, report, _ = bench(tmp_path, "--base-url", priced.base_url, "--requests", "3", "--mix", "no-such-model",
                            "--quiet")
    assert proc.returncode == 1
    (group,) = report["tiers"].values()
    assert group["requests"] == group["errors"] == 3 and group["error_kinds"] == ["HTTP 404"]
    # a gateway that is not there: every request fails, no cost
    proc, report, _ = bench(tmp_path, "--base-url", f"http://127.0.0.1:{free_port()}/v1", "--requests", "2",
                            "--quiet", "--timeout", "5")
    assert proc.returncode == 1 and "n/a" in proc.stdout
    assert sum(g["errors"] for g in report["tiers"].values()) == 2
    # bad arguments
    proc, _, _ = bench(tmp_path, "--mix", "fast:x")
    assert proc.returncode == 2 and "bad weight" in proc.stderr


def test_mix_plan_and_percentiles() -> None:
    assert parse_mix("a:0.25, b:0.75") == [("a", 0.25), ("b", 0.75)]
    assert parse_mix("gpt-5.6") == [("gpt-5.6", 1.0)]
    with pytest.raises(ValueError):
        parse_mix("a:0,b:0")
    with pytest.raises(ValueError):
        parse_mix("a:-1")
    todo = plan([("a", 0.3), ("b", 0.7)], 10, seed=1)
    assert sorted(m for m, _ in todo) == ["a"] * 3 + ["b"] * 7
    assert plan([("a", 1), ("b", 1)], 7, seed=3) == plan([("a", 1), ("b", 1)], 7, seed=3)
    assert len(plan([("a", 1), ("b", 1), ("c", 1)], 4, seed=0)) == 4
    assert percentile([], 0.5) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)
    assert percentile([5.0], 0.95) == 5.0


def test_bench_reads_the_demo_chart_back() -> None:
    # the chart committed from a run against `tiergate demo` is the command's own output
    page = (ROOT / "bench" / "tiergate-bench-demo.html").read_text()
    assert page.count("<svg") == 3 and "<script" not in page and "tiergate bench" in page
    assert "Cost per 1,000 output tokens" in page and "s saved per extra USD" in page  # the premium question



@pytest.fixture(scope="module")
def caching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default emulated tiers, priced, each with a prompt cache (``--cache-ttl 300``, as in ``tiergate demo``)."""
    tmp = tmp_path_factory.mktemp("agent")
    fast = emulator("fast", tmp, extra=("--cache-ttl", "300"))
    standard = emulator("standard", tmp, extra=("--cache-ttl", "300"))
    cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1")
    for up in cfg["upstreams"]:
        up["prices"] = PRICES[up["tier"]]
    gw, path = start_gateway(cfg, tmp)
    stack = Stack(gw, {"fast": fast, "standard": standard}, path, [gw, fast, standard])
    yield stack
    stack.stop()


def test_agent_loop_reports_each_tiers_runs_from_the_sessions_records(caching: Stack, tmp_path: Path) -> None:
    """``--agent-loop 4``: per tier, runs of four steps that each send the conversation so far under one session
    id; the steps after the first find their prefix in the upstream's prompt cache, and the gateway's record of each
    run (cost at the cached-input price, hit ratio, steps by tier) is what the report shows."""
    proc, report, html = bench(tmp_path, "--base-url", caching.base_url, "--agent-loop", "4", "--runs", "2",
                               "--concurrency", "2", "--max-tokens", "12", "--mix", "gpt-5.6-sol-fast,gpt-5.6")
    assert proc.returncode == 0, proc.stderr
    tiers = report["tiers"]
    assert list(tiers) == ["fast", "standard"] and "Agent run, mean wall time" in html.read_text()  # --out: a chart
    for tier, t in tiers.items():
        assert (t["runs"], t["failed_runs"], t["steps"], t["error_kinds"]) == (2, 0, 8, [])
        assert t["steps_by_tier"] == {tier: 8}
        assert 0 < t["step_ttft_p50_s"] <= t["step_ttft_p95_s"] < t["run_wall_p50_s"]
        assert len(t["step_ttft_p50_by_step_s"]) == len(t["cached_tokens_by_step"]) == 4
        first, *later = t["cached_tokens_by_step"]
        assert all(c > first for c in later)  # each later step finds the one before it cached
        assert later == sorted(later)  # and the cached prefix grows with the conversation
        p = PRICES[tier]
        for s in t["sessions"]:
            rec = s["record"]
            assert rec["id"] == s["id"] and rec["steps"] == 4 and rec["steps_by_tier"] == {tier: 4}
            tok = rec["tokens"]
            assert tok["cached"] > 0 and rec["cache_hit_ratio"] == pytest.approx(tok["cached"] / tok["prompt"],
                                                                                 abs=1e-4)
            billed = (tok["prompt"] - tok["cached"]) * p["input"] + tok["cached"] * p["cached_input"] \
                + tok["output"] * p["output"]
            assert rec["cost_usd"] == pytest.approx(billed / 1e6, rel=1e-6)
        assert t["cost_per_run_usd"] == pytest.approx(sum(s["record"]["cost_usd"] for s in t["sessions"]) / 2)
        assert 0 < t["cache_hit_ratio"] < 1
    assert tiers["fast"]["run_wall_mean_s"] < tiers["standard"]["run_wall_mean_s"]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "fast" in lines and "standard" in lines and "USD/run" in lines["tier"]
    assert f"{tiers['fast']['cost_per_run_usd']:.6f}" in lines["fast"]
    assert "s per run for" in lines["premium:"]
