"""The fast tier as a scheduled resource (docs/routing.md#scheduling): which priority class may take a fast upstream's
budget now. Each class active on an upstream holds ``min(share × limit − used, asked / span × reset + largest)`` of each
bucket: its expected draw, not its whole share, so that what it leaves unused is lent to the others and the fast tier
never sits idle while someone wants it. A class asking for less than :data:`MEASURED_S` holds all of
``share × limit − used``: its rate is not known yet. A class refused while under its guarantee in the current window
(*starved*) is held at the rate of its busiest slot instead of its mean until the window refills: a closed-loop client
spilled to a slow tier asks less often, so its mean understates what it wants (measured: bench.contention's agent
fleet got 24 % of the budget against a 30 % share, and batch, of share 0, 26 %). ``used`` counts from the window's
start (its reset less its length), not over a sliding window, so that a refill gives every class its guarantee again
at once. With replicas, :meth:`Scheduler.absorb` adds what the others report (``gateway.state.classes``). Pure code, no
I/O; times are the health clock's seconds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config.scheduling import SchedulingConfig
from gateway.routing.health import UpstreamHealth

STALE_S = 5.0  # the other replicas' reports, absorbed longer ago than this (Redis away), are not counted
MEASURED_S = 2.0  # seconds of asking before a class's rate is trusted; until then it holds its whole guarantee
SLOTS = 12  # a window's use is summed over this many slots: the sliding sum is right to a twelfth of the window


class Use:
    """One class's reservations in one bucket of one upstream, a sliding sum over the last ``length`` seconds."""

    __slots__ = ("length", "counts", "peaks", "slot")

    def __init__(self, length: float) -> None:
        self.length = length
        self.counts = [0.0] * SLOTS
        self.peaks = [0.0] * SLOTS
        self.slot = 0  # the slot number (now // width) the ring's newest entry is for

    def _advance(self, now: float) -> int:
        slot = int(now * SLOTS / self.length)
        if slot - self.slot >= SLOTS:
            self.counts, self.peaks = [0.0] * SLOTS, [0.0] * SLOTS
        else:
            for s in range(self.slot + 1, slot + 1):
                self.counts[s % SLOTS] = self.peaks[s % SLOTS] = 0.0
        self.slot = max(self.slot, slot)
        return slot % SLOTS

    def add(self, now: float, amount: float) -> None:
        i = self._advance(now)
        self.counts[i] += amount
        self.peaks[i] = max(self.peaks[i], amount)

    def total(self, now: float, since: float | None = None) -> float:
        """Over the window, or from ``since`` on (to the nearest slot)."""
        self._advance(now)
        if since is None:
            return sum(self.counts)
        back = min(SLOTS, self.slot - round(since * SLOTS / self.length) + 1)  # the slots from since's to now's
        return sum(self.counts[(self.slot - k) % SLOTS] for k in range(max(0, back)))

    def largest(self, now: float) -> float:
        self._advance(now)
        return max(self.peaks)

    def busiest(self, now: float) -> float:
        """The most added in one slot of the window."""
        self._advance(now)
        return max(self.counts)


@dataclass(slots=True)
class Remote:
    """One class on one upstream as the other replicas last reported it, summed over them. Times are this replica's
    health clock's; ``used`` counts from each bucket's window start, ``asked`` and ``largest`` over the window."""

    began: float
    last: float
    starved: float = -math.inf
    used: dict[str, float] = field(default_factory=dict)
    asked: dict[str, float] = field(default_factory=dict)
    largest: dict[str, float] = field(default_factory=dict)
    busiest: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Need:
    """``tokens``: the prompt plus output estimate; ``cached``: the prompt tokens believed in the upstream's cache, not
    drawn from ``uncached``."""

    tokens: int
    cached: int = 0

    def of(self, bucket: str) -> float:
        return 1.0 if bucket == "requests" else self.tokens if bucket == "tokens" else max(0, self.tokens - self.cached)


@dataclass(frozen=True, slots=True)
class Ask:
    """``cached``: the prompt tokens each upstream's cache is believed to hold for the request (an agent session's warm
    upstreams: ``gateway.routing.sessions.Affinity.warm``)."""

    scheduler: Scheduler | None
    cls: str | None
    cached: Mapping[str, int]
    marked: set[str] = field(default_factory=set)  # upstreams it was counted as asking for (once each, re-planned)

    def refuses(self, h: UpstreamHealth, need_tokens: int, now: float) -> str | None:
        if self.scheduler is None or self.cls is None or h.tier != "fast":
            return None
        need = Need(need_tokens, self.cached.get(h.name, 0))
        if h.name not in self.marked:
            self.marked.add(h.name)
            self.scheduler.wants(h, self.cls, need, now)
        return self.scheduler.refuses(h, self.cls, need, now)


class Scheduler:
    """One per process; a reload keeps the use of the classes that stay (:meth:`reconfigure`)."""

    def __init__(self, cfg: SchedulingConfig) -> None:
        self.cfg = cfg
        self.shares = {c.name: c.share for c in cfg.classes}
        # upstream -> class -> (when its active span began, when it last asked for the upstream)
        self.seen: dict[str, dict[str, tuple[float, float]]] = {}
        self.uses: dict[tuple[str, str, str], Use] = {}  # (upstream, class, bucket): reserved
        self.asks: dict[tuple[str, str, str], Use] = {}  # the same: asked for
        self.starved: dict[tuple[str, str], float] = {}  # (upstream, class): when it was last refused under its share
        self.others: dict[str, dict[str, Remote]] = {}  # upstream -> class -> the other replicas' (absorb)
        self.replicas: dict[str, tuple[str, ...]] = {}  # upstream -> the other replicas that reported it
        self.absorbed: dict[str, float] = {}  # upstream -> when the others' reports last came

    def reconfigure(self, cfg: SchedulingConfig) -> Scheduler:
        new = Scheduler(cfg)
        new.seen = {u: {c: t for c, t in by.items() if c in new.shares} for u, by in self.seen.items()}
        new.uses = {k: v for k, v in self.uses.items() if k[1] in new.shares}
        new.asks = {k: v for k, v in self.asks.items() if k[1] in new.shares}
        new.starved = {k: v for k, v in self.starved.items() if k[1] in new.shares}
        new.others, new.replicas, new.absorbed = self.others, self.replicas, self.absorbed
        return new

    def wants(self, h: UpstreamHealth, cls: str, need: Need, now: float) -> None:
        """``h`` is among the request's candidates: the class is active there, whether it is served or spills. Its
        span begins with the first ask that can be counted (once the upstream has reported its limits), so that the
        rate is not diluted by asks before it."""
        if not h.limits:
            return
        seen = self.seen.setdefault(h.name, {})
        began, last = seen.get(cls, (now, -math.inf))
        seen[cls] = (began if now - last <= self.cfg.active else now, now)
        _add(self.asks, h, cls, need, now)

    def refuses(self, h: UpstreamHealth, cls: str, need: Need, now: float) -> str | None:
        """``class_share`` when taking ``need`` now would eat into what the other active classes hold. A bucket is
        scheduled only while its limit and a live estimate are known. A class that will not fit (held back, or the
        budget short) while under its guarantee is marked starved."""
        for bucket, q in h.quota.items():
            limit = h.limits.get(bucket)
            if limit is None or limit[0] <= 0 or q.resets_at <= now:
                continue
            reset, want = q.resets_at - now, need.of(bucket)
            if q.remaining - want < self.held(h.name, cls, bucket, limit, reset, now):
                if self.used(h.name, cls, bucket, limit[1], reset, now) + want <= self.shares[cls] * limit[0]:
                    self.starved[(h.name, cls)] = now
                return "class_share"
        return None

    def used(self, upstream: str, cls: str, bucket: str, length: float, reset: float, now: float) -> float:
        """Reserved since the bucket's window began (``reset`` seconds before its end), on every replica."""
        use = self.uses.get((upstream, cls, bucket))
        remote = self._remote(upstream, cls, now)
        return (use.total(now, now + reset - length) if use is not None else 0.0) + \
            (remote.used.get(bucket, 0.0) if remote is not None else 0.0)

    def held(self, upstream: str, cls: str, bucket: str, limit: tuple[float, float], reset: float,
             now: float) -> float:
        total = 0.0
        window_start = now + reset - limit[1]
        for other, share in self.shares.items():
            if other == cls or share <= 0:
                continue
            span = self._span(upstream, other, now)
            if span is None or now - span[1] > self.cfg.active:
                continue
            asked, largest, busiest = self._asked(upstream, other, bucket, now)
            if asked <= 0:
                continue
            left = share * limit[0] - self.used(upstream, other, bucket, limit[1], reset, now)
            if now - span[0] < MEASURED_S:  # two asks a second apart would read as half the rate a second later
                total += max(0.0, left)
                continue
            if self._starved(upstream, other, now) >= window_start:
                rate = busiest * SLOTS / limit[1]
            else:
                rate = asked / min(now - span[0], limit[1])
            total += max(0.0, min(left, rate * reset + largest))
        return total

    def _remote(self, upstream: str, cls: str, now: float) -> Remote | None:
        if self.absorbed.get(upstream, -math.inf) < now - STALE_S:
            return None
        return self.others.get(upstream, {}).get(cls)

    def _span(self, upstream: str, cls: str, now: float) -> tuple[float, float] | None:
        """(when its active span began, when it last asked), on any replica."""
        mine = self.seen.get(upstream, {}).get(cls)
        remote = self._remote(upstream, cls, now)
        if remote is None:
            return mine
        if mine is None:
            return remote.began, remote.last
        return min(mine[0], remote.began), max(mine[1], remote.last)

    def _starved(self, upstream: str, cls: str, now: float) -> float:
        remote = self._remote(upstream, cls, now)
        return max(self.starved.get((upstream, cls), -math.inf), remote.starved if remote is not None else -math.inf)

    def _asked(self, upstream: str, cls: str, bucket: str, now: float) -> tuple[float, float, float]:
        """(asked in the window, the largest single ask, the most asked in one slot), on every replica."""
        ask = self.asks.get((upstream, cls, bucket))
        remote = self._remote(upstream, cls, now)
        asked, largest, busiest = (ask.total(now), ask.largest(now), ask.busiest(now)) if ask is not None else \
            (0.0, 0.0, 0.0)
        if remote is not None:
            asked += remote.asked.get(bucket, 0.0)
            largest = max(largest, remote.largest.get(bucket, 0.0))
            busiest += remote.busiest.get(bucket, 0.0)
        return asked, largest, busiest

    def took(self, h: UpstreamHealth, cls: str, need: Need, now: float) -> None:
        _add(self.uses, h, cls, need, now)

    def view(self, health: Mapping[str, UpstreamHealth], now: float) -> list[dict[str, object]]:
        """For ``GET /v1/tiergate/capacity``: every replica's use, as this one schedules with it."""
        out: list[dict[str, object]] = []
        for name, h in health.items():
            if h.tier != "fast":
                continue
            buckets = []
            for bucket, (limit, length) in h.limits.items():
                q = h.quota.get(bucket)
                live = q is not None and q.resets_at > now
                reset = q.resets_at - now if q is not None and live else length
                classes = []
                for c in self.cfg.classes:
                    used = self.used(name, c.name, bucket, length, reset, now)
                    span = self._span(name, c.name, now)
                    classes.append({"class": c.name, "share": c.share, "used": round(used, 1),
                                    "used_share": round(used / limit, 4) if limit > 0 else None,
                                    "active": span is not None and now - span[1] <= self.cfg.active,
                                    "starved": self._starved(name, c.name, now) >= now + reset - length,
                                    "held": round(self.held(name, "", bucket, (limit, length), reset, now), 1)
                                    if live else 0.0})
                buckets.append({"bucket": bucket, "limit": limit, "window_s": length,
                                "remaining": round(q.remaining, 1) if live and q else None,
                                "reset_s": round(reset, 3) if live else None, "classes": classes})
            out.append({"upstream": name, "state": h.state(now), "buckets": buckets,
                        "replicas": 1 + (len(self.replicas.get(name, ()))
                                             if self.absorbed.get(name, -math.inf) >= now - STALE_S else 0)})
        return out

    def parts_used(self, health: Mapping[str, UpstreamHealth], now: float) -> list[tuple[str, str, str, float]]:
        """(upstream, class, bucket, part of the limit this replica reserved in the current window), for the gauge:
        per replica, so that Prometheus's ``sum`` gives the deployment's."""
        out = []
        for name, h in health.items():
            for bucket, (limit, length) in h.limits.items():
                q = h.quota.get(bucket)
                since = q.resets_at - length if q is not None and q.resets_at > now else None
                for cls in self.shares:
                    use = self.uses.get((name, cls, bucket))
                    used = use.total(now, since) if use is not None else 0.0
                    out.append((name, cls, bucket, used / limit if limit > 0 else 0.0))
        return out

    # replicas: gateway.state.classes carries these through Redis

    def export(self, health: Mapping[str, UpstreamHealth], now: float) -> dict[str, dict[str, object]]:
        """Upstream -> what this replica's active classes did there: ``b``, ``l``, ``s``: seconds since their span
        began, they last asked, were last starved; per bucket ``u`` used (from the window's start), ``a`` asked,
        ``g`` the largest ask, ``p`` the busiest slot."""
        out: dict[str, dict[str, object]] = {}
        for name, seen in self.seen.items():
            h = health.get(name)
            if h is None:
                continue
            classes: dict[str, object] = {}
            for cls, (began, last) in seen.items():
                if now - last > self.cfg.active:
                    continue
                u, a, g, p = {}, {}, {}, {}
                for bucket, (_, length) in h.limits.items():
                    q = h.quota.get(bucket)
                    since = q.resets_at - length if q is not None and q.resets_at > now else None
                    use, ask = self.uses.get((name, cls, bucket)), self.asks.get((name, cls, bucket))
                    u[bucket] = use.total(now, since) if use is not None else 0.0
                    a[bucket], g[bucket], p[bucket] = (ask.total(now), ask.largest(now), ask.busiest(now)) \
                        if ask is not None else (0.0, 0.0, 0.0)
                starved = self.starved.get((name, cls))
                classes[cls] = {"b": now - began, "l": now - last, "s": now - starved if starved else None,
                                "u": u, "a": a, "g": g, "p": p}
            if classes:
                out[name] = classes
        return out

    def absorb(self, upstream: str, reports: Mapping[str, Mapping[str, Any]], now: float) -> None:
        """``reports``: each other replica's :meth:`export` for ``upstream`` (checked by the caller), its ages already
        counted to this replica's ``now``; replaces what they reported before."""
        merged: dict[str, Remote] = {}
        for report in reports.values():
            for cls, r in report.items():
                if cls not in self.shares:
                    continue
                began, last = now - float(r["b"]), now - float(r["l"])
                starved = now - float(r["s"]) if r.get("s") is not None else -math.inf
                m = merged.get(cls)
                if m is None:
                    m = merged[cls] = Remote(began, last, starved)
                else:
                    m.began, m.last, m.starved = min(m.began, began), max(m.last, last), max(m.starved, starved)
                for bucket, v in r["u"].items():
                    m.used[bucket] = m.used.get(bucket, 0.0) + float(v)
                for bucket, v in r["a"].items():
                    m.asked[bucket] = m.asked.get(bucket, 0.0) + float(v)
                for bucket, v in r["p"].items():
                    m.busiest[bucket] = m.busiest.get(bucket, 0.0) + float(v)
                for bucket, v in r["g"].items():
                    m.largest[bucket] = max(m.largest.get(bucket, 0.0), float(v))
        self.others[upstream] = merged
        self.replicas[upstream] = tuple(reports)
        self.absorbed[upstream] = now


def _add(table: dict[tuple[str, str, str], Use], h: UpstreamHealth, cls: str, need: Need, now: float) -> None:
    for bucket, (_, length) in h.limits.items():
        use = table.get((h.name, cls, bucket))
        if use is None:
            use = table[(h.name, cls, bucket)] = Use(length)
        use.add(now, need.of(bucket))
