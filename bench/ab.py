"""Interleaved A/B of gateway variants: CPU per 1,000 relayed chunks and per plain request, next to minproxy.

    .venv/bin/python -m bench.ab [--rounds N] [--phases chunks,rps] [--tokens 300] [--keys] [--latency] NAME=SPEC ...

Each ``NAME=SPEC`` is one process on CPU 1 (the bench upstream and this load generator on CPU 0, as ``bench.run``):
``minproxy`` (``bench/minproxy.py``), ``NAME=`` (the gateway of this tree), ``NAME=@DIR[,VAR=VALUE...]`` (the
gateway of another checkout, e.g. a ``git worktree`` of an older commit, with those variables), or
``NAME=VAR=VALUE[,VAR=VALUE]`` (this tree with those environment variables, e.g. ``nolog=GATEWAY_LOG_SAMPLE=0``), or
``direct`` (no proxy: the bench upstream itself).
With ``--latency`` the chunks phase also keeps each chunk's delay and reports its p50 and p99 per round, and with a
``direct`` target each one's added p50 and p99 (its percentile minus direct's of the same round): the per-chunk
latency judged like the CPU, interleaved, instead of from one run whose slow minute may land on one target. Every
round measures every process in turn (32 streams of
``--tokens`` tokens at 750 tokens/s for 6 s, then 64 concurrent plain requests for 4 s), so that a slow minute of a
shared machine lands on all of them; the summary is the median over rounds [min, max]. For deciding whether a change
to the hot path pays (bench.run's single figures move by ~10 % run to run on this VM); bench.run makes the table.
Every phase is bounded in time and count; nothing listens anywhere but 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import loadgen, procs, report

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="+", metavar="NAME=SPEC", help="minproxy, NAME=, NAME=@DIR or NAME=VAR=VALUE,...")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--phases", default="chunks,rps", help="chunks, rps or both (default)")
    p.add_argument("--tokens", type=int, default=300, help="tokens per stream in the chunks phase (default 300)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "ab", help="where the process logs go")
    p.add_argument("--keys", action="store_true", help="gateway keys on, as bench.run's keys variant")
    p.add_argument("--latency", action="store_true", help="also each chunk's delay: p50 and p99 per round (ms)")
    a = p.parse_args(argv)
    phases = {x.strip() for x in a.phases.split(",") if x.strip()}
    if not phases <= {"chunks", "rps"} or a.rounds < 1 or a.tokens < 2:
        p.error("--phases takes chunks and/or rps; --rounds >= 1; --tokens >= 2")
    a.out.mkdir(parents=True, exist_ok=True)
    procs.raise_nofile(65536)
    os.sched_setaffinity(0, {0})
    py = sys.executable
    with procs.Children() as kids:
        up = kids.start("upstream", procs.pin_prefix(0) + [py, "-m", "bench.upstream", "--port", "0"],
                        a.out / "upstream.log", cwd=ROOT)
        up_port = procs.wait_upstream_ready(up)
        cfg = a.out / "gateway.yaml"
        cfg.write_text(procs.gateway_config(up_port, keys=a.keys))
        targets: dict[str, tuple[int, str]] = {}
        for spec in a.targets:
            name, _, rest = spec.partition("=")
            if name == "direct":
                targets[name] = (0, f"http://127.0.0.1:{up_port}/v1/chat/completions")  # no process of its own
                continue
            env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
            cwd = ROOT
            if rest.startswith("@"):  # @DIR[,VAR=VALUE...]: another checkout, with those variables
                where, _, rest = rest[1:].partition(",")
                cwd = Path(where).resolve()
            for pair in filter(None, rest.split(",")):
                key, _, value = pair.partition("=")
                env[key] = value
            port = procs.free_port()
            cmd = ([py, "-m", "bench.minproxy", "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(port)]
                   if name == "minproxy" else
                   [py, "-m", "gateway", "serve", "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
                    "--log-level", "warning"])
            state = str((a.out / f"state-{name}").resolve())  # with --keys: each gateway's spend its own
            child = kids.start(name, procs.pin_prefix(1) + cmd, a.out / f"{name}.log", cwd=cwd,
                               env={"GATEWAY_STATE_DIR": state, **env, "PYTHONPATH": str(cwd)})
            procs.wait_http_ready(child, f"http://127.0.0.1:{port}/healthz")
            targets[name] = (child.pid, f"http://127.0.0.1:{port}/v1/chat/completions")
        import uvloop

        results = uvloop.run(_measure(targets, phases, a.rounds, a.tokens, a.latency))
    if "direct" in results:
        base = results["direct"]
        for cells in results.values():
            for q in ("p50", "p99"):
                if cells.get(q) and base.get(q) and cells is not base:
                    cells[f"{q} added"] = [x - d for x, d in zip(cells[q], base[q], strict=True)]
    for name, cells in results.items():
        print(name, "  ".join(f"{k}: median {statistics.median(v):.{d}f} [{min(v):.{d}f}, {max(v):.{d}f}]"
                              for k, v in cells.items() if v for d in [3 if k.startswith("p") else 2]))
    return 0


async def _measure(targets: dict[str, tuple[int, str]], phases: set[str], rounds: int,
                   tokens: int, latency: bool = False) -> dict[str, dict[str, list[float]]]:
    """Per target: "chunks" (CPU us per relayed chunk = ms per 1,000) and "rps" (CPU us per plain request); with
    ``latency``, "p50" and "p99" of the chunks' delays (ms). A pid of 0 (``direct``) has no CPU figures."""
    out: dict[str, dict[str, list[float]]] = {n: {"chunks": [], "rps": [], "p50": [], "p99": []} for n in targets}
    sess = loadgen.session()
    try:
        for r in range(rounds):
            for name, (pid, url) in targets.items():
                if "chunks" in phases:
                    await loadgen.closed_loop_streams(sess, url, conc=32, tokens=tokens, tps=750, duration=1.0,
                                                      max_requests=64, stagger=0.4, keep_delays=False)
                    c0 = procs.cpu_seconds(pid) if pid else 0.0
                    tally, _ = await loadgen.closed_loop_streams(sess, url, conc=32, tokens=tokens, tps=750,
                                                                 duration=6.0, max_requests=5000, stagger=0.4,
                                                                 keep_delays=latency)
                    _check(name, tally)
                    if pid:
                        out[name]["chunks"].append((procs.cpu_seconds(pid) - c0) * 1e6 / max(1, tally.chunks))
                    if latency:
                        delays = [ns / 1e6 for ns in tally.delays_ns]
                        out[name]["p50"].append(report.pct(delays, 50) or 0.0)
                        out[name]["p99"].append(report.pct(delays, 99) or 0.0)
                if "rps" in phases and pid:
                    await loadgen.closed_loop_requests(sess, url, conc=64, duration=0.5, max_requests=100_000)
                    c0 = procs.cpu_seconds(pid)
                    tally, _ = await loadgen.closed_loop_requests(sess, url, conc=64, duration=4.0,
                                                                  max_requests=200_000)
                    _check(name, tally)
                    out[name]["rps"].append((procs.cpu_seconds(pid) - c0) * 1e6 / max(1, tally.ok))
            print(f"round {r + 1}/{rounds}:", {n: {k: round(v[-1], 3) for k, v in d.items() if v}
                                               for n, d in out.items()}, flush=True)
    finally:
        await sess.close()
    return out


def _check(name: str, tally: Any) -> None:
    if tally.error_count:
        raise SystemExit(f"{name}: errors {dict(tally.errors)}")


if __name__ == "__main__":
    sys.exit(main())
