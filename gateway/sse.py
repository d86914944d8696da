"""Incremental Server-Sent Events scanner over bytes (WHATWG HTML §9.2.5-9.2.6 "Parsing an event stream").

Feed it upstream reads as they arrive; it returns every event whose terminating blank line has arrived,
with the bytes to forward. Lines end with CRLF, LF or CR (mixed, and a CR/LF pair may straddle two
reads); a leading UTF-8 BOM is dropped; comment lines start with ``:``. Only CR and LF end a line:
U+2028/U+2029 and other Unicode separators inside JSON never split an event (unlike ``str.splitlines``).

What is forwarded (the ``openai`` SDK's parser is stricter than the spec, wire contract §3.4):

* an event made only of ``data:``/``event:``/comment lines, LF-framed: its exact bytes;
* any other event with data: rebuilt as ``event:`` (if any) and ``data:`` lines ending ``\\n\\n``
  (``id:``, ``retry:`` and unknown fields dropped, CR/CRLF normalised to LF);
* a comment-only event (keep-alive): its exact bytes when LF-framed, else ``:\\n\\n``;
* an event without data (``event: ping``, ``id: 7``): nothing.
"""

from __future__ import annotations

from typing import NamedTuple

BOM = b"\xef\xbb\xbf"


class SSEEvent(NamedTuple):
    """One dispatched event.

    raw: bytes to forward, ending with a blank line; data: the joined ``data`` field (lines joined with
    LF), or None for a comment-only event; event: the ``event`` field, or None.
    """

    raw: bytes
    data: bytes | None
    event: bytes | None


class EventTooLarge(Exception):
    """One event grew past the scanner's ``max_event_bytes`` without its terminating blank line."""


class SSEScanner:
    """Turns a byte stream into :class:`SSEEvent` objects; keeps at most one partial event buffered.

    Args:
        max_event_bytes: largest single event accepted; :meth:`feed` raises :class:`EventTooLarge` past it.
    """

    __slots__ = ("_buf", "_started", "_max")

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self._started = False
        self._max = max_event_bytes

    @property
    def pending(self) -> int:
        """Bytes held back: the start of an event whose blank line has not arrived yet."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Add one read; return the events it completed, in order.

        Raises:
            EventTooLarge: the unfinished event is over the limit.
        """
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
        else:
            parts = buf.split(b"\n\n")
            self._buf = parts.pop()
            events = [ev for part in parts if (ev := _event_lf(part)) is not None]
        if len(self._buf) > self._max:
            self._buf = b""
            raise EventTooLarge(f"an SSE event exceeded {self._max} bytes")
        return events

    def _feed_general(self, buf: bytes) -> list[SSEEvent]:
        """Any mix of CR, LF and CRLF: split into lines by hand, holding back a trailing CR."""
        events: list[SSEEvent] = []
        lines: list[bytes] = []
        pos = 0
        start = 0
        n = len(buf)
        while pos < n:
            cr = buf.find(b"\r", pos)
            lf = buf.find(b"\n", pos)
            if cr < 0 and lf < 0:
                break
            end = lf if cr < 0 or (0 <= lf < cr) else cr
            if buf[end] == 13:  # CR: may be the first half of CRLF
                if end + 1 == n:
                    break  # wait for the next read to tell
                nxt = end + 2 if buf[end + 1] == 10 else end + 1
            else:
                nxt = end + 1
            line = buf[pos:end]
            pos = nxt
            if line:
                lines.append(line)
                continue
            if lines:
                ev = _event_lines(lines, normalise=True)
                if ev is not None:
                    events.append(ev)
                lines = []
            start = pos
        self._buf = buf[start:]
        return events


def _event_lf(part: bytes) -> SSEEvent | None:
    """One LF-framed event body (no trailing blank line); leading blank lines are skipped."""
    if part.startswith(b"\n"):
        part = part.lstrip(b"\n")
        if not part:
            return None
    if part.startswith(b"data:") and b"\n" not in part:
        data = part[6:] if part.startswith(b"data: ") else part[5:]
        return SSEEvent(part + b"\n\n", data, None)
    return _event_lines(part.split(b"\n"), normalise=False, raw=part)


def _event_lines(lines: list[bytes], *, normalise: bool, raw: bytes | None = None) -> SSEEvent | None:
    """Interpret the field lines of one event (WHATWG §9.2.6)."""
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
