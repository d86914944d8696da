"""``tiergate bench --agent-loop N`` (docs/bench.md#agent-loop): agent runs instead of single requests, to answer how
long a run took on each tier, what it cost, and whether the prompt cache stayed warm. Step ``k`` sends what an agent
loop sends (the system prompt and tools, the conversation so far as streamed, one new turn), so each step's prompt
starts with the whole of the one before. Every loop is bounded: ``--runs`` per model, N steps a run, ``--timeout``
seconds a step, a few short reads of the gateway's record."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.routing.sessions import SESSION_HEADER
from gateway.tools.loadtest.client import Result, send
from gateway.tools.loadtest.figures import percentile
from gateway.tools.loadtest.mix import parse_mix

AGENT_SYSTEM = (
    "You are a coding agent working in a Python repository. Work in small steps: call one tool, read its result, "
    "decide the next step. Keep answers short; say which tool you call next and why.\n\n"
    "Tools:\n"
    "- read_file(path: str) -> str: the file's text, at most 2,000 lines.\n"
    "- search(pattern: str, path: str = '.') -> list[str]: lines matching a regular expression, as file:line:text.\n"
    "- run_tests(selector: str = '') -> str: pytest's summary and the first failure's traceback.\n"
    "- apply_patch(diff: str) -> str: applies a unified diff; returns the files changed or the first conflict.\n"
    "- list_dir(path: str = '.') -> list[str]: the directory's entries, directories with a trailing slash.\n\n"
    "Rules: never edit tests to make them pass; run the tests after each patch; stop when they pass and summarise "
    "the change in two sentences."
)
TOOL_RESULTS = (
    "Task: the CI job `unit` fails on main since this morning. Find the failing test and fix the cause.",
    "run_tests() -> 1 failed, 212 passed. FAILED tests/test_dates.py::test_parse_duration - AssertionError: "
    "assert 273600 == 273720. parse_duration('P3DT4H2M') returned 273600.",
    "read_file('src/dates.py') -> def parse_duration(text):\n    m = DURATION.fullmatch(text)\n    days, hours, "
    "minutes = (int(g or 0) for g in m.groups())\n    return days * 86400 + hours * 3600 + minutes * 6\n",
    "search('minutes \\\\* 6', 'src') -> src/dates.py:41: return days * 86400 + hours * 3600 + minutes * 6",
    "apply_patch(...) -> changed: src/dates.py (1 line).",
    "run_tests('tests/test_dates.py') -> 14 passed in 0.21s.",
    "run_tests() -> 213 passed in 4.02s.",
    "list_dir('src') -> ['dates.py', 'money.py', 'cli.py', 'models/', '__init__.py']",
)


def context(tokens: int) -> str:
    """About ``tokens`` tokens (4 bytes each) of a repository map, the same for every run: the long, cacheable system
    prompt an agent sends (its tools, files and rules)."""
    lines, size, i = [], 0, 0
    while size < tokens * 4:
        line = f"src/pkg_{i // 8}/module_{i}.py: def handle_{i}(request, *, timeout=30): returns Result[{i}]"
        lines.append(line)
        size += len(line) + 1
        i += 1
    return "\n\nRepository map:\n" + "\n".join(lines) if lines else ""


@dataclass
class Run:
    """``wall``: seconds from sending its first step to the end of its last; ``record``: the gateway's (None: not
    read)."""

    model: str
    session: str
    steps: list[Result] = field(default_factory=list)
    wall: float = 0.0
    record: dict[str, Any] | None = None

    @property
    def group(self) -> str:
        """``model X`` when the server sent no tier header (not Tiergate)."""
        return self.steps[0].group if self.steps else f"model {self.model}"

    @property
    def failed(self) -> bool:
        return not self.steps or any(s.error is not None for s in self.steps)


def turn(k: int, session: str) -> str:
    """Names the run's ``session``, so that two runs share no more than the system prompt, as two agent runs on
    different tasks would."""
    said = TOOL_RESULTS[k % len(TOOL_RESULTS)]
    return f"Step {k + 1}. {said} (run {session})" if k == 0 else f"Step {k + 1}. {said}"


async def agent_run(session: aiohttp.ClientSession, base_url: str, model: str, steps: int, max_tokens: int,
                    timeout: float, system: str = AGENT_SYSTEM) -> Run:
    """Stops at a failed step."""
    run = Run(model, f"tiergate-bench-{secrets.token_hex(8)}")
    url = base_url.rstrip("/") + "/chat/completions"
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    t0 = time.perf_counter()
    for k in range(steps):
        messages.append({"role": "user", "content": turn(k, run.session)})
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                "max_completion_tokens": max_tokens, "messages": messages}
        res = await send(session, url, body, timeout, {SESSION_HEADER: run.session})
        run.steps.append(res)
        if res.error is not None:
            break
        messages.append({"role": "assistant", "content": "".join(res.text)})
    run.wall = time.perf_counter() - t0
    run.record = await fetch_record(session, base_url, run.session, sum(s.error is None for s in run.steps))
    return run


async def fetch_record(session: aiohttp.ClientSession, base_url: str, session_id: str,
                       steps: int) -> dict[str, Any] | None:
    """Read a few times, 50 ms apart, while the last step is being counted; None when not Tiergate, unknown or
    unreachable."""
    url = f"{base_url.rstrip('/')}/tiergate/sessions/{session_id}"
    record: dict[str, Any] | None = None
    for _ in range(20):
        try:
            async with asyncio.timeout(5), session.get(url) as resp:
                if resp.status != 200:
                    return None
                record = orjson.loads(await resp.read())
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
            return None
        if not isinstance(record, dict):
            return None
        if record.get("steps", 0) >= steps:
            return record
        await asyncio.sleep(0.05)
    return record


async def run_all(base_url: str, api_key: str, models: list[str], runs: int, steps: int, concurrency: int,
                  max_tokens: int, timeout: float, context_tokens: int = 0) -> list[Run]:
    """Interleaved; progress on stderr."""
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json",
               "user-agent": "tiergate-bench"}
    todo = [m for _ in range(runs) for m in models]  # in --mix order, a run of each model in turn
    system = AGENT_SYSTEM + context(context_tokens)
    done: list[Run] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        queue = list(reversed(todo))

        async def worker() -> None:
            while queue:
                done.append(await agent_run(session, base_url, queue.pop(), steps, max_tokens, timeout, system))

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(todo))))))
    return done


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(runs: list[Run]) -> dict[str, Any]:
    """Groups in the order ``fast``, ``standard``, the rest."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    order = {"fast": 0, "standard": 1}
    return {name: figures(groups[name]) for name in sorted(groups, key=lambda g: (order.get(g, 2), g))}


def figures(rs: list[Run]) -> dict[str, Any]:
    """Seconds, tokens, USD; None where nothing was measured. Run wall times count the runs that did not fail; the
    cache hit ratio is cached / prompt tokens over the runs' records."""
    walls = sorted(r.wall for r in rs if not r.failed)
    ttfts = sorted(s.ttft for r in rs for s in r.steps if s.ttft is not None)
    depth = max(len(r.steps) for r in rs)
    nth = [[r.steps[k] for r in rs if len(r.steps) > k] for k in range(depth)]
    by_step = [percentile(sorted(s.ttft for s in col if s.ttft is not None), 0.5) for col in nth]
    cached = [_mean([float(s.cached_tokens) for s in col if s.cached_tokens is not None]) for col in nth]
    records = [r.record for r in rs if r.record is not None]
    costs = [float(rec["cost_usd"]) for rec in records if isinstance(rec.get("cost_usd"), int | float)]
    prompt = sum(rec.get("tokens", {}).get("prompt", 0) for rec in records)
    tiers: dict[str, int] = {}
    for rec in records:
        for tier, n in (rec.get("steps_by_tier") or {}).items():
            tiers[tier] = tiers.get(tier, 0) + n
    return {
        "runs": len(rs), "failed_runs": sum(r.failed for r in rs), "steps": sum(len(r.steps) for r in rs),
        "error_kinds": sorted({s.error for r in rs for s in r.steps if s.error}),
        "run_wall_p50_s": percentile(walls, 0.5), "run_wall_mean_s": _mean(walls),
        "step_ttft_p50_s": percentile(ttfts, 0.5), "step_ttft_p95_s": percentile(ttfts, 0.95),
        "step_ttft_p50_by_step_s": by_step, "cached_tokens_by_step": cached,
        "cost_usd": sum(costs) if costs else None, "cost_per_run_usd": _mean(costs),
        "cache_hit_ratio": sum(rec.get("tokens", {}).get("cached", 0) for rec in records) / prompt if prompt else None,
        "steps_by_tier": tiers,
        "estimate": estimate(records),
        "sessions": [{"id": r.session, "wall_s": r.wall, "record": r.record} for r in rs],
    }


def estimate(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the gateway's own session records said the fast tier saved each run (``fast_tier_saved``), over the runs
    it priced every fast-tier step of (seconds per run, mean, and the mean of their intervals); None when no run had a
    fast-tier step. ``runs_priced`` of ``runs``: a run with a step the estimate had too few samples for is left out, so
    that a partial sum is never compared with a whole run."""
    views = [r["fast_tier_saved"] for r in records if isinstance(r.get("fast_tier_saved"), dict)]
    fast = [v for v in views if v.get("priced_steps", 0) + v.get("unpriced_steps", 0) > 0]
    if not fast:
        return None
    whole = [v for v in fast if not v.get("unpriced_steps") and isinstance(v.get("seconds"), int | float)]
    samples = [v["samples"] for v in whole if isinstance(v.get("samples"), int)]
    return {"runs": len(fast), "runs_priced": len(whole),
            "seconds_per_run": _mean([float(v["seconds"]) for v in whole]),
            "interval_seconds_per_run": [_mean([float(v["interval_seconds"][0]) for v in whole]),
                                         _mean([float(v["interval_seconds"][1]) for v in whole])] if whole else None,
            "fewest_samples": min(samples) if samples else None,
            "steps_priced": sum(v.get("priced_steps", 0) for v in fast),
            "steps": sum(v.get("priced_steps", 0) + v.get("unpriced_steps", 0) for v in fast)}


def measured_saving(tiers: dict[str, Any]) -> float | None:
    """Seconds per run: the standard tier's mean run minus the fast tier's, both measured here."""
    fast, std = tiers.get("fast"), tiers.get("standard")
    if not fast or not std or fast["run_wall_mean_s"] is None or std["run_wall_mean_s"] is None:
        return None
    return float(std["run_wall_mean_s"] - fast["run_wall_mean_s"])


def premium(tiers: dict[str, Any]) -> str:
    fast, std, saved = tiers.get("fast"), tiers.get("standard"), measured_saving(tiers)
    if not fast or not std or saved is None:
        return "premium: n/a (the run needs agent runs answered by both tiers)"
    text = f"premium: the fast tier saved {saved:.2f} s per run"
    if fast["cost_per_run_usd"] is None or std["cost_per_run_usd"] is None:
        return text + "; cost n/a (no session record)"
    return text + f" for {fast['cost_per_run_usd'] - std['cost_per_run_usd']:+.6f} USD per run"


def estimate_line(tiers: dict[str, Any]) -> str:
    """The gateway's estimate beside the measured difference (the two should agree: docs/sessions.md#payoff)."""
    est, saved = (tiers.get("fast") or {}).get("estimate"), measured_saving(tiers)
    if est is None:
        return "estimate: n/a (no fast-tier run with a session record)"
    if not est["runs_priced"]:
        return (f"estimate: not enough data ({est['steps_priced']} of {est['steps']} fast-tier steps priced; the "
                "standard tier's live estimate needs streamed samples first: put its model first in --mix)")
    lo, hi = est["interval_seconds_per_run"]
    text = (f"estimate: the gateway's session records said {est['seconds_per_run']:.2f} s per run ({lo:.2f} to "
            f"{hi:.2f}; {est['runs_priced']} of {est['runs']} runs priced whole, on {est['fewest_samples']}+ samples)")
    if saved is not None and saved > 0:
        text += f": {est['seconds_per_run'] / saved:.2f}x the measured {saved:.2f} s"
    return text


def table(tiers: dict[str, Any], steps: int) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    rows = [("tier", "runs", "failed", "run s p50", "run s mean", "step TTFT p50 ms", "first / later TTFT p50 ms",
             "mean cached tokens/later step", "cache hit", "USD/run", "steps by tier")]
    for name, t in tiers.items():
        later = [c for c in t["cached_tokens_by_step"][1:] if c is not None]  # each a mean per step index
        first_later = t["step_ttft_p50_by_step_s"]
        later_ttft = percentile(sorted(v for v in first_later[1:] if v is not None), 0.5)
        rows.append((name, str(t["runs"]), str(t["failed_runs"]), num(t["run_wall_p50_s"], ".2f"),
                     num(t["run_wall_mean_s"], ".2f"), ms(t["step_ttft_p50_s"]),
                     f"{ms(first_later[0] if first_later else None)} / {ms(later_ttft)}",
                     num(_mean(later), ".0f"), "-" if t["cache_hit_ratio"] is None else f"{t['cache_hit_ratio']:.1%}",
                     num(t["cost_per_run_usd"], ".6f"),
                     ",".join(f"{k}:{v}" for k, v in sorted(t["steps_by_tier"].items())) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    errors = [f"errors: {name}: {', '.join(t['error_kinds'])}" for name, t in tiers.items() if t["error_kinds"]]
    return "\n".join([f"agent loop: {steps} steps per run", *lines, *errors, premium(tiers), estimate_line(tiers)])


def main(args: Any) -> int:
    """Exit code 1 when every run failed."""
    try:
        models = [m for m, w in parse_mix(args.mix) if w > 0]
    except ValueError as exc:
        print(f"tiergate bench: {exc}", file=sys.stderr)
        return 2
    if args.agent_loop < 1 or args.runs < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.context_tokens < 0:
        print("tiergate bench: --agent-loop, --runs, --concurrency and --max-tokens must be at least 1, "
              "--context-tokens at least 0", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "unused"
    print(f"tiergate bench: {args.runs} agent runs of {args.agent_loop} steps per model ({', '.join(models)}), "
          f"{args.concurrency} at once, max {args.max_tokens} tokens a step -> {args.base_url}", file=sys.stderr)
    started = time.monotonic()
    runs = asyncio.run(run_all(args.base_url, api_key, models, args.runs, args.agent_loop, args.concurrency,
                               args.max_tokens, args.timeout, args.context_tokens))
    tiers = summary(runs)
    print(table(tiers, args.agent_loop))
    if args.json:
        meta = {"agent_loop": args.agent_loop, "runs": args.runs, "concurrency": args.concurrency, "mix": args.mix,
                "max_tokens": args.max_tokens, "context_tokens": args.context_tokens, "base_url": args.base_url,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                "elapsed": time.monotonic() - started}
        Path(args.json).write_bytes(orjson.dumps({"meta": meta, "tiers": tiers, "premium": premium(tiers),
                                                  "measured_saving_s": measured_saving(tiers),
                                                  "estimate": estimate_line(tiers)}, option=orjson.OPT_INDENT_2))
    out = "tiergate-bench.html" if args.out is None else args.out
    if out:
        from gateway.tools.loadtest.chart import render_agent_html

        Path(out).write_text(render_agent_html(tiers, args.agent_loop, premium(tiers), estimate_line(tiers)),
                             encoding="utf-8")
        print(f"chart: {out}")
    return 1 if runs and all(r.failed for r in runs) else 0
