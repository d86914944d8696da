"""Whose fault an upstream failure is (docs/routing.md#circuit-breakers, docs/tenancy.md#isolation). A failure with no
status line is the upstream's; one a request's own content can cause is *request-shaped* (:func:`request_shaped`) and is
charged to the request's source, its gateway key or its body (:class:`Blame`), so that one client alone never opens an
upstream's breaker for everyone (``gateway.routing.health``)."""

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
    """Whether ``exc`` is a failure a request's own content can cause (module docstring: whose fault): a 5xx status
    (an error event's included), or one of :data:`SHAPED_CODES`. A refused or reset connection is not."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status >= 500
    return exc.code in SHAPED_CODES


class Blame:
    """Who one request's request-shaped failures are charged to (module docstring: whose fault), and which it charged.

    Args:
        source: the request's source, computed when first asked (a gateway key's name, or a digest of the body: only a
            failure, or an upstream resting for some source, asks).

    Attributes:
        charged: (upstream name, its verdicts, source) of each request-shaped failure charged so far, in order (the
            verdicts: ``gateway.upstream.attempt.Verdicts``, which can take one back).
    """

    __slots__ = ("_source", "_known", "charged")

    def __init__(self, source: Callable[[], str]) -> None:
        self._source = source
        self._known: str | None = None
        self.charged: list[tuple[str, Any, str]] = []

    def who(self) -> str:
        """The request's source (computed once)."""
        if self._known is None:
            self._known = self._source()
        return self._known

    def everywhere(self, tried: int) -> bool:
        """Whether every one of the ``tried`` attempts failed request-shaped, on two upstreams or more: the request's
        fault (module docstring)."""
        return tried >= 2 and len(self.charged) == tried and len({name for name, _, _ in self.charged}) >= 2

    def retract(self) -> None:
        """Take back every failure charged (:meth:`UpstreamHealth.retract`); charge nothing more."""
        for _, verdicts, source in self.charged:
            verdicts.retract(source)
        self.charged = []
