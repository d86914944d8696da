"""Where a streamed request's time to first token goes inside the gateway, phase by phase.

    .venv/bin/python -m bench.trace [--requests 300]

Starts the bench upstream on CPU 0 and the gateway on CPU 1 (as ``bench.run`` does), the gateway through
``python -m bench.trace gateway ...``, which builds the app with ``time.perf_counter()`` probes at its seams (a
policy and an upstream pool that time themselves, passed to ``create_app``, and an ASGI wrapper) and serves it
with the gateway's own uvicorn settings; then sends ``--requests`` 4-token streams one at a time, first straight to
the upstream, then through the gateway, and prints the p50, p99 and maximum of each (microseconds), then, for the
slowest 1 % through the gateway, each phase of its own (where an outlier's time went):

* client TTFT, direct and through the gateway (request start to the first content chunk, as ``bench.run``);
* inside the gateway: arrival -> body read -> routing start -> routing end -> ``UpstreamPool.send`` called ->
  upstream status line received -> first body bytes sent to the client.

At concurrency 1 the process sleeps between requests, so every figure is a cold-cache figure: each phase takes
longer than its CPU cost under load (``bench.layers``). The probes add about a microsecond each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs

ROOT = Path(__file__).resolve().parent.parent
PHASES = (("t0", "body"), ("body", "d0"), ("d0", "d1"), ("d1", "t1"), ("t1", "t2"), ("t2", "t3"))
NAMES = ("arrival -> body read", "body read -> routing start (parse, facts)", "routing (Policy.decide)",
         "routing end -> upstream request sent (plan, upstream body, attempt)",
         "send -> upstream status line (aiohttp + upstream)", "status line -> first bytes to the client")


def gateway_role(argv: list[str]) -> int:
    """``python -m bench.trace gateway OUT.json N CONFIG PORT``: the gateway with probes at its seams (a policy and an
    upstream pool that time themselves, given to ``create_app``, and an ASGI wrapper); writes the first N requests'
    phase times to OUT.json, then keeps serving."""
    out, limit, cfg, port = Path(argv[0]), int(argv[1]), Path(argv[2]), int(argv[3])
    import uvicorn

    from gateway.app import create_app
    from gateway.config.load import load_config
    from gateway.config.settings import Settings
    from gateway.http.server import uvicorn_options
    from gateway.routing.facts import Decision, RequestFacts
    from gateway.routing.policy import Policy
    from gateway.upstream.attempt import Answer
    from gateway.upstream.client import UpstreamPool

    records: list[dict[str, float]] = []
    cur: dict[str, float] = {}
    clock = time.perf_counter
    gc_started: list[float] = []

    def gc_pause(phase: str, info: dict[str, int]) -> None:  # the collector's pauses inside each request
        if phase == "start":
            gc_started[:] = [clock()]
        elif gc_started and "t0" in cur:
            cur[f"gc{info['generation']}"] = cur.get(f"gc{info['generation']}", 0.0) + clock() - gc_started[0]
    import gc
    gc.callbacks.append(gc_pause)
    if os.environ.get("TRACE_GC_THRESHOLD"):  # an experiment: the collector's first threshold
        gc.set_threshold(int(os.environ["TRACE_GC_THRESHOLD"]), *gc.get_threshold()[1:])

    class TimedPolicy(Policy):
        def decide(self, facts: RequestFacts, explain: bool = False) -> Decision:
            cur["d0"] = clock()
            decision = super().decide(facts, explain)
            cur["d1"] = clock()
            return decision

    class TimedPool(UpstreamPool):
        async def send(self, *a: Any, **k: Any) -> Answer:
            conns = self._session._connector._conns if self._session is not None else {}  # type: ignore[union-attr]
            cur["idle"] = float(sum(len(v) for v in conns.values()))  # pooled connections free to take now
            cur["t1"] = clock()
            answer = await super().send(*a, **k)
            cur["t2"] = clock()
            return answer

    loaded = load_config(cfg, {}, require_keys=False)
    app = create_app(loaded, transport=TimedPool(loaded.config.upstreams, loaded.keys),
                     policy=TimedPolicy(loaded.config))

    async def traced(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        cur.clear()
        cur["t0"] = clock()

        async def timed_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                cur.setdefault("body", clock())
            return message

        async def first_body(message: Any) -> None:
            if message["type"] == "http.response.body" and "t3" not in cur:
                cur["t3"] = clock()
            await send(message)
        await app(scope, timed_receive, first_body)
        if all(a in cur and b in cur for a, b in PHASES):
            records.append(dict(cur))
            if len(records) == limit:
                out.write_text(json.dumps(records))

    uvicorn.Server(uvicorn.Config(traced, **uvicorn_options("127.0.0.1", port, "warning", Settings()))).run()
    return 0


async def _streams(port: int, n: int) -> list[float]:
    """TTFT in seconds of ``n`` sequential 4-token streams to ``port``."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}
    out = []
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for _ in range(n):
            t0 = time.perf_counter()
            first = None
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                async for piece in r.content.iter_any():
                    if first is None and b'"content":"t=' in piece:
                        first = time.perf_counter()
            if first is None:
                raise RuntimeError("a stream had no content chunk")
            out.append(first - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "gateway":
        return gateway_role(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300, help="streams measured per target (after 50 warm-up)")
    args = p.parse_args(argv)
    n, warm = max(10, min(args.requests, 5000)), 50
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="tiergate-trace-") as tmp, procs.Children() as kids:
        d = Path(tmp)
        os.sched_setaffinity(0, {0})
        up = kids.start("upstream", procs.pin_prefix(0) + [py, "-m", "bench.upstream", "--port", "0"],
                        d / "upstream.log", cwd=ROOT)
        up_port = procs.wait_upstream_ready(up)
        cfg = d / "gateway.yaml"
        cfg.write_text(procs.gateway_config(up_port))
        gw_port = procs.free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        gw = kids.start("tiergate", procs.pin_prefix(1) + [py, "-m", "bench.trace", "gateway", str(d / "trace.json"),
                                                           str(warm + n), str(cfg), str(gw_port)],
                        d / "gateway.log", cwd=ROOT, env=env)
        procs.wait_http_ready(gw, f"http://127.0.0.1:{gw_port}/healthz")
        asyncio.run(_streams(up_port, warm))
        direct = asyncio.run(_streams(up_port, n))
        asyncio.run(_streams(gw_port, warm))
        via = asyncio.run(_streams(gw_port, n))
        deadline = time.monotonic() + 10
        while not (d / "trace.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        records = json.loads((d / "trace.json").read_text())[warm:]

    def q(xs: list[float], at: float) -> float:
        ordered = sorted(xs)
        return ordered[min(len(ordered) - 1, int(at * len(ordered)))] * 1e6

    def row(name: str, xs: list[float]) -> str:
        return f"| {name} | {q(xs, 0.5):.0f} | {q(xs, 0.99):.0f} | {max(xs) * 1e6:.0f} |"

    print(f"| phase ({n} sequential 4-token streams) | p50 us | p99 us | max us |\n|---|---:|---:|---:|")
    print(row("client TTFT, direct", direct))
    print(row("client TTFT, through the gateway", via))
    phases = [(name, [r[b] - r[a] for r in records]) for (a, b), name in zip(PHASES, NAMES, strict=True)]
    for name, xs in phases:
        print(row(f"gateway: {name}", xs))
    # the outliers: for the slowest 1 % through the gateway, where inside it their time went
    slow = sorted(range(len(via)), key=lambda i: via[i])[-max(1, len(via) // 100):]
    print(f"\nthe {len(slow)} slowest streams through the gateway (us): client TTFT, then each phase above, then the "
          "garbage collector's pauses inside the request by generation")
    for i in reversed(slow):
        pauses = " ".join(f"gc{g} {records[i][f'gc{g}'] * 1e6:.0f}" for g in range(3) if f"gc{g}" in records[i])
        pauses += f" idle connections {records[i].get('idle', -1):.0f}"
        print(f"  {via[i] * 1e6:.0f}: " + ", ".join(f"{xs[i] * 1e6:.0f}" for _, xs in phases) + f"  {pauses}")
    paused = {g: sum(f"gc{g}" in r for r in records) for g in range(3)}
    print(f"requests with a collection inside them, by generation: {paused}; sent with no idle upstream connection "
          f"(a new one opened): {sum(r.get('idle') == 0 for r in records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
