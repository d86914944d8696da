"""``tiergate bench``'s chart: one self-contained HTML file (inline SVG, no scripts): TTFT and decode speed per
tier as log-scale strip plots, cost per 1,000 output tokens as bars, the premium and the table."""

from __future__ import annotations

import html
import math
import random
from typing import Any

from gateway.tools.loadtest.figures import (
    TierStats,
    as_ms,
    as_num,
    as_usd,
    percentile,
    premium,
    premium_line,
    summary,
)

# both pages' stylesheet (render_html, render_agent_html)
STYLE = """body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } p.m { color: #555; margin: 0 0 16px; }
p.p { font-weight: 600; margin: 16px 0 0; }
.charts { display: flex; flex-wrap: wrap; gap: 16px; }
svg { background: #fafafa; border: 1px solid #ddd; }
svg .t { font-size: 15px; font-weight: 600; } svg .l { font-size: 13px; font-weight: 600; }
svg .n { font-size: 11px; fill: #555; } svg .g { stroke: #e3e3e3; }
table { border-collapse: collapse; margin-top: 16px; }
td, th { border: 1px solid #ddd; padding: 4px 8px; text-align: right; } td:first-child { text-align: left; }"""
TIER_COLOURS = {"fast": "#e4572e", "standard": "#3a7ca5"}
OTHER_COLOURS = ("#6a994e", "#8e6c8a", "#bc6c25", "#577590")


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


def _bars_svg(title: str, unit: str, bars: list[tuple[str, str, float | None]], better: str = "lower is cheaper",
              missing: str = "n/a (unpriced)", whiskers: dict[str, tuple[float, float]] | None = None) -> str:
    """A horizontal bar per row (linear scale from 0); a missing value is written as ``missing``; ``whiskers``: an
    interval drawn over the row's bar."""
    w, row_h, left, right, top = 560, 40, 92, 90, 44
    h = top + row_h * max(1, len(bars)) + 30
    top_value = max([v for _, _, v in bars if v] + [hi for _, hi in (whiskers or {}).values()], default=0.0)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             f'aria-label="{html.escape(title)}">', f'<text x="{left}" y="20" class="t">{html.escape(title)}</text>',
             f'<text x="{w - 10}" y="20" class="n" text-anchor="end">{html.escape(better)}</text>']
    for i, (name, colour, v) in enumerate(bars):
        y = top + row_h * i
        parts.append(f'<text x="{left - 10}" y="{y + 20}" class="l" text-anchor="end">{html.escape(name)}</text>')
        if v is None or v < 0 or top_value <= 0:
            parts.append(f'<text x="{left}" y="{y + 20}" class="n">{html.escape(missing)}</text>')
            continue
        scale = (w - left - right) / top_value
        length = scale * v
        parts.append(f'<rect x="{left}" y="{y + 6}" width="{length:.1f}" height="20" fill="{colour}" '
                     f'fill-opacity="0.8"/><text x="{left + length + 6:.1f}" y="{y + 20}" class="n">{v:.4g}</text>')
        if whiskers and name in whiskers:
            lo, hi = (max(0.0, b) * scale + left for b in whiskers[name])
            parts.append(f'<path d="M{lo:.1f} {y + 16}H{hi:.1f}M{lo:.1f} {y + 10}V{y + 22}M{hi:.1f} {y + 10}V{y + 22}" '
                         'stroke="#222" fill="none"/>')
    parts.append(f'<text x="{left}" y="{h - 10}" class="n">{html.escape(unit)}</text></svg>')
    return "".join(parts)


def render_html(stats: list[TierStats], cost: dict[str, float] | None, meta: dict[str, Any]) -> str:
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
            name, s["requests"], s["errors"], as_ms(s["ttft_p50_s"]), as_ms(s["ttft_p95_s"]),
            as_num(s["tokens_per_s_p50"]), as_num(s["tokens_per_s_p95"]), as_ms(s["time_per_output_token_p50_s"]),
            s["output_tokens"], usd, as_usd(s["cost_per_1k_output_tokens_usd"]), as_usd(s["cost_per_request_usd"])))
            + "</tr>")
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
{STYLE}
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


def _steps_svg(title: str, unit: str, series: list[tuple[str, str, list[float | None]]]) -> str:
    """A line per tier over the step index (linear scale from 0): how a value moves as the run's prompt grows."""
    values = [v for _, _, vs in series for v in vs if v is not None]
    w, h, left, right, top, bottom = 560, 240, 60, 24, 44, 36
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             f'aria-label="{html.escape(title)}">', f'<text x="{left}" y="20" class="t">{html.escape(title)}</text>']
    steps = max((len(vs) for _, _, vs in series), default=0)
    if not values or steps < 1:
        parts.append(f'<text x="{left}" y="{top + 24}" class="n">no data</text></svg>')
        return "".join(parts)
    top_value = _nice(max(values), down=False) if max(values) > 0 else 1.0

    def xy(i: int, v: float) -> tuple[float, float]:
        x = left + (w - left - right) * (i / (steps - 1) if steps > 1 else 0.5)
        return x, h - bottom - (h - top - bottom) * v / top_value

    for t in (0.0, top_value / 2, top_value):
        _, y = xy(0, t)
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y:.1f}" y2="{y:.1f}" class="g"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" class="n" text-anchor="end">{t:.3g}</text>')
    for i in range(steps):
        x, _ = xy(i, 0.0)
        parts.append(f'<text x="{x:.1f}" y="{h - bottom + 16}" class="n" text-anchor="middle">{i + 1}</text>')
    for k, (name, colour, vs) in enumerate(series):
        points = [xy(i, v) for i, v in enumerate(vs) if v is not None]
        parts.append(f'<polyline points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}" fill="none" '
                     f'stroke="{colour}" stroke-width="2"/>')
        parts.append(f'<text x="{w - right}" y="{34 + 14 * k}" class="l" fill="{colour}" text-anchor="end">'
                     f'{html.escape(name)}</text>')
    parts.append(f'<text x="{left}" y="{h - 6}" class="n">{html.escape(unit)}</text></svg>')
    return "".join(parts)


def render_agent_html(tiers: dict[str, Any], steps: int, premium_text: str, estimate_text: str) -> str:
    """``tiergate bench --agent-loop``'s chart: run time per tier, step TTFT by step index, and the seconds saved per
    run as measured beside the gateway's own estimate (with its interval)."""
    colours = {name: _colour(name, i) for i, name in enumerate(tiers)}
    walls = _bars_svg("Agent run, mean wall time", "seconds per run (client side)",
                      [(n, colours[n], t["run_wall_mean_s"]) for n, t in tiers.items()], "lower is better", "n/a")
    ttft = _steps_svg("Step TTFT p50 by step", "step of the run; seconds (client side)",
                      [(n, colours[n], t["step_ttft_p50_by_step_s"]) for n, t in tiers.items()])
    fast, std = tiers.get("fast"), tiers.get("standard")
    measured = (std["run_wall_mean_s"] - fast["run_wall_mean_s"] if fast and std and fast["run_wall_mean_s"]
                is not None and std["run_wall_mean_s"] is not None else None)
    est = (fast or {}).get("estimate") or {}
    interval = est.get("interval_seconds_per_run")
    saved = _bars_svg("Seconds the fast tier saved per run", "measured here; the gateway's estimate, with its interval",
                      [("measured", "#555555", measured),
                       ("estimate", TIER_COLOURS["fast"], est.get("seconds_per_run"))],
                      "should agree", "n/a (not enough data)",
                      {"estimate": (interval[0], interval[1])} if interval else None)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
        n, t["runs"], t["failed_runs"], as_num(t["run_wall_mean_s"]), as_ms(t["step_ttft_p50_s"]),
        "-" if t["cache_hit_ratio"] is None else f"{t['cache_hit_ratio']:.1%}", as_usd(t["cost_per_run_usd"])))
        + "</tr>" for n, t in tiers.items())
    head = "".join(f"<th>{h}</th>" for h in ("tier", "runs", "failed", "run s mean", "step TTFT p50 ms", "cache hit",
                                              "USD per run"))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tiergate bench --agent-loop</title>
<style>
{STYLE}
</style></head><body>
<h1>tiergate bench: agent runs of {steps} steps, fast tier vs standard tier</h1>
<div class="charts">{walls}{ttft}{saved}</div>
<p class="p">{html.escape(premium_text)}</p>
<p class="p">{html.escape(estimate_text)}</p>
<table><tr>{head}</tr>{rows}</table>
</body></html>
"""
