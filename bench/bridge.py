"""What the Responses bridge costs per event, next to the byte-exact relay of the same chat stream.

    .venv/bin/python -m bench.bridge [--quick] [--repeat N] [--out DIR]

Two measurements, each a median over ``--repeat`` runs [min, max]:

1. **In the gateway process, over loopback.** The bench upstream (``bench.upstream``, OpenAI dialect, 750 chunks/s
   per stream) on CPU 0 with the load generator; one gateway process on CPU 1, configured with the bench upstream
   as ``responses: bridge``. ``--streams`` concurrent clients run streams of ``--tokens`` chunks back to back,
   first ``POST /v1/chat/completions`` (relayed byte for byte), then ``POST /v1/responses`` (bridged: the same
   chat stream upstream, translated into the Responses event stream), ``--seconds`` each. Figures: the gateway's
   CPU (``/proc/PID/stat``) per 1,000 upstream chunks, and the delay each content chunk took from the upstream's
   write (its ``t=<monotonic ns>`` stamp) to the client, p50 / p99. Every stream is checked (all chunks, then
   ``[DONE]`` or one ``response.completed``); any failure fails the run.
2. **The relay alone, in this process** (no sockets): the same chat stream fed to ``gateway.stream.relay.Relay`` and to
   ``gateway.responses.stream.BridgeRelay`` from memory, a write that drops its bytes; CPU microseconds per upstream
   chunk (``time.process_time``). This is the translation's own cost, with nothing else in the figure.

The chunk-delay columns need CPU pinning (``taskset``); without it the figures are still printed, marked unpinned.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import loadgen, procs
from bench.report import median_cell, repeated

ROOT = Path(__file__).resolve().parent.parent
_STAMP = re.compile(rb'"delta":"t=(\d+)"|"content":"t=(\d+)"')
_CHAT = b"data: [DONE]"
_RESPONSE_DONE = b"event: response.completed\n"


def _bodies(tokens: int) -> dict[str, bytes]:
    chat = {"model": "bench", "stream": True, "max_completion_tokens": tokens,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "benchmark"}]}
    responses = {"model": "bench", "stream": True, "max_output_tokens": tokens, "input": "benchmark"}
    return {"relayed": orjson.dumps(chat), "bridged": orjson.dumps(responses)}


class Tally:
    """Per phase: streams ok, content chunks seen, chunk delays (ns), errors by kind."""

    def __init__(self) -> None:
        self.ok = 0
        self.chunks = 0
        self.delays: list[int] = []
        self.errors: dict[str, int] = {}

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def _one(sess: aiohttp.ClientSession, url: str, body: bytes, tokens: int, end: bytes, tally: Tally) -> None:
    got = 0
    tail = b""
    seen_end = False
    try:
        async with sess.post(url, data=body, headers={"content-type": "application/json"},
                             timeout=aiohttp.ClientTimeout(total=60)) as resp:
            if resp.status != 200:
                await resp.read()
                tally.error(f"http_{resp.status}")
                return
            while data := await resp.content.readany():
                now = time.monotonic_ns()
                buf = tail + data
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    tail = buf
                    continue
                tail = buf[cut + 2:]
                for m in _STAMP.finditer(buf, 0, cut):
                    got += 1
                    tally.delays.append(now - int(m.group(1) or m.group(2)))
                seen_end = seen_end or end in buf
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        tally.error(type(exc).__name__)
        return
    tally.chunks += got
    if got != tokens:
        tally.error("wrong_chunk_count")
    elif not seen_end:
        tally.error("no_end")
    else:
        tally.ok += 1


async def _phase(url: str, body: bytes, tokens: int, end: bytes, streams: int, seconds: float,
                 gateway_pid: int) -> dict[str, Any]:
    tally = Tally()
    async with loadgen.session() as sess:
        for _ in range(streams):  # warm the connections on both sides
            await _one(sess, url, body, tokens, end, Tally())
        cpu0 = procs.cpu_seconds(gateway_pid)
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                await _one(sess, url, body, tokens, end, tally)

        async with asyncio.timeout(seconds + 70):
            await asyncio.gather(*(worker() for _ in range(streams)))
        cpu = procs.cpu_seconds(gateway_pid) - cpu0
    if tally.errors or not tally.ok:
        raise RuntimeError(f"{url}: {tally.ok} streams ok, errors {tally.errors}")
    d = sorted(tally.delays)
    return {"streams": tally.ok, "chunks": tally.chunks, "cpu_ms_per_1000_chunks": cpu / tally.chunks * 1e6,
            "delay_p50_ms": d[len(d) // 2] / 1e6, "delay_p99_ms": d[int(len(d) * 0.99)] / 1e6}


def _config(upstream_port: int) -> str:
    return procs.gateway_config(upstream_port).replace("    dialect: openai\n",
                                                       "    dialect: openai\n    responses: bridge\n")


def over_loopback(args: argparse.Namespace, work: Path, pin: bool) -> dict[str, dict[str, Any]]:
    """Measurement 1 (module docstring): one gateway, both phases, the same run."""
    bodies = _bodies(args.tokens)
    with procs.Children() as kids:
        up = kids.start("upstream", [*procs.pin_prefix(0 if pin else None), procs.python_exe(), "-m",
                                     "bench.upstream", "--port", "0"], work / "upstream.log", cwd=ROOT)
        up_port = procs.wait_upstream_ready(up)
        cfg = work / "gateway.yaml"
        cfg.write_text(_config(up_port))
        port = procs.free_port()
        gw = kids.start("gateway", [*procs.pin_prefix(1 if pin else None), procs.python_exe(), "-m", "gateway",
                                    "serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning"],
                        work / "gateway.log", cwd=ROOT)
        base = f"http://127.0.0.1:{port}"
        procs.wait_http_ready(gw, base + "/readyz")
        out = {}
        for name, path, end in (("relayed", "/v1/chat/completions", _CHAT),
                                ("bridged", "/v1/responses", _RESPONSE_DONE)):
            out[name] = asyncio.run(_phase(base + path, bodies[name], args.tokens, end, args.streams, args.seconds,
                                           gw.pid))
    return out


class _Reads:
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    def watch_idle(self) -> None:
        pass

    async def chunks(self) -> AsyncIterator[bytes]:
        for r in self.reads:
            yield r


def _chat_reads(tokens: int) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
                                         "model": "bench", "choices": [{"index": 0, "delta": delta,
                                                                         "finish_reason": finish}]}) + b"\n\n"
    reads = [chunk({"role": "assistant", "content": f"t={time.monotonic_ns()}"})]
    reads += [chunk({"content": f"t={time.monotonic_ns()}"}) for _ in range(tokens - 1)]
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    reads += [chunk({}, "stop"), b"data: " + orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion.chunk",
                                                           "created": 1, "model": "bench", "choices": [],
                                                           "usage": usage}) + b"\n\n", b"data: [DONE]\n\n"]
    return reads


def in_process(tokens: int, streams: int) -> dict[str, float]:
    """Measurement 2 (module docstring): CPU microseconds per upstream chunk, relay vs bridge."""
    from gateway.responses.ids import ID_PREFIX, new_id
    from gateway.responses.stream import BridgeRelay
    from gateway.responses.whole import Draft
    from gateway.stream.relay import Relay

    reads = _chat_reads(tokens)
    body = {"model": "bench", "stream": True, "max_output_tokens": tokens, "input": "benchmark"}

    async def drop(data: bytes) -> None:
        pass

    async def go(kind: str) -> float:
        t0 = time.process_time()
        for _ in range(streams):
            relay = (Relay(strip_usage_chunk=False, max_event_bytes=1 << 20) if kind == "relayed" else
                     BridgeRelay(Draft(body, new_id(ID_PREFIX)), max_event_bytes=1 << 20,
                                        finish_grace=2.0))
            stats = await relay.run(_Reads(reads), drop)
            if stats.token_chunks != tokens or not stats.done:
                raise RuntimeError(f"{kind}: {stats.token_chunks} token chunks, done={stats.done}")
        return (time.process_time() - t0) / (streams * len(reads)) * 1e6

    async def both() -> dict[str, float]:
        await go("relayed")
        await go("bridged")  # warm-up
        return {"relayed": await go("relayed"), "bridged": await go("bridged")}

    return asyncio.run(both())


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The results as Markdown rows (for bench/RESULTS.md)."""
    lines = [f"bench.bridge at {meta['git']} on {meta['when']}, {meta['cpu']}, "
             f"{meta['streams']} streams x {meta['tokens']} chunks, {meta['seconds']:g} s a phase, "
             f"{len(runs)} run(s){'' if meta['pinned'] else ', UNPINNED'}", "",
             "| path | gateway CPU ms / 1,000 chunks | chunk delay p50 / p99 ms | relay alone, CPU us / chunk |",
             "|---|---|---|---|"]
    for name in ("relayed", "bridged"):
        e2e = [r["loopback"][name] for r in runs]
        alone = [r["in_process"][name] for r in runs]
        lines.append(f"| {name} | {median_cell([e['cpu_ms_per_1000_chunks'] for e in e2e])} | "
                     f"{median_cell([e['delay_p50_ms'] for e in e2e], '{:.2f}')} / "
                     f"{median_cell([e['delay_p99_ms'] for e in e2e], '{:.2f}')} | {median_cell(alone, '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the measurements; print Markdown; write ``results.json`` and ``results.md`` under ``--out``."""
    ap = argparse.ArgumentParser(prog="python -m bench.bridge", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, figures mean nothing")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bridge")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeat, args.streams, args.tokens, args.seconds = 1, 4, 32, 1.0
    return repeated("bridge", args.repeat, lambda tmp, pin: {
        "loopback": over_loopback(args, tmp, pin), "in_process": in_process(args.tokens, max(10, args.streams * 4))},
        {"streams": args.streams, "tokens": args.tokens, "seconds": args.seconds}, markdown, args.out)

if __name__ == "__main__":
    sys.exit(main())
