"""The ``openai`` dialect: OpenAI's API and the upstreams that copy it closely (Azure OpenAI, OpenRouter, Ollama's
``/v1``). The client's bytes are forwarded as they came but for the model and the usage ask; every field is its own.

Facts (docs/reference/wire.md#chat-streams): streams end with ``data: [DONE]``; usage comes in a last
``choices: []`` chunk only when ``stream_options.include_usage`` asked for it; rate-limit headers
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` with Go-style durations (``6m0s``); a whole answer's
``openai-processing-ms`` header is its processing time; errors ``{"error": {"message", "type", "param", "code"}}``;
the Responses API served natively. Every one of these is the base class's behaviour.
"""

from __future__ import annotations

from gateway.upstream.dialects.base import Dialect


class OpenAI(Dialect):
    """OpenAI's API: the base behaviour, unchanged."""

    name = "openai"
