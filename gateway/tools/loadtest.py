"""``tiergate bench``: send a mix of real-looking chat completions through a running gateway and compare the tiers.

Each request streams (``stream_options.include_usage``, so the completion tokens come from the upstream's usage)
and is timed at the client: TTFT is the time from sending the request to the first token-bearing chunk; decode
speed uses the gateway's formula, (t_last - t_first) / (completion_tokens - first chunk's tokens), and tokens/s
is its inverse. Requests are grouped by the ``x-tiergate-tier`` response header (by model when the server is not
Tiergate). Cost comes from the gateway's ``/metrics`` (``tiergate_cost_usd_total``, before and after the run;
other traffic at the same time is counted too) when it is reachable.

The client is aiohttp (a runtime dependency), so the command works from a plain install; every loop is bounded
by ``--requests`` and every request by ``--timeout``. The chart is one self-contained HTML file: inline SVG, no
scripts.
"""

from __future__ import annotations

import asyncio
import html
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import orjson

from gateway.stream.stats import has_token

TIER_COLOURS = {"fast": "#e4572e", "standard": "#3a7ca5"}
OTHER_COLOURS = ("#6a994e", "#8e6c8a", "#bc6c25", "#577590")

PROMPTS = (
    "Write a Python function that parses an ISO 8601 duration like P3DT4H12M into seconds, with tests.",
    "Summarise the trade-offs between optimistic and pessimistic locking for a busy checkout service.",
    "Explain to a new on-call engineer how to read a p95 latency graph and when to page someone.",
    "Draft a short, friendly reply to a customer whose order arrived two days late.",
    "Given a table orders(id, user_id, total, created_at), write SQL for each user's rolling 30-day spend.",
    "What are three ways to make a React list of 10,000 rows scroll smoothly? Keep it practical.",
    "Translate into French: 'The meeting moved to Thursday at 10; bring the quarterly numbers.'",
    "Refactor this into idiomatic Go and explain each change: for i := 0; i < len(xs); i++ { sum = sum + xs[i] }",
    "Plan a three-step agent that reads a failing CI log, finds the test, and proposes a one-line fix.",
    "Give me a regex that matches UK postcodes, and two examples it should reject.",
)
SYSTEM = "You are a helpful, concise assistant."


@dataclass
class Result:
    """One request as the client saw it. Times in seconds; ``tpot`` None when it cannot be computed."""

    model: str
    group: str = ""
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    duration: float = 0.0
    prompt_tokens: int | None = None  # from the stream's usage, with the cached part of them
    cached_tokens: int | None = None
    text: list[str] = field(default_factory=list)  # the first choice's content deltas (an agent loop sends it back)


@dataclass
class TierStats:
    """Aggregates of one group (tier) of results."""

    name: str
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def ttfts(self) -> list[float]:
        return sorted(r.ttft for r in self.ok if r.ttft is not None)

    @property
    def tpots(self) -> list[float]:
        return sorted(r.tpot for r in self.ok if r.tpot is not None)

    @property
    def tps(self) -> list[float]:
        return sorted(1.0 / t for t in self.tpots if t > 0)

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens or 0 for r in self.ok)

    @property
    def mean_duration(self) -> float | None:
        """Mean seconds from sending a request to its stream's end, over the successful requests."""
        ok = self.ok
        return sum(r.duration for r in ok) / len(ok) if ok else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of sorted ``values`` by linear interpolation; None when empty."""
    if not values:
        return None
    pos = (len(values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def parse_mix(text: str) -> list[tuple[str, float]]:
    """``"model:weight,model:weight"`` -> [(model, weight)]; a model without a weight counts 1.

    Raises:
        ValueError: empty mix, bad weight, or weights that do not add up to more than 0.
    """
    mix = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        model, sep, weight = part.rpartition(":")
        if not sep or not model:
            model, weight = part, "1"
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"--mix: bad weight {weight!r} for {model!r}") from None
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"--mix: weight of {model!r} must be a finite number >= 0")
        mix.append((model, w))
    if not mix or sum(w for _, w in mix) <= 0:
        raise ValueError("--mix: give at least one model with a weight > 0, e.g. gpt-5.6-sol-fast:0.5,gpt-5.6:0.5")
    return mix


def plan(mix: list[tuple[str, float]], n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (model, prompt) pairs drawn from the mix's weights (shuffled, reproducible with ``seed``)."""
    rng = random.Random(seed)
    total = sum(w for _, w in mix)
    counts = [int(n * w / total) for _, w in mix]
    by_rest = sorted(range(len(mix)), key=lambda i: n * mix[i][1] / total - counts[i], reverse=True)
    for i in by_rest[: n - sum(counts)]:
        counts[i] += 1
    models = [m for (m, _), c in zip(mix, counts, strict=True) for _ in range(c)]
    rng.shuffle(models)
    return [(m, rng.choice(PROMPTS)) for m in models]


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
              timeout: float) -> Result:
    """Stream one chat completion of ``prompt`` and time it at the client."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]}
    return await send(session, url, body, timeout)


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float,
               headers: dict[str, str] | None = None) -> Result:
    """Stream the chat completion ``body`` (with ``headers``) and time it at the client (module docstring)."""
    model = str(body.get("model"))
    res = Result(model)
    t0 = time.perf_counter()
    first: float | None = None
    last: float | None = None
    try:
        async with asyncio.timeout(timeout), session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            res.status = resp.status
            res.group = resp.headers.get("x-tiergate-tier") or f"model {model}"
            if resp.status != 200:
                res.error = f"HTTP {resp.status}"
                await resp.read()
                return res
            first, last = await _read_events(resp, res)
    except TimeoutError:
        res.error = "timeout"
    except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
        res.error = type(exc).__name__
    res.duration = time.perf_counter() - t0
    res.group = res.group or f"model {model}"
    if first is not None:
        res.ttft = first - t0
    n, chunks = res.completion_tokens, res.chunks
    if res.error is None and first is not None and last is not None and n and chunks >= 2 and n >= chunks \
            and last > first:
        res.tpot = (last - first) * chunks / (n * (chunks - 1))
    if res.error is None and first is None:
        res.error = "no tokens"
    return res


async def _read_events(resp: aiohttp.ClientResponse, res: Result) -> tuple[float | None, float | None]:
    """Read a stream's events into ``res`` (completion tokens from usage, token-bearing chunks, an in-band error);
    returns the arrival times of the first and last token-bearing chunk, with the gateway's token test."""
    first = last = None
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buf += data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                payload = line[5:].strip() if line.startswith(b"data:") else b"[DONE]"
                if payload == b"[DONE]":
                    continue
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    res.error = "stream error: " + str((chunk["error"] or {}).get("code") or "unknown")
                    continue
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    _read_usage(usage, res)
                choices = chunk.get("choices")
                if has_token(choices):
                    res.chunks += 1
                    first = first if first is not None else now
                    last = now
                    delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
                    content = delta.get("content") if isinstance(delta, dict) else None
                    if isinstance(content, str):
                        res.text.append(content)
    return first, last


def _read_usage(usage: dict[str, Any], res: Result) -> None:
    """A stream's usage into ``res``: completion, prompt and cached prompt tokens (where they are counts)."""
    if isinstance(usage.get("completion_tokens"), int):
        res.completion_tokens = usage["completion_tokens"]
    if isinstance(usage.get("prompt_tokens"), int):
        res.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    res.cached_tokens = cached if isinstance(cached, int) else 0 if res.prompt_tokens is not None else None


async def fetch_costs(session: aiohttp.ClientSession, metrics_url: str) -> dict[str, float] | None:
    """Tier -> USD from ``tiergate_cost_usd_total`` (plus ``unpriced:TIER`` counts), or None if unreachable."""
    try:
        async with asyncio.timeout(5), session.get(metrics_url) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^tiergate_(cost_usd|unpriced_requests)_total\{(.*)\} (\S+)$', line)
        if m:
            tier = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))).get("tier", "")
            key = tier if m.group(1) == "cost_usd" else f"unpriced:{tier}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def run(base_url: str, api_key: str, mix: list[tuple[str, float]], requests: int, concurrency: int,
              max_tokens: int, timeout: float, seed: int, progress: TextIO | None) -> tuple[list[Result],
                                                                                            dict[str, float] | None]:
    """Send the planned requests with at most ``concurrency`` in flight; returns the results and the cost delta."""
    url = base_url.rstrip("/") + "/chat/completions"
    metrics_url = re.sub(r"/v1/?$", "", base_url.rstrip("/")) + "/metrics"
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json",
               "user-agent": "tiergate-bench"}
    todo = plan(mix, requests, seed)
    results: list[Result] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        before = await fetch_costs(session, metrics_url)
        queue = list(reversed(todo))
        started = time.monotonic()

        async def worker() -> None:
            while queue:
                model, prompt = queue.pop()
                results.append(await one(session, url, model, prompt, max_tokens, timeout))
                if progress is not None:
                    _progress(progress, len(results), len(todo), sum(r.error is not None for r in results),
                              time.monotonic() - started)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(todo))))))
        if progress is not None:
            progress.write("\n")
            progress.flush()
        after = await fetch_costs(session, metrics_url) if before is not None else None
    cost = None
    if before is not None and after is not None:
        cost = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return results, cost


def _progress(out: TextIO, done: int, total: int, errors: int, elapsed: float) -> None:
    width = 30
    filled = int(width * done / total) if total else width
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {errors} errors, "
              f"{elapsed:.1f} s")
    out.flush()


def group(results: list[Result]) -> list[TierStats]:
    """Results by tier: ``fast`` then ``standard`` then anything else, alphabetically."""
    groups: dict[str, TierStats] = {}
    for r in results:
        groups.setdefault(r.group, TierStats(r.group)).results.append(r)
    order = {"fast": 0, "standard": 1}
    return sorted(groups.values(), key=lambda g: (order.get(g.name, 2), g.name))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def summary(stats: list[TierStats], cost: dict[str, float] | None) -> dict[str, Any]:
    """A JSON-able summary per tier (what the table and ``--json`` show)."""
    out: dict[str, Any] = {}
    for s in stats:
        tier_cost = None if cost is None else cost.get(s.name)
        out[s.name] = {
            "requests": len(s.results), "errors": s.errors,
            "error_kinds": sorted({r.error for r in s.results if r.error}),
            "ttft_p50_s": percentile(s.ttfts, 0.5), "ttft_p95_s": percentile(s.ttfts, 0.95),
            "tokens_per_s_p50": percentile(s.tps, 0.5), "tokens_per_s_p95": percentile(s.tps, 0.95),
            "time_per_output_token_p50_s": percentile(s.tpots, 0.5), "output_tokens": s.output_tokens,
            "cost_usd": tier_cost, "unpriced_requests": None if cost is None else cost.get(f"unpriced:{s.name}", 0.0),
            "duration_mean_s": s.mean_duration,
            "cost_per_request_usd": tier_cost / len(s.ok) if tier_cost and s.ok else None,
            "cost_per_1k_output_tokens_usd": tier_cost * 1000 / s.output_tokens if tier_cost and s.output_tokens
            else None,
        }
    return out


def premium(tiers: dict[str, Any]) -> dict[str, Any] | None:
    """Whether the fast tier earned its premium in this run, from its own figures: per request, the seconds the fast
    tier saved against the standard one (mean duration), the extra USD it cost (mean cost), and their ratio, seconds
    saved per extra dollar. None unless both tiers answered and were priced."""
    fast, std = tiers.get("fast"), tiers.get("standard")
    if not fast or not std:
        return None
    saved = None if fast["duration_mean_s"] is None or std["duration_mean_s"] is None else (
        std["duration_mean_s"] - fast["duration_mean_s"])
    f_cost, s_cost = fast["cost_per_request_usd"], std["cost_per_request_usd"]
    extra = None if f_cost is None or s_cost is None else f_cost - s_cost
    ratio = saved / extra if saved is not None and extra is not None and extra > 0 else None
    return {"seconds_saved_per_request": saved, "extra_usd_per_request": extra, "seconds_saved_per_extra_usd": ratio}


def premium_line(p: dict[str, Any] | None) -> str:
    """The premium in words (the table's last line and the chart's caption)."""
    if p is None or p["seconds_saved_per_request"] is None:
        return "premium: n/a (the run needs requests answered by both tiers)"
    text = f"premium: the fast tier saved {p['seconds_saved_per_request']:.2f} s per request"
    if p["extra_usd_per_request"] is None:
        return text + "; cost n/a (unpriced, or /metrics unreachable)"
    text += f" for {p['extra_usd_per_request'] * 1000:+.4f} USD per 1,000 requests"
    if p["seconds_saved_per_extra_usd"] is not None:
        text += f": {p['seconds_saved_per_extra_usd']:,.0f} s saved per extra USD"
    return text


def table(stats: list[TierStats], cost: dict[str, float] | None) -> str:
    """The per-tier table printed at the end."""
    rows = [("tier", "requests", "errors", "TTFT p50 ms", "TTFT p95 ms", "tok/s p50", "tok/s p95", "TPOT p50 ms",
             "out tokens", "cost USD", "USD/1k out", "USD/req")]
    for name, s in summary(stats, cost).items():
        if cost is None:
            usd = "n/a"
        elif s["cost_usd"] is None or (s["cost_usd"] == 0 and s["unpriced_requests"]):
            usd = f"unpriced ({s['unpriced_requests']:.0f})" if s["unpriced_requests"] else "-"
        else:
            usd = f"{s['cost_usd']:.6f}"
        rows.append((name, str(s["requests"]), str(s["errors"]), _ms(s["ttft_p50_s"]), _ms(s["ttft_p95_s"]),
                     _num(s["tokens_per_s_p50"]), _num(s["tokens_per_s_p95"]),
                     _ms(s["time_per_output_token_p50_s"]), str(s["output_tokens"]), usd,
                     _usd(s["cost_per_1k_output_tokens_usd"]), _usd(s["cost_per_request_usd"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    return "\n".join([*lines, premium_line(premium(summary(stats, cost)))])


def _usd(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"


# --- the HTML chart -------------------------------------------------------------------------------------------

def _colour(name: str, i: int) -> str:
    return TIER_COLOURS.get(name, OTHER_COLOURS[i % len(OTHER_COLOURS)])


def _ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks over [lo, hi] on a log scale."""
    out = []
    e = math.floor(math.log10(lo))
    while 10 ** e <= hi * 1.0001:
        for m in (1, 2, 5):
            v = m * 10 ** e
            if lo * 0.9999 <= v <= hi * 1.0001:
                out.append(v)
        e += 1
    return out


def _nice(v: float, *, down: bool) -> float:
    """The nearest 1-2-5 value below (``down``) or above ``v``."""
    e = math.floor(math.log10(v))
    steps = [m * 10 ** k for k in (e - 1, e, e + 1) for m in (1, 2, 5)]
    return float(max(t for t in steps if t <= v) if down else min(t for t in steps if t >= v))


def _strip_svg(title: str, unit: str, series: list[tuple[str, str, list[float]]], better: str) -> str:
    """A log-scale strip plot: one row per tier, one dot per request, p50 and p95 marks."""
    values = [v for _, _, vs in series for v in vs if v > 0]
    w, row_h, left, right, top = 560, 66, 92, 24, 44
    h = top + row_h * max(1, len(series)) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
             f'role="img" aria-label="{html.escape(title)}">',
             f'<text x="{left}" y="20" class="t">{html.escape(title)}</text>',
             f'<text x="{w - right}" y="20" class="n" text-anchor="end">log scale; {html.escape(better)}</text>']
    if not values:
        parts.append(f'<text x="{left}" y="{top + 24}" class="n">no data</text></svg>')
        return "".join(parts)
    lo = _nice(min(values) / 1.3, down=True)
    hi = _nice(max(values) * 1.3, down=False)

    def x(v: float) -> float:
        return left + (w - left - right) * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    bottom = top + row_h * len(series)
    for t in _ticks(lo, hi):
        parts.append(f'<line x1="{x(t):.1f}" y1="{top - 4}" x2="{x(t):.1f}" y2="{bottom}" class="g"/>'
                     f'<text x="{x(t):.1f}" y="{bottom + 16}" class="n" text-anchor="middle">{t:g}</text>')
    parts.append(f'<text x="{(left + w - right) / 2:.0f}" y="{bottom + 34}" class="n" text-anchor="middle">'
                 f'{html.escape(unit)}</text>')
    rng = random.Random(7)
    for i, (name, colour, vs) in enumerate(series):
        cy = top + row_h * i + row_h / 2
        parts.append(f'<text x="{left - 10}" y="{cy + 4:.1f}" class="l" text-anchor="end">{html.escape(name)}</text>')
        for v in vs:
            if v > 0:
                parts.append(f'<circle cx="{x(v):.1f}" cy="{cy + rng.uniform(-12, 12):.1f}" r="3.2" fill="{colour}" '
                             f'fill-opacity="0.55"/>')
        ordered = sorted(v for v in vs if v > 0)
        # p50 labelled above the row, to the left of its mark; p95 below it, to the right: they never collide
        for q, dash, dy, dx, anchor in ((0.5, "", -21, -3, "end"), (0.95, ' stroke-dasharray="3 2"', 29, 3, "start")):
            p = percentile(ordered, q)
            if p is not None:
                parts.append(f'<line x1="{x(p):.1f}" y1="{cy - 17:.1f}" x2="{x(p):.1f}" y2="{cy + 17:.1f}" '
                             f'stroke="#222" stroke-width="2"{dash}/>'
                             f'<text x="{x(p) + dx:.1f}" y="{cy + dy:.1f}" class="n" text-anchor="{anchor}">'
                             f'p{int(q * 100)} {p:.3g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bars_svg(title: str, unit: str, bars: list[tuple[str, str, float | None]]) -> str:
    """A horizontal bar per tier (linear scale from 0); a missing value is written as n/a."""
    w, row_h, left, right, top = 560, 40, 92, 90, 44
    h = top + row_h * max(1, len(bars)) + 30
    top_value = max((v for _, _, v in bars if v), default=0.0)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             f'aria-label="{html.escape(title)}">', f'<text x="{left}" y="20" class="t">{html.escape(title)}</text>',
             f'<text x="{w - 10}" y="20" class="n" text-anchor="end">lower is cheaper</text>']
    for i, (name, colour, v) in enumerate(bars):
        y = top + row_h * i
        parts.append(f'<text x="{left - 10}" y="{y + 20}" class="l" text-anchor="end">{html.escape(name)}</text>')
        if v is None or top_value <= 0:
            parts.append(f'<text x="{left}" y="{y + 20}" class="n">n/a (unpriced)</text>')
            continue
        length = (w - left - right) * v / top_value
        parts.append(f'<rect x="{left}" y="{y + 6}" width="{length:.1f}" height="20" fill="{colour}" '
                     f'fill-opacity="0.8"/><text x="{left + length + 6:.1f}" y="{y + 20}" class="n">{v:.4g}</text>')
    parts.append(f'<text x="{left}" y="{h - 10}" class="n">{html.escape(unit)}</text></svg>')
    return "".join(parts)


def render_html(stats: list[TierStats], cost: dict[str, float] | None, meta: dict[str, Any]) -> str:
    """The self-contained report: TTFT and tokens/s per tier as inline SVG, and the table."""
    colours = {s.name: _colour(s.name, i) for i, s in enumerate(stats)}
    ttft = _strip_svg("Time to first token", "milliseconds (client side)",
                      [(s.name, colours[s.name], [v * 1000 for v in s.ttfts]) for s in stats], "lower is better")
    tps = _strip_svg("Decode speed", "output tokens per second (client side)",
                     [(s.name, colours[s.name], s.tps) for s in stats], "higher is better")
    tiers = summary(stats, cost)
    costs = _bars_svg("Cost per 1,000 output tokens", "USD (from the gateway's tiergate_cost_usd_total)",
                      [(name, colours[name], t["cost_per_1k_output_tokens_usd"]) for name, t in tiers.items()])
    rows = []
    for name, s in tiers.items():
        usd = "n/a" if cost is None else ("unpriced" if s["cost_usd"] in (None, 0) and s["unpriced_requests"] else
                                          f"{(s['cost_usd'] or 0):.6f}")
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            name, s["requests"], s["errors"], _ms(s["ttft_p50_s"]), _ms(s["ttft_p95_s"]), _num(s["tokens_per_s_p50"]),
            _num(s["tokens_per_s_p95"]), _ms(s["time_per_output_token_p50_s"]), s["output_tokens"], usd,
            _usd(s["cost_per_1k_output_tokens_usd"]), _usd(s["cost_per_request_usd"]))) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("tier", "requests", "errors", "TTFT p50 ms", "TTFT p95 ms",
                                              "tokens/s p50", "tokens/s p95", "TPOT p50 ms", "output tokens",
                                              "cost USD", "USD per 1k output", "USD per request"))
    verdict = html.escape(premium_line(premium(tiers)))
    info = html.escape(f"{meta['requests']} requests, concurrency {meta['concurrency']}, mix {meta['mix']}, "
                       f"max {meta['max_tokens']} tokens, against {meta['base_url']} at {meta['when']}; "
                       f"{meta['elapsed']:.1f} s")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tiergate bench</title>
<style>
body {{ font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }} p.m {{ color: #555; margin: 0 0 16px; }}
p.p {{ font-weight: 600; margin: 16px 0 0; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 16px; }}
svg {{ background: #fafafa; border: 1px solid #ddd; }}
svg .t {{ font-size: 15px; font-weight: 600; }} svg .l {{ font-size: 13px; font-weight: 600; }}
svg .n {{ font-size: 11px; fill: #555; }} svg .g {{ stroke: #e3e3e3; }}
table {{ border-collapse: collapse; margin-top: 16px; }}
td, th {{ border: 1px solid #ddd; padding: 4px 8px; text-align: right; }} td:first-child {{ text-align: left; }}
</style></head><body>
<h1>tiergate bench: fast tier vs standard tier</h1>
<p class="m">{info}</p>
<div class="charts">{ttft}{tps}{costs}</div>
<p class="p">{verdict}</p>
<table><tr>{head}</tr>{"".join(rows)}</table>
<p class="m">Each dot is one request; solid mark p50, dashed p95. TTFT: request sent to first token-bearing chunk.
Decode speed: 1 / ((t_last - t_first) / (completion tokens - first chunk's tokens)), from the stream's usage.</p>
</body></html>
"""


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
    if args.out:
        Path(args.out).write_text(render_html(stats, cost, meta), encoding="utf-8")
        print(f"chart: {args.out}")
    if args.json:
        tiers = summary(stats, cost)
        Path(args.json).write_bytes(orjson.dumps({"meta": meta, "tiers": tiers, "premium": premium(tiers)},
                                                 option=orjson.OPT_INDENT_2))
    return 1 if results and all(r.error is not None for r in results) else 0
