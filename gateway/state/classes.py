"""The priority classes' use of each fast upstream, shared by the replicas (docs/routing.md#scheduling-replicas), so
that a batch flood on one replica holds back for an interactive class active on another. Every :data:`SHARE_S`
seconds each replica writes its :meth:`gateway.routing.scheduling.Scheduler.export` for the upstream to the hash
``{prefix}:{upstream}:classes`` (a field per replica; the hash tag keeps it in the upstream's Redis Cluster slot) and
reads the others' in the same pipeline, off the request path: nothing awaits it. A report older than
:data:`STALE_S` (its replica is gone) is skipped and deleted."""

from __future__ import annotations

import functools
import math
from typing import Any

import orjson

from gateway.routing.scheduling import STALE_S, Scheduler
from gateway.state.link import RedisLink

SHARE_S = 0.25  # seconds between exchanges: how late a replica learns of another's classes, at most, plus a round trip


class SharedClasses:
    """``scheduler`` and ``health`` are the app's current ones (the composition root sets them, again on a reload)."""

    def __init__(self, link: RedisLink) -> None:
        self.link = link
        self.scheduler: Scheduler | None = None
        self.health: Any = None  # gateway.routing.health.Health
        link.every(SHARE_S, self.exchange)

    def exchange(self) -> None:
        scheduler, health, link = self.scheduler, self.health, self.link
        if scheduler is None or health is None:
            return
        mine = scheduler.export(health.by_name, health.clock())
        wall = link.wall()
        ttl = int((scheduler.cfg.active + STALE_S) * 1000)  # the hash outlives its last writer by an active span
        for name, h in health.by_name.items():
            if h.tier != "fast":
                continue
            key = f"{link.prefix}:{{{name}}}:classes"
            report = orjson.dumps({"at": wall, "c": mine.get(name, {})})

            def add(pipe: Any, key: str = key, report: bytes = report) -> None:
                pipe.hgetall(key)
                pipe.hset(key, link.replica, report)
                pipe.pexpire(key, ttl)
            link.queue("classes", add, functools.partial(self._read, name, key))

    def _read(self, upstream: str, key: str, reply: Any) -> None:
        """A field that does not parse as a report is counted (``shared_state_errors_total{op="classes"}``) and
        skipped."""
        scheduler, health, link = self.scheduler, self.health, self.link
        if scheduler is None or health is None or not isinstance(reply, dict):
            return
        wall, reports, stale = link.wall(), {}, []
        for field, raw in reply.items():
            replica = field.decode() if isinstance(field, bytes) else str(field)
            if replica == link.replica:
                continue
            try:
                report = orjson.loads(raw)
                late = max(0.0, wall - _num(report["at"]))
                if late > STALE_S:
                    stale.append(replica)
                    continue
                reports[replica] = {str(cls): _class(r, late) for cls, r in report["c"].items()}
            except (ValueError, TypeError, KeyError, AttributeError):
                link.metrics.shared_errors.labels("classes").inc()
        scheduler.absorb(upstream, reports, health.clock())
        if stale:
            link.queue("classes", lambda pipe: pipe.hdel(key, *stale))


def _num(v: Any) -> float:
    """A number as :meth:`Scheduler.export` writes it: a JSON number, finite and not negative. Raises ValueError for
    anything else: a string ``float()`` would take ("1e300", "nan"), a negative use that would make every replica
    hold back, a NaN time that is never stale."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"not a number: {v!r}")
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"not a finite, non-negative number: {v!r}")
    return f


def _class(r: dict[str, Any], late: float) -> dict[str, Any]:
    """One class of a report, every number checked and its ages counted to now (``late``: seconds since it was
    written). Raises ValueError, TypeError, KeyError or AttributeError for what the gateway never writes."""
    buckets = {k: {str(b): _num(v) for b, v in r[k].items()} for k in ("u", "a", "g", "p")}
    return {"b": _num(r["b"]) + late, "l": _num(r["l"]) + late,
            "s": _num(r["s"]) + late if r.get("s") is not None else None, **buckets}
