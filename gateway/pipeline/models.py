"""What the passthrough upstream lists at ``GET /v1/models``, cached, so that the gateway's own ``/v1/models`` shows
what can really be sent, and a model only that upstream lists can be routed to it (rule ``passthrough``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

from gateway.config.schema import GatewayConfig
from gateway.errors import GatewayError
from gateway.upstream.attempt import Transport

log = logging.getLogger("tiergate")

_ACCEPT_JSON = {"accept": "application/json"}
MODELS_RETRY = 5.0  # seconds before asking again an upstream that did not list its models


class UpstreamModels:
    """Cached for ``passthrough.models_ttl`` seconds. An upstream that does not answer within
    ``passthrough.models_timeout`` seconds, or answers no model list, leaves the last list it gave and is asked again
    after :data:`MODELS_RETRY` seconds."""

    def __init__(self, config: GatewayConfig, transport: Transport, clock: Callable[[], float]) -> None:
        self.config = config
        self.transport = transport
        self.clock = clock  # seconds (the health clock)
        self._models: list[dict[str, Any]] = []
        self._ids: frozenset[str] = frozenset()
        self._until = float("-inf")  # health clock
        self._lock: asyncio.Lock | None = None

    async def models(self) -> list[dict[str, Any]]:
        """As the upstream gave them, each id once."""
        await self._refresh()
        return self._models

    async def lists(self, model: str) -> bool:
        await self._refresh()
        return model in self._ids

    async def _refresh(self) -> None:
        pt, up = self.config.passthrough, self.config.passthrough_upstream
        if up is None or self.clock() < self._until:
            return
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # one fetch at a time; the others then read what it found
            if self.clock() < self._until:
                return
            found: list[dict[str, Any]] | None = None
            try:
                async with asyncio.timeout(pt.models_timeout):
                    answer = await self.transport.send(up, b"", stream=False, request_id="tiergate-models",
                                                       path="/models", method="GET", forward=_ACCEPT_JSON)
                    try:
                        data = await answer.read() if answer.status == 200 else b""
                    finally:
                        answer.close()
                listed = orjson.loads(data).get("data") if data else None
                if isinstance(listed, list):
                    seen: dict[str, dict[str, Any]] = {}
                    for m in listed:  # each id once, as first listed
                        if isinstance(m, dict) and isinstance(m.get("id"), str):
                            seen.setdefault(m["id"], m)
                    found = list(seen.values())
            except (GatewayError, TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
                log.info("the passthrough upstream %s did not list its models: %s", up.name, exc)
            if found is None:  # keep what it listed last; ask again soon, not after a whole TTL
                self._until = self.clock() + min(pt.models_ttl, MODELS_RETRY)
                return
            self._models, self._ids = found, frozenset(m["id"] for m in found)
            self._until = self.clock() + pt.models_ttl
