"""What the passthrough of the rest of /v1 costs, next to a direct connection and the minimal proxy, in one run.

    .venv/bin/python -m bench.passthrough [--quick] [--repeat N] [--out DIR]

The bench upstream (``bench.upstream``) on CPU 0 with the load generator; the gateway (``tiergate serve``, the bench
upstream as its passthrough upstream) and ``bench.minproxy`` on CPU 1, measured one after the other. Three phases,
each through the gateway, through minproxy and direct, a median over ``--repeat`` runs [min, max]:

1. **embeddings**: ``POST /v1/embeddings`` (a model no upstream lists: sent unchanged to the passthrough upstream;
   a 1536-float base64 answer, ~8 KiB) from 64 concurrent keep-alive clients for ``--seconds``: requests/s and the
   proxy's CPU per request (``/proc/PID/stat``).
2. **download**: ``POST /v1/audio/speech`` answered with ``--mib`` (16) MiB of binary in 64 KiB chunked writes, 4
   at a time: the proxy's CPU per MiB and the MiB/s one client gets.
3. **upload**: ``POST /v1/files`` with a ``--mib`` MiB ``application/octet-stream`` body, 4 at a time: CPU per MiB,
   MiB/s, and the proxy's peak RSS growth (``VmRSS`` sampled every 5 ms) over its idle RSS. minproxy reads a body whole
   before sending it (the gateway streams it), so its RSS grows by the bodies in flight.

Every answer is checked (status 200, the right size); any failure fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import loadgen, procs
from bench.report import median_cell, repeated

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
EMBED = b'{"model":"text-embedding-3-small","input":"benchmark","encoding_format":"base64"}'


async def _embeddings(base: str, pid: int, seconds: float, clients: int) -> dict[str, float]:
    url = base + "/v1/embeddings"
    done = 0
    async with loadgen.session() as sess:

        async def one() -> None:
            async with sess.post(url, data=EMBED, headers={"content-type": "application/json"}) as resp:
                body = await resp.read()
                if resp.status != 200 or b'"usage"' not in body:
                    raise RuntimeError(f"{url}: {resp.status} {body[:200]!r}")

        for _ in range(clients):
            await one()
        cpu0, t0 = procs.cpu_seconds(pid) if pid else 0.0, time.monotonic()
        deadline = t0 + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                await one()
                done += 1

        async with asyncio.timeout(seconds + 30):
            await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.monotonic() - t0
        cpu = procs.cpu_seconds(pid) - cpu0 if pid else 0.0
    return {"rps": done / wall, "cpu_us_per_request": cpu / done * 1e6 if pid else 0.0}


async def _transfer(base: str, pid: int, kind: str, size: int, count: int, parallel: int) -> dict[str, float]:
    payload = b"\x00" * size
    peak = [procs.rss_bytes(pid) if pid else 0]
    idle = peak[0]
    stop = asyncio.Event()

    async def sample() -> None:
        while pid and not stop.is_set():
            peak[0] = max(peak[0], procs.rss_bytes(pid))
            await asyncio.sleep(0.005)

    async with loadgen.session() as sess:

        async def one() -> float:
            t0 = time.monotonic()
            if kind == "download":
                got = 0
                async with sess.post(base + "/v1/audio/speech", json={"model": "tts-1", "input": "x", "voice": "a",
                                                                       "bench_bytes": size}) as resp:
                    async for piece in resp.content.iter_any():
                        got += len(piece)
                ok = resp.status == 200 and got == size
            else:
                async with sess.post(base + "/v1/files", data=payload,
                                     headers={"content-type": "application/octet-stream"}) as resp:
                    body = await resp.read()
                ok = resp.status == 200 and f'"bytes":{size}'.encode() in body
            if not ok:
                raise RuntimeError(f"{kind} via {base}: status {resp.status}")
            return time.monotonic() - t0

        await one()  # warm-up
        sampler = asyncio.get_running_loop().create_task(sample())
        cpu0 = procs.cpu_seconds(pid) if pid else 0.0
        times: list[float] = []
        async with asyncio.timeout(120):
            for _ in range(count // parallel):
                times += await asyncio.gather(*(one() for _ in range(parallel)))
        cpu = procs.cpu_seconds(pid) - cpu0 if pid else 0.0
        stop.set()
        await sampler
    mib = size * len(times) / MIB
    return {"cpu_ms_per_mib": cpu / mib * 1e3 if pid else 0.0, "mib_per_s_per_client": size / MIB /
            statistics.median(times), "rss_growth_mib": (peak[0] - idle) / MIB if pid else 0.0}


def _run(args: argparse.Namespace, work: Path, pin: bool) -> dict[str, dict[str, dict[str, float]]]:
    with procs.Children() as kids:
        up = kids.start("upstream", [*procs.pin_prefix(0 if pin else None), procs.python_exe(), "-m",
                                     "bench.upstream", "--port", "0"], work / "upstream.log", cwd=ROOT)
        up_port = procs.wait_upstream_ready(up)
        cfg = work / "gateway.yaml"
        cfg.write_text(procs.gateway_config(up_port) + "limits: {max_passthrough_bytes: 1073741824}\n")
        targets: list[tuple[str, str, int]] = [("direct", f"http://127.0.0.1:{up_port}", 0)]
        port = procs.free_port()
        gw = kids.start("gateway", [*procs.pin_prefix(1 if pin else None), procs.python_exe(), "-m", "gateway",
                                    "serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning"],
                        work / "gateway.log", cwd=ROOT)
        procs.wait_http_ready(gw, f"http://127.0.0.1:{port}/readyz")
        targets.append(("tiergate", f"http://127.0.0.1:{port}", gw.pid))
        mport = procs.free_port()
        mp = kids.start("minproxy", [*procs.pin_prefix(1 if pin else None), procs.python_exe(), "-m",
                                     "bench.minproxy", "--upstream", f"http://127.0.0.1:{up_port}", "--port",
                                     str(mport)], work / "minproxy.log", cwd=ROOT)
        procs.wait_http_ready(mp, f"http://127.0.0.1:{mport}/healthz")
        targets.append(("minproxy", f"http://127.0.0.1:{mport}", mp.pid))
        out: dict[str, dict[str, dict[str, float]]] = {}
        for name, base, pid in targets:
            out[name] = {"embeddings": asyncio.run(_embeddings(base, pid, args.seconds, 64)),
                         "download": asyncio.run(_transfer(base, pid, "download", args.mib * MIB, args.count, 4)),
                         "upload": asyncio.run(_transfer(base, pid, "upload", args.mib * MIB, args.count, 4))}
    return out


ROWS = [("embeddings", "rps", "embeddings req/s (64 clients)", "{:.0f}"),
        ("embeddings", "cpu_us_per_request", "embeddings: proxy CPU per request (us)", "{:.0f}"),
        ("download", "cpu_ms_per_mib", "{mib} MiB download: proxy CPU per MiB (ms)", "{:.2f}"),
        ("download", "mib_per_s_per_client", "{mib} MiB download: MiB/s per client (4 at a time)", "{:.0f}"),
        ("upload", "cpu_ms_per_mib", "{mib} MiB upload: proxy CPU per MiB (ms)", "{:.2f}"),
        ("upload", "mib_per_s_per_client", "{mib} MiB upload: MiB/s per client (4 at a time)", "{:.0f}"),
        ("upload", "rss_growth_mib", "{mib} MiB uploads, 4 at a time: proxy peak RSS growth (MiB)", "{:.1f}")]


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The results as Markdown rows (for bench/RESULTS.md)."""
    lines = [f"bench.passthrough at {meta['git']} on {meta['when']}, {meta['cpu']}, {len(runs)} run(s)"
             f"{'' if meta['pinned'] else ', UNPINNED'}", "",
             "| figure | tiergate | minproxy | direct |", "|---|---|---|---|"]
    for phase, key, label, fmt in ROWS:
        cells = []
        for target in ("tiergate", "minproxy", "direct"):
            values = [r[target][phase][key] for r in runs]
            cells.append("-" if target == "direct" and "mib_per_s" not in key and key != "rps"
                         else median_cell(values, fmt))
        lines.append(f"| {label.format(mib=meta['mib'])} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the phases; print Markdown; write ``results.json`` and ``results.md`` under ``--out``."""
    ap = argparse.ArgumentParser(prog="python -m bench.passthrough", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, figures mean nothing")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--mib", type=int, default=16, help="MiB per download / upload")
    ap.add_argument("--count", type=int, default=32, help="downloads and uploads per target")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "passthrough")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeat, args.seconds, args.mib, args.count = 1, 0.5, 1, 4
    return repeated("passthrough", args.repeat, lambda tmp, pin: _run(args, tmp, pin), {"mib": args.mib}, markdown,
                    args.out)

if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"bench.passthrough: {exc}", file=sys.stderr)
        sys.exit(1)
