"""Benchmark Tiergate against a direct connection to the same upstream, in the same run.

    .venv/bin/python -m bench.run [--quick] [--out DIR] [--repeat N] [--profile] [--phases ttft,chunks,...]

Starts the bench upstream (``bench/upstream.py``) pinned to CPU 0, the gateway (``python -m gateway serve``)
pinned to CPU 1 and, on CPU 1 too, two reference proxies: ``bench/minproxy.py`` (the least a Python proxy on
uvicorn + aiohttp does) and, when ``/usr/sbin/nginx`` exists, nginx with ``proxy_buffering off``; the load
generator is this process, pinned to CPU 0. Writes ``bench.json`` (every figure) and ``bench.md``
(the table) into ``--out``. Method and how to read the table: ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import importlib.metadata
import json
import math
import os
import platform
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench import loadgen, procs, report
from bench.loadgen import Tally

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("ttft", "chunks", "rps", "rss", "sweep")
VARIANTS = ("nolog", "keys", "redis", "traced", "otelmetrics")  # --variants: one setting changed (report.REFERENCES)


@dataclass(frozen=True)
class Sizes:
    """Every size and bound of one run."""

    ttft_requests: int = 200
    ttft_tokens: int = 4
    chunk_conc: tuple[int, ...] = (1, 32, 64)
    chunk_tokens: int = 300
    chunk_tps: float = 750.0
    chunk_duration: float = 5.0
    rps_conc: int = 64
    rps_duration: float = 5.0
    rss_levels: tuple[int, int] = (256, 1024)
    rss_tps: float = 1.0
    rss_settle: float = 2.0
    sweep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    sweep_tokens: int = 300
    sweep_duration: float = 3.0
    warmup_requests: int = 20
    phases: tuple[str, ...] = field(default=PHASES)


FULL = Sizes()
QUICK = Sizes(ttft_requests=20, chunk_conc=(1, 8), chunk_tokens=50, chunk_duration=1.0, rps_duration=1.0,
              rss_levels=(8, 32), rss_settle=1.2, sweep=(1, 8), sweep_tokens=50, sweep_duration=1.0,
              warmup_requests=5)


@dataclass
class Target:
    """Where the load generator sends requests: ``direct`` (the upstream), ``tiergate``, or a reference proxy
    (``minproxy``, ``nginx``: see ``report.REFERENCES``)."""

    name: str
    url: str
    pids: list[int]  # the proxy's processes (empty for direct)
    sess: aiohttp.ClientSession | None = None

    @property
    def proxy(self) -> bool:
        return bool(self.pids)


class Meter:
    """CPU seconds over one phase: the proxy (utime+stime, children included), the upstream, this process
    (the load generator) and the whole machine (/proc/stat), from which the CPU used outside the bench.

    ``peer_pids``: other bench proxies busy during the same interval (the interleaved TTFT phase); their CPU
    is not counted as used outside the bench."""

    def __init__(self, proxy_pids: list[int], upstream_pid: int, peer_pids: list[int] | None = None) -> None:
        self.proxy_pids = proxy_pids
        self.upstream_pid = upstream_pid
        self.peer_pids = peer_pids or []
        self.result: dict[str, Any] = {}

    def _sample(self) -> tuple[float, float, float, float, float, float, float]:
        splits = [procs.cpu_split(p) for p in self.proxy_pids]
        user, system = sum(u for u, _ in splits), sum(s for _, s in splits)
        return (time.monotonic(), user + system, procs.cpu_seconds(self.upstream_pid), procs.self_cpu_seconds(),
                procs.system_busy_seconds(), system, sum(procs.cpu_seconds(p) for p in self.peer_pids))

    def __enter__(self) -> Meter:
        self.t0 = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        t1 = self._sample()
        elapsed, proxy, up, gen, busy, proxy_sys, peers = (b - a for a, b in zip(self.t0, t1, strict=True))
        elapsed = max(elapsed, 1e-9)
        other = max(0.0, busy - proxy - up - gen - peers)
        self.result.update(
            elapsed_s=elapsed, proxy_cpu_s=proxy if self.proxy_pids else None,
            proxy_system_cpu_s=proxy_sys if self.proxy_pids else None, upstream_cpu_s=up, loadgen_cpu_s=gen,
            other_cpu_s=other, proxy_cpu_util=proxy / elapsed if self.proxy_pids else None,
            cpu0_util=(up + gen) / elapsed, other_cpu_util=other / elapsed)


def summarize(tally: Tally, meter: dict[str, Any], window_s: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": tally.requests, "ok": tally.ok, "chunks": tally.chunks, "errors": dict(tally.errors),
        "errors_total": tally.error_count, "ttft": report.ms_summary(tally.ttft_ns),
        "delay": report.ms_summary(tally.delays_ns), "latency": report.ms_summary(tally.latency_ns), "meter": meter,
    }
    if window_s:
        out["delivered_chunks_per_s"] = tally.window_chunks / window_s
    cpu = meter.get("proxy_cpu_s")
    if cpu is not None and tally.chunks:
        out["cpu_ms_per_1k_chunks"] = cpu * 1e6 / tally.chunks
    return out


class Bench:
    """One run of every phase against every target (async; this process is the load generator)."""

    def __init__(self, sizes: Sizes, targets: list[Target], upstream_pid: int, raw: bool) -> None:
        self.sizes = sizes
        self.targets = targets
        self.upstream_pid = upstream_pid
        self.raw = raw
        self.phase = ""
        self.out: dict[str, Any] = {"targets": [t.name for t in targets], "meters": {}, "warmup_errors": {}}
        self.raw_samples: dict[str, Any] = {}

    def meter(self, phase: str, target: Target, *, interleaved: bool = False) -> Meter:
        peers = [p for t in self.targets if interleaved and t is not target for p in t.pids]
        m = Meter(target.pids, self.upstream_pid, peers)
        self.out["meters"].setdefault(phase, {})[target.name] = m.result
        return m

    async def warm(self, t: Target, *, streams: int, requests: int | None = None) -> None:
        assert t.sess is not None
        tally = await loadgen.warmup(t.sess, t.url, streams=streams,
                                     requests=self.sizes.warmup_requests if requests is None else requests)
        if tally.error_count:
            w = self.out["warmup_errors"].setdefault(t.name, {})
            for k, v in tally.errors.items():
                w[f"{self.phase}: {k}"] = w.get(f"{self.phase}: {k}", 0) + v

    async def run(self) -> dict[str, Any]:
        for t in self.targets:
            t.sess = loadgen.session()
        try:
            for phase in self.sizes.phases:
                log(f"  phase {phase}")
                self.phase = phase
                await getattr(self, f"phase_{phase}")()
        finally:
            for t in self.targets:
                if t.sess is not None:
                    await t.sess.close()
        self.out["figures"] = self.figures()
        return self.out

    # --- phases -------------------------------------------------------------------------------------------

    async def phase_ttft(self) -> None:
        """Concurrency 1: requests to each target interleaved (A B B A ...), short streams."""
        s = self.sizes
        for t in self.targets:
            await self.warm(t, streams=1)
        tallies = {t.name: Tally(keep_delays=False) for t in self.targets}
        meters = {t.name: self.meter("ttft (interleaved)", t, interleaved=True) for t in self.targets if t.proxy}
        for m in meters.values():
            m.__enter__()
        try:
            async with asyncio.timeout(30 + s.ttft_requests * 2.0):
                for i in range(s.ttft_requests):
                    order = self.targets if i % 2 == 0 else self.targets[::-1]
                    for t in order:
                        assert t.sess is not None
                        await loadgen.one_stream(t.sess, t.url, s.ttft_tokens, s.chunk_tps, tallies[t.name],
                                                 timeout=30.0)
        except TimeoutError:
            for tally in tallies.values():
                tally.error("phase_timeout")
        for m in meters.values():
            m.__exit__()
        res = {}
        for t in self.targets:
            meter = meters[t.name].result if t.name in meters else {}
            res[t.name] = summarize(tallies[t.name], meter)
            if t.name in meters:
                res[t.name]["cpu_ms_per_stream_request"] = (meter["proxy_cpu_s"] * 1e3 / max(1, tallies[t.name].ok))
            self.raw_samples.setdefault("ttft_ns", {})[t.name] = tallies[t.name].ttft_ns
        self.out["ttft"] = res

    async def phase_chunks(self) -> None:
        """``c`` concurrent streams of ``chunk_tokens`` at ``chunk_tps``, back to back, for ``chunk_duration``."""
        s = self.sizes
        stream_s = s.chunk_tokens / s.chunk_tps
        res: dict[str, Any] = {}
        for c in s.chunk_conc:
            per: dict[str, Any] = {}
            max_requests = 2 * math.ceil(s.chunk_duration * c / stream_s) + c
            for t in self.targets:
                assert t.sess is not None
                await self.warm(t, streams=c)
                with self.meter(f"chunks c={c}", t) as m:
                    tally, window = await loadgen.closed_loop_streams(
                        t.sess, t.url, conc=c, tokens=s.chunk_tokens, tps=s.chunk_tps, duration=s.chunk_duration,
                        max_requests=max_requests, stagger=stream_s if c > 1 else 0.0)
                per[t.name] = summarize(tally, m.result, window)
                if self.raw:
                    self.raw_samples.setdefault("chunk_delay_ns", {}).setdefault(str(c), {})[t.name] = tally.delays_ns
            per["offered_chunks_per_s"] = c * s.chunk_tps
            res[str(c)] = per
        self.out["chunks"] = res

    async def phase_rps(self) -> None:
        """Non-streaming requests, ``rps_conc`` concurrent, for ``rps_duration`` seconds."""
        s = self.sizes
        res: dict[str, Any] = {}
        for t in self.targets:
            assert t.sess is not None
            await self.warm(t, streams=0)
            warm, _ = await loadgen.closed_loop_requests(t.sess, t.url, conc=s.rps_conc, duration=0.3,
                                                         max_requests=100_000)
            if warm.error_count:
                self.out["warmup_errors"].setdefault(t.name, {})["rps: warm-up"] = dict(warm.errors)
            with self.meter("rps", t) as m:
                tally, elapsed = await loadgen.closed_loop_requests(
                    t.sess, t.url, conc=s.rps_conc, duration=s.rps_duration, max_requests=int(s.rps_duration * 50_000))
            r = summarize(tally, m.result)
            r["rps"] = tally.ok / elapsed
            if t.proxy and tally.ok:
                r["cpu_ms_per_request"] = m.result["proxy_cpu_s"] * 1e3 / tally.ok
                r["rps_cpu_bound"] = tally.ok / m.result["proxy_cpu_s"] if m.result["proxy_cpu_s"] else None
            res[t.name] = r
        self.out["rps"] = res

    async def phase_rss(self) -> None:
        """Slow streams held open: proxy VmRSS idle, at each level, and after closing them."""
        s = self.sizes
        res: dict[str, Any] = {}
        lo, hi = s.rss_levels
        for t in self.targets:
            if not t.proxy:
                continue
            assert t.sess is not None
            await self.warm(t, streams=8)
            await asyncio.sleep(0.5)
            r: dict[str, Any] = {"idle_rss_bytes": self.rss(t)}
            held = loadgen.HeldStreams(t.sess, t.url, tps=s.rss_tps, tokens=3600)
            try:
                async with asyncio.timeout(120 + hi / 10):
                    for level in (lo, hi):
                        ok = await held.grow(level, timeout=60.0)
                        await asyncio.sleep(s.rss_settle)
                        r[f"rss_bytes_{level}"] = self.rss(t)
                        r[f"open_{level}"] = held.open
                        r[f"opened_ok_{level}"] = ok
                        if not ok or held.open < level:
                            held.tally.error(f"not_all_open_at_{level}")
            except TimeoutError:
                held.tally.error("phase_timeout")
            finally:
                await held.close()
            await asyncio.sleep(1.0)
            r["rss_bytes_after_close"] = self.rss(t)
            r["errors"] = dict(held.tally.errors)
            r["errors_total"] = held.tally.error_count
            res[t.name] = r
        self.out["rss"] = res

    async def phase_sweep(self) -> None:
        """1 -> N concurrent streams at ``chunk_tps``: delivered chunks/s and TTFT p50 per step."""
        s = self.sizes
        stream_s = s.sweep_tokens / s.chunk_tps
        res: dict[str, Any] = {}
        for c in s.sweep:
            per: dict[str, Any] = {"offered_chunks_per_s": c * s.chunk_tps}
            for t in self.targets:
                assert t.sess is not None
                await self.warm(t, streams=c, requests=0)
                with self.meter(f"sweep c={c}", t) as m:
                    tally, window = await loadgen.closed_loop_streams(
                        t.sess, t.url, conc=c, tokens=s.sweep_tokens, tps=s.chunk_tps, duration=s.sweep_duration,
                        max_requests=4 * math.ceil(s.sweep_duration * c / stream_s) + c,
                        stagger=min(stream_s, s.sweep_duration / 3) if c > 1 else 0.0)
                per[t.name] = summarize(tally, m.result, window)
            res[str(c)] = per
        self.out["sweep"] = res

    # --- figures ------------------------------------------------------------------------------------------

    def rss(self, t: Target) -> int:
        return sum(procs.rss_bytes(p) for p in t.pids)

    def figures(self) -> dict[str, dict[str, Any]]:
        """``figure -> target -> value``: the numbers the table is built from."""
        s = self.sizes
        f: dict[str, dict[str, Any]] = {}

        def put(key: str, target: str, value: Any) -> None:
            f.setdefault(key, {})[target] = value

        errors: dict[str, int] = {t.name: 0 for t in self.targets}
        if "ttft" in self.out:
            for name, r in self.out["ttft"].items():
                put("ttft_p50_ms", name, r["ttft"].get("p50"))
                put("ttft_p99_ms", name, r["ttft"].get("p99"))
                if "cpu_ms_per_stream_request" in r:
                    put("cpu_ms_per_stream_request", name, r["cpu_ms_per_stream_request"])
                errors[name] += r["errors_total"]
        for c, per in self.out.get("chunks", {}).items():
            for name in errors:
                r = per.get(name)
                if r is None:
                    continue
                put(f"chunk_p50_ms_c{c}", name, r["delay"].get("p50"))
                put(f"chunk_p99_ms_c{c}", name, r["delay"].get("p99"))
                if "cpu_ms_per_1k_chunks" in r:
                    put(f"cpu_ms_per_1k_chunks_c{c}", name, r["cpu_ms_per_1k_chunks"])
                errors[name] += r["errors_total"]
        for name, r in self.out.get("rps", {}).items():
            put("rps", name, r["rps"])
            if "cpu_ms_per_request" in r:
                put("cpu_ms_per_request", name, r["cpu_ms_per_request"])
                put("rps_proxy_cpu_util", name, r["meter"]["proxy_cpu_util"] * 100)
                put("rps_cpu_bound", name, r.get("rps_cpu_bound"))
            errors[name] += r["errors_total"]
        lo, hi = s.rss_levels
        for name, r in self.out.get("rss", {}).items():
            mib = 1024 * 1024
            put("rss_idle_mib", name, r["idle_rss_bytes"] / mib)
            if f"rss_bytes_{lo}" in r:
                put(f"rss_{lo}_mib", name, r[f"rss_bytes_{lo}"] / mib)
            if f"rss_bytes_{hi}" in r:
                put(f"rss_{hi}_mib", name, r[f"rss_bytes_{hi}"] / mib)
            if f"rss_bytes_{lo}" in r and f"rss_bytes_{hi}" in r:
                put("rss_per_stream_kib", name, (r[f"rss_bytes_{hi}"] - r[f"rss_bytes_{lo}"]) / 1024 / (hi - lo))
            errors[name] += r["errors_total"]
        for per in self.out.get("sweep", {}).values():
            for name in errors:
                if name in per:
                    errors[name] += per[name]["errors_total"]
        for name, n in errors.items():
            put("errors", name, n)
        return f


# --- orchestration ----------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("aiohttp", "uvicorn", "uvloop", "httptools", "starlette", "fastapi", "orjson"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def idle_load(seconds: float = 1.0) -> float:
    """CPU cores busy on this machine while the bench runs nothing (other users' load)."""
    b0, t0 = procs.system_busy_seconds(), time.monotonic()
    time.sleep(seconds)
    return (procs.system_busy_seconds() - b0) / (time.monotonic() - t0)


def run_once(args: argparse.Namespace, sizes: Sizes, out: Path, idx: int, pin: bool) -> dict[str, Any]:
    """Start the upstream, the gateway (and nginx), run every phase, stop everything."""
    py = sys.executable
    suffix = f"-{idx}" if args.repeat > 1 else ""
    with procs.Children() as kids:
        up = kids.start("upstream", procs.pin_prefix(0 if pin else None) + [
            py, "-m", "bench.upstream", "--port", "0", *(["--ratelimit-headers"] if args.redis else [])],
            out / f"upstream{suffix}.log", cwd=ROOT)
        up_port = procs.wait_upstream_ready(up)
        procs.wait_http_ready(up, f"http://127.0.0.1:{up_port}/healthz")
        cfg = out / f"gateway{suffix}.yaml"
        cfg.write_text(procs.gateway_config(up_port))
        gw_port = procs.free_port()
        prof = out / f"gateway{suffix}.prof"
        gw_cmd = procs.pin_prefix(1 if pin else None) + [py]
        gw_cmd += ["-m", "bench.gwprofile", str(prof)] if args.profile else ["-m", "gateway"]
        gw_cmd += ["serve", "--config", str(cfg), "--host", "127.0.0.1", "--port", str(gw_port),
                   "--log-level", "warning", "--workers", str(args.workers)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env["GATEWAY_STATE_DIR"] = str((out / f"state{suffix}").resolve())  # the keys variant's spend: the run's own
        # uvicorn re-raises the stop signal after its graceful shutdown; under the profiler that must be SIGINT
        # (KeyboardInterrupt unwinds to bench.gwprofile, which then writes its file); SIGTERM would kill it first.
        gw = kids.start("tiergate", gw_cmd, out / f"gateway{suffix}.log", cwd=ROOT, env=env,
                        stop_signal=signal.SIGINT if args.profile else signal.SIGTERM)
        procs.wait_http_ready(gw, f"http://127.0.0.1:{gw_port}/healthz")
        gw_pids = [gw.pid]
        if args.workers > 1:  # uvicorn's supervisor spawns the workers; count them all (they are not reaped yet)
            deadline = time.monotonic() + 30
            while len(procs.descendants(gw.pid)) < args.workers and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # every worker has imported the app and listens
            gw_pids += procs.descendants(gw.pid)
        targets = [Target("direct", f"http://127.0.0.1:{up_port}/v1/chat/completions", []),
                   Target("tiergate", f"http://127.0.0.1:{gw_port}/v1/chat/completions", gw_pids)]
        started = [f"upstream :{up_port} (pid {up.pid})", f"tiergate :{gw_port} (pid {gw.pid})"]
        if not args.no_minproxy:
            mp_port = procs.free_port()
            mp = kids.start("minproxy", procs.pin_prefix(1 if pin else None) + [
                py, "-m", "bench.minproxy", "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(mp_port)],
                out / f"minproxy{suffix}.log", cwd=ROOT)
            procs.wait_http_ready(mp, f"http://127.0.0.1:{mp_port}/healthz")
            targets.append(Target("minproxy", f"http://127.0.0.1:{mp_port}/v1/chat/completions", [mp.pid]))
            started.append(f"minproxy :{mp_port} (pid {mp.pid})")
        if args.redis:  # the same gateway, its state shared through a redis-server beside the upstream (CPU 0)
            rd_port = procs.free_port()
            rd = kids.start("redis-server", procs.pin_prefix(0 if pin else None) + [
                "redis-server", "--port", str(rd_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                out / f"redis{suffix}.log")
            started.append(f"redis-server :{rd_port} (pid {rd.pid})")
        otlp = None
        if {"traced", "otelmetrics"} & set(args.variants):  # their exports go to a sink beside the upstream (CPU 0)
            sink_port = procs.free_port()
            sink = kids.start("otlpsink", procs.pin_prefix(0 if pin else None) + [
                py, "-m", "bench.otlpsink", "--port", str(sink_port)], out / f"otlpsink{suffix}.log", cwd=ROOT)
            procs.wait_http_ready(sink, f"http://127.0.0.1:{sink_port}/healthz")
            otlp = f"http://127.0.0.1:{sink_port}"
            started.append(f"otlpsink :{sink_port} (pid {sink.pid})")
        for name in args.variants:  # the same gateway again, one setting changed (report.REFERENCES says which)
            vcfg = out / f"gateway-{name}{suffix}.yaml"
            vcfg.write_text(procs.gateway_config(up_port, f"redis://127.0.0.1:{rd_port}/0" if name == "redis" else None,
                                                 keys=name == "keys"))
            venv = {**env, "GATEWAY_LOG_SAMPLE": "0"} if name == "nolog" else dict(env)
            if name in ("traced", "otelmetrics"):
                venv["OTEL_EXPORTER_OTLP_ENDPOINT"] = str(otlp)
                venv["OTEL_TRACES_EXPORTER" if name == "traced" else "OTEL_METRICS_EXPORTER"] = "otlp"
            v_port = procs.free_port()
            vg = kids.start(f"tiergate-{name}", procs.pin_prefix(1 if pin else None) + [
                py, "-m", "gateway", "serve", "--config", str(vcfg), "--host", "127.0.0.1", "--port", str(v_port),
                "--log-level", "warning"], out / f"gateway-{name}{suffix}.log", cwd=ROOT, env=venv)
            procs.wait_http_ready(vg, f"http://127.0.0.1:{v_port}/healthz")
            if name == "redis":
                time.sleep(0.5)  # it has connected to Redis (in the background: start-up never waits for it)
            targets.append(Target(name, f"http://127.0.0.1:{v_port}/v1/chat/completions", [vg.pid]))
            started.append(f"tiergate-{name} :{v_port} (pid {vg.pid})")
        if procs.NGINX.exists() and not args.no_nginx:
            ng_port = procs.free_port()
            ng_dir = (out / f"nginx{suffix}").resolve()
            ng_dir.mkdir(exist_ok=True)
            (ng_dir / "nginx.conf").write_text(procs.nginx_config(ng_dir, ng_port, up_port))
            ng = kids.start("nginx", procs.pin_prefix(1 if pin else None) + [str(procs.NGINX), "-p", str(ng_dir),
                                                                           "-c", str(ng_dir / "nginx.conf")],
                            ng_dir / "nginx.log")
            procs.wait_http_ready(ng, f"http://127.0.0.1:{ng_port}/healthz")
            time.sleep(0.2)
            targets.append(Target("nginx", f"http://127.0.0.1:{ng_port}/v1/chat/completions",
                                  [ng.pid, *procs.descendants(ng.pid)]))
            started.append(f"nginx :{ng_port} (pid {ng.pid})")
        skipped = [f"{name} {st}" for name, st in reference_status(args).items() if st != "measured"]
        log(f"run {idx + 1}/{args.repeat}: {', '.join(started)}" + "".join(f"; {x}" for x in skipped))
        bench = Bench(sizes, targets, up.pid, args.raw)
        import uvloop

        result = uvloop.run(bench.run())
        result["gateway_rss_end_mib"] = procs.rss_bytes(gw.pid) / 1024 / 1024
        if args.raw:
            (out / f"raw{suffix}.json").write_text(json.dumps(bench.raw_samples))
        for child in list(kids.kids):
            if not child.alive():
                result.setdefault("crashed", []).append(child.name)
        code = kids.stop(gw)
        result["gateway_exit_code"] = code
    if args.profile and prof.exists():
        import pstats

        with (out / f"gateway-profile{suffix}.txt").open("w") as fh:
            st = pstats.Stats(str(prof), stream=fh)
            st.sort_stats("tottime").print_stats(50)
            st.sort_stats("cumulative").print_stats(70)
    return result


def reference_status(args: argparse.Namespace) -> dict[str, str]:
    """Per reference proxy: "measured", or why it was skipped (recorded in bench.json's meta)."""
    return {"minproxy": "skipped (--no-minproxy)" if args.no_minproxy else "measured",
            "nginx": "skipped (--no-nginx)" if args.no_nginx else
            "measured" if procs.NGINX.exists() else f"skipped ({procs.NGINX} not installed)",
            **{name: "measured" if name in args.variants else "skipped (not in --variants)" for name in VARIANTS}}


def markdown(meta: dict[str, Any], rows: list[report.Row], runs: list[dict[str, Any]], repeat: int) -> str:
    refs = report.references(runs[0])
    # bench.json files from before minproxy existed carry no "references": only whether nginx ran is known.
    status = meta.get("references") or {"nginx": "measured" if "nginx" in refs else "skipped"}
    described = ", ".join(f"{name} ({report.REFERENCES[name]})" for name in refs) or "none"
    described += "".join(f"; {name} {st}" for name, st in status.items() if name not in refs)
    v = meta["versions"]
    lines = [
        f"# Tiergate benchmark{' (quick smoke run)' if meta['quick'] else ''}",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['nproc']} CPUs, {meta['cpu_model']}; pinned: {meta['pinning']}",
        f"- Python {v['python']}, aiohttp {v['aiohttp']}, uvicorn {v['uvicorn']}, uvloop {v['uvloop']}, "
        f"httptools {v['httptools']}, starlette {v['starlette']}, orjson {v['orjson']}",
        f"- gateway: git {meta['git']}, `--workers {meta.get('gateway_workers', 1)}`",
        f"- command: `{meta.get('command', 'python -m bench.run')}`",
        f"- load before the run: loadavg {meta['loadavg_before']}, {meta['idle_other_cores']:.2f} cores busy outside "
        f"the bench; after: loadavg {meta['loadavg_after']}",
        f"- runs: {repeat}" + (" (cells are the mean; spread = max - min of the judged column)" if repeat > 1 else ""),
        f"- reference proxies: {described}",
        "",
        "added = tiergate minus direct, same run (for percentiles: difference of the percentiles); "
        "`<reference> added` is the same for that reference proxy. "
        "CPU and RSS figures are the proxy process's own (utime+stime incl. children, VmRSS).",
        "",
        report.markdown_table(rows, refs=refs, repeat=repeat),
        "",
    ]
    if runs[0].get("sweep"):
        lines += [f"## Sweep (run 1): concurrent streams at {meta['sizes']['chunk_tps']:g} tokens/s each", "",
                  report.sweep_table(runs[0]), ""]
    lines += ["## Conditions (run 1): CPU use per phase", "",
              "CPU 0 hosts the upstream and the load generator; near 100 % it, not the proxy, limits the figures.",
              "", report.conditions_table(runs[0]), ""]
    errs = {k: v for r in runs for k, v in r.get("warmup_errors", {}).items() if v}
    if errs:
        lines += [f"Warm-up errors (not counted above): {errs}", ""]
    for i, r in enumerate(runs):
        if r.get("crashed"):
            lines += [f"run {i + 1}: processes that died during the run: {r['crashed']}", ""]
    return "\n".join(lines)


def render(path: Path, out: Path) -> int:
    """Rebuild the Markdown report from a ``bench.json`` (e.g. after changing the table layout)."""
    data = json.loads(path.read_text())
    meta, runs = data["meta"], data["runs"]
    rows = report.aggregate([report.build_rows(r, meta["sizes"]) for r in runs])
    md = markdown(meta, rows, runs, len(runs))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (< 60 s): the CI smoke run")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="output folder (default bench/out)")
    p.add_argument("--repeat", type=int, default=1, help="run everything N times and report the spread")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--profile", action="store_true",
                   help="run the gateway under cProfile with a CPU clock (bench/gwprofile.py; the figures are then "
                        "NOT comparable); writes gateway.prof and gateway-profile.txt")
    p.add_argument("--raw", action="store_true", help="also write every TTFT and chunk-delay sample (raw*.json)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--no-minproxy", action="store_true", help="skip the minimal Python reference proxy")
    p.add_argument("--workers", type=int, default=1,
                   help="run the gateway with `tiergate serve --workers N` (its CPU figures then sum every worker; "
                        "use with --no-pin, or every worker shares the proxy's one core)")
    p.add_argument("--no-nginx", action="store_true", help="skip nginx even when installed")
    p.add_argument("--variants", default="", help=f"comma-separated subset of {','.join(VARIANTS)}: also measure the "
                   "gateway with that one setting changed, in the same run (bench/README.md); redis also makes the "
                   "upstream send rate-limit headers (every target sees them)")
    p.add_argument("--redis", action="store_true", help="the same as --variants redis")
    p.add_argument("--render", type=Path, metavar="BENCH_JSON",
                   help="only rebuild bench.md (into --out) from an earlier bench.json; runs nothing")
    args = p.parse_args(argv)
    args.variants = [x.strip() for x in args.variants.split(",") if x.strip()]
    if args.redis and "redis" not in args.variants:
        args.variants.append("redis")
    if bad := [x for x in args.variants if x not in VARIANTS]:
        p.error(f"unknown variant(s): {', '.join(bad)}")
    args.redis = "redis" in args.variants
    if args.render:
        return render(args.render, args.out)
    phases = tuple(x.strip() for x in args.phases.split(",") if x.strip())
    if bad := [x for x in phases if x not in PHASES]:
        p.error(f"unknown phase(s): {', '.join(bad)}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.workers < 1 or (args.workers > 1 and args.profile):
        p.error("--workers must be >= 1, and 1 with --profile")
    sizes = replace(QUICK if args.quick else FULL, phases=phases)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    # SIGTERM behaves like Ctrl-C: unwind, and the finally blocks stop every child.
    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
    nofile = procs.raise_nofile(65536)
    ncpu = os.cpu_count() or 1
    pin = not args.no_pin and ncpu >= 2 and hasattr(os, "sched_setaffinity")
    if pin:
        os.sched_setaffinity(0, {0})
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "quick": args.quick,
        "nproc": ncpu, "cpu_model": procs.cpu_model(), "versions": versions(), "git": procs.git_rev(),
        "pinning": "upstream + load generator on CPU 0, proxy on CPU 1" if pin else "no",
        "gateway_workers": args.workers, "nofile_limit": nofile, "sizes": asdict(sizes),
        "loadavg_before": procs.loadavg(),
        "references": reference_status(args),
        "idle_other_cores": idle_load(1.0), "command": " ".join([Path(sys.executable).name, "-m", "bench.run",
                                                                 *(argv if argv is not None else sys.argv[1:])]),
    }
    log(f"{'quick' if args.quick else 'full'} run, phases {','.join(phases)}; output in {out}; "
        f"{meta['idle_other_cores']:.2f} cores busy outside the bench")
    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for i in range(args.repeat):
            gc.collect()
            runs.append(run_once(args, sizes, out, i, pin))
    except KeyboardInterrupt:
        log("interrupted; every child process has been stopped")
        return 130
    except RuntimeError as exc:  # a process did not start; its log tail is in the message
        log(f"failed: {exc}")
        return 1
    meta["loadavg_after"] = procs.loadavg()
    meta["wall_s"] = time.monotonic() - t0
    rows = report.aggregate([report.build_rows(r, asdict(sizes)) for r in runs])
    md = markdown(meta, rows, runs, args.repeat)
    (out / "bench.md").write_text(md)
    (out / "bench.json").write_text(json.dumps({"meta": meta, "table": [r.as_dict() for r in rows], "runs": runs},
                                               indent=1, default=str))
    print(md)
    total_errors = sum(int(r.get("figures", {}).get("errors", {}).get("tiergate", 0) or 0) for r in runs)
    log(f"done in {meta['wall_s']:.0f} s; wrote {out / 'bench.md'} and {out / 'bench.json'}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 1 if total_errors or any(r.get("crashed") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
