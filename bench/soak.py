"""Soak: many concurrent streams for minutes against upstreams that play, at random, faults of real upstreams.

    .venv/bin/python -m bench.soak [--streams 200] [--minutes 10] [--max-requests N] [--seed 0] [--out DIR]

Starts two emulated upstreams (fast: Cerebras dialect, standard: OpenAI dialect) and a gateway in front of them,
then keeps ``--streams`` requests in flight for ``--minutes``. Each request is a normal answer or, at random, one
of the emulator's faults (``gateway.tools.emulator.faults.FAULTS``, each one that other gateways' and SDKs' bug reports
describe an upstream doing: error events before the first token, silence after the finish, an error then a cut body,
mislabelled streams, late usage, exhausted quotas, context overflows, reset headers, stale keep-alive connections,
...), a cut or stalled stream, or a client that leaves (right after the finish chunk, or mid-stream). Every answer is
checked against what that fault must give the client (a status, a stream that ends with ``[DONE]`` and no error, or
exactly one in-band error event), and the gateway's own ``tiergate_requests_total`` by outcome is read before and
after.

It reports requests by expected outcome and by the gateway's outcome, every wrong outcome (with examples), and
the gateway's RSS, open file descriptors and asyncio tasks after warm-up and after the load (once it has
settled): flat means nothing leaks. Writes ``soak.json`` and ``soak.md`` to ``--out`` (default
``bench/out/soak``). Not run in CI (ten minutes); ``--minutes 0.2 --streams 20`` is a quick check.

Health is configured so that no upstream ever rests (no breaker, no cooldown): a fault of one request must not
change what another one gets, so that every outcome can be checked exactly. Breakers and cooldowns have their
own tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import procs

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = "You are a soak test. Answer at length."
# fault -> what the client must get: an HTTP status, "ok" (a stream ending in [DONE], no error, no usage chunk
# it did not ask for), "one_error" (a 200 stream ending in exactly one in-band error event, no [DONE]) or
# "one_error_done" (the upstream's own error chunk and then its own [DONE], relayed as they came: OpenRouter's shape)
EXPECT: dict[str, int | str] = {
    "none": "ok", "error_first": 400, "error_first_500": 500, "done_held": "ok", "silent_after_finish": "ok",
    "error_fin": "one_error", "mislabelled": "ok", "usage_late": "ok", "usage_on_error": "one_error_done",
    "quota_429": 429, "overflow_500": 400, "empty_envelope": 500, "reset_zero": "ok", "reset_only_429": 429,
    "stale": "ok", "done_no_blank": "ok", "usage_chunk": "ok", "drop": "one_error", "stall": "one_error",
    "leave_after_finish": "left", "leave_mid_stream": "left",
}
WEIGHTS = {"none": 30, **{k: 3 for k in EXPECT if k != "none"}}
DATA_LINE = re.compile(rb"^data: (.*)$", re.M)


@dataclass
class Tally:
    """What the soak saw."""

    sent: int = 0
    by_fault: Counter[str] = field(default_factory=Counter)
    wrong: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    transport_errors: int = 0

    def miss(self, fault: str, why: str) -> None:
        self.wrong[fault] += 1
        self.examples.setdefault(fault, why[:300])


def _config(fast_port: int, std_port: int) -> dict[str, Any]:
    never_rest = {"failures": 1_000_000_000, "cooldown_default": 0, "cooldown_max": 0, "exhausted_cooldown": 0}
    timeouts = {"connect": 2, "idle": 1.0, "finish_grace": 0.5, "total": 30}
    return {
        "default_tier": "standard", "max_attempts": 2,
        "upstreams": [
            {"name": "soak-fast", "tier": "fast", "base_url": f"http://127.0.0.1:{fast_port}/v1", "dialect": "cerebras",
             "timeouts": {**timeouts, "ttft": 2.0}, "health": never_rest, "prices": {"input": 2, "output": 8},
             "models": {"m": "m-wse"}},
            {"name": "soak-standard", "tier": "standard", "base_url": f"http://127.0.0.1:{std_port}/v1",
             "dialect": "openai", "timeouts": timeouts, "health": never_rest, "prices": {"input": 1, "output": 4},
             "models": {"m": "m-gpu"}},
        ],
        "aliases": {"m-fast": {"model": "m", "tier": "fast"}},
    }


def _body(fault: str, rng: random.Random) -> dict[str, Any]:
    tokens = rng.randint(8, 120)
    directive = f"tokens={tokens} tps={rng.choice((100, 300, 750))} ttft_ms={rng.randint(5, 60)}"
    if fault == "drop":
        directive += " drop_after=3"
    elif fault == "stall":
        directive += " stall_after=3"
    elif fault not in ("none", "leave_after_finish", "leave_mid_stream"):
        directive += f" fault={fault}"
    body: dict[str, Any] = {"model": rng.choice(("m", "m-fast")), "stream": True,
                            "messages": [{"role": "user", "content": f"{MESSAGES} [[emulate {directive}]]"}]}
    if fault == "usage_late":
        body["model"] = "m"  # the late usage chunk is the OpenAI dialect's (the standard tier here)
    return body


def _check(fault: str, status: int, ctype: str, raw: bytes) -> str | None:
    """None when the client got what ``fault`` must give it, else why not."""
    want = EXPECT[fault]
    if isinstance(want, int):
        if status != want:
            return f"status {status}, want {want}: {raw[:200]!r}"
        err = orjson.loads(raw).get("error")
        return None if isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} else "no envelope"
    if status != 200 or not ctype.startswith("text/event-stream"):
        return f"status {status} {ctype}: {raw[:200]!r}"
    if not raw.endswith(b"\n\n"):
        return f"ends inside an event: {raw[-120:]!r}"
    datas = DATA_LINE.findall(raw)
    errors = [d for d in datas if d.startswith(b"{") and b'"error"' in d and "error" in orjson.loads(d)]
    done = datas.count(b"[DONE]")
    for d in datas:
        if d != b"[DONE]":
            chunk = orjson.loads(d)  # every data line is JSON
            if chunk.get("choices") == []:
                return "a usage chunk the client did not ask for"
    if want == "ok":
        if errors or done != 1 or datas[-1] != b"[DONE]":
            return f"errors {len(errors)}, [DONE] x{done}: {raw[-200:]!r}"
    elif len(errors) != 1 or done != (want == "one_error_done"):
        return f"errors {len(errors)}, [DONE] x{done}: {raw[-200:]!r}"
    return None


async def _one(session: aiohttp.ClientSession, url: str, fault: str, rng: random.Random, tally: Tally) -> None:
    tally.sent += 1
    tally.by_fault[fault] += 1
    body = _body(fault, rng)
    try:
        async with session.post(url, json=body) as resp:
            if fault in ("leave_after_finish", "leave_mid_stream"):
                marker = b'"finish_reason":"stop"' if fault == "leave_after_finish" else b'"content":"'
                seen = b""
                async for data in resp.content.iter_any():
                    seen += data
                    if marker in seen[-4096:] or marker in seen:
                        break
                resp.close()  # leave: the connection is dropped, as an SDK loop's `break` does
                return
            raw = await resp.read()
            why = _check(fault, resp.status, resp.headers.get("content-type", ""), raw)
            if why is not None:
                tally.miss(fault, why)
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.transport_errors += 1
        tally.miss(fault, f"{type(exc).__name__}: {exc}")


async def _load(url: str, streams: int, seconds: float, max_requests: int, seed: int, tally: Tally) -> None:
    names = list(WEIGHTS)
    weights = [WEIGHTS[n] for n in names]
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 100_003 + i)
            while time.monotonic() < deadline and tally.sent < max_requests:
                await _one(session, url, rng.choices(names, weights)[0], rng, tally)
        await asyncio.gather(*(worker(i) for i in range(streams)))


def _scrape(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:  # noqa: S310 - loopback only
        return resp.read().decode()


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}", 1)[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _outcomes(text: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for line in text.splitlines():
        m = re.match(r'^tiergate_requests_total\{.*outcome="(\w+)".*\} (\S+)$', line)
        if m:
            out[m.group(1)] += int(float(m.group(2)))
    return out


def _state(pid: int, base: str) -> dict[str, float]:
    text = _scrape(base)
    return {"rss_mib": procs.rss_bytes(pid) / 2**20, "open_fds": len(os.listdir(f"/proc/{pid}/fd")),
            "tasks": _metric(text, "tiergate_event_loop_tasks"),
            "in_flight": _metric(text, "tiergate_in_flight_requests")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=200, help="requests in flight at once (default 200)")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (default 10)")
    ap.add_argument("--max-requests", type=int, default=2_000_000, help="stop after this many requests in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "soak")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    procs.raise_nofile()
    py = sys.executable
    with procs.Children() as kids:
        ports = {"fast": procs.free_port(), "standard": procs.free_port()}
        for tier, port in ports.items():
            kids.start(f"emulator-{tier}", [py, "-m", "gateway", "emulate", "--tier", tier, "--port", str(port)],
                       args.out / f"emulator-{tier}.log", cwd=ROOT)
        cfg_path = args.out / "soak.yaml"
        cfg_path.write_text(json.dumps(_config(ports["fast"], ports["standard"]), indent=1))
        gw_port = procs.free_port()
        gw = kids.start("gateway", [py, "-m", "gateway", "serve", "--config", str(cfg_path), "--port", str(gw_port),
                                    "--log-level", "warning"], args.out / "gateway.log", cwd=ROOT)
        base = f"http://127.0.0.1:{gw_port}"
        procs.wait_http_ready(gw, base + "/readyz")
        url = base + "/v1/chat/completions"
        warm = Tally()  # at full concurrency, so that the upstream keep-alive pool has its working size
        asyncio.run(_load(url, args.streams, min(10.0, args.minutes * 6), args.max_requests, args.seed + 1, warm))
        time.sleep(3.0)
        start = _state(gw.pid, base)
        before = _scrape(base)
        tally = Tally()
        t0 = time.monotonic()
        print(f"[soak] {args.streams} streams for {args.minutes:g} min against {url}", flush=True)
        asyncio.run(_load(url, args.streams, args.minutes * 60, args.max_requests, args.seed, tally))
        ran = time.monotonic() - t0
        time.sleep(3.0)  # finish_grace tails and drains end; then everything must be back where it started
        end = _state(gw.pid, base)
        after = _scrape(base)
        outcomes = _outcomes(after) - _outcomes(before)
        alive = gw.alive()
    result = {"streams": args.streams, "seconds": round(ran, 1), "requests": tally.sent,
              "requests_per_second": round(tally.sent / ran, 1), "by_fault": dict(sorted(tally.by_fault.items())),
              "gateway_outcomes": dict(sorted(outcomes.items())), "wrong": dict(tally.wrong),
              "wrong_examples": tally.examples, "transport_errors": tally.transport_errors,
              "start": start, "end": end, "gateway_alive_at_end": alive, "seed": args.seed}
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    md = [f"# Soak: {args.streams} streams for {ran / 60:.1f} min, {tally.sent} requests "
          f"({tally.sent / ran:.0f}/s), seed {args.seed}", "",
          "| | after warm-up | after the load (settled 3 s) |", "|---|---:|---:|"]
    for key in ("rss_mib", "open_fds", "tasks", "in_flight"):
        md.append(f"| {key} | {start[key]:.1f} | {end[key]:.1f} |")
    md += ["", f"wrong outcomes: {sum(tally.wrong.values())} (transport errors: {tally.transport_errors})", "",
           "| fault | requests | wrong | must give |", "|---|---:|---:|---|"]
    md += [f"| {k} | {v} | {tally.wrong.get(k, 0)} | {EXPECT[k]} |" for k, v in sorted(tally.by_fault.items())]
    md += ["", "gateway outcomes (tiergate_requests_total): "
           + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))]
    md += [f"- {k}: {v}" for k, v in tally.examples.items()]
    (args.out / "soak.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if not tally.wrong and alive else 1


if __name__ == "__main__":
    raise SystemExit(main())
