"""The ``vllm`` dialect: OpenAI-compatible inference servers run by the user (vLLM, SGLang, llama.cpp's
``llama-server`` and ``llama-cpp-python``), the usual open-weight standard tier and a home-grown fast one.

Facts (vLLM's and llama.cpp's server docs; the recorded ``vllm_chat_stream`` and ``llamacpp_*`` fixtures):
their extra sampling fields (``chat_template_kwargs``, ``min_tokens``, ``top_k``, ``repetition_penalty``, ...) are
the client's and pass through byte for byte; a stream reports usage only when ``stream_options.include_usage`` asks
(the gateway asks, so every stream is counted); a prompt over the context window is answered 400 (vLLM) or 500
(llama.cpp, older vLLM), both read as 400 ``context_length_exceeded``; an error event may put the status in an
integer ``code``; no rate-limit headers; the Responses API is partial or missing, so it is served through the bridge,
and ``/v1/completions`` and ``/v1/embeddings`` by the passthrough.
"""

from __future__ import annotations

from gateway.upstream.dialects.base import Dialect


class VLLM(Dialect):
    """Self-hosted OpenAI-compatible servers: OpenAI's rules; what differs is declared in ``gateway.config``
    (served through the bridge) and read by the shared error rules (``gateway.errors``)."""

    name = "vllm"
