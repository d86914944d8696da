"""The ``gateway.upstream.attempt.Verdicts`` of a replica with shared state: an attempt's verdicts go to its upstream's
local health, and its answer's rate-limit report to the shared estimate too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import GatewayError
from gateway.routing.health import Mark, UpstreamHealth
from gateway.routing.ratelimits import Window, quota_report
from gateway.state.redis import Admission, SharedState


class SharedVerdicts:
    __slots__ = ("local", "shared", "admission", "reported")

    def __init__(self, local: UpstreamHealth, shared: SharedState, admission: Admission | None) -> None:
        self.local, self.shared, self.admission = local, shared, admission
        self.reported = False

    def start(self, now: float, need_tokens: int) -> Mark:
        return self.local.start(now, need_tokens)

    def finish(self) -> None:
        self.local.finish()
        if not self.reported and self.admission is not None and self.admission.member is not None:
            self.shared.landed(self.local.name, self.admission.member)

    def observe_headers(self, headers: Mapping[str, str], now: float, mark: Any = None) -> None:
        """Read by the general reader (``gateway.routing.ratelimits``)."""
        self.observe_report(quota_report(headers), now, mark)

    def observe_report(self, report: dict[str, Window], now: float, mark: Any = None) -> None:
        self.local.observe_report(report, now, mark)
        self.reported = True
        self.shared.observed(self.local, report, self.admission)

    def settle(self, exc: GatewayError | None, now: float, need_tokens: int = 0, source: str | None = None) -> None:
        self.local.settle(exc, now, need_tokens, source)

    def retract(self, source: str) -> None:
        self.local.retract(source)
