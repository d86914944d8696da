"""``tiergate bench`` itself (:func:`main`): the run, its table, its chart and its JSON."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.tools.loadtest.chart import render_html
from gateway.tools.loadtest.client import run
from gateway.tools.loadtest.figures import group, premium, summary, table
from gateway.tools.loadtest.mix import parse_mix


def main(args: Any) -> int:
    """Run ``tiergate bench`` with parsed ``args``; returns the exit code (1 when every request failed)."""
    try:
        mix = parse_mix(args.mix)
    except ValueError as exc:
        print(f"tiergate bench: {exc}", file=sys.stderr)
        return 2
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        print("tiergate bench: --requests, --concurrency and --max-tokens must be at least 1", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "unused"
    print(f"tiergate bench: {args.requests} requests, concurrency {args.concurrency}, mix {args.mix}, "
          f"max {args.max_tokens} tokens -> {args.base_url}", file=sys.stderr)
    started = time.monotonic()
    results, cost = asyncio.run(run(args.base_url, api_key, mix, args.requests, args.concurrency, args.max_tokens,
                                    args.timeout, args.seed, None if args.quiet else sys.stderr))
    elapsed = time.monotonic() - started
    stats = group(results)
    print(table(stats, cost))
    if cost is None:
        print("(cost: n/a, the gateway's /metrics was not reachable)")
    meta = {"requests": args.requests, "concurrency": args.concurrency, "mix": args.mix, "max_tokens": args.max_tokens,
            "base_url": args.base_url, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "elapsed": elapsed}
    out = "tiergate-bench.html" if args.out is None else args.out
    if out:
        Path(out).write_text(render_html(stats, cost, meta), encoding="utf-8")
        print(f"chart: {out}")
    if args.json:
        tiers = summary(stats, cost)
        Path(args.json).write_bytes(orjson.dumps({"meta": meta, "tiers": tiers, "premium": premium(tiers)},
                                                 option=orjson.OPT_INDENT_2))
    return 1 if results and all(r.error is not None for r in results) else 0
