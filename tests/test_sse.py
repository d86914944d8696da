"""gateway.stream.sse.SSEScanner against the WHATWG event-stream rules and docs/reference/wire.md#sse-framing.

Each test compares the scanner with a literal expectation or with ``whatwg()``, an independent
reference implementation of HTML §9.2.6 written over decoded text; the scanner works on bytes.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.stream.sse import BOM, EventTooLarge, SSEEvent, SSEScanner

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "upstream"
EOLS = (b"\n", b"\r\n", b"\r")
Pair = tuple[bytes | None, bytes | None]


# ---------------------------------------------------------------------------------------------- helpers


def feed_all(chunks: list[bytes], scanner: SSEScanner | None = None) -> list[SSEEvent]:
    scanner = scanner or SSEScanner()
    out: list[SSEEvent] = []
    for chunk in chunks:
        out += scanner.feed(chunk)
    return out


def pairs(events: list[SSEEvent]) -> list[Pair]:
    """(data, event) of every event that carries data; comment-only events are left out."""
    return [(ev.data, ev.event) for ev in events if ev.data is not None]


def split_at(raw: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({min(max(c, 0), len(raw)) for c in cuts}), len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(bounds)]


def reframe(lf_body: bytes, eol: bytes) -> bytes:
    return lf_body.replace(b"\n", eol)


def mixed(lf_body: bytes) -> bytes:
    """Every line end of an LF body replaced by CRLF, LF and CR in turn (a CR is never followed by an LF
    that would merge two line ends into one CRLF)."""
    it = itertools.cycle((b"\r\n", b"\n", b"\r"))
    return re.sub(rb"\n", lambda _: next(it), lf_body)


_EOL_RE = re.compile(r"\r\n|\r|\n")


def whatwg(stream: bytes) -> tuple[list[tuple[str, str | None]], bool]:
    """Reference: HTML §9.2.5-9.2.6 over UTF-8 text. Returns the dispatched (data, type-or-None) list and
    whether the stream ends inside an event (a partial line, or field lines without their blank line)."""
    text = stream.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    out: list[tuple[str, str | None]] = []
    data, event, seen = "", "", False
    pos = 0
    for m in _EOL_RE.finditer(text):
        line, pos = text[pos : m.start()], m.end()
        if not line:
            if data:
                out.append((data[:-1] if data.endswith("\n") else data, event or None))
            data, event, seen = "", "", False
            continue
        seen = True
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data += value + "\n"
    return out, seen or pos < len(text)


def as_text(events: list[SSEEvent]) -> list[tuple[str, str | None]]:
    return [(ev.data.decode("utf-8", "replace"), (ev.event or b"").decode("utf-8", "replace") or None)
            for ev in events if ev.data is not None]


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Turn a hang into a failure (SIGALRM interrupts a pure-Python loop)."""

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"SSEScanner did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def assert_wellformed(events: list[SSEEvent]) -> None:
    """What the gateway may forward (docs/reference/wire.md#sse-framing): one blank line per event, LF only, only
    data/event lines (or only comments), never id/retry/unknown fields, never a leading BOM."""
    for ev in events:
        assert ev.raw.endswith(b"\n\n"), ev
        assert b"\n\n" not in ev.raw[:-1], ev
        assert b"\r" not in ev.raw, ev
        lines = ev.raw[:-2].split(b"\n")
        if ev.data is None:
            assert ev.event is None and all(line.startswith(b":") for line in lines), ev
            continue
        names = [line.partition(b":")[0] for line in lines if not line.startswith(b":")]
        assert set(names) <= {b"data", b"event"} and b"data" in names, ev
        assert not ev.raw.startswith(BOM), ev


# ------------------------------------------------------------------------------------ line endings

SAMPLE_LF = (
    b": hello\n"
    b"\n"
    b'data: {"a":1}\n'
    b"\n"
    b"event: error\n"
    b'data: {"error":{"message":"x"}}\n'
    b"\n"
    b"data: first\n"
    b"data: second\n"
    b": a comment between data lines\n"
    b"data:third\n"
    b"\n"
    b"id: 7\n"
    b"\n"
    b"data: [DONE]\n"
    b"\n"
)
SAMPLE_PAIRS: list[Pair] = [
    (b'{"a":1}', None),
    (b'{"error":{"message":"x"}}', b"error"),
    (b"first\nsecond\nthird", None),
    (b"[DONE]", None),
]


@pytest.mark.parametrize("framing", ["lf", "crlf", "cr", "mixed"])
def test_every_line_ending_gives_the_same_events(framing: str) -> None:
    body = {"lf": SAMPLE_LF, "crlf": reframe(SAMPLE_LF, b"\r\n"), "cr": reframe(SAMPLE_LF, b"\r"),
            "mixed": mixed(SAMPLE_LF)}[framing]
    scanner = SSEScanner()
    events = scanner.feed(body)
    assert pairs(events) == SAMPLE_PAIRS
    assert [ev.data for ev in events].count(None) == 1  # the leading comment-only event
    assert scanner.pending == 0
    assert_wellformed(events)


def test_mixed_framing_really_mixes() -> None:
    body = mixed(SAMPLE_LF)
    assert b"\r\n" in body and re.search(rb"\r(?!\n)", body) and re.search(rb"(?<!\r)\n", body)
    assert pairs(feed_all([body])) == SAMPLE_PAIRS


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
def test_every_two_and_three_way_split_gives_the_same_events(eol: bytes) -> None:
    body = reframe(b"event: e\ndata: 1\ndata: 2\n\n: c\n\ndata: x\n\n", eol)
    want = [(b"1\n2", b"e"), (b"x", None)]
    for i, j in itertools.combinations_with_replacement(range(len(body) + 1), 2):
        assert pairs(feed_all([body[:i], body[i:j], body[j:]])) == want, (i, j)


@pytest.mark.parametrize("framing", ["lf", "crlf", "cr", "mixed"])
def test_one_byte_reads(framing: str) -> None:
    body = {"lf": SAMPLE_LF, "crlf": reframe(SAMPLE_LF, b"\r\n"), "cr": reframe(SAMPLE_LF, b"\r"),
            "mixed": mixed(SAMPLE_LF)}[framing]
    scanner = SSEScanner()
    events = feed_all([body[i : i + 1] for i in range(len(body))], scanner)
    assert pairs(events) == SAMPLE_PAIRS
    assert scanner.pending == 0


def test_cr_and_lf_split_across_reads() -> None:
    scanner = SSEScanner()
    assert scanner.feed(b"data: a\r") == []
    assert scanner.pending > 0
    # the LF completes the CRLF begun in the last read: it is not a blank line
    assert scanner.feed(b"\n") == []
    assert scanner.pending > 0
    assert pairs(scanner.feed(b"data: b\r\n\r")) == [(b"a\nb", None)]
    assert scanner.pending == 0
    # that LF is the second half of the blank line's CRLF, not a second blank line nor a line of its own
    assert pairs(scanner.feed(b"\ndata: c\r\n\r\n")) == [(b"c", None)]
    assert scanner.pending == 0


def test_lf_after_a_split_crlf_is_skipped_once_only() -> None:
    # "data: a" CR | LF LF: the first LF belongs to the CR; the second is the blank line
    assert pairs(feed_all([b"data: a\r", b"\n\n"])) == [(b"a", None)]
    # "data: a" CR | LF | LF: the same, one read per byte
    assert pairs(feed_all([b"data: a\r", b"\n", b"\n"])) == [(b"a", None)]
    # "data: a" CR | LF CR LF | "data: b" ...: a CRLF blank line after a split CRLF
    assert pairs(feed_all([b"data: a\r", b"\n\r\n", b"data: b\r\n\r\n"])) == [(b"a", None), (b"b", None)]
    # an empty read between the CR and its LF keeps the pairing
    assert pairs(feed_all([b"data: a\r", b"", b"\n", b"\r\n"])) == [(b"a", None)]


def test_an_event_ending_with_cr_at_the_end_of_a_read_is_returned_at_once() -> None:
    """A CR ends its line whatever follows: CR-framed events must not wait for the next read."""
    scanner = SSEScanner()
    assert pairs(scanner.feed(b"data: a\r\r")) == [(b"a", None)]
    assert scanner.pending == 0
    assert pairs(scanner.feed(b"data: b\r\r")) == [(b"b", None)]
    assert scanner.pending == 0


def test_event_split_over_many_reads_and_several_events_in_one_read() -> None:
    scanner = SSEScanner()
    assert scanner.feed(b"da") == []
    assert scanner.feed(b"ta: {\"x\"") == []
    assert scanner.feed(b":1}") == []
    assert scanner.feed(b"\n") == []
    assert scanner.pending == len(b'data: {"x":1}\n')
    events = scanner.feed(b"\ndata: 2\n\ndata: 3\n\nevent: e\ndata: 4\n\ndata: 5")
    assert pairs(events) == [(b'{"x":1}', None), (b"2", None), (b"3", None), (b"4", b"e")]
    assert scanner.pending == len(b"data: 5")
    assert pairs(scanner.feed(b"\n\n")) == [(b"5", None)]
    assert scanner.pending == 0


# ------------------------------------------------------------------------------------------ comments


def test_keep_alive_comment_events_pass_as_comments() -> None:
    events = feed_all([b": keep-alive\n\n:\n\n: data: not data\n: event: error\n\n"])
    assert [(ev.raw, ev.data, ev.event) for ev in events] == [
        (b": keep-alive\n\n", None, None),
        (b":\n\n", None, None),
        (b": data: not data\n: event: error\n\n", None, None),
    ]


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_keep_alive_comment_in_cr_framing_becomes_a_bare_comment(eol: bytes) -> None:
    events = feed_all([b": keep-alive" + eol + eol])
    assert [(ev.raw, ev.data, ev.event) for ev in events] == [(b":\n\n", None, None)]


def test_comment_lines_inside_an_event_do_not_change_its_data() -> None:
    events = feed_all([b": before\ndata: a\n: between\ndata: b\n: after\n\n"])
    assert pairs(events) == [(b"a\nb", None)]


# ------------------------------------------------------------------------------------------------- BOM


@pytest.mark.parametrize("cuts", [[], [0], [1], [2], [3], [1, 2], [1, 2, 3], [3, 4], [2, 5]])
def test_leading_bom_is_dropped_however_it_is_split(cuts: list[int]) -> None:
    body = BOM + b"data: x\n\n: c\n\n"
    scanner = SSEScanner()
    events = feed_all(split_at(body, cuts), scanner)
    assert pairs(events) == [(b"x", None)]
    assert events[0].raw == b"data: x\n\n"
    assert BOM not in b"".join(ev.raw for ev in events)
    assert scanner.pending == 0


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
def test_leading_bom_before_cr_framing(eol: bytes) -> None:
    events = feed_all([BOM[:1], BOM[1:] + b"data: x" + eol + eol])
    assert [(ev.raw, ev.data) for ev in events] == [(b"data: x\n\n", b"x")]


def test_only_one_leading_bom_is_dropped() -> None:
    # the second BOM belongs to the field name "\ufeffdata": an unknown field, so there is no data
    assert feed_all([BOM + BOM + b"data: x\n\ndata: y\n\n"]) == [SSEEvent(b"data: y\n\n", b"y", None)]
    # a BOM after the first event is not a BOM either
    events = feed_all([b"data: x\n\n" + BOM + b"data: y\n\ndata: z\n\n"])
    assert pairs(events) == [(b"x", None), (b"z", None)]
    assert BOM not in b"".join(ev.raw for ev in events)


def test_partial_bom_followed_by_other_bytes_is_kept() -> None:
    # b"\xef\xbb" then "data": not a BOM, the bytes belong to the first field name (unknown: no event)
    assert feed_all([b"\xef\xbb", b"data: x\n\ndata: y\n\n"]) == [SSEEvent(b"data: y\n\n", b"y", None)]
    assert pairs(feed_all([b"\xef", b"\n\ndata: y\n\n"])) == [(b"y", None)]


# ---------------------------------------------------------------------------------------- data fields


@pytest.mark.parametrize(
    ("body", "data"),
    [
        (b"data: a\ndata: b\ndata: c\n\n", b"a\nb\nc"),
        (b"data:a\n\n", b"a"),
        (b"data:  a\n\n", b" a"),  # only one leading space is removed
        (b"data: a \n\n", b"a "),
        (b"data\n\n", b""),  # a field name without a colon: empty value, but data was given
        (b"data:\n\n", b""),
        (b"data:\ndata:\n\n", b"\n"),
        (b"data: a:b: c\n\n", b"a:b: c"),
        (b"data: a\ndata\ndata: b\n\n", b"a\n\nb"),
    ],
)
def test_data_field_values(body: bytes, data: bytes) -> None:
    for eol in EOLS:
        assert pairs(feed_all([reframe(body, eol)])) == [(data, None)], eol
    assert whatwg(body)[0] == [(data.decode(), None)]


def test_event_field_groq_error() -> None:
    body = b'event: error\ndata: {"error":{"message":"Tool call validation failed","code":"tool_use_failed"}}\n\n'
    [ev] = feed_all([body])
    assert ev.event == b"error"
    assert json.loads(ev.data)["error"]["code"] == "tool_use_failed"
    assert ev.raw == body
    for eol in (b"\r\n", b"\r"):
        [ev2] = feed_all([reframe(body, eol)])
        assert (ev2.raw, ev2.data, ev2.event) == (body, ev.data, b"error")


def test_last_event_field_wins_and_does_not_leak_into_the_next_event() -> None:
    events = feed_all([b"event: a\nevent: b\ndata: 1\n\ndata: 2\n\nevent: c\n\ndata: 3\n\n"])
    assert pairs(events) == [(b"1", b"b"), (b"2", None), (b"3", None)]


@pytest.mark.parametrize(
    "sep",
    ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"],
    ids=["U+2028", "U+2029", "U+0085", "VT", "FF", "FS", "GS", "RS"],
)
@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
def test_unicode_separators_inside_json_never_split_an_event(sep: str, eol: bytes) -> None:
    raw_sep = sep.encode()  # raw, not \u-escaped (a raw VT/FF/FS/GS/RS is not even legal JSON: still one event)
    payload = b'{"choices":[{"delta":{"content":"a' + raw_sep + b"b" + raw_sep + b'"}}]}'
    body = reframe(b"data: " + payload + b"\n\ndata: next\n\n", eol)
    scanner = SSEScanner()
    events = feed_all([body], scanner)
    assert pairs(events) == [(payload, None), (b"next", None)]
    if sep in "\u2028\u2029\x85":
        assert json.loads(events[0].data)["choices"][0]["delta"]["content"] == f"a{sep}b{sep}"
    assert scanner.pending == 0


def test_raw_0x85_byte_is_not_a_line_end() -> None:
    assert pairs(feed_all([b"data: a\x85b\x0bc\x0cd\n\n"])) == [(b"a\x85b\x0bc\x0cd", None)]


# ----------------------------------------------------------------------------- events without data


@pytest.mark.parametrize(
    "body",
    [b"event: ping\n\n", b"id: 7\n\n", b"id: 7\n\n\n", b"retry: 5\n\n", b"event: ping\nid: 1\nretry: 9\n\n",
     b"foo: bar\n\n", b"foo\n\n", b": c\nid: 7\n\n", b"event: error\n: c\n\n", b"\n\n\n\n"],
)
@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
def test_events_without_data_are_never_emitted(body: bytes, eol: bytes) -> None:
    scanner = SSEScanner()
    assert scanner.feed(reframe(body, eol)) == []
    assert scanner.pending == 0  # nothing is half-way: the stream may end here cleanly
    assert pairs(scanner.feed(b"data: x\n\n")) == [(b"x", None)]


def test_id_retry_and_unknown_fields_are_dropped_from_the_emitted_bytes() -> None:
    events = feed_all([b"id: 7\ndata: a\nretry: 5\n\nevent: e\nid: 8\ndata: b\nfoo: bar\n\n"
                       b": c\nid: 9\ndata: c\n\n"])
    assert [ev.raw for ev in events] == [b"data: a\n\n", b"event: e\ndata: b\n\n", b"data: c\n\n"]
    assert pairs(events) == [(b"a", None), (b"b", b"e"), (b"c", None)]


def test_rebuilt_event_keeps_a_leading_space_of_the_value() -> None:
    [ev] = feed_all([b"id: 1\ndata:  x\n\n"])
    assert ev.raw == b"data:  x\n\n"
    assert whatwg(ev.raw)[0] == [(" x", None)]


# ----------------------------------------------------------------------------------------- exact bytes


def test_lf_framed_plain_events_are_forwarded_byte_for_byte() -> None:
    body = (b": ping\n\n" b"data: {\"a\":1}\n\n" b"event: error\ndata:{\"b\":2}\n\n" b"data: x\n: c\ndata:  y\n\n"
            b"data\n\n" b"data: [DONE]\n\n")
    events = feed_all([body])
    assert [ev.raw for ev in events] == [b": ping\n\n", b"data: {\"a\":1}\n\n", b"event: error\ndata:{\"b\":2}\n\n",
                                         b"data: x\n: c\ndata:  y\n\n", b"data\n\n", b"data: [DONE]\n\n"]
    assert b"".join(ev.raw for ev in events) == body


def test_extra_blank_lines_between_events_are_not_forwarded_and_leave_nothing_pending() -> None:
    scanner = SSEScanner()
    events = scanner.feed(b"\n\ndata: a\n\n\n\n\ndata: b\n\n\n")
    assert [ev.raw for ev in events] == [b"data: a\n\n", b"data: b\n\n"]
    assert scanner.pending == 0
    assert scanner.feed(b"\n") == [] and scanner.pending == 0
    assert [ev.raw for ev in scanner.feed(b"data: c\n\n")] == [b"data: c\n\n"]


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_cr_framed_events_are_rebuilt_with_lf(eol: bytes) -> None:
    events = feed_all([reframe(b"event: e\ndata: a\n: c\ndata: b\n\n", eol)])
    assert [ev.raw for ev in events] == [b"event: e\ndata: a\ndata: b\n\n"]


# ---------------------------------------------------------------------------------------- size limit


def test_partial_event_over_the_limit_raises() -> None:
    scanner = SSEScanner(max_event_bytes=32)
    assert scanner.feed(b"data: " + b"x" * 20) == []
    with pytest.raises(EventTooLarge):
        scanner.feed(b"y" * 20)
    assert scanner.pending == 0


def test_complete_event_over_the_limit_in_one_read_raises() -> None:
    scanner = SSEScanner(max_event_bytes=32)
    with pytest.raises(EventTooLarge):
        scanner.feed(b"data: " + b"x" * 40 + b"\n\n")
    scanner = SSEScanner(max_event_bytes=32)
    with pytest.raises(EventTooLarge):
        scanner.feed(b"data: ok\n\ndata: " + b"x" * 40 + b"\r\n\r\n")


@pytest.mark.parametrize("reads", ["one", "bytes"])
def test_limit_is_exact_for_lf_events(reads: str) -> None:
    body = b"data: 0123\n\n"  # the event is 11 bytes without its blank line

    def run(limit: int) -> list[SSEEvent]:
        chunks = [body] if reads == "one" else [body[i : i + 1] for i in range(len(body))]
        return feed_all(chunks, SSEScanner(max_event_bytes=limit))

    assert pairs(run(11)) == [(b"0123", None)]
    with pytest.raises(EventTooLarge):
        run(10)


def test_limit_is_exact_for_a_partial_lf_event_after_finished_ones() -> None:
    scanner = SSEScanner(max_event_bytes=11)
    assert pairs(scanner.feed(b"data: a\n\ndata: 0123\n")) == [(b"a", None)]
    assert scanner.pending == 11
    with pytest.raises(EventTooLarge):
        SSEScanner(max_event_bytes=10).feed(b"data: a\n\ndata: 0123\n")


def test_limit_is_exact_for_a_partial_cr_framed_event() -> None:
    scanner = SSEScanner(max_event_bytes=10)
    assert scanner.feed(b"data: 012\r") == []  # 10 bytes held: at the limit, not over it
    assert scanner.pending == 10
    assert pairs(scanner.feed(b"\n\r\n")) == [(b"012", None)]
    with pytest.raises(EventTooLarge):
        SSEScanner(max_event_bytes=9).feed(b"data: 012\r")


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
def test_many_small_events_in_one_read_are_not_too_large(eol: bytes) -> None:
    body = reframe(b"data: 0123456789\n\n" * 100, eol)
    scanner = SSEScanner(max_event_bytes=24)
    assert len(scanner.feed(body)) == 100


def test_default_limit_accepts_a_large_event() -> None:
    payload = b"x" * (1 << 20)
    assert pairs(feed_all([b"data: " + payload[: 1 << 19], payload[1 << 19 :] + b"\n\n"])) == [(payload, None)]


# ------------------------------------------------------------------------------------------ fixtures


def _streaming_fixtures() -> list[tuple[str, bytes, dict]]:
    out = []
    for meta_path in sorted(FIXTURES.glob("*.json")):
        meta = json.loads(meta_path.read_text())
        if meta.get("streaming") is True:
            out.append((meta_path.stem, (FIXTURES / meta["body_file"]).read_bytes(), meta))
    return out


STREAMING = _streaming_fixtures()
ONE_SHOT = {name: pairs(SSEScanner().feed(body)) for name, body, _ in STREAMING}


def test_fixtures_are_found() -> None:
    assert len(STREAMING) >= 10
    assert all(b"\r" not in body for _, body, _ in STREAMING)  # LF originals: re-framing is meaningful


@pytest.mark.parametrize(("name", "body", "meta"), STREAMING, ids=[name for name, _, _ in STREAMING])
def test_fixture_one_shot_matches_recorded_sse_check(name: str, body: bytes, meta: dict) -> None:
    check = meta["sse_check"]
    scanner = SSEScanner()
    events = scanner.feed(body)
    data_events = [ev for ev in events if ev.data is not None]
    assert len(data_events) == check["events"]
    assert sum(ev.data is None for ev in events) == check["comment_lines"]
    assert sum(ev.data == b"[DONE]" for ev in data_events) == check["done_markers"]
    types: dict[str, int] = {}
    for ev in data_events:
        if ev.event is not None:
            types[ev.event.decode()] = types.get(ev.event.decode(), 0) + 1
    assert types == check["event_field_types"]
    assert b"".join(ev.raw for ev in events) == body  # plain LF events: forwarded byte for byte
    assert scanner.pending == 0
    assert as_text(events) == whatwg(body)[0]


@pytest.mark.parametrize(("name", "body", "meta"), STREAMING, ids=[name for name, _, _ in STREAMING])
def test_fixture_crlf_split_after_every_cr(name: str, body: bytes, meta: dict) -> None:
    crlf = reframe(body, b"\r\n")
    scanner = SSEScanner()
    chunks = [c + b"\r" for c in crlf.split(b"\r")]
    chunks[-1] = chunks[-1][:-1]
    assert b"".join(chunks) == crlf
    assert pairs(feed_all(chunks, scanner)) == ONE_SHOT[name]
    assert scanner.pending == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fixture=st.sampled_from(STREAMING),
    eol=st.sampled_from([*EOLS, b"mixed"]),
    cuts=st.lists(st.integers(min_value=0, max_value=32_000), max_size=80),
    bom=st.booleans(),
)
def test_fixture_reframed_and_cut_anywhere_gives_the_lf_one_shot_events(
    fixture: tuple[str, bytes, dict], eol: bytes, cuts: list[int], bom: bool
) -> None:
    name, body, _ = fixture
    framed = mixed(body) if eol == b"mixed" else reframe(body, eol)
    if bom:
        framed = BOM + framed
    scanner = SSEScanner()
    events = feed_all(split_at(framed, [c % (len(framed) + 1) for c in cuts]), scanner)
    assert pairs(events) == ONE_SHOT[name]
    assert scanner.pending == 0
    assert_wellformed(events)


# ---------------------------------------------------------------------------------------------- fuzz

_TOKENS = [b"data", b"event", b"id", b"retry", b"foo", b":", b": ", b" ", b"\n", b"\r", b"\r\n", b"\n\n",
           b"x", b"{\"a\":1}", b"error", b"[DONE]", "\u2028".encode(), b"\xc2\x85", b"\x0b", b"\x0c", b"\x00",
           b"\xff", b"\xe2\x80", BOM[:1], BOM[1:]]
_sse_like = st.lists(st.sampled_from(_TOKENS), max_size=60).map(b"".join)
_streams = st.one_of(_sse_like, st.binary(max_size=200), st.tuples(st.just(BOM), _sse_like).map(b"".join))


@st.composite
def split_stream(draw: st.DrawFn, streams: st.SearchStrategy[bytes] = _streams) -> tuple[bytes, list[bytes]]:
    raw = draw(streams)
    cuts = draw(st.lists(st.integers(min_value=0, max_value=len(raw)), max_size=12))
    return raw, split_at(raw, cuts)


@settings(max_examples=300, deadline=None)
@given(split_stream())
def test_fuzz_matches_the_reference_and_emits_only_safe_bytes(case: tuple[bytes, list[bytes]]) -> None:
    raw, chunks = case
    scanner = SSEScanner()
    with time_limit(5):
        events = feed_all(chunks, scanner)
    want, incomplete = whatwg(raw)
    assert as_text(events) == want
    assert (scanner.pending > 0) == incomplete
    assert_wellformed(events)
    out = b"".join(ev.raw for ev in events)
    assert not out.startswith(BOM)
    assert b"\n" + BOM not in out  # no emitted line starts with a BOM
    # what the gateway forwards parses (by the reference rules) to the very same events
    assert whatwg(out) == (want, False)
    # the result does not depend on where the reads were cut
    assert pairs(SSEScanner().feed(raw)) == pairs(events)


@settings(max_examples=200, deadline=None)
@given(split_stream(st.tuples(st.sampled_from([b"", BOM]), _sse_like).map(b"".join)))
def test_fuzz_output_never_contains_a_bom_when_only_the_leading_one_is_sent(case: tuple[bytes, list[bytes]]) -> None:
    raw, chunks = case
    body = raw[3:] if raw.startswith(BOM) else raw
    if BOM in body:  # _sse_like can assemble a BOM from its halves; that one is data, not a BOM
        return
    out = b"".join(ev.raw for ev in feed_all(chunks))
    assert BOM not in out


@settings(max_examples=200, deadline=None)
@given(split_stream(), st.integers(min_value=1, max_value=40))
def test_fuzz_small_limit_raises_only_event_too_large(case: tuple[bytes, list[bytes]], limit: int) -> None:
    raw, chunks = case
    scanner = SSEScanner(max_event_bytes=limit)
    events: list[SSEEvent] = []
    with time_limit(5):
        try:
            for chunk in chunks:
                events += scanner.feed(chunk)
        except EventTooLarge:
            assert len(raw) > limit
            assert scanner.pending == 0
            assert as_text(events) == whatwg(raw)[0][: len(as_text(events))]
            return
    assert as_text(events) == whatwg(raw)[0]
    assert_wellformed(events)
