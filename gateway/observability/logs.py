"""The request log and the gateway's operational events (docs/operations.md#logs): one structured line each on stdout,
through structlog; process messages stay on stderr. The request line is never the prompt, the answer or a credential,
and does not depend on the events' level, as an access log does not. Until :func:`configure` runs (in-process tests,
benches of the ASGI app) nothing is logged and a request costs one attribute test."""

from __future__ import annotations

import asyncio
import atexit
import logging
import random
import re
import select
import sys
from typing import Any, BinaryIO, Literal

import orjson
import structlog

REQUEST_FIELDS = ("request_id", "method", "path", "status", "outcome", "tier", "upstream", "rule", "fallback",
                  "model", "upstream_model", "stream", "attempts", "ttft_s", "duration_s", "input_tokens",
                  "output_tokens", "cached_tokens", "cost_usd")
# what looks like a credential in an upstream's words (OpenAI: "Incorrect API key provided: sk-abc***wxyz"): a key with
# a known prefix (OpenAI sk-, sk-proj-, sk-svcacct-; Cerebras csk-; Groq gsk_; xAI xai-; the gateway's own tg-), a
# bearer token, whatever follows "API key provided:", anything already part-masked with asterisks, and any long run of
# token characters with a digit in it (a key of no known shape)
_KEY_PREFIX = r"(?:sk|csk|gsk|xai|tg|pk|rk)[-_](?:(?:proj|svcacct|admin|live|test)[-_])?"
_SECRETS = re.compile(rf"(?i)\b({_KEY_PREFIX})[A-Za-z0-9_\-*.]*[A-Za-z0-9_*]"
                      r"|\b(bearer\s+)\S+"
                      rf"|\b(api[ _-]?key(?:\s+provided|\s+is)?\s*[:=]\s*)(?!{_KEY_PREFIX})\S+"
                      r"|[A-Za-z0-9_\-]*\*{2,}[A-Za-z0-9_\-]*"
                      r"|\b(?=[A-Za-z0-9_\-]*\d)[A-Za-z0-9_\-]{24,}")
LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
          "debug": logging.DEBUG}


class TurnFlushed:
    """The JSON lines written during one event-loop turn leave together at its end, in whole-line writes of at most
    ``PIPE_BUF`` bytes (4096 on Linux): structlog's ``BytesLogger`` flushes every line, one ``write`` per request
    (measured ~1.7 us of the line's ~4 us). A pipe write of at most ``PIPE_BUF`` is atomic (POSIX ``write``), so lines
    from ``--workers`` processes sharing one stdout never interleave mid-line. What waits at exit is written by
    ``atexit`` and by :func:`flush` at the app's shutdown: uvicorn ends a process stopped by SIGTERM by that signal,
    which skips ``atexit``."""

    __slots__ = ("_raw", "_lines", "_due", "__weakref__")  # structlog keys its per-file lock weakly

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._lines: list[bytes] = []
        self._due = False
        atexit.register(self.out)

    def write(self, data: bytes) -> None:
        self._lines.append(data)

    def flush(self) -> None:
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.out()
            return
        self._due = True
        loop.call_soon(self.out)

    def out(self) -> None:
        self._due = False
        lines, self._lines = self._lines, []
        group: list[bytes] = []
        size = 0
        for line in lines:
            if group and size + len(line) > select.PIPE_BUF:
                self._put(group)
                group, size = [], 0
            group.append(line)
            size += len(line)
        if group:
            self._put(group)

    def _put(self, group: list[bytes]) -> None:
        try:
            self._raw.write(b"".join(group))
            self._raw.flush()
        except OSError as exc:  # a full non-blocking pipe, a full disk: this group is lost, not the turn's others
            logging.getLogger("gateway.logs").warning("%d log lines were not written: %s", len(group), exc)


class _Logs:
    __slots__ = ("access", "events", "sample", "stamp", "render", "sink")

    def __init__(self) -> None:
        self.access: Any = None  # once configured: the request log's structlog logger (BytesLogger / PrintLogger)
        self.events: Any = None  # the events' bound logger (level-filtered)
        self.sample = 1.0
        self.stamp: Any = None  # the request line's processors, called directly (see request())
        self.render: Any = None
        self.sink: TurnFlushed | None = None  # the JSON lines' file (json format)


LOGS = _Logs()


def configure(fmt: Literal["json", "text"], level: str = "info", sample: float = 1.0) -> None:
    """Once per process, before serving. ``level``: the events' lowest (``GATEWAY_LOG_LEVEL``); ``sample``: the share of
    successful requests whose line is written."""
    processors: list[Any] = [structlog.processors.add_log_level,
                             structlog.processors.TimeStamper(fmt="iso", utc=True, key="time")]
    if fmt == "json":
        processors.append(structlog.processors.JSONRenderer(serializer=orjson.dumps))
        LOGS.sink = TurnFlushed(sys.stdout.buffer)
        factory: Any = structlog.BytesLoggerFactory(LOGS.sink)  # type: ignore[arg-type]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False, sort_keys=False, timestamp_key="time"))
        factory = structlog.PrintLoggerFactory(sys.stdout)
        LOGS.sink = None
    LOGS.access = factory()
    LOGS.stamp, LOGS.render = processors[1], processors[2]
    LOGS.events = structlog.wrap_logger(factory(), processors=processors,
                                        wrapper_class=structlog.make_filtering_bound_logger(
                                            LEVELS.get(level.lower(), logging.INFO)))
    LOGS.sample = sample


def flush() -> None:
    sink = LOGS.sink
    if sink is not None:
        sink.out()


def wanted(outcome: str) -> bool:
    """Asked before the line's fields are gathered: a sampled-out success costs this call."""
    return LOGS.access is not None and (outcome != "success" or LOGS.sample >= 1.0 or random.random() < LOGS.sample)


def request(fields: dict[str, Any]) -> None:
    """Through structlog's own time stamper, renderer and logger, called directly: measured, a bound logger's plumbing
    (context copy, keyword re-packing, level dispatch) was ~4 of the line's ~7 us, and an access line needs none of
    it."""
    fields["event"] = "request"
    fields["level"] = "info"
    LOGS.access.msg(LOGS.render(None, "info", LOGS.stamp(None, "info", fields)))


def redact(text: str, limit: int = 500) -> str:
    """A known key prefix such as ``sk-proj-`` is kept, so that the operator sees which kind of key it was; cut to
    ``limit`` characters."""
    masked = _SECRETS.sub(lambda m: next((g for g in m.groups() if g), "") + "***", text)
    return masked if len(masked) <= limit else masked[:limit] + "..."


def event(name: str, level: str = "info", **fields: Any) -> None:
    events = LOGS.events
    if events is not None:
        getattr(events, level)(name, **fields)
