"""The ``openai`` dialect: OpenAI's API and close copies (Azure OpenAI, OpenRouter, Ollama's ``/v1``), whose facts
(docs/reference/wire.md#chat-streams) are all the base class's behaviour."""

from __future__ import annotations

from gateway.upstream.dialects.base import Dialect


class OpenAI(Dialect):
    """The base behaviour, unchanged."""

    name = "openai"
