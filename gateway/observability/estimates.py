"""Live latency estimates per upstream and model, from the traffic the gateway relays
(docs/deadlines.md#live-estimates): TTFT as a line over the prompt size, because prefill grows with the input; decode
tokens/s; completion length per route. Each has a central value and a tail, from the last ``window`` seconds.
``prompt_tokens`` is the gateway's own estimate (request bytes / 4), the figure routing predicts with, so that the line
is fitted and used in one unit. Summaries are cached, so that recording a sample costs an append and reading one a
lookup. Pure: every time is passed in."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# service tiers of one model that are served at their own speed: each is its own series (``gateway.config.upstreams``;
# ``priority`` is ``fast``'s old name); the standard ones (``auto``, ``default``, ``scale``) share the model's
_OWN_SERIES = {"priority": "fast", "fast": "fast", "ultrafast": "ultrafast", "flex": "flex"}


def bucket(model: str, service_tier: str | None) -> str:
    """A tier served at its own speed is its own series (``model@fast``, ``model@flex``, ...): a tier's latencies never
    blend with another's."""
    own = _OWN_SERIES.get(service_tier) if service_tier is not None else None
    return model if own is None else f"{model}@{own}"


def quantile(ordered: Sequence[float], q: float) -> float:
    """Linear between the closest ranks: numpy's default, "method 7" of Hyndman and Fan. ``ordered`` sorted, not
    empty."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Spread:
    """``tail``: the slow side (p90 of a time, p10 of a speed), ``best`` the quick side (p10 of a time, p90 of a
    speed): with ``central``, an interval; ``newest``: on the estimates' clock; a summary is cached, so its age is read
    against a time (:meth:`age`)."""

    central: float
    tail: float
    samples: int
    newest: float
    best: float = 0.0

    def age(self, now: float) -> float:
        return max(0.0, now - self.newest)


@dataclass(frozen=True, slots=True)
class Latency:
    """Seconds, tokens, tokens per second. ``base`` + ``per_token`` × prompt tokens: the TTFT line; ``residual``: its
    residuals' median and p90, ``residual_p95`` their p95 (the ``p95`` hedge delay); ``speed``: median and p10 decode
    tokens/s, None when no stream in the window had two token-bearing chunks or more."""

    base: float
    per_token: float
    residual: Spread
    speed: Spread | None
    residual_p95: float = 0.0

    @property
    def samples(self) -> int:
        return self.residual.samples

    def age(self, now: float) -> float:
        return self.residual.age(now)

    def ttft(self, prompt_tokens: int, tail: bool = True) -> float:
        """Seconds, never below 0."""
        r = self.residual.tail if tail else self.residual.central
        return max(0.0, self.base + self.per_token * prompt_tokens + r)

    def took(self, prompt_tokens: int, output_tokens: int) -> tuple[float, float, float] | None:
        """Seconds a streamed answer of ``output_tokens`` to ``prompt_tokens`` (uncached) takes, first byte to last:
        (quick side, central, slow side), from the TTFT residuals' p10, p50, p90 and the decode speed's p90, p50,
        p10. None while the speed is unmeasured."""
        if self.speed is None or min(self.speed.central, self.speed.tail, self.speed.best) <= 0:
            return None
        line, n = self.base + self.per_token * prompt_tokens, max(0, output_tokens - 1)
        r, v = self.residual, self.speed
        return (max(0.0, line + r.best) + n / v.best, max(0.0, line + r.central) + n / v.central,
                max(0.0, line + r.tail) + n / v.tail)

    def ttft_p95(self, prompt_tokens: int) -> float:
        """The ``hedge: p95`` delay, in seconds."""
        return max(0.0, self.base + self.per_token * prompt_tokens + self.residual_p95)

    def decode(self, tokens: int, tail: bool = True) -> float | None:
        """Seconds from the first to the last of ``tokens`` output tokens; None while the speed is unmeasured."""
        if self.speed is None:
            return None
        tps = self.speed.tail if tail else self.speed.central
        return max(0, tokens - 1) / tps if tps > 0 else None

    def as_dict(self, now: float, prompt_tokens: Iterable[int] = (100, 1000, 10000)) -> dict[str, Any]:
        """For ``GET /v1/tiergate/estimates``."""
        return {
            "ttft": {"samples": self.samples, "age_s": round(self.age(now), 3), "base_s": round(self.base, 6),
                     "per_1k_prompt_tokens_s": round(self.per_token * 1000, 6),
                     "at_prompt_tokens": {str(p): {"p50_s": round(self.ttft(p, tail=False), 4),
                                                   "p90_s": round(self.ttft(p), 4)} for p in prompt_tokens}},
            "tokens_per_second": None if self.speed is None else {
                "samples": self.speed.samples, "age_s": round(self.speed.age(now), 3),
                "p50": round(self.speed.central, 2), "p10": round(self.speed.tail, 2)},
        }


REFRESH = 0.1  # seconds: a summary is recomputed at most this often per series while samples keep coming


class _Series:
    """Its summary is cached until a sample ages out or, once new samples came, for at most :data:`REFRESH` seconds: a
    busy series costs ~10 us per recompute, bounded so to ten a second whatever the request rate."""

    __slots__ = ("points", "summary", "valid_until", "computed_at")

    def __init__(self, size: int) -> None:
        self.points: deque[tuple[float, float, float]] = deque(maxlen=size)  # (time, x, y)
        self.summary: Any = None
        self.valid_until = -1.0  # the summary may be served until then; -1: recompute
        self.computed_at = 0.0

    def add(self, now: float, x: float, y: float) -> None:
        self.points.append((now, x, y))
        self.stale()

    def stale(self) -> None:
        if self.summary is None:
            self.valid_until = -1.0
        else:
            self.valid_until = min(self.valid_until, self.computed_at + REFRESH)

    def keep(self, summary: Any, now: float, until: float) -> None:
        self.summary, self.computed_at, self.valid_until = summary, now, until

    def live(self, now: float, window: float) -> list[tuple[float, float, float]]:
        points = self.points
        while points and now - points[0][0] > window:
            points.popleft()
        return list(points)


class Estimates:
    """One per process. ``window``: seconds of traffic an estimate reflects; ``samples``: the newest kept per series."""

    def __init__(self, window: float = 60.0, samples: int = 64) -> None:
        self.window = window
        self.size = samples
        self._ttft: dict[tuple[str, str], _Series] = {}
        self._speed: dict[tuple[str, str], _Series] = {}
        self._length: dict[tuple[str, str], _Series] = {}

    def _series(self, table: dict[tuple[str, str], _Series], key: tuple[str, str]) -> _Series:
        found = table.get(key)
        if found is None:
            found = table[key] = _Series(self.size)
        return found

    # recording (the hot path: an append each)

    def observe_ttft(self, upstream: str, model: str, now: float, *, prompt_tokens: int, ttft: float) -> None:
        """Recorded at the first token, not at the stream's end: a tier that queues up is seen one decode earlier."""
        self._series(self._ttft, (upstream, model)).add(now, float(prompt_tokens), ttft)

    def observe_speed(self, upstream: str, model: str, now: float, speed: float) -> None:
        """Tokens/s of a stream that ran to its end with two token-bearing chunks or more."""
        if speed > 0:
            key = (upstream, model)
            self._series(self._speed, key).add(now, 0.0, speed)
            ttft = self._ttft.get(key)
            if ttft is not None:
                ttft.stale()  # the cached Latency holds the speed too

    def observe_stream(self, upstream: str, model: str, now: float, *, prompt_tokens: int, ttft: float,
                       speed: float | None = None) -> None:
        """For tests and the simulation."""
        self.observe_ttft(upstream, model, now, prompt_tokens=prompt_tokens, ttft=ttft)
        if speed is not None:
            self.observe_speed(upstream, model, now, speed)

    def observe_length(self, rule: str, model: str, now: float, completion_tokens: int) -> None:
        self._series(self._length, (rule, model)).add(now, 0.0, float(completion_tokens))

    # reading

    def latency(self, upstream: str, model: str, now: float) -> Latency | None:
        """None: unmeasured, its samples aged out; deadline routing re-measures it."""
        series = self._ttft.get((upstream, model))
        if series is None:
            return None
        if now <= series.valid_until:
            cached: Latency | None = series.summary
            return cached
        points = series.live(now, self.window)
        if not points:
            series.keep(None, now, float("inf"))  # until a sample comes
            return None
        base, slope, resid = _fit(points)
        speed_series = self._speed.get((upstream, model))
        speed = _spread(speed_series, now, self.window, low_tail=True) if speed_series is not None else None
        ordered = sorted(resid)
        found = Latency(base, slope, Spread(quantile(ordered, 0.5), quantile(ordered, 0.9), len(ordered),
                                            points[-1][0], quantile(ordered, 0.1)), speed, quantile(ordered, 0.95))
        # valid until the oldest sample (of either series) ages out; new samples shorten it (_Series.stale)
        oldest = points[0][0]
        if speed_series is not None and speed_series.points:
            oldest = min(oldest, speed_series.points[0][0])
        series.keep(found, now, oldest + self.window)
        return found

    def completion(self, rule: str, model: str, now: float) -> Spread | None:
        """Median and p90, in tokens, or None."""
        series = self._length.get((rule, model))
        return _spread(series, now, self.window) if series is not None else None

    def latencies(self, now: float) -> list[tuple[str, str, Latency | None]]:
        return [(u, m, self.latency(u, m, now)) for u, m in sorted(self._ttft)]

    def snapshot(self, now: float) -> dict[str, Any]:
        """``GET /v1/tiergate/estimates``."""
        out: dict[str, Any] = {"window_s": self.window, "samples": self.size, "latency": [], "completion_tokens": []}
        for upstream, model in sorted(self._ttft):
            est = self.latency(upstream, model, now)
            out["latency"].append({"upstream": upstream, "model": model, "measured": est is not None,
                                   **(est.as_dict(now) if est is not None else {})})
        for rule, model in sorted(self._length):
            length = self.completion(rule, model, now)
            out["completion_tokens"].append({"rule": rule, "model": model, **(
                {"samples": length.samples, "age_s": round(length.age(now), 3), "p50": round(length.central, 1),
                 "p90": round(length.tail, 1)} if length is not None else {"samples": 0})})
        return out


def _spread(series: _Series, now: float, window: float, low_tail: bool = False) -> Spread | None:
    """``low_tail``: the tail is p10, the slow side of a speed."""
    if series.valid_until >= 0 and now <= series.valid_until:
        cached: Spread | None = series.summary
        return cached
    points = series.live(now, window)
    if not points:
        series.keep(None, now, float("inf"))
        return None
    ordered = sorted(p[2] for p in points)
    found = Spread(quantile(ordered, 0.5), quantile(ordered, 0.1 if low_tail else 0.9), len(ordered),
                   points[-1][0], quantile(ordered, 0.9 if low_tail else 0.1))
    series.keep(found, now, points[0][0] + window)
    return found


MIN_SPREAD = 256  # prompt tokens: the sizes seen must span at least this (and half their mean) to fit a slope


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float, list[float]]:
    """Slope >= 0: prefill never gets faster with a longer prompt. Flat unless the prompt sizes span :data:`MIN_SPREAD`
    tokens and half their mean: over a narrow span the slope is the noise's, and predicting a long prompt from it would
    extrapolate that noise (seen: 25-35-token prompts gave 0.09 s per 1,000 tokens on a flat-TTFT upstream)."""
    n = len(points)
    mx = sum(p[1] for p in points) / n
    my = sum(p[2] for p in points) / n
    slope = 0.0
    xs = [p[1] for p in points]
    if n >= 3 and max(xs) - min(xs) >= max(MIN_SPREAD, 0.5 * mx):
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((p[1] - mx) * (p[2] - my) for p in points) / sxx)
    base = my - slope * mx
    return base, slope, [p[2] - base - slope * p[1] for p in points]
