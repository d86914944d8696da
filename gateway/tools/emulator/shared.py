"""What the connections of one emulator share (:class:`Emulator`). With ``timing_log`` every streamed answer appends
one JSON line as it ends, ``{"rid", "received", "first_token", "last_token", "token_chunks"}``, times from
``time.perf_counter()`` (``CLOCK_MONOTONIC``, shared by the machine's processes): when the request was complete and
when the write holding the first / last token-bearing chunk reached the socket (the metrics tests' ground truth)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, TextIO

from gateway.tools.emulator.budget import TokenBudget
from gateway.tools.emulator.config import EmulatorConfig
from gateway.tools.emulator.plans import Handler, Received
from gateway.tools.emulator.prompt_cache import PromptCache
from gateway.tools.emulator.surface import Surface


class Emulator:
    """``handler`` None: always a model; ``record``: keep every :class:`Received` in ``requests`` and every
    connection's close in ``closed_at`` (``time.monotonic()``)."""

    def __init__(self, config: EmulatorConfig, handler: Handler | None = None, *, record: bool = False,
                 timing_log: Path | None = None) -> None:
        self.config = config
        self.handler = handler
        self.record = record
        self.requests: list[Received] = []
        self.opened = 0
        self.closed_at: list[float] = []
        # the Responses API responses made and stored (not ``store: false``), by id (newest last, bounded): a
        # follow-up to any other is refused, as OpenAI refuses it, so that a gateway that starts a conversation afresh
        # (or continues a store: false one over HTTP) is caught; GET and DELETE /v1/responses/{id} read and remove
        # them, as OpenAI's do
        self.responses_made: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # their input items, each with an id, for GET /v1/responses/{id}/input_items (OpenAI API reference, "List
        # input items"); forgotten with their response
        self.inputs_made: dict[str, list[dict[str, Any]]] = {}
        self.surface = Surface()  # files, batches, ... (the rest of the /v1 surface)
        self.budget = TokenBudget()  # config.tokens_per_minute's window (gateway.tools.emulator.budget)
        self.cache: PromptCache | None = None  # made when config.cache_ttl is first set (it may come from the admin)
        self._log: TextIO | None = timing_log.open("a", buffering=1) if timing_log else None

    def made(self, response: dict[str, Any], kept: OrderedDict[str, dict[str, Any]] | None = None,
             inputs: list[dict[str, Any]] | None = None) -> None:
        """``kept``: :attr:`responses_made` by default, or a WebSocket's own memory; the oldest is forgotten past
        10,000. ``inputs``: its input items, kept with a stored response."""
        stored = kept is None
        kept = self.responses_made if kept is None else kept
        kept[response["id"]] = response
        if stored and inputs is not None:
            self.inputs_made[response["id"]] = inputs
        if len(kept) > 10_000:
            gone, _ = kept.popitem(last=False)
            if stored:
                self.inputs_made.pop(gone, None)

    def cached(self, body: dict[str, Any], prompt: bytes, now: float) -> int:
        """0 without ``cache_ttl``; keyed by the body's ``prompt_cache_key``
        (``gateway.tools.emulator.prompt_cache``)."""
        ttl = self.config.cache_ttl
        if not ttl:
            return 0
        if self.cache is None or self.cache.ttl != ttl:
            self.cache = PromptCache(ttl)
        key = body.get("prompt_cache_key")
        return self.cache.use(key if isinstance(key, str) else "", prompt, now)

    @property
    def timed(self) -> bool:
        return self._log is not None

    def log_timing(self, line: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.write(json.dumps(line) + "\n")
