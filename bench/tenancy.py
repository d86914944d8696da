"""Tenancy soak: several gateway keys share one gateway for minutes, one of them hostile.

    .venv/bin/python -m bench.tenancy [--minutes 3] [--concurrency 24] [--max-requests N] [--seed 0] [--out DIR]

Starts two emulated upstreams (fast: Cerebras dialect, standard: OpenAI dialect) and a gateway with gateway keys in
front of them, then runs, for ``--minutes`` (or ``--max-requests`` in all), ``--concurrency`` workers split over
four keys:

* ``interactive``: streamed chat completions with ``max_tokens``, both tiers (limits: 60,000 tokens a minute, 1 USD a
  day);
* ``batch``: whole chat completions, standard tier only (300 requests a minute);
* ``agent``: Responses API turns on the fast tier (through the bridge), each continuing the last with
  ``previous_response_id``; the ids it made are what the hostile key goes after;
* ``hostile`` (20,000 tokens a minute, 0.3 USD a day), at random: the double slash (``/v1//chat/completions``) with
  ``max_tokens`` far over its limit; long streams without ``max_tokens`` that it leaves before the usage; legacy
  completions streamed through the passthrough without ``max_tokens`` or ``include_usage`` (no usage ever comes: it
  must be charged what was relayed); another
  key's response (``GET``, ``previous_response_id``, ``DELETE``) and file; bodies that every upstream answers 500 (a
  lone surrogate); 1 MiB bodies; legacy completions with ``max_tokens`` far over its limit; ``/metrics`` with its
  gateway key.

Every answer is checked against what a correct gateway gives (the hostile key's tricks: 404 or 401 or 429 or its own
500, never another key's data; the others: never a 503 ``upstreams_resting``, never a 5xx). Every five seconds it
reads the gateway's RSS and each key's charged tokens and USD (``tiergate_key_tokens_total``,
``tiergate_key_cost_usd_total``, with a scrape token). It reports per key what was sent, admitted and charged against
its limits (the most tokens charged in one UTC minute, the USD of the run), every wrong answer, the breakers opened,
and RSS over time. Writes ``tenancy.json`` and ``tenancy.md`` to ``--out`` (default ``bench/out/tenancy``). Not run in
CI; ``--minutes 0.3 --concurrency 8`` is a quick check.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs

ROOT = Path(__file__).resolve().parent.parent
PRICE = {"input": 10.0, "output": 30.0}  # USD per million tokens
LIMITS = {"interactive": {"tokens_per_minute": 60_000, "usd_per_day": 1.0},
          "batch": {"requests_per_minute": 300}, "agent": {}, "hostile": {"tokens_per_minute": 20_000,
                                                                         "usd_per_day": 0.3}}
SHARE = {"interactive": 3, "batch": 2, "agent": 2, "hostile": 3}  # of every 10 workers
TRICKS = ("double_slash", "leave_early", "stream_no_usage", "their_response", "their_file", "fails_everywhere",
          "big_body", "legacy_over", "metrics", "plain")


@dataclass
class Tally:
    """What the soak saw, per key."""

    sent: Counter[str] = field(default_factory=Counter)
    status: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    tricks: Counter[str] = field(default_factory=Counter)
    wrong: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    responses: list[str] = field(default_factory=list)  # ids the agent made
    files: list[str] = field(default_factory=list)  # ids the interactive key uploaded

    def miss(self, what: str, why: str) -> None:
        self.wrong[what] += 1
        self.examples.setdefault(what, why[:300])


def _config(fast: int, std: int, keys: dict[str, str], scrape: str) -> dict[str, Any]:
    up = {"timeouts": {"connect": 2, "idle": 5, "finish_grace": 0.5, "total": 30}, "prices": PRICE}
    return {
        "default_tier": "standard",
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": f"http://127.0.0.1:{fast}/v1", "dialect": "cerebras",
             "models": {"gpt-5.6": "gpt-5.6-wse"}, **up},
            {"name": "standard", "tier": "standard", "base_url": f"http://127.0.0.1:{std}/v1", "dialect": "openai",
             "models": {"gpt-5.6": "gpt-5.6-2026-10-01"}, **up},
        ],
        "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"}},
        "auth": {"metrics": {"sha256": [hashlib.sha256(scrape.encode()).hexdigest()]},
                 "keys": [{"name": n, "sha256": hashlib.sha256(k.encode()).hexdigest(), "limits": LIMITS[n],
                           **({"tiers": ["standard"]} if n == "batch" else {})} for n, k in keys.items()]},
    }


class Soak:
    """The load of one run (module docstring)."""

    def __init__(self, base: str, keys: dict[str, str], seed: int, tally: Tally) -> None:
        self.base, self.keys, self.tally = base, keys, tally
        self.rng = random.Random(seed)

    def _h(self, name: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[name]}"}

    async def _post(self, s: aiohttp.ClientSession, name: str, path: str, body: Any,
                    read: int | None = None) -> tuple[int, bytes]:
        """POST ``body``; with ``read``, leave after that many content events of a stream."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with s.post(self.base + path, data=data, headers={**self._h(name), "content-type": "application/json"}
                          ) as resp:
            if read is None or resp.status != 200:
                return resp.status, await resp.read()
            seen = 0
            async for line in resp.content:
                if b'"content":"' in line:
                    seen += 1
                    if seen >= read:
                        break
            return resp.status, b""

    async def interactive(self, s: aiohttp.ClientSession) -> None:
        model = self.rng.choice(("gpt-5.6-sol-fast", "gpt-5.6"))
        status, raw = await self._post(s, "interactive", "/v1/chat/completions", {
            "model": model, "stream": True, "max_tokens": 120,
            "messages": [{"role": "user", "content": "[[emulate tokens=100 tps=2000 ttft_ms=20]] help me"}]})
        self._seen("interactive", status, raw)
        if self.rng.random() < 0.05 and len(self.tally.files) < 50:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", b'{"custom_id": "x"}\n', filename="mine.jsonl")
            async with s.post(self.base + "/v1/files", data=form, headers=self._h("interactive")) as resp:
                made = await resp.json() if resp.status == 200 else {}
                if isinstance(made.get("id"), str):
                    self.tally.files.append(made["id"])

    async def batch(self, s: aiohttp.ClientSession) -> None:
        status, raw = await self._post(s, "batch", "/v1/chat/completions", {
            "model": "gpt-5.6", "max_tokens": 60,
            "messages": [{"role": "user", "content": "[[emulate tokens=50 tps=5000 ttft_ms=10]] summarise"}]})
        self._seen("batch", status, raw)

    async def agent(self, s: aiohttp.ClientSession, state: dict[str, str]) -> None:
        body: dict[str, Any] = {"model": "gpt-5.6-sol-fast", "input": "next step", "max_output_tokens": 40}
        if "last" in state:
            body["previous_response_id"] = state["last"]
        status, raw = await self._post(s, "agent", "/v1/responses", body)
        self._seen("agent", status, raw)
        if status == 200:
            state["last"] = json.loads(raw)["id"]
            self.tally.responses.append(state["last"])
            if len(self.tally.responses) > 200:
                self.tally.responses.pop(0)
            if self.rng.random() < 0.1:
                state.pop("last")  # a new run

    async def hostile(self, s: aiohttp.ClientSession) -> None:
        trick = self.rng.choice(TRICKS)
        self.tally.tricks[trick] += 1
        self.tally.sent["hostile"] += 1
        got = await getattr(self, f"_{trick}")(s)
        self.tally.status["hostile"][got[0]] += 1
        if not got[1]:
            self.tally.miss(f"hostile:{trick}", f"status {got[0]}: {got[2]!r}")

    # the hostile key's tricks: (status, right?, what came back)

    async def _double_slash(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1//chat/completions", {
            "model": "gpt-5.6", "max_tokens": 50_000, "messages": [{"role": "user", "content": "x"}]})
        return status, status == 404, raw

    async def _leave_early(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6-sol-fast", "stream": True,
            "messages": [{"role": "user", "content": "[[emulate tokens=3000 tps=20000]] go"}]}, read=2000)
        return status, status in (200, 429), raw

    async def _stream_no_usage(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        """Legacy completions streamed through the passthrough, no ``max_tokens``, no usage: all 2,000 events
        arrive (or a 429), and the key is charged them (the per-minute figures show it)."""
        status, raw = await self._post(s, "hostile", "/v1/completions", {
            "model": "gpt-5.6", "stream": True, "prompt": "[[emulate tokens=2000 tps=20000]] go on"})
        whole = raw.count(b'data: {"id"') == 2000 and raw.endswith(b"data: [DONE]\n\n")
        return status, (status == 200 and whole) or status == 429, raw[-300:]

    async def _their_response(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        if not self.tally.responses:
            return 0, True, b""
        rid = self.rng.choice(self.tally.responses)
        how = self.rng.choice(("get", "continue", "delete"))
        if how == "continue":
            status, raw = await self._post(s, "hostile", "/v1/responses", {
                "model": "gpt-5.6-sol-fast", "input": "what did they say?", "previous_response_id": rid})
            return status, status in (400, 429) and b"secret" not in raw, raw
        method = s.get if how == "get" else s.delete
        async with method(self.base + f"/v1/responses/{rid}", headers=self._h("hostile")) as resp:
            raw = await resp.read()
            return resp.status, resp.status in (404, 429), raw

    async def _their_file(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        if not self.tally.files or self.rng.random() < 0.3:
            async with s.get(self.base + "/v1/files", headers=self._h("hostile")) as resp:
                raw = await resp.read()
                theirs = any(f.encode() in raw for f in self.tally.files)
                return resp.status, resp.status in (200, 429) and not theirs, raw
        fid = self.rng.choice(self.tally.files)
        async with s.get(self.base + f"/v1/files/{fid}/content", headers=self._h("hostile")) as resp:
            raw = await resp.read()
            return resp.status, resp.status in (404, 429), raw

    async def _fails_everywhere(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6", "max_tokens": 10,
            "messages": [{"role": "user", "content": "[[emulate status=500]] \\ud800"}]})
        return status, status in (500, 429, 503), raw  # its own 500 (or its own rest): never the others'

    async def _big_body(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6", "max_tokens": 8, "messages": [{"role": "user", "content": "y" * 2**20}]})
        return status, status in (200, 429), raw

    async def _legacy_over(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/completions", {
            "model": "gpt-5.6", "prompt": "x", "max_tokens": 50_000})
        return status, status == 429, raw

    async def _metrics(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        async with s.get(self.base + "/metrics", headers=self._h("hostile")) as resp:
            raw = await resp.read()
            return resp.status, resp.status == 401 and b"tiergate_key_" not in raw, raw

    async def _plain(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6-sol-fast", "max_tokens": 50,
            "messages": [{"role": "user", "content": "[[emulate tokens=40]] hi"}]})
        return status, status in (200, 429), raw

    def _seen(self, name: str, status: int, raw: bytes) -> None:
        self.tally.sent[name] += 1
        self.tally.status[name][status] += 1
        if status >= 500 or (status == 429 and name in ("agent",)):  # never the hostile key's doing
            self.tally.miss(f"{name}:{status}", raw.decode("utf-8", "replace"))

    async def run(self, workers: int, seconds: float, max_requests: int) -> None:
        deadline = time.monotonic() + seconds
        names = [n for n, share in SHARE.items() for _ in range(share)]
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async def worker(i: int) -> None:
                name, state = names[i % len(names)], {}  # type: ignore[var-annotated]
                while time.monotonic() < deadline and sum(self.tally.sent.values()) < max_requests:
                    try:
                        if name == "agent":
                            await self.agent(s, state)
                        else:
                            await getattr(self, name)(s)
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        self.tally.miss(f"{name}:transport", repr(exc))
            await asyncio.gather(*(worker(i) for i in range(workers)))


async def _sample(base: str, scrape: str, pid: int, seconds: float, out: list[dict[str, Any]]) -> None:
    """Every 5 s: RSS, and each key's charged tokens and USD."""
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(base + "/metrics", headers={"authorization": f"Bearer {scrape}"}) as resp:
                text = await resp.text()
            row: dict[str, Any] = {"t": round(time.time(), 1), "rss_mib": round(procs.rss_bytes(pid) / 2**20, 1),
                                   "breakers_open": _metric(text, "tiergate_upstream_state", state="open")}
            for name in LIMITS:
                row[f"{name}_tokens"] = _metric(text, "tiergate_key_tokens_total", key=name)
                row[f"{name}_usd"] = round(_metric(text, "tiergate_key_cost_usd_total", key=name), 6)
            out.append(row)
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(5.0)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}", 1)[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _per_minute(samples: list[dict[str, Any]], name: str) -> float:
    """The most tokens charged to ``name`` within one UTC minute (from the 5 s samples)."""
    by_minute: dict[int, list[float]] = defaultdict(list)
    for row in samples:
        by_minute[int(row["t"] // 60)].append(row[f"{name}_tokens"])
    minutes = sorted(by_minute)
    most, before = 0.0, samples[0][f"{name}_tokens"] if samples else 0.0
    for m in minutes:
        last = by_minute[m][-1]
        most = max(most, last - before)
        before = last
    return most


async def _load(base: str, keys: dict[str, str], scrape: str, pid: int, args: argparse.Namespace,
                tally: Tally) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    soak = Soak(base, keys, args.seed, tally)
    await asyncio.gather(soak.run(args.concurrency, args.minutes * 60, args.max_requests),
                         _sample(base, scrape, pid, args.minutes * 60 + 3, samples))
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long the load runs (default 3)")
    ap.add_argument("--concurrency", type=int, default=24, help="workers in all, split over the keys (default 24)")
    ap.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "tenancy")
    args = ap.parse_args(argv)
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
        cfg_path.write_text(json.dumps(_config(ports["fast"], ports["standard"], keys, scrape), indent=1))
        gw_port = procs.free_port()
        gw = kids.start("gateway", [py, "-m", "gateway", "serve", "--config", str(cfg_path), "--port", str(gw_port),
                                    "--log-level", "warning"], args.out / "gateway.log", cwd=ROOT,
                        env={**os.environ, "GATEWAY_STATE_DIR": str(args.out / "state")})
        base = f"http://127.0.0.1:{gw_port}"
        procs.wait_http_ready(gw, base + "/readyz")
        print(f"[tenancy] {args.concurrency} workers for {args.minutes:g} min against {base}", flush=True)
        t0 = time.monotonic()
        samples = asyncio.run(_load(base, keys, scrape, gw.pid, args, tally))
        ran = time.monotonic() - t0
        alive = gw.alive()
    last = samples[-1]
    per_key = {name: {"sent": tally.sent[name], "status": dict(sorted(tally.status[name].items())),
                      "limits": LIMITS[name], "tokens_charged": last[f"{name}_tokens"],
                      "usd_charged": last[f"{name}_usd"], "most_tokens_in_one_minute": _per_minute(samples, name)}
               for name in LIMITS}
    result = {"minutes": round(ran / 60, 2), "concurrency": args.concurrency, "seed": args.seed,
              "per_key": per_key, "hostile_tricks": dict(tally.tricks), "wrong": dict(tally.wrong),
              "wrong_examples": tally.examples, "breakers_opened": max(r["breakers_open"] for r in samples),
              "rss_mib": [(round(r["t"] - samples[0]["t"]), r["rss_mib"]) for r in samples],
              "gateway_alive_at_end": alive}
    (args.out / "tenancy.json").write_text(json.dumps(result, indent=1))
    md = [f"# Tenancy soak: {args.concurrency} workers for {ran / 60:.1f} min, seed {args.seed}", "",
          "| key | sent | statuses | limits | tokens charged | most tokens in a minute | USD charged |",
          "|---|---:|---|---|---:|---:|---:|"]
    for name, k in per_key.items():
        md.append(f"| {name} | {k['sent']} | {k['status']} | {k['limits']} | {k['tokens_charged']:.0f} | "
                  f"{k['most_tokens_in_one_minute']:.0f} | {k['usd_charged']:.4f} |")
    md += ["", f"hostile tricks: {dict(tally.tricks)}", f"breakers opened: {result['breakers_opened']:.0f}",
           f"wrong answers: {sum(tally.wrong.values())} {dict(tally.wrong)}", "",
           "RSS (MiB) over time: " + ", ".join(f"{t}s {m}" for t, m in result["rss_mib"])]
    md += [f"- {k}: {v}" for k, v in tally.examples.items()]
    (args.out / "tenancy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if not tally.wrong and alive else 1


if __name__ == "__main__":
    raise SystemExit(main())
