"""The fast tier as a scheduled resource (docs/routing.md#scheduling): which priority class may take a fast upstream's
budget now. Each class active on an upstream holds ``min(share × limit − used, asked / span × reset + largest)`` of each
bucket: its expected draw, not its whole share, so that what it leaves unused is lent to the others and the fast tier
never sits idle while someone wants it. Pure code, no I/O; times are the health clock's seconds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.config.scheduling import SchedulingConfig
from gateway.routing.health import UpstreamHealth

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

    def total(self, now: float) -> float:
        self._advance(now)
        return sum(self.counts)

    def largest(self, now: float) -> float:
        self._advance(now)
        return max(self.peaks)


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
        # what other replicas reserved in the window, by the same key; nothing fills it yet: each replica schedules
        # from its own traffic (docs/routing.md#scheduling: bounds)
        self.shared: dict[tuple[str, str, str], float] = {}

    def reconfigure(self, cfg: SchedulingConfig) -> Scheduler:
        new = Scheduler(cfg)
        new.seen = {u: {c: t for c, t in by.items() if c in new.shares} for u, by in self.seen.items()}
        new.uses = {k: v for k, v in self.uses.items() if k[1] in new.shares}
        new.asks = {k: v for k, v in self.asks.items() if k[1] in new.shares}
        return new

    def wants(self, h: UpstreamHealth, cls: str, need: Need, now: float) -> None:
        """``h`` is among the request's candidates: the class is active there, whether it is served or spills."""
        seen = self.seen.setdefault(h.name, {})
        began, last = seen.get(cls, (now, -math.inf))
        seen[cls] = (began if now - last <= self.cfg.active else now, now)
        _add(self.asks, h, cls, need, now)

    def refuses(self, h: UpstreamHealth, cls: str, need: Need, now: float) -> str | None:
        """``class_share`` when taking ``need`` now would eat into what the other active classes hold. A bucket is
        scheduled only while its limit and a live estimate are known."""
        for bucket, q in h.quota.items():
            limit = h.limits.get(bucket)
            if limit is None or limit[0] <= 0 or q.resets_at <= now:
                continue
            if q.remaining - need.of(bucket) < self.held(h.name, cls, bucket, limit, q.resets_at - now, now):
                return "class_share"
        return None

    def held(self, upstream: str, cls: str, bucket: str, limit: tuple[float, float], reset: float,
             now: float) -> float:
        total = 0.0
        seen = self.seen.get(upstream)
        if not seen:
            return 0.0
        for other, share in self.shares.items():
            span = seen.get(other)
            if other == cls or share <= 0 or span is None or now - span[1] > self.cfg.active:
                continue
            use, asked = self.uses.get((upstream, other, bucket)), self.asks.get((upstream, other, bucket))
            used = (use.total(now) if use is not None else 0.0) + self.shared.get((upstream, other, bucket), 0.0)
            if asked is None:
                continue
            rate = asked.total(now) / min(max(now - span[0], 1.0), limit[1])
            total += max(0.0, min(share * limit[0] - used, rate * reset + asked.largest(now)))
        return total

    def took(self, h: UpstreamHealth, cls: str, need: Need, now: float) -> None:
        _add(self.uses, h, cls, need, now)

    def view(self, health: Mapping[str, UpstreamHealth], now: float) -> list[dict[str, object]]:
        """For ``GET /v1/tiergate/capacity``."""
        out: list[dict[str, object]] = []
        for name, h in health.items():
            if h.tier != "fast":
                continue
            buckets = []
            for bucket, (limit, length) in h.limits.items():
                q = h.quota.get(bucket)
                live = q is not None and q.resets_at > now
                classes = []
                for c in self.cfg.classes:
                    use = self.uses.get((name, c.name, bucket))
                    used = (use.total(now) if use is not None else 0.0) + self.shared.get((name, c.name, bucket), 0)
                    span = self.seen.get(name, {}).get(c.name)
                    classes.append({"class": c.name, "share": c.share, "used": round(used, 1),
                                    "used_share": round(used / limit, 4) if limit > 0 else None,
                                    "active": span is not None and now - span[1] <= self.cfg.active,
                                    "held": round(self.held(name, "", bucket, (limit, length),
                                                            q.resets_at - now, now), 1) if live and q else 0.0})
                buckets.append({"bucket": bucket, "limit": limit, "window_s": length,
                                "remaining": round(q.remaining, 1) if live and q else None,
                                "reset_s": round(q.resets_at - now, 3) if live and q else None, "classes": classes})
            out.append({"upstream": name, "state": h.state(now), "buckets": buckets})
        return out

    def parts_used(self, health: Mapping[str, UpstreamHealth], now: float) -> list[tuple[str, str, str, float]]:
        """(upstream, class, bucket, part of the limit reserved in the last window), for the gauge."""
        out = []
        for name, h in health.items():
            for bucket, (limit, _) in h.limits.items():
                for cls in self.shares:
                    use = self.uses.get((name, cls, bucket))
                    used = (use.total(now) if use is not None else 0.0) + self.shared.get((name, cls, bucket), 0.0)
                    out.append((name, cls, bucket, used / limit if limit > 0 else 0.0))
        return out

def _add(table: dict[tuple[str, str, str], Use], h: UpstreamHealth, cls: str, need: Need, now: float) -> None:
    for bucket, (_, length) in h.limits.items():
        use = table.get((h.name, cls, bucket))
        if use is None:
            use = table[(h.name, cls, bucket)] = Use(length)
        use.add(now, need.of(bucket))
