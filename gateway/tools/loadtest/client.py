"""``tiergate bench``'s client: each request streamed and timed as the module ``gateway.tools.loadtest`` says
(TTFT, decode speed from the stream's usage), sent with at most ``--concurrency`` in flight, and the cost delta read
from the gateway's ``/metrics``."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp
import orjson

from gateway.stream.stats import has_token
from gateway.tools.loadtest.mix import SYSTEM, plan


@dataclass
class Result:
    """One request as the client saw it. Times in seconds; ``tpot`` None when it cannot be computed."""

    model: str
    group: str = ""
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    duration: float = 0.0
    prompt_tokens: int | None = None  # from the stream's usage, with the cached part of them
    cached_tokens: int | None = None
    text: list[str] = field(default_factory=list)  # the first choice's content deltas (an agent loop sends it back)


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
              timeout: float) -> Result:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]}
    return await send(session, url, body, timeout)


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float,
               headers: dict[str, str] | None = None) -> Result:
    """Timed at the client, as ``gateway.tools.loadtest`` says."""
    model = str(body.get("model"))
    res = Result(model)
    t0 = time.perf_counter()
    first: float | None = None
    last: float | None = None
    try:
        async with asyncio.timeout(timeout), session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            res.status = resp.status
            res.group = resp.headers.get("x-tiergate-tier") or f"model {model}"
            if resp.status != 200:
                res.error = f"HTTP {resp.status}"
                await resp.read()
                return res
            first, last = await _read_events(resp, res)
    except TimeoutError:
        res.error = "timeout"
    except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
        res.error = type(exc).__name__
    res.duration = time.perf_counter() - t0
    res.group = res.group or f"model {model}"
    if first is not None:
        res.ttft = first - t0
    n, chunks = res.completion_tokens, res.chunks
    if res.error is None and first is not None and last is not None and n and chunks >= 2 and n >= chunks \
            and last > first:
        res.tpot = (last - first) * chunks / (n * (chunks - 1))
    if res.error is None and first is None:
        res.error = "no tokens"
    return res


async def _read_events(resp: aiohttp.ClientResponse, res: Result) -> tuple[float | None, float | None]:
    """Read a stream's events into ``res`` (completion tokens from usage, token-bearing chunks, an in-band error);
    returns the arrival times of the first and last token-bearing chunk, with the gateway's token test."""
    first = last = None
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buf += data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                payload = line[5:].strip() if line.startswith(b"data:") else b"[DONE]"
                if payload == b"[DONE]":
                    continue
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    res.error = "stream error: " + str((chunk["error"] or {}).get("code") or "unknown")
                    continue
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    _read_usage(usage, res)
                choices = chunk.get("choices")
                if has_token(choices):
                    res.chunks += 1
                    first = first if first is not None else now
                    last = now
                    delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
                    content = delta.get("content") if isinstance(delta, dict) else None
                    if isinstance(content, str):
                        res.text.append(content)
    return first, last


def _read_usage(usage: dict[str, Any], res: Result) -> None:
    """A stream's usage into ``res``: completion, prompt and cached prompt tokens (where they are counts)."""
    if isinstance(usage.get("completion_tokens"), int):
        res.completion_tokens = usage["completion_tokens"]
    if isinstance(usage.get("prompt_tokens"), int):
        res.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    res.cached_tokens = cached if isinstance(cached, int) else 0 if res.prompt_tokens is not None else None


async def fetch_costs(session: aiohttp.ClientSession, metrics_url: str) -> dict[str, float] | None:
    """Tier -> USD from ``tiergate_cost_usd_total`` (plus ``unpriced:TIER`` counts), or None if unreachable."""
    try:
        async with asyncio.timeout(5), session.get(metrics_url) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^tiergate_(cost_usd|unpriced_requests)_total\{(.*)\} (\S+)$', line)
        if m:
            tier = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))).get("tier", "")
            key = tier if m.group(1) == "cost_usd" else f"unpriced:{tier}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def run(base_url: str, api_key: str, mix: list[tuple[str, float]], requests: int, concurrency: int,
              max_tokens: int, timeout: float, seed: int, progress: TextIO | None) -> tuple[list[Result],
                                                                                            dict[str, float] | None]:
    """Send the planned requests with at most ``concurrency`` in flight; returns the results and the cost delta."""
    url = base_url.rstrip("/") + "/chat/completions"
    metrics_url = re.sub(r"/v1/?$", "", base_url.rstrip("/")) + "/metrics"
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json",
               "user-agent": "tiergate-bench"}
    todo = plan(mix, requests, seed)
    results: list[Result] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        before = await fetch_costs(session, metrics_url)
        queue = list(reversed(todo))
        started = time.monotonic()

        async def worker() -> None:
            while queue:
                model, prompt = queue.pop()
                results.append(await one(session, url, model, prompt, max_tokens, timeout))
                if progress is not None:
                    _progress(progress, len(results), len(todo), sum(r.error is not None for r in results),
                              time.monotonic() - started)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(todo))))))
        if progress is not None:
            progress.write("\n")
            progress.flush()
        after = await fetch_costs(session, metrics_url) if before is not None else None
    cost = None
    if before is not None and after is not None:
        cost = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return results, cost


def _progress(out: TextIO, done: int, total: int, errors: int, elapsed: float) -> None:
    width = 30
    filled = int(width * done / total) if total else width
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {errors} errors, "
              f"{elapsed:.1f} s")
    out.flush()
