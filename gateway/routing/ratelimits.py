"""Rate-limit headers, in every form the upstreams send them: Go durations (``6m0s``) or float seconds, windows with or
without a period suffix (``-tokens-minute``), retry hints. One reader for every dialect, on purpose
(docs/architecture.md#general-readers); a dialect may override it (``gateway.upstream.dialects.base.Dialect``)."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


@functools.lru_cache(maxsize=1024)  # one per answer with rate-limit headers; the values repeat ("6m0s", "1ms", ...)
def parse_reset(value: str) -> float | None:
    """Seconds, or None for anything unreadable."""
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # inf, nan or 1e999 is no time to wait for
        return max(0.0, seconds) if math.isfinite(seconds) else None
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds: ``retry-after-ms`` is float ms, ``retry-after`` float seconds, as the SDK reads them."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                seconds = float(value) * scale
            except ValueError:
                continue
            if math.isfinite(seconds):  # inf or nan waits for nothing: the next header, else none
                return max(0.0, seconds)
    return None


PERIODS = {"second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0}
# the buckets a request draws on: every request one ``requests``, its prompt plus output ``tokens``; Cerebras' second
# bucket counts only what its prompt cache did not hold (its rate-limit docs: uncached and total tokens)
BUCKETS = ("requests", "tokens", "uncached")


@dataclass(frozen=True, slots=True)
class Window:
    """``remaining`` and ``limit`` (None: not sent) in requests or tokens; ``reset`` and ``length`` in seconds, a window
    without a period suffix being a minute, as OpenAI's are."""

    remaining: float
    reset: float
    limit: float | None
    length: float


def quota_report(headers: Mapping[str, str]) -> dict[str, Window]:
    """The tightest window of each of :data:`BUCKETS`; one without a readable reset is taken for a minute's."""
    seen: dict[str, Window] = {}
    for name, value in headers.items():
        if not name.startswith("x-ratelimit-remaining-"):
            continue
        suffix = name[22:]  # requests, tokens, requests-day, tokens-minute, uncached-tokens-minute, ...
        kind = suffix.split("-", 1)[0]
        if kind not in BUCKETS:
            continue
        try:
            remaining = float(value)
        except ValueError:
            continue
        if kind in seen and remaining >= seen[kind].remaining:
            continue
        reset = parse_reset(headers.get(f"x-ratelimit-reset-{suffix}", ""))
        limit: float | None
        try:
            limit = float(headers.get(f"x-ratelimit-limit-{suffix}", ""))
        except ValueError:
            limit = None
        seen[kind] = Window(remaining, 60.0 if reset is None else reset, limit,
                            PERIODS.get(suffix.rsplit("-", 1)[-1], 60.0))
    return seen


def zero_limit(headers: Mapping[str, str]) -> bool:
    """A limit of 0: the account may not use this model here at all, a 429 that never clears: "not available", not
    "wait"."""
    return any(w.limit == 0 for w in quota_report(headers).values())


def retry_wait(headers: Mapping[str, str]) -> float | None:
    """Seconds a 429 asks to wait: its retry hint, else the reset of the window it exhausted, else None.

    Some upstreams answer 429 with ``x-ratelimit-reset-*`` and no ``retry-after`` (Cerebras' rate-limit docs: float
    seconds per minute and per day). The windows at 0 remaining decide, the longest of them; with no remaining counts at
    all, the soonest reset (a daily window's is hours away and says nothing about which ran out)."""
    wait = parse_retry_after(headers)
    if wait is not None:
        return wait
    empty: list[float] = []
    resets: list[float] = []
    for name, value in headers.items():
        if not name.startswith("x-ratelimit-reset-"):
            continue
        reset = parse_reset(value)
        if reset is None:
            continue
        resets.append(reset)
        remaining = headers.get("x-ratelimit-remaining-" + name[len("x-ratelimit-reset-"):])
        with contextlib.suppress(ValueError):
            if remaining is not None and float(remaining) <= 0:
                empty.append(reset)
    if empty:
        return max(empty)
    has_counts = any(n.startswith("x-ratelimit-remaining-") for n in headers)
    return min(resets) if resets and not has_counts else None
