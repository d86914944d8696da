"""Upstream dialects, one module each (``base`` holds the interface); :func:`of` picks an upstream's."""

from __future__ import annotations

from gateway.config.upstreams import UpstreamConfig
from gateway.upstream.dialects.base import Dialect
from gateway.upstream.dialects.cerebras import Cerebras
from gateway.upstream.dialects.groq import Groq
from gateway.upstream.dialects.openai import OpenAI
from gateway.upstream.dialects.vllm import VLLM

DIALECTS: dict[str, Dialect] = {d.name: d for d in (OpenAI(), Cerebras(), VLLM(), Groq())}


def of(upstream: UpstreamConfig) -> Dialect:
    """The dialect of ``upstream`` (its ``dialect:``; config validation admits only names listed here)."""
    return DIALECTS[upstream.dialect]
