"""Summaries, the figure table (direct | tiergate | added | reference proxies | target), JSON/Markdown writers."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import procs

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

# Reference proxies, in the order their columns appear; each one that ran gets "<name>" and "<name> added".
REFERENCES: dict[str, str] = {
    "minproxy": "a minimal Python proxy: uvicorn + aiohttp, bench/minproxy.py",
    "nginx": "proxy_buffering off",
    "nolog": "Tiergate itself with the request log off for successes (GATEWAY_LOG_SAMPLE=0; --variants nolog)",
    "keys": "Tiergate itself with gateway keys on: one key with per-minute limits, sent by every target's load "
            "(--variants keys)",
    "redis": "Tiergate itself with state.redis_url: replicas' shared state in a local redis-server (--redis)",
    "traced": "Tiergate itself with OpenTelemetry traces exported (OTEL_TRACES_EXPORTER=otlp, to bench/otlpsink.py; "
              "--variants traced)",
    "otelmetrics": "Tiergate itself with OpenTelemetry GenAI metrics exported (OTEL_METRICS_EXPORTER=otlp, to "
                   "bench/otlpsink.py; --variants otelmetrics)",
}


def references(run: dict[str, Any]) -> list[str]:
    """The reference proxies measured in ``run``, in column order (old runs: none, or nginx only)."""
    targets = run.get("targets", [])
    return [name for name in REFERENCES if name in targets]


class Row:
    """One figure: values per column, unit, and its target (text and check) when the issue sets one.

    ``refs`` and ``refs_added`` hold the reference proxies' cells, keyed by target name (``minproxy``, ``nginx``).
    """

    def __init__(self, key: str, label: str, unit: str, direct: float | None, tiergate: float | None,
                 added: float | None, target: str = "", check: tuple[str, float, str | None] | None = None,
                 refs: dict[str, float | None] | None = None,
                 refs_added: dict[str, float | None] | None = None) -> None:
        self.key = key
        self.label = label
        self.unit = unit
        self.direct = direct
        self.tiergate = tiergate
        self.added = added
        self.refs = refs or {}
        self.refs_added = refs_added or {}
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
        """JSON form: every known reference gets ``<name>`` and ``<name>_added`` (None when it did not run)."""
        out: dict[str, Any] = {"key": self.key, "figure": self.label, "unit": self.unit, "direct": self.direct,
                               "tiergate": self.tiergate, "added": self.added}
        for name in REFERENCES:
            out[name] = self.refs.get(name)
            out[f"{name}_added"] = self.refs_added.get(name)
        out.update(target=self.target, verdict=self.verdict(), spread=self.spread, other_load=self.other_load)
        return out


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _get(d: dict[str, Any] | None, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def build_rows(run: dict[str, Any], sizes: dict[str, Any]) -> list[Row]:
    """The table rows of one run (see bench/README.md, "Reading the table")."""
    rows: list[Row] = []
    refs = references(run)

    def row(key: str, label: str, unit: str, figure: str, added: str, target: str = "",
            check: tuple[str, float, str] | None = None) -> None:
        """One figure for every target; ``added``: "diff" (proxy minus direct), "whole" (the proxy's own CPU
        or memory: all of it is added) or "none" (no added column). Only direct has no proxy figures."""
        vals = {name: _get(run, "figures", figure, name) for name in ("direct", "tiergate", *refs)}
        if added == "diff":
            extra = {name: _sub(v, vals["direct"]) for name, v in vals.items()}
        else:
            extra = {name: (v if added == "whole" else None) for name, v in vals.items()}
        rows.append(Row(key, label, unit, vals["direct"], vals["tiergate"], extra["tiergate"], target, check,
                        {n: vals[n] for n in refs}, {n: extra[n] for n in refs}))

    n = sizes["ttft_requests"]
    row("ttft_p50", f"TTFT p50 (1 stream, {n} requests)", "ms", "ttft_p50_ms", "diff",
        "added <= 0.6 ms", ("added", 0.6, "le"))
    row("ttft_p99", f"TTFT p99 (1 stream, {n} requests)", "ms", "ttft_p99_ms", "diff",
        "added <= 3 ms", ("added", 3.0, "le"))
    row("cpu_stream_request", f"proxy CPU per streamed request ({sizes['ttft_tokens']} tokens, 1 stream)", "ms",
        "cpu_ms_per_stream_request", "whole")
    tps = sizes["chunk_tps"]
    for c in sizes["chunk_conc"]:
        for q in ("p50", "p99"):
            target, check = "", None
            if q == "p99" and c == 32:
                target, check = "added <= 1 ms", ("added", 1.0, "le")
            if q == "p99" and c == 64:
                target, check = "stretch: added <= 1 ms", ("added", 1.0, "le")
            row(f"chunk_{q}_{c}", f"per-chunk delay {q}, {c} stream{'s' if c > 1 else ''} @ {tps:g} tok/s", "ms",
                f"chunk_{q}_ms_c{c}", "diff", target, check)
    for c in sizes["chunk_conc"]:
        target, check = ("<= 25 ms (stretch <= 15)", ("tiergate", 25.0, "le")) if c == 32 else ("", None)
        row(f"cpu_chunks_{c}", f"proxy CPU per 1,000 relayed chunks, {c} stream{'s' if c > 1 else ''}", "ms",
            f"cpu_ms_per_1k_chunks_c{c}", "whole", target, check)
    conc = sizes["rps_conc"]
    row("cpu_request", f"proxy CPU per non-streaming request ({conc} concurrent)", "ms", "cpu_ms_per_request",
        "whole", "<= 0.25 ms", ("tiergate", 0.25, "le"))
    row("rps", f"non-streaming req/s ({conc} concurrent, proxy on one core)", "req/s", "rps", "none",
        ">= 4,000", ("tiergate", 4000.0, "ge"))
    row("rps_cpu_bound", "non-streaming req/s one proxy core allows (1 / CPU per request)", "req/s", "rps_cpu_bound",
        "none")
    row("rps_util", "proxy CPU use during the req/s phase", "%", "rps_proxy_cpu_util", "none")
    lo, hi = sizes["rss_levels"]
    for key, label, figure, target, check in (
        ("rss_idle", "proxy RSS idle (after warm-up)", "rss_idle_mib", "", None),
        ("rss_lo", f"proxy RSS with {lo} open slow streams", f"rss_{lo}_mib",
         "<= 80 MiB" if lo == 256 else "", ("tiergate", 80.0, "le") if lo == 256 else None),
        ("rss_hi", f"proxy RSS with {hi} open slow streams", f"rss_{hi}_mib", "", None),
        ("rss_per_stream", f"proxy RSS per additional open stream ({lo} -> {hi})", "rss_per_stream_kib",
         "<= 40 KiB" if (lo, hi) == (256, 1024) else "", ("tiergate", 40.0, "le") if (lo, hi) == (256, 1024) else None),
    ):
        row(key, label, "KiB" if key == "rss_per_stream" else "MiB", figure, "none", target, check)
    row("errors", "errors (all measured phases)", "count", "errors", "diff", "0", ("tiergate", 0.0, "le"))
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
        for col in ("direct", "tiergate", "added"):
            vals = [getattr(r, col) for r in rows if getattr(r, col) is not None]
            setattr(agg, col, statistics.fmean(vals) if vals else None)
        for name in [n for n in REFERENCES if any(n in r.refs for r in rows)]:
            for cells, into in ((lambda r: r.refs, agg.refs), (lambda r: r.refs_added, agg.refs_added)):
                vals = [v for r in rows if (v := cells(r).get(name)) is not None]
                into[name] = statistics.fmean(vals) if vals else None
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


def markdown_table(rows: list[Row], *, refs: Sequence[str], repeat: int) -> str:
    """The figure table; ``refs``: the reference proxies to show (``<name>`` and ``<name> added`` columns)."""
    cols = ["figure", "direct", "tiergate", "added"]
    for name in refs:
        cols += [name, f"{name} added"]
    if repeat > 1:
        cols.append(f"spread ({repeat} runs)")
    cols += ["other load", "target"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 2) + ["---"]) + "|"]
    for r in rows:
        cells = [r.label, fmt(r.direct, r.unit), fmt(r.tiergate, r.unit), fmt(r.added, r.unit)]
        for name in refs:
            cells += [fmt(r.refs.get(name), r.unit), fmt(r.refs_added.get(name), r.unit)]
        if repeat > 1:
            cells.append(fmt(r.spread, r.unit))
        cells.append(fmt(r.other_load * 100 if r.other_load is not None else None, "%"))
        verdict = r.verdict()
        cells.append(f"{r.target} ({verdict})" if r.target and verdict else (r.target or ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(run: dict[str, Any]) -> str:
    """Per step: delivered chunks/s and TTFT p50 per target, each proxy's CPU use, errors per target."""
    sweep = run.get("sweep", {})
    proxies = ["tiergate", *references(run)]
    names = ["direct", *proxies]
    head = ["streams", "offered chunks/s"]
    head += [f"{n} chunks/s" for n in names] + [f"{n} TTFT p50" for n in names]
    head += [f"{n} CPU use" for n in proxies] + [f"errors ({'/'.join(names)})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:"] * len(head)) + "|"]
    for c, per in sweep.items():
        cells = [str(c), f"{per.get('offered_chunks_per_s', 0):,.0f}"]
        cells += [f"{_get(per, n, 'delivered_chunks_per_s') or 0:,.0f}" for n in names]
        cells += [fmt(_get(per, n, "ttft", "p50"), "ms") for n in names]
        for n in proxies:
            util = _get(per, n, "meter", "proxy_cpu_util")
            cells.append(fmt(util * 100 if util is not None else None, "%"))
        cells.append("/".join(str(_get(per, n, "errors_total") or 0) for n in names))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def conditions_table(run: dict[str, Any]) -> str:
    """Per phase and target: proxy CPU use, CPU-0 use (upstream + load generator), CPU outside the bench."""
    lines = ["| phase | target | seconds | proxy CPU | CPU 0 (upstream + loadgen) "
             "| other CPU (other processes, kernel, steal) |",
             "|---|---|---:|---:|---:|---:|"]
    order = {name: i for i, name in enumerate(("direct", "tiergate", *REFERENCES))}
    for phase, per in run.get("meters", {}).items():
        for target, m in sorted(per.items(), key=lambda kv: order.get(kv[0], len(order))):
            util = m.get("proxy_cpu_util")
            lines.append(f"| {phase} | {target} | {m['elapsed_s']:.1f} | "
                         f"{fmt(util * 100 if util is not None else None, '%')} | "
                         f"{m['cpu0_util'] * 100:.0f} % | {m['other_cpu_util'] * 100:.0f} % |")
    return "\n".join(lines)


def median_cell(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """A table cell: the median of one figure over runs, with ``[min, max]`` when there are several."""
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def repeated(name: str, repeat: int, one_run: Callable[[Path, bool], dict[str, Any]], meta: dict[str, Any],
             markdown: Callable[[dict[str, Any], list[dict[str, Any]]], str], out: Path) -> int:
    """The frame of ``bench.bridge`` and ``bench.passthrough``: this process pinned to CPU 0 (beside the bench
    upstream) when there are two, ``one_run(tmp_dir, pinned)`` ``repeat`` times, then ``results.json`` and
    ``results.md`` (``markdown(meta, runs)``) under ``out``, the Markdown printed. Returns the exit code (0)."""
    pin = (os.cpu_count() or 1) >= 2 and hasattr(os, "sched_setaffinity")
    if pin:
        os.sched_setaffinity(0, {0})
    runs = []
    for i in range(repeat):
        with tempfile.TemporaryDirectory(prefix=f"tiergate-bench-{name}-") as tmp:
            runs.append(one_run(Path(tmp), pin))
        print(f"run {i + 1}/{repeat}: {json.dumps(runs[-1])}", file=sys.stderr)
    meta = {"git": procs.git_rev(), "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "cpu": procs.cpu_model(), "pinned": pin, **meta}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    md = markdown(meta, runs)
    (out / "results.md").write_text(md)
    print(md)
    return 0
