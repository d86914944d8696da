"""What the gateway keeps of one agent run (docs/sessions.md) and the bounded table of runs in this process; the
replicas' is ``gateway.state.sessions``. Pure code: times come in as wall-clock seconds, so that replicas agree on them.
A step's admission checks the budgets and reserves it with nothing in between, so that concurrent steps cannot pass a
budget together."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# Seconds a step's hold counts against its run at most (wall-clock): a replica that died mid-step frees its runs'
# budgets after this, and a step still in flight after it stops counting as in flight (its end still counts). Longer
# than one non-streamed attempt may take by default (``upstreams[].timeouts.total``, 600 s) and a failover's connect:
# an agent's step is a model call, and a stream has no total timeout, so a step that streams for longer than this is
# the one case it misses.
HOLD_S = 900.0


def scope(owner: str | None, session_id: str) -> str:
    """The gateway key's name is in it, so that two tenants naming the same id have two sessions. 32 hex digits of a
    SHA-256: bounded, and safe in a Redis key whatever the id holds."""
    return hashlib.sha256(f"{owner or ''}\x1f{session_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Warm:
    """``at``: wall seconds; ``prompt_tokens``: the prefix the upstream's prompt cache now holds."""

    at: float
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Move:
    """``at``: wall seconds; ``reason``: one of ``gateway.routing.sessions.MOVE_REASONS``."""

    at: float
    source: str
    target: str
    reason: str


# samples the standard tier's estimate must rest on (the fewer of its TTFT and decode-speed samples) before the
# seconds a fast-tier step saved are priced with it: one sample is one answer's luck, not the tier's speed
MIN_SAMPLES = 8


@dataclass(frozen=True, slots=True)
class Payoff:
    """Seconds a fast-tier step saved against the standard tier's live estimate for the same output and the prompt it
    would have had uncached there: ``central`` from the estimate's medians, ``low`` and ``high`` from its quick and
    slow sides; ``samples``: the fewer of its TTFT and speed samples. ``central`` None: not enough data (fewer than
    :data:`MIN_SAMPLES`, or the standard tier unmeasured), and no number is claimed."""

    central: float | None
    low: float = 0.0
    high: float = 0.0
    samples: int = 0

    def wire(self) -> str:
        """``central|low|high|samples``, or ``u`` (unpriced): its argument to ``session_step.lua``."""
        if self.central is None or not all(math.isfinite(v) for v in (self.central, self.low, self.high)):
            return "u"  # Redis' HINCRBYFLOAT refuses a non-finite number, and the script would overwrite the total
        return f"{self.central!r}|{self.low!r}|{self.high!r}|{self.samples}"


@dataclass(frozen=True, slots=True)
class Step:
    """``duration`` in seconds; ``saved`` None: not a fast-tier step; ``usd``: 0 when unpriced."""

    upstream: str
    tier: str
    duration: float
    usd: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    saved: Payoff | None = None
    move: str | None = None


@dataclass(frozen=True, slots=True)
class Hold:
    """``id`` is random, unique per step; ``usd``: its estimated cost (0 when unpriced)."""

    id: str
    usd: float

    def member(self) -> str:
        """``<id>|<usd>``: its member in the run's set of holds in Redis."""
        return f"{self.id}|{self.usd!r}"


@dataclass(frozen=True, slots=True)
class Bounds:
    """``max_usd`` None: not checked (a step the USD budget moved to the standard tier is not held to it)."""

    max_steps: int | None
    max_usd: float | None

    def refused(self, steps: int, held: int, usd: float, reserved: float) -> str | None:
        if self.max_steps is not None and steps + held >= self.max_steps:
            return "max_steps"
        if self.max_usd is not None and usd + reserved >= self.max_usd:
            return "max_usd"
        return None


@dataclass(frozen=True, slots=True)
class Tally:
    """``steps``, ``held``, ``usd``, ``reserved``: what the run counted when checked, this step's hold included when
    admitted."""

    record: SessionRecord
    refused: str | None
    steps: int
    held: int
    usd: float
    reserved: float

    @property
    def number(self) -> int:
        """1-based: its steps finished and in flight, itself included."""
        return self.steps + self.held


@dataclass
class SessionRecord:
    """Times in wall-clock seconds. ``moves``: the newest (``sessions.max_moves``), ``moved`` counts all; ``holds``:
    hold id -> (USD reserved, wall-clock expiry)."""

    owner: str | None
    id: str
    source: str
    started: float
    last: float = 0.0
    steps: int = 0
    usd: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    last_upstream: str | None = None
    warm: dict[str, Warm] = field(default_factory=dict)
    seconds_by_tier: dict[str, float] = field(default_factory=dict)
    seconds_by_upstream: dict[str, float] = field(default_factory=dict)
    steps_by_tier: dict[str, int] = field(default_factory=dict)
    saved: float = 0.0  # seconds, over the priced fast-tier steps (Payoff); saved_low, saved_high: its interval
    saved_steps: int = 0
    saved_low: float = 0.0
    saved_high: float = 0.0
    saved_samples: int = 0  # the fewest samples a priced step's estimate rested on
    unpriced_steps: int = 0  # fast-tier steps with not enough data to price
    moves: list[Move] = field(default_factory=list)
    moved: int = 0
    holds: dict[str, tuple[float, float]] = field(default_factory=dict)

    def in_flight(self, now: float) -> tuple[int, float]:
        live = [usd for usd, until in self.holds.values() if until > now]
        return len(live), sum(live)

    def expire(self, now: float) -> None:
        """Holds whose settlement never came."""
        for hold_id in [h for h, (_, until) in self.holds.items() if until <= now]:
            del self.holds[hold_id]

    def idle(self, now: float, idle: float) -> bool:
        """Never while a step is in flight."""
        return self.in_flight(now)[0] == 0 and now - (self.last if self.steps else self.started) >= idle

    def without_holds(self) -> SessionRecord:
        """A deep copy, nothing shared: another table's record of the run's steps."""
        return dataclasses.replace(self, **{f.name: copy.deepcopy(getattr(self, f.name)) for f in _COPIED}, holds={})

    def take_totals(self, other: SessionRecord) -> None:
        """``other`` is a newer view of the same run (Redis'); its own holds stay."""
        for f in _COPIED:
            setattr(self, f.name, copy.deepcopy(getattr(other, f.name)))

    def add(self, step: Step, now: float, max_moves: int) -> Move | None:
        move = None
        if step.move is not None and self.last_upstream is not None:
            self.moved += 1
            move = Move(now, self.last_upstream, step.upstream, step.move)
            if max_moves:
                self.moves.append(move)
                del self.moves[:-max_moves]
        self.steps += 1
        self.last = now
        self.usd += step.usd
        self.prompt_tokens += step.prompt_tokens
        self.cached_tokens += step.cached_tokens
        self.output_tokens += step.output_tokens
        self.last_upstream = step.upstream
        self.warm[step.upstream] = Warm(now, step.prompt_tokens)
        self.seconds_by_tier[step.tier] = self.seconds_by_tier.get(step.tier, 0.0) + step.duration
        self.seconds_by_upstream[step.upstream] = self.seconds_by_upstream.get(step.upstream, 0.0) + step.duration
        self.steps_by_tier[step.tier] = self.steps_by_tier.get(step.tier, 0) + 1
        self.paid(step.saved)
        return move

    def paid(self, p: Payoff | None) -> None:
        if p is None:
            return
        if p.central is None:
            self.unpriced_steps += 1
            return
        self.saved_samples = p.samples if not self.saved_steps else min(self.saved_samples, p.samples)
        self.saved += p.central
        self.saved_low += p.low
        self.saved_high += p.high
        self.saved_steps += 1

    def payoff(self) -> dict[str, object]:
        """What the fast tier saved the run, as the session view shows it: a number only with data behind it."""
        fast = self.saved_steps + self.unpriced_steps
        out: dict[str, object] = {"seconds": None, "interval_seconds": None, "priced_steps": self.saved_steps,
                                  "unpriced_steps": self.unpriced_steps, "samples": self.saved_samples or None}
        if not fast:
            out["note"] = "no fast-tier step yet"
        elif not self.saved_steps:
            out["note"] = (f"not enough data: the standard tier's live estimate had fewer than {MIN_SAMPLES} "
                           "streamed answers behind it at each step (streamed traffic on the standard tier teaches it)")
        else:
            out["seconds"] = round(self.saved, 6)
            out["interval_seconds"] = [round(self.saved_low, 6), round(self.saved_high, 6)]
            if self.unpriced_steps:
                out["note"] = f"covers {self.saved_steps} of the {fast} fast-tier steps (the rest: not enough data)"
        return out

    def as_dict(self) -> dict[str, object]:
        """As ``GET /v1/tiergate/sessions/{id}`` shows it."""
        return {
            "object": "tiergate.session", "id": self.id, "source": self.source, "steps": self.steps,
            "started_at": round(self.started, 3), "last_step_at": round(self.last, 3) if self.steps else None,
            "wall_seconds": round(max(0.0, self.last - self.started), 6) if self.steps else 0.0,
            "cost_usd": round(self.usd, 9),
            "tokens": {"prompt": self.prompt_tokens, "cached": self.cached_tokens, "output": self.output_tokens},
            "cache_hit_ratio": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
            "steps_by_tier": dict(self.steps_by_tier),
            "seconds_by_tier": {k: round(v, 6) for k, v in self.seconds_by_tier.items()},
            "seconds_by_upstream": {k: round(v, 6) for k, v in self.seconds_by_upstream.items()},
            "last_upstream": self.last_upstream,
            "fast_tier_saved_seconds": round(self.saved, 6) if self.saved_steps else None,
            "fast_tier_saved_steps": self.saved_steps,
            "fast_tier_saved": self.payoff(),
            "moves": [{"at": round(m.at, 3), "from": m.source, "to": m.target, "reason": m.reason} for m in self.moves],
            "moves_total": self.moved,
        }


_COPIED = tuple(f for f in dataclasses.fields(SessionRecord) if f.name != "holds")


class SessionTable(Protocol):
    """:class:`MemorySessions`, or ``gateway.state.sessions.SharedSessions`` across replicas."""

    async def load(self, key: str, now: float) -> SessionRecord | None:
        """None: unknown, or idle too long."""
        ...

    async def begin(self, key: str, fresh: SessionRecord, hold: Hold, bounds: Bounds, now: float) -> Tally:
        """Checks ``bounds`` and reserves ``hold`` in one atomic step; ``fresh``: the run as the step read it, made the
        record when none is kept."""
        ...

    def settle(self, key: str, record: SessionRecord, hold: Hold | None, step: Step | None, now: float,
               max_moves: int) -> None:
        """Not awaited. ``step`` None: no upstream answered it, and no step is added."""
        ...


class MemorySessions:
    """``idle``: seconds a run is kept after its last step. One key holds at most ``key_share`` of ``max_items``, and a
    full table takes room from the key holding the most, so that a key holding fewer runs never loses one to another.
    ``on_end`` is told each run with a step that leaves, for the per-session metrics."""

    def __init__(self, max_items: int, idle: float, on_end: Callable[[SessionRecord], None] | None = None,
                 key_share: float = 1.0, hold_s: float = HOLD_S) -> None:
        self.max_items = max_items
        self.idle = idle
        self.on_end = on_end
        self.hold_s = hold_s
        self.per_key = max(1, int(max_items * key_share))
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()  # least recently used first
        self._owned: dict[str | None, OrderedDict[str, None]] = {}  # each owner's keys, least recently used first

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def get(self, key: str, now: float) -> SessionRecord | None:
        record = self._records.get(key)
        if record is None:
            return None
        if record.idle(now, self.idle):
            self._forget(key)
            return None
        return record

    async def load(self, key: str, now: float) -> SessionRecord | None:
        return self.get(key, now)

    async def begin(self, key: str, fresh: SessionRecord, hold: Hold, bounds: Bounds, now: float) -> Tally:
        return self.take(key, fresh, hold, bounds, now)

    def take(self, key: str, fresh: SessionRecord, hold: Hold, bounds: Bounds, now: float) -> Tally:
        """No await between the check and the reservation. A run the table does not hold takes ``fresh`` (without any
        holds it carries) as its record from now on."""
        record = self.get(key, now)
        if record is None:
            record = fresh.without_holds() if fresh.holds else fresh
        record.expire(now)
        held, reserved = record.in_flight(now)
        refused = bounds.refused(record.steps, held, record.usd, reserved)
        if refused is not None:
            return Tally(record, refused, record.steps, held, record.usd, reserved)
        record.holds[hold.id] = (hold.usd, now + self.hold_s)
        self.put(key, record, now)
        return Tally(record, None, record.steps, held + 1, record.usd, reserved + hold.usd)

    def mirror(self, key: str, seen: SessionRecord, hold: Hold, now: float) -> None:
        """Redis admitted the step: the copy takes its totals and the hold, to count on while Redis is away."""
        record = self.get(key, now)
        if record is None:
            record = seen.without_holds()
        else:
            record.take_totals(seen)
        record.holds[hold.id] = (hold.usd, now + self.hold_s)
        self.put(key, record, now)

    def settle(self, key: str, record: SessionRecord, hold: Hold | None, step: Step | None, now: float,
               max_moves: int) -> None:
        self.release(key, record, hold, step, now, max_moves)

    def release(self, key: str, record: SessionRecord, hold: Hold | None, step: Step | None, now: float,
                max_moves: int) -> Move | None:
        """``record`` is used again if the table lost the run meanwhile."""
        kept = self._records.get(key)
        if hold is not None:
            record.holds.pop(hold.id, None)
            if kept is not None:
                kept.holds.pop(hold.id, None)
        if step is None:
            return None
        target = kept if kept is not None else record
        move = target.add(step, now, max_moves)
        self.put(key, target, now)
        return move

    def put(self, key: str, record: SessionRecord, now: float) -> None:
        """What is over the bounds, or idle, leaves."""
        self._records[key] = record
        self._records.move_to_end(key)
        mine = self._owned.setdefault(record.owner, OrderedDict())
        mine[key] = None
        mine.move_to_end(key)
        self.sweep(now, 8)
        while record.owner is not None and len(mine) > self.per_key:
            self._forget(next(iter(mine)))  # over its share: its own least recently used
        while len(self._records) > self.max_items:
            # full: the key holding the most sessions gives up its least recently used, so that a key new to a
            # table full of others' runs takes room from the largest holder, not from a quieter key
            largest = max(self._owned.values(), key=len)
            self._forget(next(iter(largest)))

    def sweep(self, now: float, most: int) -> None:
        """At most ``most`` a call, so that a put does bounded work; the first run not idle ends it."""
        for _ in range(most):
            oldest = next(iter(self._records.items()), None)
            if oldest is None or not oldest[1].idle(now, self.idle):
                return
            self._forget(oldest[0])

    def _forget(self, key: str) -> None:
        record = self._records.pop(key)
        mine = self._owned.get(record.owner)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._owned[record.owner]
        if record.steps and self.on_end is not None:
            self.on_end(record)
