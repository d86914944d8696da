"""Agent loops over HTTP and over the Responses API's WebSocket mode, per tier, through the gateway and direct to the
emulator; and what the gateway's CPU costs per event it relays as an SSE event or as a WebSocket frame.

    .venv/bin/python -m bench.websocket [--loops 3] [--steps 20] [--rounds 3] [--quick] [--out DIR]

Processes: three emulators on CPU 0 with this harness (``tiergate emulate``: the fast tier's Cerebras dialect, 750
tokens/s and 50 ms TTFT; the standard tier's OpenAI dialect, 50 tokens/s and 400 ms; and, for the fast tier's
direct loops, the fast tier's pace in the OpenAI dialect, which serves the Responses API and its WebSocket mode
itself), and the gateway on CPU 1: the fast tier bridged (chat completions upstream), the standard tier native with
``websocket: true`` (a client socket's turns cross one upstream socket), and ``bench-http``, the same standard
emulator without ``websocket`` (each turn of a socket a streamed POST).

1. **Agent loops.** ``--loops`` loops of ``--steps`` model turns each, per tier, transport and target: each turn a
   streamed ``POST /v1/responses`` (HTTP, a new client per loop) or a ``response.create`` on the loop's socket
   (``client.responses.connect()``, opened inside the loop's time), chained by ``previous_response_id``, its input
   only the last tool's output; every turn but the last is a tool call (``[[emulate tool=call]]``), the last a
   48-token answer. Figures: the turn's TTFT (sent to its first ``.delta`` event, every turn of every loop: p50 and
   p90) and the loop's time (median).
2. **CPU per event.** ``--streams`` concurrent clients (aiohttp, raw bytes and frames) each run streams of
   ``--tokens`` tokens at 2,000 tokens/s back to back, one path at a time, interleaved over ``--rounds`` rounds:
   the gateway's CPU (``/proc/PID/stat``) over the events its clients received, median [min, max].

Every turn and stream is checked (its terminal event, its tool call); any failure fails the run. Nothing listens
anywhere but 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai

from bench import procs

ROOT = Path(__file__).resolve().parent.parent
TOOLS: list[Any] = [{"type": "function", "name": "run_tests", "description": "Run the project's tests.",
                     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                    "required": ["path"], "additionalProperties": False}, "strict": True}]
MODELS = {("fast", "gateway"): "gpt-5.6-sol-fast", ("standard", "gateway"): "gpt-5.6",
          ("fast", "direct"): "gpt-5.6", ("standard", "direct"): "gpt-5.6"}
CPU_PATHS = [("sse", "native", "gpt-5.6"), ("ws", "native, upstream socket", "gpt-5.6"),
             ("ws", "native, HTTP upstream", "bench-http"), ("sse", "bridged", "gpt-5.6-sol-fast"),
             ("ws", "bridged", "gpt-5.6-sol-fast")]


def config(fast: int, standard: int) -> str:
    """The gateway's config (module docstring)."""
    cfg = {"default_tier": "standard", "upstreams": [
        {"name": "fast", "tier": "fast", "base_url": f"http://127.0.0.1:{fast}/v1", "dialect": "cerebras",
         "models": {"gpt-5.6": "gpt-5.6-wse"}},
        {"name": "standard", "tier": "standard", "base_url": f"http://127.0.0.1:{standard}/v1", "dialect": "openai",
         "websocket": True, "models": {"gpt-5.6": "gpt-5.6-2026-10-01"}},
        {"name": "standard-http", "tier": "standard", "base_url": f"http://127.0.0.1:{standard}/v1",
         "dialect": "openai", "models": {"bench-http": "gpt-5.6-2026-10-01"}}],
        "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"}}}
    return json.dumps(cfg)


# 1. agent loops

def _turn_input(step: int, steps: int, call_id: str | None) -> list[dict[str, Any]]:
    """The input of turn ``step`` (0-based): the task, then each tool's output; the last turn is told to answer."""
    directive = "[[emulate tool=text tokens=48]]" if step == steps - 1 else "[[emulate tool=call]]"
    if call_id is None:
        return [{"type": "message", "role": "user", "content": f"Fix the failing test. {directive}"}]
    return [{"type": "function_call_output", "call_id": call_id, "output": f"1 failed, 41 passed {directive}"}]


def _read_turn(events: Any, sent: float) -> tuple[float, Any]:
    """(TTFT, the completed response) of one turn's events."""
    first = None
    for event in events:
        if first is None and event.type.endswith(".delta"):
            first = time.perf_counter()
        if event.type == "response.completed":
            assert first is not None, "a turn without output"
            return first - sent, event.response
        if event.type in ("error", "response.failed", "response.incomplete"):
            raise RuntimeError(f"turn failed: {event}")
    raise RuntimeError("the turn's stream ended before response.completed")


def agent_loop(base: str, model: str, steps: int, transport: str) -> tuple[list[float], float]:
    """One loop (module docstring, 1): its turns' TTFTs and its time, seconds."""
    start = time.perf_counter()
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    ttfts: list[float] = []
    previous, call_id = None, None
    conn = client.responses.connect().enter() if transport == "ws" else None
    try:
        for step in range(steps):
            body: dict[str, Any] = {"model": model, "tools": TOOLS, "input": _turn_input(step, steps, call_id)}
            if previous is not None:
                body["previous_response_id"] = previous
            sent = time.perf_counter()
            if conn is not None:
                conn.response.create(**body)
                ttft, done = _read_turn(conn, sent)
            else:
                ttft, done = _read_turn(client.responses.create(stream=True, **body), sent)
            ttfts.append(ttft)
            previous = done.id
            calls = [item for item in done.output if item.type == "function_call"]
            if step < steps - 1:
                assert calls, f"turn {step + 1} of {steps} made no tool call"
                call_id = calls[0].call_id
            else:
                assert not calls and done.output_text, "the last turn did not answer"
    finally:
        if conn is not None:
            conn.close()
        client.close()
    return ttfts, time.perf_counter() - start


def loops(targets: dict[tuple[str, str], str], n: int, steps: int) -> list[dict[str, Any]]:
    """Every (tier, transport, target) loop, interleaved: one loop of each in turn, ``n`` times."""
    runs: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
    for _ in range(n):
        for tier in ("fast", "standard"):
            for transport in ("http", "ws"):
                for where in ("gateway", "direct"):
                    ttfts, took = agent_loop(targets[tier, where], MODELS[tier, where], steps, transport)
                    got = runs.setdefault((tier, transport, where), ([], []))
                    got[0].extend(ttfts)
                    got[1].append(took)
    out = []
    for (tier, transport, where), (ttfts, took) in runs.items():
        ttfts.sort()
        out.append({"tier": tier, "transport": transport, "target": where, "turns": len(ttfts),
                    "ttft_p50_ms": statistics.median(ttfts) * 1000,
                    "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1000,
                    "loop_s": statistics.median(took)})
    return out


# 2. CPU per event

async def _sse(session: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> int:
    async with session.post(base + "/responses", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.read()
    assert b"response.completed" in data, data[-300:]
    return data.count(b"\ndata: ") + data.startswith(b"data: ")


async def _ws(ws: aiohttp.ClientWebSocketResponse, body: dict[str, Any]) -> int:
    await ws.send_str(json.dumps({"type": "response.create", **body}))
    frames = 0
    while True:
        msg = await ws.receive(timeout=60)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        frames += 1
        if msg.data.startswith('{"type":"response.completed"'):
            return frames
        assert '"type":"error"' not in msg.data[:40], msg.data


async def cpu_phase(base: str, pid: int, transport: str, model: str, streams: int, per_client: int,
                    tokens: int) -> tuple[float, int]:
    """(gateway CPU seconds, events received) of ``streams`` clients running ``per_client`` streams each."""
    body = {"model": model, "input": f"bench [[emulate tokens={tokens} tps=2000 ttft_ms=5]]"}

    async def client(session: aiohttp.ClientSession) -> int:
        seen = 0
        if transport == "sse":
            for _ in range(per_client):
                seen += await _sse(session, base, body)
            return seen
        async with session.ws_connect(base.replace("http://", "ws://") + "/responses", max_msg_size=0) as ws:
            for _ in range(per_client):
                seen += await _ws(ws, body)
        return seen

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session) for _ in range(2)))  # warm: connections, sockets, templates
        before = procs.cpu_seconds(pid)
        counts = await asyncio.gather(*(client(session) for _ in range(streams)))
        used = procs.cpu_seconds(pid) - before
    return used, sum(counts)


def cpu(base: str, pid: int, rounds: int, streams: int, per_client: int, tokens: int) -> list[dict[str, Any]]:
    """CPU microseconds per event of every path of :data:`CPU_PATHS`, median over ``rounds`` interleaved rounds."""
    samples: dict[tuple[str, str], list[float]] = {}
    events: dict[tuple[str, str], int] = {}
    for _ in range(rounds):
        for transport, path, model in CPU_PATHS:
            used, seen = asyncio.run(cpu_phase(base, pid, transport, model, streams, per_client, tokens))
            samples.setdefault((transport, path), []).append(used / seen * 1e6)
            events[transport, path] = seen
    return [{"transport": t, "path": p, "events": events[t, p], "us_per_event": statistics.median(v),
             "min": min(v), "max": max(v)} for (t, p), v in samples.items()]


def render(loop_rows: list[dict[str, Any]], cpu_rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown tables of a run."""
    by = {(r["tier"], r["transport"], r["target"]): r for r in loop_rows}
    out: list[str] = [f"{time.strftime('%Y-%m-%d')}, load average {procs.loadavg()}.", ""]
    if loop_rows:
        out += [f"Agent loops: {args.loops} loops of {args.steps} turns per row (TTFT over every turn of them):", "",
                "| tier | transport | TTFT p50 gateway | TTFT p50 direct | TTFT p90 gateway | TTFT p90 direct "
                "| loop gateway | loop direct |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for tier in ("fast", "standard"):
            for transport in ("http", "ws"):
                g, d = by[tier, transport, "gateway"], by[tier, transport, "direct"]
                out.append(f"| {tier} | {'HTTP (SSE)' if transport == 'http' else 'WebSocket'} "
                           f"| {g['ttft_p50_ms']:.1f} ms | {d['ttft_p50_ms']:.1f} ms | {g['ttft_p90_ms']:.1f} ms "
                           f"| {d['ttft_p90_ms']:.1f} ms | {g['loop_s']:.2f} s | {d['loop_s']:.2f} s |")
        out.append("")
    if cpu_rows:
        out += [f"CPU per event relayed ({args.streams} concurrent clients, {args.per_client} streams of "
                f"{args.tokens} tokens each per round; median of {args.rounds} rounds [min, max]):", "",
                "| path | client transport | gateway CPU per event | events per round |", "|---|---|---:|---:|"]
        for r in cpu_rows:
            out.append(f"| {r['path']} | {'SSE' if r['transport'] == 'sse' else 'WebSocket frames'} "
                       f"| {r['us_per_event']:.1f} µs [{r['min']:.1f}, {r['max']:.1f}] | {r['events']:,} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.websocket", description=__doc__.splitlines()[0])
    p.add_argument("--loops", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--per-client", type=int, default=8)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--phases", default="loops,cpu", help="loops, cpu or both (default)")
    p.add_argument("--quick", action="store_true", help="1 loop of 4 turns, 1 round of small streams (a smoke run)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "websocket")
    a = p.parse_args(argv)
    if a.quick:
        a.loops, a.steps, a.rounds, a.streams, a.per_client, a.tokens = 1, 4, 1, 2, 2, 50
    a.out.mkdir(parents=True, exist_ok=True)
    procs.raise_nofile(65536)
    os.sched_setaffinity(0, {0})
    py = sys.executable
    ports = {name: procs.free_port() for name in ("fast", "standard", "direct", "gateway")}
    with procs.Children() as kids:
        for name, tier, extra in (("fast", "fast", []), ("standard", "standard", []),
                                  ("direct", "fast", ["--dialect", "openai"])):
            kid = kids.start(name, procs.pin_prefix(0) + [py, "-m", "gateway", "emulate", "--tier", tier, "--port",
                                                           str(ports[name]), *extra], a.out / f"{name}.log", cwd=ROOT)
            procs.wait_http_ready(kid, f"http://127.0.0.1:{ports[name]}/emulator/config")
        cfg = a.out / "gateway.yaml"
        cfg.write_text(config(ports["fast"], ports["standard"]))
        gw = kids.start("gateway", procs.pin_prefix(1) + [py, "-m", "gateway", "serve", "--config", str(cfg),
                                                         "--port", str(ports["gateway"]), "--log-level", "warning"],
                        a.out / "gateway.log", cwd=ROOT)
        procs.wait_http_ready(gw, f"http://127.0.0.1:{ports['gateway']}/readyz")
        base = f"http://127.0.0.1:{ports['gateway']}/v1"
        targets = {("fast", "gateway"): base, ("standard", "gateway"): base,
                   ("fast", "direct"): f"http://127.0.0.1:{ports['direct']}/v1",
                   ("standard", "direct"): f"http://127.0.0.1:{ports['standard']}/v1"}
        phases = set(a.phases.split(","))
        loop_rows = loops(targets, a.loops, a.steps) if "loops" in phases else []
        cpu_rows = cpu(base, gw.pid, a.rounds, a.streams, a.per_client, a.tokens) if "cpu" in phases else []
    table = render(loop_rows, cpu_rows, a)
    (a.out / "websocket.md").write_text(table)
    (a.out / "websocket.json").write_text(json.dumps({"loops": loop_rows, "cpu": cpu_rows}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
