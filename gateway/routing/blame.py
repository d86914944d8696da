"""Whose fault an upstream failure is (docs/routing.md#circuit-breakers, docs/tenancy.md#isolation): one a request's
own content can cause is charged to that request's source, so that one client alone never opens an upstream's breaker
for everyone (``gateway.routing.health`` counts it). Pure code, no I/O."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.errors import GatewayError, UpstreamStatusError

# failures without a status that a request's content can cause (gateway.errors codes): a first token or an answer that
# never comes (a prompt that takes the upstream too long), a broken, oversized or nonsensical answer
SHAPED_CODES = frozenset({"upstream_ttft_timeout", "upstream_idle_timeout", "upstream_stream_interrupted",
                          "upstream_event_too_large", "upstream_bad_response"})


MAX_SOURCES = 1024  # sources whose recent request-shaped failures an upstream remembers (the least recent go first)


def request_shaped(exc: GatewayError) -> bool:
    """A 5xx (an error event's included) may be the request's doing: vLLM and llama.cpp fail that way on some malformed
    inputs. A refused or reset connection never is."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status >= 500
    return exc.code in SHAPED_CODES


class Blame:
    """``charged``: (upstream, its ``gateway.upstream.attempt.Verdicts``, source) of each failure charged, for
    :meth:`retract`. ``source`` (a gateway key's name, else a digest of the body) is computed on first ask: only a
    failure, or an upstream resting for some source, asks."""

    __slots__ = ("_source", "_known", "charged")

    def __init__(self, source: Callable[[], str]) -> None:
        self._source = source
        self._known: str | None = None
        self.charged: list[tuple[str, Any, str]] = []

    def who(self) -> str:
        if self._known is None:
            self._known = self._source()
        return self._known

    def everywhere(self, tried: int) -> bool:
        """Every attempt failed request-shaped, on two upstreams or more: the request is at fault, not the upstreams."""
        return tried >= 2 and len(self.charged) == tried and len({name for name, _, _ in self.charged}) >= 2

    def retract(self) -> None:
        """Take back every failure charged (:meth:`UpstreamHealth.retract`)."""
        for _, verdicts, source in self.charged:
            verdicts.retract(source)
        self.charged = []
