"""prometheus-client's Counter, Gauge and Histogram over lock-free values, for a gateway whose metrics are all updated
on its event loop's thread (a scrape only reads them). prometheus-client guards every value with a ``threading.Lock``
(measured ~270 ns an update against ~60 ns without) and finds a histogram's bucket by a linear scan; a plain request
makes ~20 updates. Under ``--workers N`` prometheus-client's multiprocess values (mmap files) are used instead:
:func:`kind` picks. Exposition, labels and names are prometheus-client's own."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, values


class LoopValue:
    """``values.MutexValue`` without its lock: safe while one thread writes (a read sees an old or a new float)."""

    __slots__ = ("_value", "_exemplar")
    _multiprocess = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


class LoopCounter(Counter):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = LoopValue()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if amount < 0 or exemplar:
            return super().inc(amount, exemplar)  # its ValueError, or its exemplar
        try:
            self._value._value += amount
        except AttributeError:  # a labelled parent has no value: prometheus-client's ValueError (free when unraised)
            super().inc(amount, exemplar)


class LoopGauge(Gauge):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = LoopValue()

    def inc(self, amount: float = 1) -> None:
        if self._is_most_recent:  # prometheus-client refuses it: so here, not first under --workers
            return super().inc(amount)
        try:
            self._value._value += amount
        except AttributeError:  # a labelled parent (as LoopCounter.inc)
            super().inc(amount)

    def dec(self, amount: float = 1) -> None:
        if self._is_most_recent:
            return super().dec(amount)
        try:
            self._value._value -= amount
        except AttributeError:
            super().dec(amount)

    def set(self, value: float) -> None:
        try:
            self._value._value = float(value)
        except AttributeError:
            super().set(value)


class LoopHistogram(Histogram):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = LoopValue()
        self._buckets = [LoopValue() for _ in self._upper_bounds]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        """The bucket is the first whose upper bound is >= ``amount`` (prometheus-client's rule); NaN counts in none."""
        if exemplar or amount != amount:
            return super().observe(amount, exemplar)
        try:
            self._sum._value += amount
        except AttributeError:  # a labelled parent (as LoopCounter.inc)
            return super().observe(amount, exemplar)
        self._buckets[bisect_left(self._upper_bounds, amount)]._value += 1


_LOOP: dict[type[Any], type[Any]] = {Counter: LoopCounter, Gauge: LoopGauge, Histogram: LoopHistogram}


def kind(declared: type[Any]) -> type[Any]:
    """The lock-free class for ``declared`` in a single process; prometheus-client's own under its multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` set when it was imported)."""
    if values.ValueClass is not values.MutexValue:
        return declared
    return _LOOP.get(declared, declared)
