"""The gateway's live figures of its own time against the benchmark's added per-chunk delay, interleaved
(docs/metrics.md#gateway-added-time): the bench upstream on CPU 0, the gateway alone on CPU 1; each round N streams
at 750 tokens/s straight to the upstream, then through the gateway with its ``/metrics`` scraped before and after, so
that each round's live quantiles (``tiergate_gateway_added_seconds`` and ``tiergate_event_loop_lag_seconds``) are of
that round's load only. A round's benchmark figure is the gateway's percentile minus direct's of the same round; the
closing line gives the medians over the rounds (one slow minute of the VM moves one round, not the verdict). The
same for the time to first token, from the live ``first_byte`` and two loop waits.
Bounded: 2 x ROUNDS phases of ``--seconds`` each.

    .venv/bin/python -m bench.added --streams 32 --seconds 10 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from bench import loadgen, procs

ROOT = Path(__file__).resolve().parent.parent


def _q(values: list[int], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] / 1e6  # ns -> ms


def quantile(buckets: list[tuple[float, float]], p: float) -> float:
    """``histogram_quantile`` over cumulative (le, count) pairs, in seconds."""
    total = buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= p * total:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (p * total - prev_count) / max(count - prev_count, 1e-9)
        prev_le, prev_count = le, count
    return prev_le


def live(metrics: str) -> dict[str, list[tuple[float, float]]]:
    found: dict[str, list[tuple[float, float]]] = {}
    for line in metrics.splitlines():
        m = re.match(r"tiergate_(gateway_added|event_loop_lag)_seconds_bucket\{(.*)\} (\S+)", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            found.setdefault(labels.get("phase", "loop_lag"), []).append((float(labels["le"]), float(m.group(3))))
    return {k: sorted(v) for k, v in found.items()}


def draw(buckets: list[tuple[float, float]], n: int, rng: random.Random) -> list[float]:
    """``n`` values drawn from a histogram's cumulative (le, count) buckets, uniform inside a bucket (as
    ``histogram_quantile`` interpolates), in seconds; the +Inf bucket's values at its lower bound."""
    bounds, weights, prev_le, prev_count = [], [], 0.0, 0.0
    for le, count in buckets:
        if count > prev_count:
            bounds.append((prev_le, prev_le if math.isinf(le) else le))
            weights.append(count - prev_count)
        prev_le, prev_count = le, count
    return [rng.uniform(*b) for b in rng.choices(bounds, weights, k=n)]


def predicted(direct_ns: list[int], parts: list[list[tuple[float, float]]], rng: random.Random,
              n: int = 200_000) -> list[int]:
    """The delays a client would see through the gateway if the gateway added what its live figures say, each part
    independent of the others and of the client's own delay: a direct delay of the round plus one draw from each
    histogram of ``parts``, ``n`` draws (ns). Percentiles of a sum are not sums of percentiles: this is the
    like-for-like comparison."""
    draws = [draw(h, n, rng) for h in parts]
    return [rng.choice(direct_ns) + int(sum(added) * 1e9) for added in zip(*draws, strict=True)]


def _delta(after: dict[str, list[tuple[float, float]]],
           before: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
    """Cumulative buckets of one round: ``after`` minus ``before`` (same buckets, counters only grow)."""
    out = {}
    for name, buckets in after.items():
        was = dict(before.get(name, []))
        out[name] = [(le, count - was.get(le, 0.0)) for le, count in buckets]
    return out


async def _rounds(up: int, gw: int, streams: int, seconds: float,
                  rounds: int) -> list[tuple[loadgen.Tally, loadgen.Tally, dict[str, list[tuple[float, float]]]]]:
    sess = loadgen.session()
    out = []
    direct, through = (f"http://127.0.0.1:{port}/v1/chat/completions" for port in (up, gw))
    metrics = f"http://127.0.0.1:{gw}/metrics"
    try:
        await loadgen.warmup(sess, direct, streams=streams)
        await loadgen.warmup(sess, through, streams=streams)
        async with httpx.AsyncClient(timeout=5) as scrape:
            for _ in range(rounds):
                d, _ = await loadgen.closed_loop_streams(sess, direct, conc=streams, tokens=300, tps=750,
                                                         duration=seconds, max_requests=100_000, stagger=0.4)
                before = live((await scrape.get(metrics)).text)
                g, _ = await loadgen.closed_loop_streams(sess, through, conc=streams, tokens=300, tps=750,
                                                         duration=seconds, max_requests=100_000, stagger=0.4)
                out.append((d, g, _delta(live((await scrape.get(metrics)).text), before)))
    finally:
        await sess.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.added", description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0, help="each phase of a round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--probes", type=float, default=400.0,
                    help="the gateway's loop-lag probes a second (GATEWAY_LOOP_LAG_RATE): a p99 of one round's probes "
                         "rests on their hundredth; 40, the default, leaves ~3 above it in 8 s")
    args = ap.parse_args()
    if not 0 < args.probes <= 2000:
        ap.error("--probes: 0 < probes <= 2000 (without probes there is no loop wait to compare)")
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp, procs.Children() as kids:
        up = kids.start("upstream", procs.pin_prefix(0) + [py, "-m", "bench.upstream", "--port", "0"],
                        Path(tmp) / "upstream.log", cwd=ROOT)
        up_port = procs.wait_upstream_ready(up)
        cfg = Path(tmp) / "gateway.yaml"
        cfg.write_text(procs.gateway_config(up_port))
        gw_port = procs.free_port()
        gw = kids.start("gateway", procs.pin_prefix(1) + [py, "-m", "gateway", "serve", "--config", str(cfg), "--port",
                                                          str(gw_port), "--log-level", "warning"],
                        Path(tmp) / "gateway.log", cwd=ROOT,
                        env={**os.environ, "GATEWAY_LOG_SAMPLE": "0", "GATEWAY_LOOP_LAG_RATE": str(args.probes)})
        procs.wait_http_ready(gw, f"http://127.0.0.1:{gw_port}/readyz")
        measured = asyncio.run(_rounds(up_port, gw_port, args.streams, args.seconds, args.rounds))
    print(f"{args.streams} streams at 750 tokens/s, {args.rounds} rounds of {args.seconds:g} s each way; ms")
    print("| round | direct p50 / p99 | through the gateway p50 / p99 | predicted by the live figures p50 / p99 "
          "| live: chunk p50 / p99 | live: loop lag p50 / p99 (probes) | benchmark added p99 | live added p99 "
          "| live / benchmark |\n|---|---|---|---|---|---|---:|---:|---:|")
    rng = random.Random(36)
    added, live_added, errors = [], [], 0
    for i, (d, g, figures) in enumerate(measured, 1):
        errors += d.error_count + g.error_count
        c, lag = figures["chunk"], figures["loop_lag"]
        guess = predicted(d.delays_ns, [lag, c], rng)
        d50, d99, g50, g99, p50, p99 = (_q(v, p) for v in (d.delays_ns, g.delays_ns, guess) for p in (0.5, 0.99))
        c50, c99, l50, l99 = (quantile(b, p) * 1e3 for b in (c, lag) for p in (0.5, 0.99))
        added.append(g99 - d99)
        live_added.append(p99 - d99)
        print(f"| {i} | {d50:.3f} / {d99:.3f} | {g50:.3f} / {g99:.3f} | {p50:.3f} / {p99:.3f} | {c50:.3f} / {c99:.3f} "
              f"| {l50:.3f} / {l99:.3f} ({int(lag[-1][1])}) | {g99 - d99:.3f} | {p99 - d99:.3f} "
              f"| {(p99 - d99) / (g99 - d99):.2f} |")
    m = statistics.median
    print(f"| median | | | | | | {m(added):.3f} | {m(live_added):.3f} | {m(live_added) / m(added):.2f} |")
    print("\nTime to first token, each stream of the rounds: the live `first_byte` plus two loop waits (the request's "
          "bytes, the first token's)\n| round | direct p50 / p99 | through the gateway p50 / p99 | predicted p50 / p99 "
          "| live: first_byte p50 / p99 | added p50: benchmark / live | added p99: benchmark / live |\n"
          "|---|---|---|---|---|---|---|")
    ttft = []
    for i, (d, g, figures) in enumerate(measured, 1):
        fb, lag = figures["first_byte"], figures["loop_lag"]
        guess = predicted(d.ttft_ns, [fb, lag, lag], rng)
        d50, d99, g50, g99, p50, p99 = (_q(v, p) for v in (d.ttft_ns, g.ttft_ns, guess) for p in (0.5, 0.99))
        ttft.append((g50 - d50, p50 - d50, g99 - d99, p99 - d99))
        print(f"| {i} | {d50:.3f} / {d99:.3f} | {g50:.3f} / {g99:.3f} | {p50:.3f} / {p99:.3f} "
              f"| {quantile(fb, 0.5) * 1e3:.3f} / {quantile(fb, 0.99) * 1e3:.3f} | {g50 - d50:.3f} / {p50 - d50:.3f} "
              f"| {g99 - d99:.3f} / {p99 - d99:.3f} |")
    b50, l50, b99, l99 = (m(col) for col in zip(*ttft, strict=True))
    print(f"| median | | | | | {b50:.3f} / {l50:.3f} ({l50 / b50:.2f}) | {b99:.3f} / {l99:.3f} ({l99 / b99:.2f}) |")
    if errors:
        print(f"errors: {errors}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
