"""The relay's two opt-in rewrites (``answers.model: requested``, ``answers.cost: usage``;
docs/metrics.md#cost-in-answers), in-process on the reads an upstream may send: every model member renamed, whatever
the upstream named (empty, spaced, changing mid-stream), never inside content; the usage chunk priced and renamed;
and pricing nothing from counts that are not counts."""

from __future__ import annotations

import orjson
import pytest

from gateway.observability.metrics import Metrics
from gateway.stream.relay import Relay


def _chunk(model: str, content: str | None = None, usage: dict[str, object] | None = None,
           spaced: bool = False) -> bytes:
    body: dict[str, object] = {"id": "c", "object": "chat.completion.chunk", "model": model,
                               "choices": [] if usage else [{"index": 0, "delta": {"content": content},
                                                             "finish_reason": None}]}
    if usage:
        body["usage"] = usage
    data = orjson.dumps(body)
    if spaced:
        data = data.replace(b'":', b'": ')
    return b"data: " + data + b"\n\n"


def test_every_model_member_is_renamed_and_content_never() -> None:
    relay = Relay(strip_usage_chunk=False, max_event_bytes=1 << 20, rename="gpt-5.6-sol-fast")
    out = b"".join(relay._take(c) for c in (
        _chunk(""), _chunk("up-1", 'text with "model":"up-1" in it'), _chunk("up-2", "x", spaced=True),
        _chunk("up-1", usage={"prompt_tokens": 3, "completion_tokens": 2})))
    events = [orjson.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: ")]
    assert [e["model"] for e in events] == ["gpt-5.6-sol-fast"] * 4
    assert events[1]["choices"][0]["delta"]["content"] == 'text with "model":"up-1" in it'


def test_the_usage_chunk_is_priced_and_renamed_and_counts_that_are_not_counts_are_unpriced() -> None:
    def price(usage: dict[str, object], served: str | None) -> float | None:
        return 0.25 if isinstance(usage.get("completion_tokens"), int) else None
    relay = Relay(strip_usage_chunk=False, max_event_bytes=1 << 20, rename="asked", price=price)
    out = relay._take(_chunk("up\u00e9", usage={"prompt_tokens": 3, "completion_tokens": 2}))
    event = orjson.loads(out[6:].strip())
    assert (event["model"], event["usage"]["cost"]) == ("asked", 0.25)
    metrics = Metrics.__new__(Metrics)  # only its price tables are read
    metrics.model_prices, metrics.models, metrics.prices = {("u", "m"): (1e-6, 1e-7, 2e-6)}, {"m"}, {}
    assert metrics.price("u", "m", {"prompt_tokens": "10", "completion_tokens": None}) is None
    assert metrics.price("u", "m", {"prompt_tokens": 10, "completion_tokens": 5}) == pytest.approx(2e-5)
