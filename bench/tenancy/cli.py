"""The command line of the soak: the emulators and the gateway started, one run (:mod:`bench.tenancy.run`), and
its report written (:mod:`bench.tenancy.report`)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.tenancy.common import KEY_EXTRA, LIMITS, PRICE, PRIORITY, ROOT, Tally
from bench.tenancy.phases import tier_charged
from bench.tenancy.report import markdown, per_key, rss_summary, verdicts
from bench.tenancy.run import load, upstream_batches


def gateway_config(fast: int, std: int, keys: dict[str, str], scrape: str) -> dict[str, Any]:
    """Two upstreams (the standard one selling ``service_tier: priority`` at :data:`PRIORITY`) and the keys."""
    up = {"timeouts": {"connect": 2, "idle": 5, "finish_grace": 0.5, "total": 30}}
    return {
        "default_tier": "standard",
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": f"http://127.0.0.1:{fast}/v1", "dialect": "cerebras",
             "models": {"gpt-5.6": "gpt-5.6-wse"}, "prices": PRICE, **up},
            {"name": "standard", "tier": "standard", "base_url": f"http://127.0.0.1:{std}/v1", "dialect": "openai",
             "models": {"gpt-5.6": "gpt-5.6-2026-10-01"}, "prices": {**PRICE, "service_tiers": {"priority": PRIORITY}},
             **up},
        ],
        "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"}},
        "auth": {"metrics": {"sha256": [hashlib.sha256(scrape.encode()).hexdigest()]},
                 "keys": [{"name": n, "sha256": hashlib.sha256(k.encode()).hexdigest(), "limits": LIMITS[n],
                           **KEY_EXTRA.get(n, {})} for n, k in keys.items()]},
    }


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Tenancy soak: several gateway keys share one gateway, one hostile.")
    ap.add_argument("--minutes", type=float, default=3.0, help="how long the load runs (default 3)")
    ap.add_argument("--concurrency", type=int, default=24, help="workers in all, split over the keys (default 24)")
    ap.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "tenancy")
    return ap.parse_args(argv)


def result(args: argparse.Namespace, ran: float, tally: Tally, samples: list[dict[str, Any]],
           batches: list[dict[str, Any]], alive: bool) -> dict[str, Any]:
    """The run's figures (``tenancy.json``), with the run-end checks: the upstream made a batch only for what the
    gateway served, none naming another key's file; the dropped tier billed at the default."""
    served = tally.trick_codes["unreadable_batch: duplicate, own last"]["200"]
    theirs = sum(1 for b in batches if b.get("input_file_id") in tally.files)
    tier = tier_charged(tally.phases["tier_drop"], samples[-1]["tiered_usd"])
    extra = {"unreadable_batch": theirs == 0 and len(batches) == served, "tier_drop": tier["held"]}
    return {"minutes": round(ran / 60, 2), "concurrency": args.concurrency, "seed": args.seed,
            "per_key": per_key(tally, samples), "tricks": verdicts(tally, extra),
            "variants": {k: dict(v) for k, v in tally.trick_codes.items() if ": " in k},
            "phases": dict(tally.phases), "tier_drop": tier,
            "batches_upstream": {"made": len(batches), "naming_theirs": theirs, "served": served},
            "wrong": dict(tally.wrong), "wrong_examples": tally.examples,
            "breakers_opened": max(r["breakers_open"] for r in samples), "rss_mib": rss_summary(samples),
            "gateway_alive_at_end": alive}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    procs.raise_nofile()
    py = sys.executable
    keys = {name: "tg-" + os.urandom(24).hex() for name in LIMITS}
    scrape = "tg-" + os.urandom(24).hex()
    tally = Tally()
    with procs.Children() as kids:
        ports = {"fast": procs.free_port(), "standard": procs.free_port()}
        for tier, port in ports.items():
            kids.start(f"emulator-{tier}", [py, "-m", "gateway", "emulate", "--tier", tier, "--port", str(port)],
                       args.out / f"emulator-{tier}.log", cwd=ROOT)
        cfg_path = args.out / "tenancy.yaml"
        cfg_path.write_text(json.dumps(gateway_config(ports["fast"], ports["standard"], keys, scrape), indent=1))
        gw_port = procs.free_port()
        gw = kids.start("gateway", [py, "-m", "gateway", "serve", "--config", str(cfg_path), "--port", str(gw_port),
                                    "--log-level", "warning"], args.out / "gateway.log", cwd=ROOT,
                        env={**os.environ, "GATEWAY_STATE_DIR": str(args.out / "state")})
        base = f"http://127.0.0.1:{gw_port}"
        procs.wait_http_ready(gw, base + "/readyz")
        print(f"[tenancy] {args.concurrency} workers for {args.minutes:g} min against {base}", flush=True)
        t0 = time.monotonic()
        samples = asyncio.run(load(base, keys, scrape, gw.pid, args, tally))
        ran = time.monotonic() - t0
        batches = asyncio.run(upstream_batches(ports))
        alive = gw.alive()
    out = result(args, ran, tally, samples, batches, alive)
    (args.out / "tenancy.json").write_text(json.dumps(out, indent=1))
    md = markdown(out)
    (args.out / "tenancy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    failed = any(v["verdict"] == "NOT HELD" for v in out["tricks"].values())
    return 0 if not tally.wrong and alive and not failed else 1
