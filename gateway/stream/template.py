"""The relay's fast path: a stream's ordinary token chunks recognised by their bytes, so that each is observed and
forwarded without a scan and a JSON parse (measured: 5.34 -> 3.69 us of the gateway's own CPU per relayed chunk)."""

from __future__ import annotations

import re
from typing import Any

from orjson import JSONDecodeError, loads

_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "refusal")  # a delta of one of these alone: a template


_OBFUSCATION = b'"obfuscation":"'  # OpenAI's per-chunk random padding, the chunk's last member (its value varies)


# bytes of a text that JSON may reject (a control byte, an escape, UTF-8 that may be invalid): such a text is parsed
_SUSPECT = re.compile(rb"[\x00-\x1f\\\x80-\xff]")


class Template:
    """The bytes every ordinary token chunk of one stream shares: ``head`` up to the text's opening quote, ``mid`` from
    its closing quote to the event's end, or (``wild``) to the opening quote of OpenAI's ``obfuscation`` value, which
    changes every chunk. ``always``: a tool call's arguments, a token even when empty.

    Why a match is safe: an event that is ``head`` + ``text`` + ``mid``, ``text`` holding no unescaped quote, no line
    break and ending on no escaping backslash, tokenises as JSON exactly like the learned chunk but for the text string:
    the same kind of chunk. :meth:`learn` proves the location by parsing a probe built from the template."""

    __slots__ = ("head", "mid", "wild", "always", "_hl", "_ml")

    def __init__(self, head: bytes, mid: bytes, wild: bool, always: bool) -> None:
        self.head, self.mid, self.wild, self.always = head, mid, wild, always
        self._hl, self._ml = len(head), len(mid)

    @classmethod
    def learn(cls, raw: bytes, data: bytes, chunk: dict[str, Any]) -> Template | None:
        """None when the chunk is not ordinary (one ``data:`` line, one choice, no ``finish_reason``, a delta of one
        text member or one tool call's arguments) or its text cannot be located in its bytes."""
        choices = chunk.get("choices")
        if len(raw) != len(data) + 8 or type(choices) is not list or len(choices) != 1:
            return None  # not one "data: " line; or not one choice
        want = loads(data)  # the chunk again, to change into what the probe must parse as
        choice = want["choices"][0]
        delta = choice.get("delta") if type(choice) is dict else None
        if type(delta) is not dict or len(delta) != 1 or choice.get("finish_reason") is not None:
            return None
        ((key, value),) = delta.items()
        leaf: Any
        if key in _TEXT_KEYS and type(value) is str and value:
            leaf, name, marker, always = delta, key, b'"delta":{"' + key.encode() + b'":"', False
        else:  # a tool call's arguments, streamed piece by piece: a token-bearing delta even when empty
            call = value[0] if key == "tool_calls" and type(value) is list and len(value) == 1 else None
            leaf = call.get("function") if type(call) is dict else None
            if type(leaf) is not dict or type(leaf.get("arguments")) is not str:
                return None
            name, marker, always = "arguments", b'"arguments":"', True
        start = raw.find(marker)
        if start < 0 or raw.find(marker, start + 1) >= 0:
            return None
        start += len(marker)
        end = _closing_quote(raw, start)
        if end < 0:
            return None
        head, mid = raw[:start], raw[end:]
        obf = chunk.get("obfuscation")
        plain = isinstance(obf, str) and obf.isascii() and (obf.isalnum() or not obf)
        tail = _OBFUSCATION + str(obf).encode() + b'"}\n\n' if plain else b""
        wild = bool(tail) and next(reversed(chunk)) == "obfuscation" and mid.endswith(tail)
        if wild:  # the last member: mid stops at its value's opening quote
            mid = mid[:len(mid) - len(tail) + len(_OBFUSCATION)]
            want["obfuscation"] = "Zz9"
        # the proof: a probe with another text (escapes in it) parses as the chunk with that text, and nothing else
        leaf[name] = "\u00e9\\x"
        probe = head + b"\\u00e9\\\\x" + mid + (b'Zz9"}\n\n' if wild else b"")
        try:
            if loads(probe[6:-2]) != want:
                return None
        except JSONDecodeError:
            return None
        return cls(head, mid, wild, always)

    def match(self, chunk: bytes) -> int:
        """Token-bearing events in ``chunk`` (one read, from an event boundary) when it is made of this template's
        events only, else -1: the full look. A text that is not a valid JSON string fails the match, as it would fail
        the full path's parse; plain ASCII without escapes is valid as it is."""
        head, mid, hl, ml, wild = self.head, self.mid, self._hl, self._ml, self.wild
        n, pos, tokens = len(chunk), 0, 0
        while True:
            if not chunk.startswith(head, pos):
                return -1
            start = pos + hl
            end = chunk.find(b'"', start)
            if end > start and chunk[end - 1] == 92:  # maybe escaped: _closing_quote, called only then (hot path)
                end = _closing_quote(chunk, start)
            if end < 0 or not chunk.startswith(mid, end):
                return -1
            if _SUSPECT.search(chunk, start, end) is not None:  # valid JSON, as the full path's parse would find?
                try:
                    loads(chunk[start - 1:end + 1])  # a raw LF or CR, a lone surrogate, bad UTF-8: JSONDecodeError
                except JSONDecodeError:
                    return -1
            pos = end + ml
            if wild:  # the obfuscation value, up to '"}' and the blank line
                close = chunk.find(b'"}\n\n', pos)
                if close < 0 or close > pos and not chunk[pos:close].isalnum():  # ASCII letters and digits, or none
                    return -1
                pos = close + 4
            if end > start or self.always:
                tokens += 1
            if pos >= n:
                return tokens


def _closing_quote(data: bytes, start: int) -> int:
    """A quote behind an odd run of backslashes is escaped; -1 when there is none."""
    end = data.find(b'"', start)
    while end > start and data[end - 1] == 92:
        back = end - 1
        while back >= start and data[back] == 92:
            back -= 1
        if (end - 1 - back) % 2 == 0:
            break  # an even run escapes itself: the quote ends the string
        end = data.find(b'"', end + 1)
    return end
