"""The relay's template fast path (``gateway.stream.relay.Template``) observes and forwards exactly what the full path
does.

A stream is relayed twice over the same reads, in-process: once as shipped, once with ``Relay.LEARN = 0`` (every
event scanned and parsed). Output bytes and every observed figure must be equal, for every recorded chat stream in
``tests/fixtures/upstream`` and for made-up streams that aim at the fast path's edges (escaped quotes and
backslashes, a raw line break or CR inside a text, OpenAI's obfuscation member, tool-call arguments, two choices,
a shape change mid-stream, several events per read, reads cut anywhere). The fast path must also really be taken
where it can: otherwise these tests would compare the full path with itself.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.stream.relay import Relay
from gateway.stream.stats import Extra
from gateway.stream.template import Template
from gateway.upstream import dialects

from conftest import FIXTURES


class Reads:
    """A ``StreamBody`` playing fixed reads, with no I/O."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.at = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        while self.at < len(self.reads):
            self.at += 1
            yield self.reads[self.at - 1]

    def watch_idle(self) -> None:
        pass


def relay(reads: list[bytes], *, learn: int | None = None, choices: int = 1,
          extra: Extra | None = None) -> tuple[bytes, dict[str, Any], int]:
    """Relay ``reads`` (from an upstream whose dialect is ``extra``; None: OpenAI's); return the client's bytes, the
    stats that do not depend on the clock, and how many events went the full way (``_process``)."""
    r = Relay(strip_usage_chunk=True, max_event_bytes=1 << 20, choices=choices, extra=extra)
    if learn is not None:
        r.LEARN = learn
        r._learn = learn
    full = 0
    process = r._process

    def counted(events: Any, now: float) -> bytes:
        nonlocal full
        full += len(events)
        return process(events, now)

    r._process = counted  # type: ignore[method-assign]
    out: list[bytes] = []

    async def write(data: bytes) -> None:
        out.append(data)

    async def go() -> tuple[str, str] | None:
        try:
            await r.run(Reads(reads), write)
        except GatewayError as exc:  # before the first token: the caller answers with a status
            return type(exc).__name__, exc.code
        return None

    raised = asyncio.run(go())
    stats = r.stats
    figures: dict[str, Any] = {"raised": raised}
    figures |= {name: getattr(stats, name) for name in ("token_chunks", "usage", "timings", "done", "finished",
                                                        "complete", "error")}
    figures["timed"] = (stats.t_first_token is None, stats.t_last_token is None)
    return b"".join(out), figures, full


def both(reads: list[bytes], choices: int = 1, extra: Extra | None = None) -> int:
    """Assert both paths agree on ``reads``; return the events the shipped path parsed."""
    fast_out, fast, parsed = relay(reads, choices=choices, extra=extra)
    full_out, full, _ = relay(reads, learn=0, choices=choices, extra=extra)
    assert fast_out == full_out
    assert fast == full
    return parsed


def chunk(text: str | None = None, *, args: str | None = None, index: int = 0, finish: str | None = None,
          obfuscation: str | None = None, raw_text: bytes | None = None) -> bytes:
    """One chat.completion.chunk event as an upstream writes it; ``raw_text`` puts bytes in the text as they are."""
    delta: dict[str, Any] = {}
    if args is not None:
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": args}}]}
    elif text is not None:
        delta = {"content": text}
    body: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
                            "usage": None}
    if obfuscation is not None:
        body["obfuscation"] = obfuscation
    data = json.dumps(body, separators=(",", ":")).encode()
    if raw_text is not None:
        data = data.replace(b'"content":"@"', b'"content":"' + raw_text + b'"')
    return b"data: " + data + b"\n\n"


ROLE = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
USAGE = (b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9,'
         b'"total_tokens":12}}\n\ndata: [DONE]\n\n')


def stream(*events: bytes) -> bytes:
    return ROLE + b"".join(events) + chunk(finish="stop") + USAGE


def per_event(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


def cut(body: bytes, size: int) -> list[bytes]:
    return [body[i:i + size] for i in range(0, len(body), size)]


CHAT_STREAMS = sorted(p.stem for p in FIXTURES.glob("*.json")
                      if (meta := json.loads(p.read_text()))["streaming"]
                      and meta["request"]["path"].split("?")[0].endswith("/chat/completions"))


@pytest.mark.parametrize("name", CHAT_STREAMS)
def test_recorded_streams_are_relayed_the_same_either_way(name: str) -> None:
    body = (FIXTURES / f"{name}.body").read_bytes()
    for reads in ([body], per_event(body), cut(body, 7), cut(body, 64)):
        both(reads)


def test_recorded_openai_text_stream_takes_the_fast_path() -> None:
    """OpenAI's own chunks end with a random ``obfuscation`` member: the template must still match them."""
    events = per_event((FIXTURES / "openai_chat_stream_text.body").read_bytes())
    tokens = [e for e in events if b'"content":"' in e and b'"content":""' not in e]
    assert len(tokens) >= 40 and all(b'"obfuscation":"' in e for e in tokens)
    assert both(events) == len(events) - len(tokens) + 2  # only the first two token chunks are parsed


def test_recorded_refusal_and_tool_call_streams_take_the_fast_path() -> None:
    for name in ("openai_chat_stream_refusal", "openai_chat_stream_tool_call", "cerebras_chat_stream_tool_call"):
        events = per_event((FIXTURES / f"{name}.body").read_bytes())
        assert both(events) <= len(events) // 2, name


@pytest.mark.parametrize(("name", "dialect", "read"), [
    ("groq_chat_stream_text", "groq", "usage"),                 # x_groq.usage on the last chunk
    ("llamacpp_chat_stream_reasoning", "vllm", "usage"),        # llama-server's timings.predicted_n
    ("cerebras_chat_stream_text", "cerebras", "timings"),        # time_info on the finish chunk
])
def test_the_member_a_dialect_adds_is_read_on_both_paths(name: str, dialect: str, read: str) -> None:
    """The member an upstream's dialect adds to OpenAI's chunks is read whether its chunk came after template chunks
    or not; an upstream labelled with another dialect still has the usage the member holds read (on the finishing
    chunk, on both paths alike), but not its timings."""
    events = per_event((FIXTURES / f"{name}.body").read_bytes())
    both(events, extra=dialects.DIALECTS[dialect])
    _, figures, _ = relay(events, extra=dialects.DIALECTS[dialect])
    assert figures[read] is not None
    both(events, extra=dialects.DIALECTS["openai"])
    _, as_openai, _ = relay(events, extra=dialects.DIALECTS["openai"])
    assert as_openai["timings"] is None and as_openai["usage"] == figures["usage"]


def test_plain_text_streams_past_the_first_token_chunk_are_not_parsed() -> None:
    texts = ["Hello", " wor", "ld", "é 漢字 🙂", "x" * 500]
    events = [chunk(t) for t in texts]
    parsed = both(per_event(stream(*events)))
    assert parsed == 6  # role, first token, second (learns), finish, usage, [DONE]: the other three are not
    assert both([stream(*events)]) == 9  # one read holding every event goes the full way, all nine


@pytest.mark.parametrize("text", ['say "hi"', "ends with a backslash \\", "\\\\", '\\"', "a\\\\\"b", '"', "\\n"])
def test_escaped_quotes_and_backslashes(text: str) -> None:
    events = [chunk("first"), chunk(text), chunk(text + text), chunk("last")]
    assert both(per_event(stream(*events))) == 6


@pytest.mark.parametrize("raw", [b"a\rb", b"a\r", b"a\nb", b"x\\", b"x\\\\\\", b'x\\"', b"\\u00e9"])
def test_raw_bytes_in_a_text_that_the_template_must_not_take(raw: bytes) -> None:
    """A raw CR or LF frames the event differently; an odd run of backslashes escapes the closing quote; these
    must go the full way (and an escape that is valid JSON may go the fast one): the same result either way."""
    events = [chunk("first"), chunk("@", raw_text=raw), chunk("second")]
    both(per_event(stream(*events)))
    both([stream(*events)])
    both(cut(stream(*events), 5))


def test_empty_text_is_no_token_and_tool_call_arguments_always_are() -> None:
    events = [chunk("a"), chunk(""), chunk("b"), chunk(args='{"ci'), chunk(args=""), chunk(args='ty": "Paris"}')]
    _, figures, _ = relay(per_event(stream(*events)))
    assert figures["token_chunks"] == 5
    both(per_event(stream(*events)))


def test_obfuscation_values_that_are_not_letters_and_digits_go_the_full_way() -> None:
    events = [chunk("a", obfuscation="Ab1"), chunk("b", obfuscation="Zx9Q"), chunk("c", obfuscation="a b"),
              chunk("d", obfuscation="q\\u0041"), chunk("e", obfuscation=""), chunk("f", obfuscation="\u00e9")]
    both(per_event(stream(*events)))


def test_two_choices_and_a_change_of_shape() -> None:
    events = [chunk("a", index=0), chunk("b", index=1), chunk("c", index=0), chunk("d", index=1),
              chunk(args="{"), chunk(args="}"), chunk("again")]
    both(per_event(stream(*events)), choices=2)
    both(per_event(stream(*events)), choices=1)


def test_a_finish_or_usage_after_template_chunks_in_one_read() -> None:
    events = [chunk("a"), chunk("b")]
    tail = chunk("c") + chunk("d") + chunk(finish="stop") + USAGE
    for reads in ([ROLE + events[0], events[1], tail], [ROLE + events[0], events[1] + chunk("c")[:30],
                                                         chunk("c")[30:], tail]):
        fast_out, fast, _ = relay(reads)
        assert fast["finished"] and fast["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
        both(reads)


def test_learn_refuses_what_it_cannot_prove() -> None:
    def learned(event: bytes) -> Template | None:
        data = event[6:-2]
        return Template.learn(event, data, json.loads(data))

    assert learned(chunk("a")) is not None
    assert learned(chunk("")) is None  # no token
    assert learned(chunk("a", finish="stop")) is None
    two = b'data: {"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}\n\n'
    assert learned(two) is None
    # the marker twice (once inside another member): the text's place is not known
    twice = b'data: {"x":{"delta":{"content":"a"}},"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    assert learned(twice) is None
    spaced = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
    assert learned(spaced) is None  # the marker is written without spaces: not found, not guessed


@pytest.mark.parametrize("raw", [rb"\ud83d", b"a\tb", b"a\x00b", b"a\xffb", b"\xed\xa0\x80", rb"\q", rb"\u12",
                                 b"\xc3"])
def test_a_text_that_is_not_valid_json_is_no_token_either_way(raw: bytes) -> None:
    """The full path's parse rejects such a chunk (a lone surrogate from an emoji split by the upstream, a raw control
    byte, bad UTF-8, a bad escape): it is forwarded but not counted; the fast path must not count it either."""
    reads = [ROLE, chunk("first"), chunk("@", raw_text=raw), chunk(finish="stop"), USAGE]
    assert relay(reads)[1]["token_chunks"] == 1
    both(reads)


def test_a_read_over_max_event_bytes_goes_the_full_way() -> None:
    reads = [ROLE, chunk("first"), chunk("x" * 5000), chunk(finish="stop"), USAGE]
    r = Relay(strip_usage_chunk=True, max_event_bytes=1024)

    async def write(data: bytes) -> None:
        pass

    assert asyncio.run(r.run(Reads(reads), write)).error == "upstream_event_too_large"


def _random_stream(rng: random.Random) -> list[bytes]:
    """A stream mostly of one shape (so that a template is learned and used), with the events that must break it."""
    frame = rng.choice([b"\n"] * 8 + [b"\r\n", b"\r"])
    pieces = [b"a", b" Hello", b'\\"', b"\\\\", b"\\\\\\\"", b"\\n", b"\\u00e9", b"\\ud83d\\ude00", "é🙂".encode(),
              b"}", b'"},', b"\t", b"\xff", b"\\ud83d", b"\\q", b"\n", b"\r", b'"', b"\\"]
    key = rng.choice(["content", "content", "reasoning_content", "refusal"])
    obfuscated = rng.random() < 0.5
    events = [ROLE.replace(b"\n", frame)]
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.08:
            events.append(rng.choice([b": keep-alive", b"data: [DONE]", b"data: not json", b"data:{}", b"id: 7",
                                      b'data: {"error":{"message":"boom"}}', b"event: error\ndata: {}"]) + frame * 2)
            continue
        body: dict[str, Any] = {"id": "c", "choices": [{"index": rng.choice([0] * 9 + [1]),
                                                       "delta": {key: "@@"}, "finish_reason": None}]}
        if kind < 0.15:
            body["usage"] = rng.choice([None, {"prompt_tokens": 1, "completion_tokens": 2}])
        if kind < 0.2:
            body["choices"][0]["delta"] = {"tool_calls": [{"index": 0, "function": {"arguments": "@@"}}]}
        if obfuscated:
            body["obfuscation"] = rng.choice(["", "Ab9", "x y", "é"] if kind < 0.25 else ["", "Zq", "abc123XYZ"])
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode()
        text = b"".join(rng.choice(pieces[:11] if rng.random() < 0.8 else pieces) for _ in range(rng.randint(0, 3)))
        events.append(b"data: " + data.replace(b"@@", text) + frame * 2)
    events += [chunk(finish="stop").replace(b"\n", frame), USAGE.replace(b"\n", frame)][:rng.randint(0, 2)]
    body_bytes = b"".join(events)
    if rng.random() < 0.5:
        return events
    cuts = sorted(rng.sample(range(1, len(body_bytes)), min(len(body_bytes) - 1, rng.randint(1, 6))))
    return [body_bytes[i:j] for i, j in zip([0, *cuts], [*cuts, len(body_bytes)], strict=True)]


def test_random_streams_are_relayed_the_same_either_way() -> None:
    """A bounded randomised differential test (3,000 streams, fixed seed): the fast path takes some reads of most of
    them, and every one comes out the same as on the full path."""
    rng = random.Random(17)
    taken = 0
    for _ in range(3000):
        reads = _random_stream(rng)
        parsed = both(reads)
        taken += parsed < sum(r.count(b"\n\n") + r.count(b"\r\r") for r in reads)
    assert taken > 600  # the fast path was really exercised


def test_nothing_is_learned_on_the_way_to_the_first_token() -> None:
    """Learning costs a parse more: it waits for the second token chunk, so that it never delays the first token."""
    r = Relay(strip_usage_chunk=True, max_event_bytes=1 << 20)
    body = Reads([ROLE, chunk("first"), chunk("second"), chunk("third")])
    asyncio.run(r.first(body))
    assert r.stats.t_first_token is not None and r._template is None
    r2 = Relay(strip_usage_chunk=True, max_event_bytes=1 << 20)
    r2._take(ROLE + chunk("first"))
    r2._take(chunk("second"))
    assert r2._template is not None
