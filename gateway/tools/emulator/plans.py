"""A scripted answer (:class:`Plan`) and the request it answers (:class:`Received`): what a test's handler, given
to an emulator (``gateway.tools.emulator.server.EmulatorThread``) or to the in-process transport
(``gateway.tools.scripted``), plays byte for byte instead of answering like a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Plan:
    """``head_delay`` and each part's delay in seconds; each part is its own write (its own HTTP chunk when
    ``chunked``); ``end``: as :class:`~gateway.tools.emulator.schedule.Schedule`'s; ``drop``: close without
    answering, at once (what a server does to a keep-alive connection it timed out just as a request arrived) or
    after ``head_delay`` (one that read the request and failed)."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream; charset=utf-8"})
    parts: list[tuple[float, bytes]] = field(default_factory=list)
    end: str = "ok"
    chunked: bool = True
    head_delay: float = 0.0
    drop: bool = False


@dataclass
class Received:
    """Header names lower-case; ``at``: ``time.monotonic()`` when it was complete; ``connection``: 1, 2, ... in the
    order the connections opened."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    connection: int = 0


Handler = Callable[[Received], "Plan | None"]
