"""How the upstreams of each dialect answer, as the emulator plays them: one :class:`Profile` a dialect, in
:data:`PROFILES` (the one place of the emulator that names dialects: tests/test_dialects.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

# Cerebras' 429 when its per-minute token budget is spent (also the fault ``reset_only_429``)
TPM_EXCEEDED = (b'{"message":"Tokens per minute limit exceeded","type":"too_many_tokens_error","param":"quota",'
                b'"code":"token_quota_exceeded"}')


class Answer(Protocol):
    """What a profile reads of the answer it shapes (a ``gateway.tools.emulator.generation.Generation``)."""

    id: bytes

    def usage(self) -> dict[str, Any]: ...

    def time_info(self) -> dict[str, Any]: ...


def _openai_429(budget: int, spent: int, cost: int) -> bytes:
    return orjson.dumps({"error": {
        "message": f"Rate limit reached for tokens per min (TPM): Limit {budget}, Used {spent}, Requested {cost}.",
        "type": "tokens", "param": None, "code": "rate_limit_exceeded"}})


def _x_groq(gen: Answer) -> bytes:
    return b',"x_groq":{"id":"req_' + gen.id[-26:] + b'","usage":' + orjson.dumps(gen.usage()) + b"}"


def _groq_whole(gen: Answer) -> dict[str, Any]:
    return {"x_groq": {"id": "req_" + gen.id.decode()[-26:]}}


def _cerebras_finish(gen: Answer) -> bytes:
    return b',"usage":' + orjson.dumps(gen.usage()) + b',"time_info":' + orjson.dumps(gen.time_info())


@dataclass(frozen=True)
class Profile:
    """One row of :data:`PROFILES` per name ``gateway.config.upstreams.Dialect`` admits (tests/test_dialects.py fails
    while one is missing); the defaults are OpenAI's. ``responses``: serves ``/v1/responses`` (else 404: the gateway
    bridges it); ``openai_chunks``: OpenAI's chunk shape (a role chunk with ``content: ""``, ``finish_reason`` on
    every chunk, a ``choices: []`` usage chunk only when asked), else Cerebras' (a bare role chunk, ``finish_reason``
    on the last alone, no usage chunk); ``finish``: what the last finish chunk carries after its ``choices`` when
    usage is reported; ``window``, ``reset``: the rate-limit headers' period suffix and reset format (Go-style
    ``%.3fs``, or float seconds); ``refusal``: its 429 body, given (budget, spent, cost) in tokens."""

    responses: bool = False
    openai_chunks: bool = True
    done: bool = True
    finish: Callable[[Answer], bytes] = lambda gen: b""
    whole: Callable[[Answer], dict[str, Any]] = lambda gen: {}
    processing_ms: bool = False
    window: bytes = b""
    reset: bytes = b"%.3fs"
    refusal: Callable[[int, int, int], bytes] = _openai_429
    service_tier: bool = False


PROFILES: dict[str, Profile] = {
    "openai": Profile(responses=True, processing_ms=True, service_tier=True),
    "vllm": Profile(),
    "groq": Profile(finish=_x_groq, whole=_groq_whole),
    "cerebras": Profile(openai_chunks=False, done=False, finish=_cerebras_finish,
                        whole=lambda gen: {"time_info": gen.time_info()}, window=b"-minute", reset=b"%.3f",
                        refusal=lambda budget, spent, cost: TPM_EXCEEDED),
}
