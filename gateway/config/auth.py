"""Gateway keys in the config (``auth:``): each key's hash, tiers, default metadata and limits, and who may read
``/metrics``."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from gateway.config.base import TIERS, Strict, Tier
from gateway.config.sessions import KeySession


class KeyLimits(Strict):
    """What one gateway key may spend (``gateway.tenancy.keys``; None: no limit). Minutes are fixed windows (the current
    UTC minute), days and months UTC calendar ones; tokens are the request's estimate (prompt bytes / 4 plus its
    ``max_tokens``) while it runs, then its usage; USD from its usage at the serving upstream's ``prices``, as
    ``tiergate_cost_usd_total``."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    usd_per_day: float | None = Field(None, gt=0)
    usd_per_month: float | None = Field(None, gt=0)


class KeyConfig(Strict):
    """One gateway key (``auth.keys``).

    name: how metrics and the request log name it (never the key itself); sha256: the hex SHA-256 of the key
    (``tiergate keys add NAME`` makes a key and prints this line); tiers: the tiers its requests may use (a request
    for another is served by one of these, ``x-tiergate-fallback: key_tier``); metadata: defaults routing reads as if
    the client had sent them in ``metadata`` (the client's own win); limits: requests, tokens and USD it may spend
    (over them: 429); fast: its allowance on the fast tier (over it, its requests spill to the standard tier,
    ``x-tiergate-fallback: key_allowance``); session: the session its requests belong to when they name none, and
    its runs' budgets (``gateway.config.sessions.KeySession``); class: its priority class on the fast tier
    (``scheduling.classes``; None: ``scheduling.default_class``), the highest its requests may ask for.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tiers: list[Tier] = Field(default_factory=lambda: list(TIERS), min_length=1)
    metadata: dict[str, str] = {}
    limits: KeyLimits = KeyLimits()
    fast: KeyLimits = KeyLimits()
    session: KeySession = KeySession()
    priority_class: str | None = Field(None, alias="class")


class MetricsAccess(Strict):
    """Who may read ``/metrics`` when gateway keys are on: it names every key and what each spent, which one tenant
    must not read of another. sha256: the hex SHA-256 of each scrape token (``tiergate keys add NAME --metrics``;
    Prometheus sends it as ``authorization: {credentials: ...}``): a scrape token reads ``/metrics`` and nothing else,
    and no gateway key reads ``/metrics``; public: anyone who reaches the port reads it (as without keys). There is no
    separate metrics port: ``/metrics`` is on the API's port, so with ``public`` every tenant reads every key's name
    and spend; only for a port no tenant reaches (a sidecar on loopback, a single team's gateway)."""

    sha256: list[str] = []
    public: bool = False

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        if any(re.fullmatch(r"[0-9a-f]{64}", h) is None for h in v):
            raise ValueError("each entry is the hex SHA-256 of a scrape token (tiergate keys add NAME --metrics)")
        return v


class AuthConfig(Strict):
    """Gateway keys (``gateway.tenancy.keys``): with this section every ``/v1`` request must carry one (``Authorization:
    Bearer`` or ``api-key``). keys: the keys; keys_file: a YAML file with more (a list of the same entries, e.g. a
    mounted Secret), read with the config (and again on ``SIGHUP``); metrics: who may read ``/metrics``
    (:class:`MetricsAccess`; by default a scrape token)."""

    keys: list[KeyConfig] = []
    keys_file: Path | None = None
    metrics: MetricsAccess = MetricsAccess()

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        for what in ("name", "sha256"):
            seen = [getattr(k, what) for k in self.keys]
            if len(set(seen)) < len(seen):
                raise ValueError(f"each key needs its own {what}")
        return self
