"""The event loop's lag, measured live (docs/metrics.md#gateway-added-time): every ``interval`` seconds a callback is
made ready with ``call_soon`` and timed until it runs. That is the wait anything that becomes ready meanwhile has,
an upstream's chunk whose bytes just arrived among them, behind the loop's other work: under concurrency the larger
part of the gateway's added per-chunk latency, which no timing inside one request's own code sees. Costs two clock
reads and two loop callbacks per interval."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

INTERVAL = 0.005  # seconds between probes: 200 a second, enough samples for a p99 within seconds


class LoopLag:
    """``observe``: takes the seconds a probe waited."""

    def __init__(self, observe: Callable[[float], None], interval: float = INTERVAL) -> None:
        self.observe = observe
        self.interval = interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.Handle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(self.interval, self._probe)

    def _probe(self) -> None:
        assert self._loop is not None
        self._handle = self._loop.call_soon(self._ran, time.perf_counter())

    def _ran(self, made_ready: float) -> None:
        self.observe(time.perf_counter() - made_ready)
        assert self._loop is not None
        self._handle = self._loop.call_later(self.interval, self._probe)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
