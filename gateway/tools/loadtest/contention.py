"""``tiergate bench --contention`` (docs/bench.md#contention): the fast tier as a scarce resource, first come first
served against scheduled (docs/routing.md#scheduling), in one run.

Each mode gets its own fresh processes: an emulated fast tier with a per-minute token budget (``--budget``), an
emulated standard tier (50 tokens/s after 0.4 s), and a gateway in front (FCFS: no ``scheduling:``; scheduled: classes
interactive 0.6 / agent 0.3 / batch 0.0), three gateway keys (one per class) and prices on both upstreams. The load,
all streamed and timed at the client: an interactive key at a steady rate with an ``x-tiergate-deadline-ms`` only the
fast tier can meet, an agent fleet (a few sequential loops with a short think time) and a batch flood (many concurrent
loops) that empties the budget within seconds. Every loop is bounded by ``--seconds`` and a request count; every
request by a timeout. Nothing listens anywhere but 127.0.0.1.

The fast budget used is what the fast emulator charged (its own formula: the prompt's JSON bytes / 4 plus the token
limit, ``gateway.tools.emulator.counts``) for the requests it served, over its budget times the windows the load's span
opens (the emulator's window is a fixed minute from its first charge).
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.tenancy.keys import digest, new_key
from gateway.tools.emulator.counts import prompt_of, token_limit
from gateway.tools.loadtest.client import Result, fetch_costs, send
from gateway.tools.loadtest.mix import PROMPTS, SYSTEM

CLASSES = ("interactive", "agent", "batch")
SCHEDULING = {"classes": [{"name": "interactive", "share": 0.6}, {"name": "agent", "share": 0.3},
                          {"name": "batch", "share": 0.0}], "default_class": "agent"}
PRICES = {"fast": {"input": 0.6, "output": 1.2}, "standard": {"input": 0.35, "output": 0.75}}
WINDOW = 60.0  # the emulator's budget window (gateway.tools.emulator.budget)


@dataclass(frozen=True)
class Sizes:
    """The scenario's knobs (``tiergate bench --contention`` flags)."""

    seconds: float = 60.0  # load per mode
    budget: int = 60_000  # the fast emulator's tokens per minute
    rate: float = 2.0  # interactive requests per second
    deadline_ms: int = 1000  # the interactive deadline: the fast tier meets it, the standard tier (~1.7 s) does not
    agents: int = 3  # agent loops
    think: float = 0.25  # seconds an agent thinks between steps
    batch: int = 16  # batch loops at once
    max_tokens: int = 200  # the CLI's --max-tokens default
    fast_tps: float = 2000.0
    fast_ttft: float = 0.02
    timeout: float = 30.0


@dataclass
class Sent:
    """One request as the client saw it, with its class and what the fast emulator charges for it."""

    cls: str
    result: Result
    charge: int
    deadline_ms: int | None = None

    @property
    def fast(self) -> bool:
        return self.result.status == 200 and self.result.group == "fast"

    @property
    def hit(self) -> bool:
        return (self.deadline_ms is not None and self.result.error is None
                and self.result.duration * 1000 <= self.deadline_ms)


@dataclass
class Mode:
    """One mode's run: every request, the cost delta (USD by tier) and its wall time."""

    name: str
    sent: list[Sent] = field(default_factory=list)
    cost: dict[str, float] | None = None
    elapsed: float = 0.0
    budget: int = 0
    seconds: float = 0.0  # the load's span: requests start only within it

    def fast_tokens(self, cls: str | None = None) -> int:
        return sum(s.charge for s in self.sent if s.fast and cls in (None, s.cls))

    def budget_used(self, cls: str | None = None) -> float:
        """Of the budget, by every class or ``cls``."""
        # the windows the load's span opened (the last requests' tails run past it, into no new window's budget)
        windows = max(1, math.ceil(self.seconds / WINDOW - 1e-9))
        return self.fast_tokens(cls) / (self.budget * windows) if self.budget else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(port: int, proc: subprocess.Popen[bytes], what: str, path: str | None = None, timeout: float = 20.0) -> None:
    """Until ``port`` accepts (or ``path`` answers 200); raises RuntimeError when ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if path is None:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within {timeout:g} s")


def gateway_config(fast: str, standard: str, keys: dict[str, str], scheduled: bool) -> dict[str, Any]:
    """The gateway of one mode: the same upstreams, keys and prices; ``scheduling:`` only when ``scheduled``."""
    timeouts = {"connect": 2, "idle": 10, "total": 60}
    ups = [{"name": f"{tier}-1", "tier": tier, "base_url": url, "dialect": "openai", "timeouts": timeouts,
            "prices": PRICES[tier], "models": {"m": "m"}} for tier, url in (("fast", fast), ("standard", standard))]
    cfg: dict[str, Any] = {"default_tier": "fast", "upstreams": ups, "auth": {"metrics": {"public": True}, "keys": [
        {"name": cls, "sha256": digest(key), **({"class": cls} if scheduled else {})} for cls, key in keys.items()]}}
    if scheduled:
        cfg["scheduling"] = SCHEDULING
    return cfg


class Stack:
    """A fresh fast emulator, standard emulator and gateway (subprocesses), stopped by :meth:`stop`."""

    def __init__(self, sizes: Sizes, keys: dict[str, str], scheduled: bool, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            fast = self._emulator(tmp, "fast", "--tps", f"{sizes.fast_tps:g}", "--ttft", f"{sizes.fast_ttft:g}",
                                  "--tokens-per-minute", str(sizes.budget))
            std = self._emulator(tmp, "standard")
            self.port = _free_port()
            path = tmp / f"gateway-{self.port}.yaml"
            path.write_text(yaml.safe_dump(gateway_config(fast, std, keys, scheduled)))
            log = (tmp / f"gateway-{self.port}.log").open("wb")
            env = {**os.environ, "GATEWAY_LOG_SAMPLE": "0"}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                                "--port", str(self.port), "--log-level", "warning"],
                                               stdout=log, stderr=subprocess.STDOUT, env=env))
            _wait(self.port, self.procs[-1], "the gateway", "/readyz")
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def _emulator(self, tmp: Path, tier: str, *extra: str) -> str:
        port = _free_port()
        log = (tmp / f"emulator-{tier}-{port}.log").open("wb")
        self.procs.append(subprocess.Popen([sys.executable, "-m", "gateway", "emulate", "--tier", tier,
                                            "--dialect", "openai", "--port", str(port), "--exit-with-parent", *extra],
                                           stdout=log, stderr=subprocess.STDOUT))
        _wait(port, self.procs[-1], f"the {tier} emulator")
        return f"http://127.0.0.1:{port}/v1"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _body(sizes: Sizes, n: int) -> dict[str, Any]:
    return {"model": "m", "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": sizes.max_tokens,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[n % len(PROMPTS)]}]}


async def load(url: str, keys: dict[str, str], sizes: Sizes) -> list[Sent]:
    """The three classes at once for ``sizes.seconds``: interactive open-loop at ``rate`` with its deadline, the agent
    loops, and the batch flood (from a second in, once interactive and the agents are known to be asking)."""
    out: list[Sent] = []
    endpoint = url.rstrip("/") + "/chat/completions"
    until = time.monotonic() + sizes.seconds
    cap = max(1, int(sizes.seconds * 200))  # a bound on any one loop's requests, far above what it can send

    async def one(session: aiohttp.ClientSession, cls: str, n: int, deadline: int | None = None) -> None:
        body = _body(sizes, n)
        headers = {"authorization": f"Bearer {keys[cls]}", "content-type": "application/json"}
        if deadline is not None:
            headers["x-tiergate-deadline-ms"] = str(deadline)
        res = await send(session, endpoint, body, sizes.timeout, headers)
        out.append(Sent(cls, res, len(prompt_of(body)) // 4 + (token_limit(body) or 0), deadline))

    async def loop(session: aiohttp.ClientSession, cls: str, start: float, pause: float) -> None:
        await asyncio.sleep(start)
        for n in range(cap):
            if time.monotonic() >= until:
                return
            await one(session, cls, n)
            await asyncio.sleep(pause)

    async def interactive(session: aiohttp.ClientSession) -> None:
        tasks, t0 = [], time.monotonic()
        for n in range(max(1, int(sizes.seconds * sizes.rate))):
            await asyncio.sleep(max(0.0, t0 + n / sizes.rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, "interactive", n, sizes.deadline_ms)))
        await asyncio.gather(*tasks)

    lead = min(1.0, sizes.seconds / 4)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(interactive(session), *(loop(session, "agent", 0.0, sizes.think)
                                                     for _ in range(sizes.agents)),
                             *(loop(session, "batch", lead, 0.0) for _ in range(sizes.batch)))
    return out


async def _measure(name: str, stack: Stack, keys: dict[str, str], sizes: Sizes) -> Mode:
    mode = Mode(name, budget=sizes.budget, seconds=sizes.seconds)
    metrics = f"http://127.0.0.1:{stack.port}/metrics"
    started = time.monotonic()
    mode.sent = await load(stack.url, keys, sizes)
    mode.elapsed = time.monotonic() - started
    async with aiohttp.ClientSession() as session:
        mode.cost = await fetch_costs(session, metrics)  # a fresh gateway: everything it counted is this run's
    return mode


def run(sizes: Sizes, progress: Any = None) -> list[Mode]:
    """FCFS, then scheduled, each against fresh processes; returns both modes."""
    keys = {cls: new_key() for cls in CLASSES}
    modes = []
    with tempfile.TemporaryDirectory(prefix="tiergate-contention-") as tmp:
        for name, scheduled in (("FCFS", False), ("scheduled", True)):
            if progress is not None:
                print(f"tiergate bench --contention: {name}, {sizes.seconds:g} s ...", file=progress, flush=True)
            stack = Stack(sizes, keys, scheduled, Path(tmp))
            try:
                modes.append(asyncio.run(_measure(name, stack, keys, sizes)))
            finally:
                stack.stop()
    return modes
