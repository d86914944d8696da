"""Incremental Server-Sent Events scanner over bytes (WHATWG HTML §9.2.5-9.2.6 "Parsing an event stream"). Only CR and
LF end a line: U+2028/U+2029 inside JSON never split an event (unlike ``str.splitlines``).

An event of only ``data:``/``event:``/comment lines, LF-framed, is forwarded as its exact bytes; any other is rebuilt as
``event:`` and ``data:`` lines ending ``\\n\\n``, because the ``openai`` SDK's parser is stricter than the spec
(docs/reference/wire.md#sse-framing). An event without data (``event: ping``) is dropped."""

from __future__ import annotations

from typing import NamedTuple

BOM = b"\xef\xbb\xbf"


class SSEEvent(NamedTuple):
    """``data``: the data lines joined with LF, None for a comment-only event (a keep-alive)."""

    raw: bytes
    data: bytes | None
    event: bytes | None


class EventTooLarge(Exception):
    pass


class SSEScanner:
    """Keeps at most one partial event buffered. A CR that ends a read ends its line at once, so that the event it
    completes is not held for the next read; an LF opening that read is then skipped as the CRLF's second half.
    ``max_event_bytes``: an event's lines and line ends, without the blank line."""

    __slots__ = ("_buf", "_started", "_max", "_skip_lf")

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self._started = False
        self._max = max_event_bytes
        self._skip_lf = False  # the last read ended with a CR: an LF opening the next read belongs to it

    @property
    def idle(self) -> bool:
        """Then the next read may skip :meth:`feed`, when it starts and ends at event boundaries."""
        return not self._buf and not self._skip_lf

    @property
    def pending(self) -> int:
        """Bytes of an event whose blank line has not arrived yet."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[SSEEvent]:  # noqa: C901 - the per-read hot path, its LF case inlined
        """Raises EventTooLarge when an event, finished or not, is over the limit; what the scanner held is dropped."""
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[0] == 10:
                chunk = chunk[1:]
        buf = self._buf + chunk if self._buf else chunk
        if not self._started:
            if len(buf) < 3 and BOM.startswith(buf):
                self._buf = buf
                return []
            self._started = True
            if buf.startswith(BOM):
                buf = buf[3:]
        if b"\r" in buf:
            events = self._feed_general(buf)
            if len(self._buf) > self._max:
                raise self._too_large()
            return events
        parts = buf.split(b"\n\n")
        rest = parts.pop()
        if rest and rest[0] == 10:  # a blank line with no event before it: nothing to keep
            rest = rest.lstrip(b"\n")
        self._buf = rest
        if len(buf) > self._max:  # only then can an event, finished or not, be over the limit
            if len(rest) > self._max:
                raise self._too_large()
            for part in parts:
                if len(part) >= self._max and len(part.lstrip(b"\n")) + 1 > self._max:
                    raise self._too_large()
        events = []
        new = tuple.__new__  # builds an SSEEvent without the Python-level NamedTuple.__new__ frame
        for part in parts:  # the common event, one "data: " line, is built here without a call
            if part.startswith(b"data: ") and b"\n" not in part:
                events.append(new(SSEEvent, (part + b"\n\n", part[6:], None)))
            elif (ev := _event_lf(part)) is not None:
                events.append(ev)
        return events

    def _too_large(self) -> EventTooLarge:
        self._buf = b""
        self._skip_lf = False
        return EventTooLarge(f"an SSE event exceeded {self._max} bytes")

    def _feed_general(self, buf: bytes) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        lines: list[bytes] = []
        pos = 0
        start = 0  # first byte of the event being built
        n = len(buf)
        trailing_cr = False
        cr = buf.find(b"\r")
        lf = buf.find(b"\n")
        while cr >= 0 or lf >= 0:
            if cr < 0 or 0 <= lf < cr:
                end = lf
                nxt = lf + 1
            else:
                end = cr
                if cr + 1 == n:
                    nxt = n
                    trailing_cr = True
                else:
                    nxt = cr + 2 if buf[cr + 1] == 10 else cr + 1
            line = buf[pos:end]
            pos = nxt
            if 0 <= cr < pos:
                cr = buf.find(b"\r", pos)
            if 0 <= lf < pos:
                lf = buf.find(b"\n", pos)
            if line:
                lines.append(line)
                continue
            if lines:
                if end - start > self._max:
                    raise self._too_large()
                ev = _event_lines(lines, normalise=True)
                if ev is not None:
                    events.append(ev)
                lines = []
            start = pos
        rest = buf[start:]
        if trailing_cr:
            self._skip_lf = True  # an LF opening the next read completes this CRLF
            if rest:
                # the CR ended a line of an unfinished event: hold it as LF, so that it cannot pair with
                # an LF that the next read brings after the skipped one
                rest = rest[:-1] + b"\n"
        self._buf = rest
        return events


def _event_lf(part: bytes) -> SSEEvent | None:
    if part.startswith(b"\n"):
        part = part.lstrip(b"\n")
        if not part:
            return None
    if part.startswith(b"data:") and b"\n" not in part:
        data = part[6:] if part.startswith(b"data: ") else part[5:]
        return SSEEvent(part + b"\n\n", data, None)
    return _event_lines(part.split(b"\n"), normalise=False, raw=part)


def _event_lines(lines: list[bytes], *, normalise: bool, raw: bytes | None = None) -> SSEEvent | None:
    """WHATWG §9.2.6."""
    data: list[bytes] = []
    event: bytes | None = None
    plain = True  # only data/event/comment lines: forward the original bytes
    for line in lines:
        if line.startswith(b":"):
            continue
        name, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value
        else:
            plain = False  # id, retry, unknown: dropped from the output
    if not data:
        if event is None and plain:  # comments only: a keep-alive
            return SSEEvent(raw + b"\n\n" if raw is not None and not normalise else b":\n\n", None, None)
        return None
    joined = b"\n".join(data)
    if plain and not normalise and raw is not None:
        return SSEEvent(raw + b"\n\n", joined, event)
    head = b"event: " + event + b"\n" if event is not None else b""
    return SSEEvent(head + b"".join(b"data: " + d + b"\n" for d in data) + b"\n", joined, event)
