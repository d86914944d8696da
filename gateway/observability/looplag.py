"""The event loop's lag, measured live (docs/metrics.md#gateway-added-time): how long a file descriptor that becomes
readable at a random moment waits until a callback it makes ready has run. That is the wait an upstream chunk's bytes
have behind the loop's other work (the rest of the callback running when they arrive, the other I/O callbacks of the
poll, then the ready queue their task's step joins): under concurrency the larger part of the gateway's added
per-chunk latency, which no timing inside one request's own code sees.

On Linux the probe is a ``timerfd`` (timerfd_create(2)) armed for an absolute CLOCK_MONOTONIC time: the kernel makes
it readable then, whatever the loop is doing, and the wait counts from that moment. A probe made ready from inside the
loop (``call_soon`` from a timer, the fallback elsewhere) starts its clock only when the loop gets round to it and so
misses the rest of the callback in progress, about half of the wait at the tail: measured with ``python -m
bench.added --streams 32`` (medians of four to six rounds), that probe plus the chunk's own time gave 48 % of the
benchmark's added p99, this one 81-97 % over three runs. The moments are jittered (uniform over 0.5-1.5 of the
interval) so that the probe does not lock to the phase of a periodic load such as streams paced at a fixed token
rate.

Costs per probe two clock reads, one ``timerfd_settime`` through ctypes, one read, two loop callbacks and one
observation, and the wake-up of an idle loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import time
from collections.abc import Callable

# seconds between probes while requests are in flight, on average: 40 a second, 12,000 samples in a 5-minute rate
# window. A probe that wakes an idle loop costs more than the probe itself (measured on an idle gateway: +0.45 % of a
# core at 40 a second, +1.2 % at 200), hence IDLE_INTERVAL
INTERVAL = 0.025


IDLE_INTERVAL = 0.25  # seconds between probes while nothing is in flight: a quiet gateway is barely woken
JITTER = 0.5  # each interval is drawn uniformly from [1 - JITTER, 1 + JITTER] times the mean


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_TFD_TIMER_ABSTIME = 1  # <sys/timerfd.h>


class _TimerFD:
    """A one-shot CLOCK_MONOTONIC timerfd (the clock of ``time.monotonic_ns`` on Linux). Raises OSError where
    there is none (not Linux)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            create, self._settime = libc.timerfd_create, libc.timerfd_settime
        except AttributeError as exc:
            raise OSError("no timerfd") from exc
        create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        self._settime.restype = ctypes.c_int
        self.fd = create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")

    def arm(self, at_ns: int) -> None:
        """Readable at ``at_ns`` (CLOCK_MONOTONIC nanoseconds); a time already past makes it readable at once."""
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(at_ns // 1_000_000_000, at_ns % 1_000_000_000))
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) < 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")

    def clear(self) -> bool:
        """Whether it had expired (reading resets it)."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)


class LoopLag:
    """``observe``: takes the seconds a probe waited; ``busy``: whether requests are in flight (probed every
    ``interval`` seconds on average then, else every :data:`IDLE_INTERVAL` or ``interval`` if longer; None: never
    probed)."""

    def __init__(self, observe: Callable[[float], None], busy: Callable[[], bool] = lambda: True,
                 interval: float | None = INTERVAL) -> None:
        self.observe = observe
        self.busy = busy
        self.interval = interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self._timer: _TimerFD | None = None
        self._due = 0  # ns, CLOCK_MONOTONIC: when the armed timerfd becomes readable
        self._jitter = random.Random()

    @property
    def exact(self) -> bool:
        """Whether the wait counts from the moment the probe's fd became readable (the timerfd), not from when the
        loop first ran a callback for it."""
        return self._timer is not None

    def start(self) -> None:
        if self.interval is None:
            return
        self._loop = asyncio.get_running_loop()
        try:
            self._timer = _TimerFD()
            self._loop.add_reader(self._timer.fd, self._readable)
        except (OSError, NotImplementedError):  # no timerfd, or a loop without add_reader (Windows' proactor)
            if self._timer is not None:
                self._timer.close()
            self._timer = None
        self._next()

    def _gap(self) -> float:
        assert self.interval is not None
        mean = self.interval if self.busy() else max(self.interval, IDLE_INTERVAL)
        return mean * self._jitter.uniform(1 - JITTER, 1 + JITTER)

    def _next(self) -> None:
        assert self._loop is not None
        if self._timer is None:
            self._handle = self._loop.call_later(self._gap(), self._probe)
            return
        self._due = time.monotonic_ns() + int(self._gap() * 1e9)
        try:
            self._timer.arm(self._due)
        except OSError:  # not seen; the probe goes on as the fallback rather than stop
            self._loop.remove_reader(self._timer.fd)
            self._timer.close()
            self._timer = None
            self._next()

    def _readable(self) -> None:
        assert self._loop is not None and self._timer is not None
        if self._timer.clear():  # the chunk's path: bytes readable -> I/O callback -> its task's step made ready
            self._handle = self._loop.call_soon(self._ran, self._due / 1e9)

    def _probe(self) -> None:
        assert self._loop is not None
        self._handle = self._loop.call_soon(self._ran, time.monotonic())

    def _ran(self, since: float) -> None:
        self.observe(max(0.0, time.monotonic() - since))
        self._next()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._timer is not None:
            assert self._loop is not None
            self._loop.remove_reader(self._timer.fd)
            self._timer.close()
            self._timer = None
