"""The defaults of one emulated tier, and how ``POST /emulator/config`` changes them mid-run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EmulatorConfig:
    """``ttft`` in seconds; ``fixtures``: the checkout's ``tests/fixtures/upstream`` (an installed wheel has none:
    ``--fixtures``)."""

    tps: float = 750.0
    ttft: float = 0.05
    dialect: str = "cerebras"
    fixtures: Path = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "upstream"
    max_tokens: int = 4096
    # one shared budget of every caller (gateway.tools.emulator.budget); None: no limit
    tokens_per_minute: int | None = None
    # seconds a prompt prefix stays cached (gateway.tools.emulator.prompt_cache); None: no cache
    cache_ttl: float | None = None
    prefill_tps: float | None = None  # prompt tokens prefilled per second, added to the TTFT (cached ones are not)

    @classmethod
    def for_tier(cls, tier: str, **overrides: Any) -> EmulatorConfig:
        base = cls() if tier == "fast" else cls(tps=50.0, ttft=0.4, dialect="openai")
        return cls(**{**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}})

    def changed(self, given: Any) -> EmulatorConfig:
        """``{"ttft_ms": 3000}``, ``{"tps": 50}``, ``{"tokens_per_minute": N}``, ``{"cache_ttl": S}``,
        ``{"prefill_tps": N}`` (0 turns the last three off), for every later request. Raises ValueError, TypeError or
        KeyError for anything else."""
        changes: dict[str, Any] = {"ttft": float(given["ttft_ms"]) / 1000} if "ttft_ms" in given else {}
        if "tps" in given:
            changes["tps"] = float(given["tps"])
        if "tokens_per_minute" in given:
            changes["tokens_per_minute"] = int(given["tokens_per_minute"]) or None
        for name in ("cache_ttl", "prefill_tps"):  # a prompt cache and a prefill time, or (0) none
            if name in given:
                changes[name] = float(given[name]) or None
        return dataclasses.replace(self, **changes)

    def shown(self) -> dict[str, Any]:
        """What ``GET /emulator/config`` answers."""
        return {"ttft_ms": self.ttft * 1000, "tps": self.tps, "dialect": self.dialect,
                "tokens_per_minute": self.tokens_per_minute, "cache_ttl": self.cache_ttl,
                "prefill_tps": self.prefill_tps}
