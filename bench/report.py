"""Summaries, the figure table (direct | tiergate | added | target) and the JSON/Markdown writers."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

MIB = 1024 * 1024
BUSY = 0.30  # "other CPU" share above which a phase's figures are flagged unreliable


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks; None when empty."""
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ms_summary(values_ns: Sequence[int]) -> dict[str, Any]:
    """n, p50, p90, p99, p99.9, max and mean in milliseconds."""
    if not values_ns:
        return {"n": 0}
    s = sorted(values_ns)
    out: dict[str, Any] = {"n": len(s)}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p999", 99.9)):
        out[name] = pct(s, q) / 1e6  # type: ignore[operator]
    out["max"] = s[-1] / 1e6
    out["mean"] = sum(s) / len(s) / 1e6
    return out


# --- the figure table -------------------------------------------------------------------------------------

class Row:
    """One figure: values per column, unit, and its target (text and check) when the issue sets one."""

    def __init__(self, key: str, label: str, unit: str, direct: float | None, tiergate: float | None,
                 added: float | None, target: str = "", check: tuple[str, float, str | None] | None = None,
                 nginx: float | None = None, nginx_added: float | None = None) -> None:
        self.key = key
        self.label = label
        self.unit = unit
        self.direct = direct
        self.tiergate = tiergate
        self.added = added
        self.nginx = nginx
        self.nginx_added = nginx_added
        self.target = target
        self.check = check  # (which column: "added"|"tiergate", threshold, "le"|"ge")
        self.spread: float | None = None
        self.other_load: float | None = None  # highest CPU share used outside the bench during the phase

    def verdict(self) -> str:
        if not self.check:
            return ""
        col, threshold, op = self.check
        value = getattr(self, col)
        if value is None:
            return "not measured"
        ok = value <= threshold if op == "le" else value >= threshold
        out = "met" if ok else "MISSED"
        if self.other_load is not None and self.other_load > BUSY:
            out += ", machine busy: unreliable"
        elif col == "added" and value < 0:
            out += ", baseline noisier than tiergate"
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "figure": self.label, "unit": self.unit, "direct": self.direct,
                "tiergate": self.tiergate, "added": self.added, "nginx": self.nginx, "nginx_added": self.nginx_added,
                "target": self.target, "verdict": self.verdict(), "spread": self.spread,
                "other_load": self.other_load}


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _get(d: dict[str, Any] | None, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def build_rows(run: dict[str, Any], sizes: dict[str, Any]) -> list[Row]:
    """The table rows of one run (see README "Reading the table")."""
    rows: list[Row] = []
    has_nginx = "nginx" in run.get("targets", [])

    def pair(key: str, label: str, unit: str, path: tuple[str, ...], target: str = "",
             check: tuple[str, float, str] | None = None) -> None:
        direct = _get(run, *path, "direct")
        tg = _get(run, *path, "tiergate")
        ng = _get(run, *path, "nginx") if has_nginx else None
        rows.append(Row(key, label, unit, direct, tg, _sub(tg, direct), target, check, ng, _sub(ng, direct)))

    n = sizes["ttft_requests"]
    pair("ttft_p50", f"TTFT p50 (1 stream, {n} requests)", "ms", ("figures", "ttft_p50_ms"),
         "added <= 0.6 ms", ("added", 0.6, "le"))
    pair("ttft_p99", f"TTFT p99 (1 stream, {n} requests)", "ms", ("figures", "ttft_p99_ms"),
         "added <= 3 ms", ("added", 3.0, "le"))
    tg = _get(run, "figures", "cpu_ms_per_stream_request", "tiergate")
    ng = _get(run, "figures", "cpu_ms_per_stream_request", "nginx") if has_nginx else None
    rows.append(Row("cpu_stream_request", f"proxy CPU per streamed request ({sizes['ttft_tokens']} tokens, 1 stream)",
                    "ms", None, tg, tg, "", None, ng, ng))
    tps = sizes["chunk_tps"]
    for c in sizes["chunk_conc"]:
        for q in ("p50", "p99"):
            target, check = "", None
            if q == "p99" and c == 32:
                target, check = "added <= 1 ms", ("added", 1.0, "le")
            if q == "p99" and c == 64:
                target, check = "stretch: added <= 1 ms", ("added", 1.0, "le")
            pair(f"chunk_{q}_{c}", f"per-chunk delay {q}, {c} stream{'s' if c > 1 else ''} @ {tps:g} tok/s", "ms",
                 ("figures", f"chunk_{q}_ms_c{c}"), target, check)
    for c in sizes["chunk_conc"]:
        target, check = ("<= 25 ms (stretch <= 15)", ("tiergate", 25.0, "le")) if c == 32 else ("", None)
        tg = _get(run, "figures", f"cpu_ms_per_1k_chunks_c{c}", "tiergate")
        ng = _get(run, "figures", f"cpu_ms_per_1k_chunks_c{c}", "nginx") if has_nginx else None
        rows.append(Row(f"cpu_chunks_{c}", f"proxy CPU per 1,000 relayed chunks, {c} stream{'s' if c > 1 else ''}",
                        "ms", None, tg, tg, target, check, ng, ng))
    conc = sizes["rps_conc"]
    tg = _get(run, "figures", "cpu_ms_per_request", "tiergate")
    ng = _get(run, "figures", "cpu_ms_per_request", "nginx") if has_nginx else None
    rows.append(Row("cpu_request", f"proxy CPU per non-streaming request ({conc} concurrent)", "ms", None, tg, tg,
                    "<= 0.25 ms", ("tiergate", 0.25, "le"), ng, ng))
    direct = _get(run, "figures", "rps", "direct")
    tg = _get(run, "figures", "rps", "tiergate")
    ng = _get(run, "figures", "rps", "nginx") if has_nginx else None
    rows.append(Row("rps", f"non-streaming req/s ({conc} concurrent, proxy on one core)", "req/s", direct, tg, None,
                    ">= 4,000", ("tiergate", 4000.0, "ge"), ng, None))
    tg = _get(run, "figures", "rps_cpu_bound", "tiergate")
    ng = _get(run, "figures", "rps_cpu_bound", "nginx") if has_nginx else None
    rows.append(Row("rps_cpu_bound", "non-streaming req/s one proxy core allows (1 / CPU per request)", "req/s", None,
                    tg, None, "", None, ng, None))
    tg = _get(run, "figures", "rps_proxy_cpu_util", "tiergate")
    ng = _get(run, "figures", "rps_proxy_cpu_util", "nginx") if has_nginx else None
    rows.append(Row("rps_util", "proxy CPU use during the req/s phase", "%", None, tg, None, "", None, ng, None))
    lo, hi = sizes["rss_levels"]
    for key, label, path, target, check in (
        ("rss_idle", "proxy RSS idle (after warm-up)", "rss_idle_mib", "", None),
        ("rss_lo", f"proxy RSS with {lo} open slow streams", f"rss_{lo}_mib",
         "<= 80 MiB" if lo == 256 else "", ("tiergate", 80.0, "le") if lo == 256 else None),
        ("rss_hi", f"proxy RSS with {hi} open slow streams", f"rss_{hi}_mib", "", None),
        ("rss_per_stream", f"proxy RSS per additional open stream ({lo} -> {hi})", "rss_per_stream_kib",
         "<= 40 KiB" if (lo, hi) == (256, 1024) else "", ("tiergate", 40.0, "le") if (lo, hi) == (256, 1024) else None),
    ):
        tg = _get(run, "figures", path, "tiergate")
        ng = _get(run, "figures", path, "nginx") if has_nginx else None
        rows.append(Row(key, label, "KiB" if key == "rss_per_stream" else "MiB", None, tg, None, target, check, ng,
                        None))
    pair("errors", "errors (all measured phases)", "count", ("figures", "errors"), "0", ("tiergate", 0.0, "le"))
    meters = run.get("meters", {})
    for r in rows:
        phase = _phase_of(r.key)
        per = meters.get(phase, {}) if phase else {}
        loads = [m["other_cpu_util"] for m in per.values() if "other_cpu_util" in m]
        r.other_load = max(loads) if loads else None
    return rows


def _phase_of(key: str) -> str | None:
    """The meter (phase) a row's figure comes from, for its "other load" cell."""
    if key.startswith(("ttft", "cpu_stream_request")):
        return "ttft (interleaved)"
    m = re.fullmatch(r"(?:chunk_p\d+|cpu_chunks)_(\d+)", key)
    if m:
        return f"chunks c={m.group(1)}"
    if key in ("cpu_request", "rps", "rps_cpu_bound", "rps_util"):
        return "rps"
    return None


def aggregate(runs_rows: list[list[Row]]) -> list[Row]:
    """Mean of each cell over the runs; ``spread`` = max - min of the judged column (added, else tiergate)."""
    if len(runs_rows) == 1:
        return runs_rows[0]
    out = []
    for rows in zip(*runs_rows, strict=True):
        first = rows[0]
        agg = Row(first.key, first.label, first.unit, None, None, None, first.target, first.check)
        for col in ("direct", "tiergate", "added", "nginx", "nginx_added"):
            vals = [getattr(r, col) for r in rows if getattr(r, col) is not None]
            setattr(agg, col, statistics.fmean(vals) if vals else None)
        col = "added" if first.added is not None else "tiergate"
        vals = [getattr(r, col) for r in rows if getattr(r, col) is not None]
        agg.spread = (max(vals) - min(vals)) if len(vals) > 1 else None
        loads = [r.other_load for r in rows if r.other_load is not None]
        agg.other_load = max(loads) if loads else None
        out.append(agg)
    return out


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "count":
        return f"{value:g}"
    if unit == "req/s":
        return f"{value:,.0f}"
    if unit == "%":
        return f"{value:.0f} %"
    if unit in ("MiB", "KiB"):
        return f"{value:.1f} {unit}"
    a = abs(value)
    digits = 3 if a < 10 else (2 if a < 100 else 1)
    return f"{value:.{digits}f} {unit}"


def markdown_table(rows: list[Row], *, nginx: bool, repeat: int) -> str:
    cols = ["figure", "direct", "tiergate", "added"]
    if nginx:
        cols += ["nginx", "nginx added"]
    if repeat > 1:
        cols.append(f"spread ({repeat} runs)")
    cols += ["other load", "target"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 2) + ["---"]) + "|"]
    for r in rows:
        cells = [r.label, fmt(r.direct, r.unit), fmt(r.tiergate, r.unit), fmt(r.added, r.unit)]
        if nginx:
            cells += [fmt(r.nginx, r.unit), fmt(r.nginx_added, r.unit)]
        if repeat > 1:
            cells.append(fmt(r.spread, r.unit))
        cells.append(fmt(r.other_load * 100 if r.other_load is not None else None, "%"))
        verdict = r.verdict()
        cells.append(f"{r.target} ({verdict})" if r.target and verdict else (r.target or ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(run: dict[str, Any], *, nginx: bool) -> str:
    sweep = run.get("sweep", {})
    names = ["direct", "tiergate"] + (["nginx"] if nginx else [])
    head = ["streams", "offered chunks/s"]
    head += [f"{n} chunks/s" for n in names] + [f"{n} TTFT p50" for n in names]
    head += ["tiergate CPU use", "errors (d/t)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:"] * len(head)) + "|"]
    for c, per in sweep.items():
        cells = [str(c), f"{per.get('offered_chunks_per_s', 0):,.0f}"]
        cells += [f"{_get(per, n, 'delivered_chunks_per_s') or 0:,.0f}" for n in names]
        cells += [fmt(_get(per, n, "ttft", "p50"), "ms") for n in names]
        util = _get(per, "tiergate", "meter", "proxy_cpu_util")
        cells.append(fmt(util * 100 if util is not None else None, "%"))
        cells.append(f"{_get(per, 'direct', 'errors_total') or 0}/{_get(per, 'tiergate', 'errors_total') or 0}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def conditions_table(run: dict[str, Any]) -> str:
    """Per phase and target: proxy CPU use, CPU-0 use (upstream + load generator), CPU outside the bench."""
    lines = ["| phase | target | seconds | proxy CPU | CPU 0 (upstream + loadgen) "
             "| other CPU (other processes, kernel, steal) |",
             "|---|---|---:|---:|---:|---:|"]
    for phase, per in run.get("meters", {}).items():
        for target, m in per.items():
            util = m.get("proxy_cpu_util")
            lines.append(f"| {phase} | {target} | {m['elapsed_s']:.1f} | "
                         f"{fmt(util * 100 if util is not None else None, '%')} | "
                         f"{m['cpu0_util'] * 100:.0f} % | {m['other_cpu_util'] * 100:.0f} % |")
    return "\n".join(lines)
