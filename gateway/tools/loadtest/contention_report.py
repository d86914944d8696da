"""``tiergate bench --contention``'s figures: the per-class rows and per-mode totals, as a markdown table, JSON and an
SVG chart (no dependencies), and the command itself (:func:`main`)."""

from __future__ import annotations

import html
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.tools.loadtest.contention import CLASSES, Mode, Sizes, run
from gateway.tools.loadtest.figures import percentile

COLOURS = {"FCFS": "#8d99ae", "scheduled": "#e4572e"}


def rows(modes: list[Mode]) -> list[dict[str, Any]]:
    """One row per class and mode (a class's modes side by side)."""
    out = []
    for cls in CLASSES:
        for mode in modes:
            sent = [s for s in mode.sent if s.cls == cls]
            ttfts = sorted(s.result.ttft for s in sent if s.result.ttft is not None)
            timed = [s for s in sent if s.deadline_ms is not None]
            p50, p95 = percentile(ttfts, 0.5), percentile(ttfts, 0.95)
            out.append({"class": cls, "mode": mode.name, "requests": len(sent),
                        "fast": sum(s.fast for s in sent) / len(sent) if sent else 0.0,
                        "budget": mode.budget_used(cls),
                        "ttft_p50_ms": None if p50 is None else p50 * 1000,
                        "ttft_p95_ms": None if p95 is None else p95 * 1000,
                        "deadline_hit": sum(s.hit for s in timed) / len(timed) if timed else None,
                        "http_429": sum(s.result.status == 429 for s in sent),
                        "errors": sum(s.result.error is not None for s in sent)})
    return out


def totals(modes: list[Mode]) -> list[dict[str, Any]]:
    """Per mode: the fast budget used (and against FCFS's), cost, the clients' 429s and errors."""
    base = modes[0].budget_used() if modes else 0.0
    return [{"mode": m.name, "fast_tokens": m.fast_tokens(), "budget": m.budget, "elapsed_s": round(m.elapsed, 1),
             "budget_used": m.budget_used(), "vs_fcfs": m.budget_used() / base if base else None,
             "cost_usd": None if m.cost is None else sum(v for k, v in m.cost.items() if not k.startswith("unpriced")),
             "http_429": sum(s.result.status == 429 for s in m.sent),
             "errors": sum(s.result.error is not None for s in m.sent)} for m in modes]


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.0f} %"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f} ms"


def table(per_class: list[dict[str, Any]], per_mode: list[dict[str, Any]]) -> str:
    """Both tables in markdown."""
    lines = ["| class | mode | requests | served fast | of the fast budget | TTFT p50 | TTFT p95 | deadline hit | 429s "
             "| errors |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['class']} | {r['mode']} | {r['requests']} | {_pct(r['fast'])} | {_pct(r['budget'])} | "
              f"{_ms(r['ttft_p50_ms'])} | "
              f"{_ms(r['ttft_p95_ms'])} | {_pct(r['deadline_hit'])} | {r['http_429']} | {r['errors']} |"
              for r in per_class]
    lines += ["", "| mode | fast tokens served | fast budget used | vs FCFS | cost | 429s seen by clients |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {t['mode']} | {t['fast_tokens']:,} of {t['budget']:,}/min | {_pct(t['budget_used'])} | "
              f"{_pct(t['vs_fcfs'])} | " + ("–" if t["cost_usd"] is None else f"${t['cost_usd']:.4f}")
              + f" | {t['http_429']} |" for t in per_mode]
    return "\n".join(lines)


def _panel(x0: int, title: str, per_class: list[dict[str, Any]], key: str, scale: float, unit: str) -> list[str]:
    """Grouped bars, one group per class, one bar per mode."""
    w, h, base = 250, 150, 190
    parts = [f'<text x="{x0}" y="24" font-size="13" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{x0}" y1="{base}" x2="{x0 + w}" y2="{base}" stroke="#333"/>']
    for i, cls in enumerate(CLASSES):
        gx = x0 + 10 + i * (w // len(CLASSES))
        for j, r in enumerate(r for r in per_class if r["class"] == cls):
            v = r[key] or 0.0
            bh = h * min(v / scale, 1.0) if scale else 0.0
            x = gx + j * 30
            parts.append(f'<rect x="{x}" y="{base - bh:.1f}" width="26" height="{bh:.1f}" '
                         f'fill="{COLOURS.get(r["mode"], "#577590")}"/>')
            label = f"{v * 100:.0f}%" if unit == "%" else f"{v:,.0f}"
            parts.append(f'<text x="{x + 13}" y="{base - bh - 4:.1f}" font-size="10" '
                         f'text-anchor="middle">{label}</text>')
        parts.append(f'<text x="{gx + 28}" y="{base + 16}" font-size="11" text-anchor="middle">{cls}</text>')
    return parts


def svg(per_class: list[dict[str, Any]], per_mode: list[dict[str, Any]]) -> str:
    """The chart: share served fast and TTFT p95 per class, FCFS against scheduled; the budget used in the legend."""
    p95 = max([r["ttft_p95_ms"] or 0.0 for r in per_class] + [1.0])
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="600" height="250" viewBox="0 0 600 250" '
             'font-family="sans-serif" role="img" aria-label="contention: FCFS against scheduled">',
             '<rect width="600" height="250" fill="white"/>',
             *_panel(20, "share served by the fast tier", per_class, "fast", 1.0, "%"),
             *_panel(320, "TTFT p95 (ms)", per_class, "ttft_p95_ms", p95 * 1.15, "ms")]
    for i, t in enumerate(per_mode):
        x = 20 + i * 290
        parts.append(f'<rect x="{x}" y="226" width="12" height="12" fill="{COLOURS.get(t["mode"], "#577590")}"/>')
        parts.append(f'<text x="{x + 18}" y="236" font-size="11">{html.escape(t["mode"])}: fast budget used '
                     f'{_pct(t["budget_used"])}, 429s {t["http_429"]}</text>')
    return "\n".join([*parts, "</svg>"]) + "\n"


def main(args: Any) -> int:
    """``tiergate bench --contention``: run both modes, print the tables; with ``--out DIR`` also write
    ``contention.md``, ``contention.json`` and ``contention.svg`` there. Exit 1 when a client saw a 429 or an error."""
    sizes = Sizes(**{k: v for k, v in vars(args).items() if k in Sizes.__dataclass_fields__ and v is not None})
    if sizes.seconds <= 0 or sizes.seconds > 600 or sizes.budget < 1 or sizes.rate <= 0:
        print("tiergate bench --contention: --seconds in (0, 600], --budget >= 1, --rate > 0", file=sys.stderr)
        return 2
    modes = run(sizes, None if args.quiet else sys.stderr)
    per_class, per_mode = rows(modes), totals(modes)
    text = table(per_class, per_mode)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "sizes": vars(sizes)}
        (out / "contention.md").write_text(text + "\n", encoding="utf-8")
        (out / "contention.svg").write_text(svg(per_class, per_mode), encoding="utf-8")
        (out / "contention.json").write_bytes(orjson.dumps({"meta": meta, "classes": per_class, "modes": per_mode},
                                                           option=orjson.OPT_INDENT_2))
        print(f"written: {out}/contention.{{md,json,svg}}", file=sys.stderr)
    return 1 if any(t["http_429"] or t["errors"] for t in per_mode) else 0
