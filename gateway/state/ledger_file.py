"""Gateway keys' spend kept on disk (``GATEWAY_STATE_DIR``), so that a restart without Redis (a deploy, a crash, an OOM
kill) does not set every key's day and month back to zero (docs/tenancy.md#limits).

The ``--workers N`` sharing the file add to it under ``flock`` rather than overwrite each other, and each write brings
back what the others added. It is read and written in a thread, so that a slow disk never stalls the loop that relays
streams, and replaced by ``rename`` (atomic in POSIX), so that a crash mid-write leaves the last whole file. A crash
loses the last ``every`` seconds; a directory that cannot be written is logged once and the gateway goes on."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from gateway.observability import logs
from gateway.tenancy.ledger import MemoryLedger, windows

log = logging.getLogger("tiergate")
FILE = "ledger.json"
Slot = tuple[str, str, str, str]  # (key name, level, dimension, window): MemoryLedger.counts' keys


def _name(slot: Slot) -> str:
    return "/".join(slot)  # key names are [A-Za-z0-9_.-] (config), the rest fixed words: "/" never occurs in them


def _slot(name: str) -> Slot | None:
    parts = name.split("/")
    return (parts[0], parts[1], parts[2], parts[3]) if len(parts) == 4 else None


def read(path: Path, current: dict[str, str]) -> dict[Slot, tuple[str, float]]:
    """``current``: window name -> id. A file that is missing or not ours reads as nothing: what cannot be read counts
    from nothing."""
    try:
        raw = orjson.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    out: dict[Slot, tuple[str, float]] = {}
    counts = raw.get("counts") if isinstance(raw, dict) else None
    for name, entry in (counts.items() if isinstance(counts, dict) else ()):
        slot = _slot(name)
        if slot is None or not isinstance(entry, list) or len(entry) != 2:
            continue
        window_id, value = entry
        if current.get(slot[3]) == window_id and isinstance(value, int | float) and 0 <= value < float("inf"):
            out[slot] = (window_id, float(value))
    return out


class LedgerFile:
    """``every``: seconds between writes; ``ledger`` may be a shared ledger's local one."""

    def __init__(self, directory: Path, ledger: MemoryLedger, every: float = 1.0,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = directory / FILE
        self.ledger = ledger
        self.every = every
        self.wall = wall
        self._written: dict[Slot, tuple[str, float]] = {}  # what the file held for each counter after our last write
        self._version = -1  # ledger.version at the last write
        self._mtime = 0  # the file's modification time (ns) when last looked at
        self._broken = False  # the directory cannot be written: said once

    def _current(self) -> dict[str, str]:
        return {w: v[0] for w, v in windows(self.wall()).items()}

    def load(self) -> None:
        """At start-up, before any request."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._unwritable(exc)
            return
        found = read(self.path, self._current())
        for slot, (window_id, value) in found.items():
            self.ledger.counts[slot] = (window_id, value)
        self._written = dict(found)
        self._version = self.ledger.version
        if found:
            logs.event("ledger_loaded", path=str(self.path), counters=len(found))

    def _changed_on_disk(self) -> bool:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return False
        changed, self._mtime = mtime != self._mtime, mtime
        return changed

    async def flush(self) -> None:
        """Also when this process spent nothing, if another wrote since: that brings back its spend."""
        if self._broken or (self.ledger.version == self._version and not self._changed_on_disk()):
            return
        version = self.ledger.version
        ours = dict(self.ledger.counts)  # what this process counts now: its last known totals plus its own since
        current = self._current()
        try:
            merged = await asyncio.to_thread(self._merge, ours, current)
        except OSError as exc:
            self._unwritable(exc)
            return
        counts = self.ledger.counts
        for slot, (window_id, total) in merged.items():
            mine = ours.get(slot)
            base = mine[1] if mine is not None and mine[0] == window_id else 0.0
            now = counts.get(slot)
            if now is None or now[0] == window_id:  # the others' share, added to what is counted here now
                counts[slot] = (window_id, max(0.0, (now[1] if now is not None else 0.0) + total - base))
        self._written = merged
        self._version = version  # a change made meanwhile is written next time
        self._changed_on_disk()  # our own write is not another's

    def _merge(self, ours: dict[Slot, tuple[str, float]],
               current: dict[str, str]) -> dict[Slot, tuple[str, float]]:
        """In a thread, under the file's lock: ours is added as what changed since our last write, so that the workers'
        spends add up."""
        with open(self.path.with_suffix(".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                merged = read(self.path, current)
                for slot, (window_id, value) in ours.items():
                    if current.get(slot[3]) != window_id:
                        continue  # its window is over: nothing counts there any more
                    before = self._written.get(slot)
                    delta = value - (before[1] if before is not None and before[0] == window_id else 0.0)
                    found = merged.get(slot)
                    base = found[1] if found is not None else 0.0
                    merged[slot] = (window_id, max(0.0, base + delta))
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(orjson.dumps({"version": 1, "counts": {_name(s): list(v) for s, v in merged.items()}}))
                os.replace(tmp, self.path)
                return merged
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    async def run(self) -> None:
        """Once more when cancelled, so that a clean stop loses nothing."""
        try:
            while True:
                await asyncio.sleep(self.every)
                await self.flush()
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.flush())
            raise

    def _unwritable(self, exc: OSError) -> None:
        if not self._broken:
            self._broken = True
            logs.event("ledger_unwritable", "warning", path=str(self.path), error=f"{type(exc).__name__}: {exc}")
            log.warning("the gateway keys' spend cannot be kept in %s (%s): it lives as long as this process; set "
                        "GATEWAY_STATE_DIR to a writable directory", self.path, exc)
