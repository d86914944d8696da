"""A scripted answer (:class:`Plan`) and the request it answers (:class:`Received`): what a test's handler, given
to an emulator (``gateway.tools.emulator.server.EmulatorThread``) or to the in-process transport
(``gateway.tools.scripted``), plays byte for byte instead of answering like a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Plan:
    """A scripted answer.

    status and headers: the status line and headers (``transfer-encoding: chunked`` or ``content-length`` is
    added); head_delay: seconds before the status line; parts: (delay in seconds before the write, bytes), each
    its own write (its own HTTP chunk when ``chunked``); end: after the last part, ``ok`` (a clean end), ``eof``
    (close the connection, inside the chunked body), ``reset`` (TCP RST) or ``stall`` (silence, the connection
    kept open); chunked: chunked transfer encoding, else ``content-length`` over the joined parts; drop: close
    the connection without answering (at once: what a server does to a keep-alive connection it timed out just as a
    request arrived; after ``head_delay``: a server that read the request and then failed).
    """

    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream; charset=utf-8"})
    parts: list[tuple[float, bytes]] = field(default_factory=list)
    end: str = "ok"
    chunked: bool = True
    head_delay: float = 0.0
    drop: bool = False


@dataclass
class Received:
    """One request as the emulator saw it: header names lower-case; ``at``: ``time.monotonic()`` when it was
    complete; ``connection``: which connection (1, 2, ... in the order opened) it came on."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    connection: int = 0


Handler = Callable[[Received], "Plan | None"]
