"""``tiergate bench``'s figures: the results grouped by tier (:class:`TierStats`), their percentiles, the per-tier
summary (what the table, the chart and ``--json`` show), whether the fast tier earned its premium, and the table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.tools.loadtest.client import Result


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


def group(results: list[Result]) -> list[TierStats]:
    """Results by tier: ``fast`` then ``standard`` then anything else, alphabetically."""
    groups: dict[str, TierStats] = {}
    for r in results:
        groups.setdefault(r.group, TierStats(r.group)).results.append(r)
    order = {"fast": 0, "standard": 1}
    return sorted(groups.values(), key=lambda g: (order.get(g.name, 2), g.name))


def as_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def as_num(v: float | None) -> str:
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
    rows = [("tier", "requests", "errors", "TTFT p50 ms", "TTFT p95 ms", "tok/s p50", "tok/s p95", "TPOT p50 ms",
             "out tokens", "cost USD", "USD/1k out", "USD/req")]
    for name, s in summary(stats, cost).items():
        if cost is None:
            usd = "n/a"
        elif s["cost_usd"] is None or (s["cost_usd"] == 0 and s["unpriced_requests"]):
            usd = f"unpriced ({s['unpriced_requests']:.0f})" if s["unpriced_requests"] else "-"
        else:
            usd = f"{s['cost_usd']:.6f}"
        rows.append((name, str(s["requests"]), str(s["errors"]), as_ms(s["ttft_p50_s"]), as_ms(s["ttft_p95_s"]),
                     as_num(s["tokens_per_s_p50"]), as_num(s["tokens_per_s_p95"]),
                     as_ms(s["time_per_output_token_p50_s"]), str(s["output_tokens"]), usd,
                     as_usd(s["cost_per_1k_output_tokens_usd"]), as_usd(s["cost_per_request_usd"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    return "\n".join([*lines, premium_line(premium(summary(stats, cost)))])


def as_usd(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"
