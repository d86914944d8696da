"""The gateway's live figures of its own time against the benchmark's added per-chunk delay, in one run
(docs/metrics.md#gateway-added-time): the bench upstream on CPU 0, the gateway alone on CPU 1, N streams at 750
tokens/s straight to the upstream and then through the gateway; then the gateway's ``tiergate_gateway_added_seconds``
and ``tiergate_event_loop_lag_seconds`` quantiles from its ``/metrics``. Bounded: two phases of ``--seconds`` each.

    .venv/bin/python -m bench.added --streams 32 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import loadgen, procs

ROOT = Path(__file__).resolve().parent.parent


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


async def _load(up: int, gw: int, streams: int, seconds: float) -> dict[str, loadgen.Tally]:
    sess = loadgen.session()
    out = {}
    try:
        for name, port in (("direct", up), ("gateway", gw)):
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await loadgen.warmup(sess, url, streams=streams)
            out[name], _ = await loadgen.closed_loop_streams(sess, url, conc=streams, tokens=300, tps=750,
                                                             duration=seconds, max_requests=100_000, stagger=0.4)
    finally:
        await sess.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.added", description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    up_port, gw_port = _free(), _free()
    children: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            up = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "bench.upstream", "--port",
                                   str(up_port)], stdout=subprocess.PIPE, cwd=ROOT)
            children.append(up)
            assert up.stdout is not None
            up.stdout.readline()  # READY <port>
            cfg = Path(tmp) / "gateway.yaml"
            cfg.write_text(procs.gateway_config(up_port))
            gw = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "gateway", "serve", "--config",
                                   str(cfg), "--port", str(gw_port), "--log-level", "warning"], cwd=ROOT,
                                  env={**os.environ, "GATEWAY_LOG_SAMPLE": "0"})
            children.append(gw)
            deadline = time.monotonic() + 20
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{gw_port}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not become ready")
                time.sleep(0.1)
            tallies = asyncio.run(_load(up_port, gw_port, args.streams, args.seconds))
            figures = live(httpx.get(f"http://127.0.0.1:{gw_port}/metrics", timeout=5).text)
        finally:
            for p in children:
                p.terminate()
                p.wait(10)
    d, g = tallies["direct"], tallies["gateway"]
    print(f"{args.streams} streams at 750 tokens/s, {args.seconds:g} s; errors direct {dict(d.errors)} "
          f"gateway {dict(g.errors)}")
    print("| figure | p50 ms | p99 ms |\n|---|---:|---:|")
    print(f"| benchmark: added per-chunk delay (gateway - direct) | {_q(g.delays_ns, 0.5) - _q(d.delays_ns, 0.5):.3f} "
          f"| {_q(g.delays_ns, 0.99) - _q(d.delays_ns, 0.99):.3f} |")
    for name in ("chunk", "loop_lag", "first_byte"):
        if name in figures:
            b = figures[name]
            print(f"| live: {name} ({int(b[-1][1])} observations) | {quantile(b, 0.5) * 1e3:.3f} "
                  f"| {quantile(b, 0.99) * 1e3:.3f} |")
    if "chunk" in figures and "loop_lag" in figures:
        c, lag = figures["chunk"], figures["loop_lag"]
        print(f"| live: chunk + loop_lag | {(quantile(c, 0.5) + quantile(lag, 0.5)) * 1e3:.3f} "
              f"| {(quantile(c, 0.99) + quantile(lag, 0.99)) * 1e3:.3f} |")
    return 0 if not d.error_count and not g.error_count else 1


if __name__ == "__main__":
    sys.exit(main())
