"""The hostile key's ping flood: one WebSocket-mode socket to ``/v1/responses`` (its valid key, the handshake by hand
on loopback) that sends masked 125-byte pings as fast as the kernel takes them and never reads. Before the fix
uvicorn wrote every pong to a transport that never stopped reading, and the gateway's RSS grew without bound (89 to
204 MB in 18 s, tests/test_websocket.py). Held: the gateway stops reading that client (its sends block: TCP
back-pressure) or closes it, the kernel took less than :data:`TAKEN_BOUND` of it, the gateway's RSS grew less than
:data:`GROWTH_BOUND`, and once the client goes the gateway lets the socket go. Each round is bounded in pings and
seconds; the other keys' load runs on meanwhile."""

from __future__ import annotations

import asyncio
import base64
import os
import select
import socket
import time
from typing import Any

import aiohttp

from bench import procs
from bench.tenancy.common import Tally, metric, scrape

PINGS = 200_000  # at most, per round (26 MB of frames)
SECONDS = 20.0  # at most, per round
STALL = 1.0  # seconds of blocked sends that end a round: the gateway stopped reading
TAKEN_BOUND = 32 * 2**20  # what the kernel's buffers on loopback hold, with room (9-10 MB measured by the test)
GROWTH_BOUND = 16 * 2**20  # the test's bound; it measured +1.7 MiB on an idle gateway
ROUNDS = 4
EVERY = 40.0  # seconds between the rounds' starts


def _handshake(port: int, key: str) -> tuple[socket.socket, bytes]:
    """A raw socket upgraded to WebSocket on ``/v1/responses`` (or refused: the head says)."""
    sock = socket.socket()
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                 f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 65536:
        got = sock.recv(4096)
        if not got:
            break
        head += got
    return sock, head


def flood(port: int, key: str, pings: int = PINGS, seconds: float = SECONDS,
          stall: float = STALL) -> tuple[socket.socket, int, str]:
    """Ping without reading, at most ``pings`` and ``seconds``: the socket (still open, unread), the bytes the kernel
    took, and how it ended: ``blocked`` (sends stayed blocked ``stall`` s), ``closed`` (the gateway closed it),
    ``all taken`` (never blocked) or ``refused <status line>``."""
    sock, head = _handshake(port, key)
    if not head.startswith(b"HTTP/1.1 101"):
        return sock, 0, "refused " + head.split(b"\r\n", 1)[0].decode("latin-1")
    mask = os.urandom(4)
    frame = bytes([0x89, 0x80 | 125]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(os.urandom(125)))
    batch = memoryview(frame * 64)
    sock.setblocking(False)
    sent = offset = 0
    start = time.monotonic()
    blocked_since: float | None = None
    while sent < pings * len(frame) and time.monotonic() - start < seconds:
        try:
            n = sock.send(batch[offset:])
        except BlockingIOError:
            now = time.monotonic()
            blocked_since = blocked_since or now
            if now - blocked_since >= stall:
                return sock, sent, "blocked"
            select.select([], [sock], [], stall / 10)
            continue
        except OSError:  # reset or broken pipe: the gateway closed it (1008 or an abort)
            return sock, sent, "closed"
        blocked_since = None
        sent += n
        offset = (offset + n) % len(batch)
    return sock, sent, "all taken"


async def _released(s: aiohttp.ClientSession, base: str, token: str, within: float = 15.0) -> float | None:
    """Seconds until the gateway holds no socket (``tiergate_websocket_sockets`` 0; the hostile key's other sockets
    live milliseconds), or None if it still held one ``within`` seconds on."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if metric(await scrape(s, base, token), "tiergate_websocket_sockets") == 0:
            return round(time.monotonic() - start, 2)
        await asyncio.sleep(0.1)
    return None


async def one_round(s: aiohttp.ClientSession, base: str, port: int, key: str, token: str,
                    pid: int) -> dict[str, Any]:
    """One flood, measured: what was taken, how it ended, the gateway's RSS before and after, when it let go."""
    before = procs.rss_bytes(pid)
    sock, sent, ended = await asyncio.to_thread(flood, port, key)
    try:
        await asyncio.sleep(0.5)  # what the gateway read last is answered
        grown = procs.rss_bytes(pid) - before
    finally:
        sock.close()  # unread bytes in its receive buffer: the kernel resets the connection
    released = await _released(s, base, token)
    held = (ended in ("blocked", "closed") and sent < TAKEN_BOUND and grown < GROWTH_BOUND
            and released is not None)
    return {"ended": ended, "taken_mib": round(sent / 2**20, 1), "pings": sent // 131,  # 2 + 4 + 125 bytes a frame
            "rss_before_mib": round(before / 2**20, 1), "rss_grown_mib": round(grown / 2**20, 1),
            "released_s": released, "held": held}


async def ping_floods(base: str, key: str, token: str, pid: int, tally: Tally, seconds: float) -> None:
    """:data:`ROUNDS` floods at most, the first 10 s into the load, then every :data:`EVERY` s while a whole one
    fits before the deadline."""
    port = int(base.rsplit(":", 1)[1])
    deadline = time.monotonic() + seconds
    await asyncio.sleep(min(10.0, seconds / 3))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for _ in range(ROUNDS):
            started = time.monotonic()
            if deadline - started < SECONDS + 5 and tally.phases["ping_flood"]:
                return
            row = await one_round(s, base, port, key, token, pid)
            tally.phases["ping_flood"].append(row)
            tally.answer("hostile", 101 if not row["ended"].startswith("refused") else 0, b"", "ping_flood")
            tally.trick_codes["ping_flood: ended"][row["ended"]] += 1
            if not row["held"]:
                tally.miss("hostile:ping_flood", repr(row))
            await asyncio.sleep(max(0.0, min(EVERY - (time.monotonic() - started), deadline - time.monotonic())))
