"""Agent sessions every replica shares (docs/sessions.md#replicas), so that a run's next step finds its warm upstream,
its budgets and its totals whichever replica it reaches, and every replica's admission counts its steps in flight."""

from __future__ import annotations

from typing import Any

from redis.asyncio.client import Pipeline

from gateway.state.link import RedisLink, number
from gateway.tenancy.sessions import Bounds, Hold, MemorySessions, Move, SessionRecord, Step, Tally, Warm, scope


def record_key(record: SessionRecord) -> str:
    return scope(record.owner, record.id)


class SharedSessions:
    """``{prefix}:session:{<key>}`` holds the run's totals, added to by ``lua/session_step.lua`` so that steps two
    replicas serve at once both count; ``...:moves``; and ``...:holds``, its steps in flight (``<hold id>|<usd>`` scored
    by expiry, wall seconds), so that a replica that died mid-step leaks no hold. ``{prefix}:sessions:{<owner>}``
    indexes a key's runs by last use, so that one key holds at most its share of ``sessions.max_items`` in Redis too.
    ``local`` keeps a copy of each run this process served, which admits and counts while Redis is away (missing the
    other replicas' steps meanwhile)."""

    def __init__(self, local: MemorySessions, shared: RedisLink, max_moves: int) -> None:
        self.local = local
        self.shared = shared
        self.max_moves = max_moves
        self.ttl_ms = max(1, int(local.idle * 1000))
        self.on_end, local.on_end = local.on_end, self._ended

    def _ended(self, record: SessionRecord) -> None:
        """The run ended only if no replica took a step of it since this one's last; then it is told on, once."""
        if self.on_end is None:
            return
        tell = self.on_end

        def check(steps: Any) -> None:
            if steps is None or number(steps) == record.steps:
                tell(record)
        self.shared.queue("session", lambda pipe: pipe.hget(self._key(record_key(record)), "n"), check)

    def _key(self, key: str) -> str:
        return f"{self.shared.prefix}:session:{{{key}}}"  # a hash tag: the session's keys share a Cluster slot

    async def load(self, key: str, now: float) -> SessionRecord | None:
        name = self._key(key)

        def read(pipe: Pipeline) -> None:
            pipe.hgetall(name)
            pipe.lrange(name + ":moves", 0, self.max_moves - 1)
            pipe.zrangebyscore(name + ":holds", f"({now!r}", "+inf", withscores=True)
        ok, replies = await self.shared.ask("session", read)
        if not ok:
            return self.local.get(key, now)
        record = decode(replies[0], replies[1], replies[2])
        if record is None or record.idle(now, self.local.idle):
            return None
        return record

    async def begin(self, key: str, fresh: SessionRecord, hold: Hold, bounds: Bounds, now: float) -> Tally:
        """Without an answer in time, admitted in the local copy alone; its hold in Redis, if the script ran after all,
        is removed by the settlement, or expires."""
        name = self._key(key)
        args: list[str | int] = [
            self.ttl_ms, repr(now), repr(now + self.local.hold_s), hold.member(), repr(hold.usd),
            "" if bounds.max_steps is None else bounds.max_steps,
            "" if bounds.max_usd is None else repr(bounds.max_usd), fresh.owner or "", fresh.id, fresh.source,
            repr(fresh.started), max(1, int(self.local.hold_s * 1000))]
        script = self.shared.session_begin
        ok, replies = await self.shared.ask("session", lambda pipe: pipe.evalsha(
            script.sha, 2, name, name + ":holds", *args))
        reply = replies[0] if ok else None
        if not isinstance(reply, list) or len(reply) != 6:
            return self.local.take(key, fresh, hold, bounds, now)
        refused = _text(reply[1]) or None
        tally = Tally(fresh, refused, int(number(reply[2]) or 0), int(number(reply[3]) or 0),
                      number(reply[4]) or 0.0, number(reply[5]) or 0.0)
        if refused is None:
            self.local.mirror(key, fresh, hold, now)
            self._index(key, fresh.owner, now)
        return tally

    def settle(self, key: str, record: SessionRecord, hold: Hold | None, step: Step | None, now: float,
               max_moves: int) -> None:
        if key not in self.local and record.holds:  # Redis' view of the run becomes the copy: not its holds
            record = record.without_holds()
        move = self.local.release(key, record, hold, step, now, max_moves)
        name, member = self._key(key), "" if hold is None else hold.member()
        if step is None:
            if member:
                self.shared.queue("session", lambda pipe: pipe.zrem(name + ":holds", member))
            return
        args: list[str | int] = [
            self.ttl_ms, repr(now), record.owner or "", record.id, record.source, repr(record.started),
            step.upstream, step.tier, repr(step.duration), repr(step.usd), step.prompt_tokens, step.cached_tokens,
            step.output_tokens, "" if step.saved is None else step.saved.wire(),
            "" if move is None else f"{move.at!r}|{move.source}|{move.target}|{move.reason}", max_moves, member]
        script = self.shared.session_step
        self.shared.queue("session", lambda pipe: pipe.evalsha(
            script.sha, 3, name, name + ":moves", name + ":holds", *args))
        self._index(key, record.owner, now)

    def _index(self, key: str, owner: str | None, now: float) -> None:
        """Over its share, a key's own least recently used runs leave Redis as they leave this table."""
        index = f"{self.shared.prefix}:sessions:{{{owner or ''}}}"
        bound = self.local.per_key if owner is not None else self.local.max_items
        at: list[str | int] = [key, repr(now), bound, repr(self.local.idle), self.ttl_ms]
        indexing = self.shared.session_index
        self.shared.queue("session", lambda pipe: pipe.evalsha(indexing.sha, 1, index, *at), self._evict)

    def _evict(self, gone: Any) -> None:
        """One key per command: each is its own Cluster slot."""
        names = [self._key(k.decode() if isinstance(k, bytes) else str(k)) for k in gone or ()]
        if names:
            self.shared.queue("session", lambda pipe: [pipe.delete(n, n + ":moves", n + ":holds") for n in names])


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def decode(fields: Any, moves: Any, holds: Any = ()) -> SessionRecord | None:
    """``holds``: ``(member, expiry)`` pairs. None for what the gateway did not write. A run whose first step is in
    flight has no ``n`` nor ``t`` yet."""
    if not isinstance(fields, dict) or not fields:
        return None
    f = {_text(k): _text(v) for k, v in fields.items()}
    started, last, steps = number(f.get("s0")), number(f.get("t")) or 0.0, number(f.get("n")) or 0.0
    if started is None or "i" not in f:
        return None
    record = SessionRecord(f.get("o") or None, f["i"], f.get("src", ""), started, last, int(steps),
                           number(f.get("u")) or 0.0, int(number(f.get("pi")) or 0), int(number(f.get("pc")) or 0),
                           int(number(f.get("po")) or 0), f.get("lu") or None, saved=number(f.get("sv")) or 0.0,
                           saved_steps=int(number(f.get("svn")) or 0), saved_low=number(f.get("svl")) or 0.0,
                           saved_high=number(f.get("svh")) or 0.0, saved_samples=int(number(f.get("svm")) or 0),
                           unpriced_steps=int(number(f.get("svu")) or 0), moved=int(number(f.get("mv")) or 0))
    for name, value in f.items():
        kind, _, rest = name.partition(":")
        if not rest:
            continue
        if kind == "w":
            at, _, prompt = value.partition("|")
            when = number(at)
            if when is not None:
                record.warm[rest] = Warm(when, int(number(prompt) or 0))
        elif kind in ("tt", "tu", "st") and (amount := number(value)) is not None:
            if kind == "tt":
                record.seconds_by_tier[rest] = amount
            elif kind == "tu":
                record.seconds_by_upstream[rest] = amount
            else:
                record.steps_by_tier[rest] = int(amount)
    for item in reversed(moves if isinstance(moves, list) else []):
        parts = (item.decode(errors="replace") if isinstance(item, bytes) else str(item)).split("|")
        moved_at = number(parts[0]) if len(parts) == 4 else None
        if moved_at is not None:
            record.moves.append(Move(moved_at, parts[1], parts[2], parts[3]))
    _holds(record, holds)
    return record


def _holds(record: SessionRecord, holds: Any) -> None:
    for item in holds if isinstance(holds, list) else []:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            hold_id, _, usd = _text(item[0]).rpartition("|")
            until = number(item[1])
            if hold_id and until is not None:
                record.holds[hold_id] = (number(usd) or 0.0, until)
