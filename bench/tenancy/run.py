"""One run's clock: the load, the side tricks and the ping floods at once, the gateway sampled every five seconds
meanwhile, and what the upstreams were sent read back at the end."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aiohttp

from bench import procs
from bench.tenancy.common import LIMITS, Tally, metric, scrape
from bench.tenancy.flood import ping_floods
from bench.tenancy.load import Soak
from bench.tenancy.phases import Phases

SAMPLE_EVERY = 5.0


async def sample(base: str, token: str, pid: int, seconds: float, out: list[dict[str, Any]]) -> None:
    """Every :data:`SAMPLE_EVERY` s until ``seconds`` are over: RSS, the breakers open, and each key's charged tokens
    and USD."""
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        while True:
            text = await scrape(s, base, token)
            row: dict[str, Any] = {"t": round(time.time(), 1), "rss_mib": round(procs.rss_bytes(pid) / 2**20, 1),
                                   "breakers_open": metric(text, "tiergate_upstream_state", state="open")}
            for name in LIMITS:
                row[f"{name}_tokens"] = metric(text, "tiergate_key_tokens_total", key=name)
                row[f"{name}_usd"] = round(metric(text, "tiergate_key_cost_usd_total", key=name), 9)
            out.append(row)
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(SAMPLE_EVERY, max(0.1, deadline - time.monotonic())))


async def upstream_batches(ports: dict[str, int]) -> list[dict[str, Any]]:
    """Every batch the emulated upstreams were asked to make (their own list: what the gateway forwarded)."""
    made: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for port in ports.values():
            async with s.get(f"http://127.0.0.1:{port}/v1/batches") as resp:
                if resp.status == 200:
                    made.extend((await resp.json()).get("data") or [])
    return made


async def load(base: str, keys: dict[str, str], token: str, pid: int, args: argparse.Namespace,
               tally: Tally) -> list[dict[str, Any]]:
    """Everything of one run at once (the package's docstring); the samples taken meanwhile."""
    samples: list[dict[str, Any]] = []
    seconds = args.minutes * 60
    phases = Phases(base, keys, args.seed + 1, tally, time.monotonic() + seconds)
    await asyncio.gather(Soak(base, keys, args.seed, tally).run(args.concurrency, seconds, args.max_requests),
                         phases.session_bursts(), phases.pinned_run(), phases.tier_drop(),
                         ping_floods(base, keys["hostile"], token, pid, tally, seconds),
                         sample(base, token, pid, seconds + 3, samples))
    return samples
