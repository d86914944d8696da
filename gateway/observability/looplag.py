"""The event loop's lag, measured live (docs/metrics.md#gateway-added-time): every ``interval`` seconds a callback is
made ready with ``call_soon`` and timed until it runs. That is the wait anything that becomes ready meanwhile has,
an upstream's chunk whose bytes just arrived among them, behind the loop's other work: under concurrency the larger
part of the gateway's added per-chunk latency, which no timing inside one request's own code sees. Costs two clock
reads, two loop callbacks and one observation per interval, and the wake-up of an idle loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# seconds between probes while requests are in flight: 40 a second, 12,000 samples in a 5-minute rate window. A probe
# that wakes an idle loop costs more than the probe itself (measured on an idle gateway: +0.45 % of a core at 40 a
# second, +1.2 % at 200), hence IDLE_INTERVAL
INTERVAL = 0.025


IDLE_INTERVAL = 0.25  # seconds between probes while nothing is in flight: a quiet gateway is barely woken


class LoopLag:
    """``observe``: takes the seconds a probe waited; ``busy``: whether requests are in flight (probed every
    ``interval`` then, else every :data:`IDLE_INTERVAL`)."""

    def __init__(self, observe: Callable[[float], None], busy: Callable[[], bool] = lambda: True,
                 interval: float = INTERVAL) -> None:
        self.observe = observe
        self.busy = busy
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
        self._handle = self._loop.call_later(self.interval if self.busy() else IDLE_INTERVAL, self._probe)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
