"""Agent sessions every replica shares (:class:`SharedSessions`): each session's record in Redis, so that a run's next
step finds its warm upstream, its budgets and its totals whichever replica it reaches; this process's table
(``gateway.tenancy.sessions.MemorySessions``) answers while Redis is away."""

from __future__ import annotations

from typing import Any

from redis.asyncio.client import Pipeline

from gateway.state.link import RedisLink, number
from gateway.tenancy.sessions import MemorySessions, Move, SessionRecord, Step, Warm, scope


def record_key(record: SessionRecord) -> str:
    """The table key of ``record``'s session."""
    return scope(record.owner, record.id)


class SharedSessions:
    """A ``gateway.tenancy.sessions.SessionTable`` kept in Redis: ``{prefix}:session:{<key>}``, a hash of the run's
    totals (added to by ``lua/session_step.lua``, so that steps served at once by two replicas both count) and
    ``...:moves``, its newest moves; both live ``sessions.idle`` after the last step. ``{prefix}:sessions:{<owner>}``
    indexes each gateway key's sessions by their last step (``lua/session_index.lua``), so that one key holds at most
    its share of ``sessions.max_items`` in Redis too (its least recently used go; without keys, ``max_items`` in
    all). ``local`` keeps a copy of each session this process served, read while Redis is away (then the other
    replicas' steps since are missed)."""

    def __init__(self, local: MemorySessions, shared: RedisLink, max_moves: int) -> None:
        self.local = local
        self.shared = shared
        self.max_moves = max_moves
        self.ttl_ms = max(1, int(local.idle * 1000))
        self.on_end, local.on_end = local.on_end, self._ended

    def _ended(self, record: SessionRecord) -> None:
        """This process's copy of a session left its table: the session ended there only if no replica took a
        step of it since this one's last (Redis counts the same steps); then it is told on, once."""
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
        ok, replies = await self.shared.ask("session", read)
        if not ok:
            return self.local.get(key, now)
        record = decode(replies[0], replies[1])
        if record is None:
            return None
        if now - record.last >= self.local.idle:
            return None
        return record

    def store(self, key: str, record: SessionRecord, step: Step, now: float) -> None:
        self.local.put(key, record, now)
        move = record.moves[-1] if step.move is not None and record.moves else None
        args: list[str | int] = [
            self.ttl_ms, repr(now), record.owner or "", record.id, record.source, repr(record.started),
            step.upstream, step.tier, repr(step.duration), repr(step.usd), step.prompt_tokens, step.cached_tokens,
            step.output_tokens, "" if step.saved is None else repr(step.saved),
            "" if move is None else f"{move.at!r}|{move.source}|{move.target}|{move.reason}", self.max_moves]
        name = self._key(key)
        script = self.shared.session_step
        self.shared.queue("session", lambda pipe: pipe.evalsha(script.sha, 2, name, name + ":moves", *args))
        # the key's index: over its share, its own least recently used runs leave Redis as they leave this table
        index = f"{self.shared.prefix}:sessions:{{{record.owner or ''}}}"
        bound = self.local.per_key if record.owner is not None else self.local.max_items
        at: list[str | int] = [key, repr(now), bound, repr(self.local.idle), self.ttl_ms]
        indexing = self.shared.session_index
        self.shared.queue("session", lambda pipe: pipe.evalsha(indexing.sha, 1, index, *at), self._evict)

    def _evict(self, gone: Any) -> None:
        """Delete the records of the sessions that left a key's index (one key per command: each its own slot)."""
        names = [self._key(k.decode() if isinstance(k, bytes) else str(k)) for k in gone or ()]
        if names:
            self.shared.queue("session", lambda pipe: [pipe.delete(n, n + ":moves") for n in names])


def decode(fields: Any, moves: Any) -> SessionRecord | None:
    """A session from its hash and its moves list as Redis returns them, or None (no such session, or not one the
    gateway wrote)."""
    if not isinstance(fields, dict) or not fields:
        return None
    f = {k.decode(errors="replace") if isinstance(k, bytes) else str(k):
         v.decode(errors="replace") if isinstance(v, bytes) else str(v) for k, v in fields.items()}
    started, last, steps = number(f.get("s0")), number(f.get("t")), number(f.get("n"))
    if started is None or last is None or steps is None or "i" not in f:
        return None
    record = SessionRecord(f.get("o") or None, f["i"], f.get("src", ""), started, last, int(steps),
                           number(f.get("u")) or 0.0, int(number(f.get("pi")) or 0), int(number(f.get("pc")) or 0),
                           int(number(f.get("po")) or 0), f.get("lu") or None, saved=number(f.get("sv")) or 0.0,
                           saved_steps=int(number(f.get("svn")) or 0), moved=int(number(f.get("mv")) or 0))
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
    return record
