"""The YAML config: upstreams per tier, model maps, aliases and routing defaults, validated at start-up.

Shape (see ``config/gateway.yaml`` for a commented example)::

    default_tier: standard            # fast | standard
    upstreams:
      - name: cerebras                # unique, used in headers and metric labels
        tier: fast
        base_url: https://api.cerebras.ai/v1
        api_key_env: CEREBRAS_API_KEY # name of the env var holding the key; null = no key
        dialect: cerebras             # openai | cerebras: which request fields it accepts
        timeouts: {connect: 5, idle: 60, total: 600}   # seconds
        models: {gpt-oss-120b: gpt-oss-120b}           # client-facing name -> upstream model id
    aliases:
      gpt-5.6-sol-fast: {model: gpt-5.6, tier: fast}   # a name that pins a tier
    workloads: {interactive: fast, agent: fast, batch: standard, eval: standard, background: standard}

A bad file raises :class:`gateway.errors.ConfigError` whose message names the file, the field path
and the problem; the process stops before it serves anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from gateway.errors import ConfigError

Tier = Literal["fast", "standard"]
TIERS: tuple[Tier, Tier] = ("fast", "standard")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    """Per-upstream timeouts in seconds.

    connect: TCP connect (and TLS) to the upstream.
    idle: longest silence between two reads of a response, including the wait for the status line and
        the first event; a stream that stalls longer ends with an in-band error.
    total: whole non-streaming request; streams have no total timeout.
    """

    connect: float = Field(5.0, gt=0)
    idle: float = Field(120.0, gt=0)
    total: float = Field(600.0, gt=0)


class UpstreamConfig(_Strict):
    """One upstream endpoint of a tier."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    tier: Tier
    base_url: str
    api_key_env: str | None = None
    dialect: Literal["openai", "cerebras"] = "openai"
    timeouts: Timeouts = Timeouts()
    models: dict[str, str] = Field(min_length=1)
    max_connections: int = Field(256, ge=1)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")


class AliasConfig(_Strict):
    """A client-facing model name that stands for a configured model, optionally pinned to a tier."""

    model: str
    tier: Tier | None = None


class Limits(_Strict):
    """Size limits in bytes."""

    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_event_bytes: int = Field(8 * 1024 * 1024, ge=1024)


class GatewayConfig(_Strict):
    """The whole validated config file."""

    default_tier: Tier = "standard"
    fallback: bool = True
    max_attempts: int = Field(2, ge=1, le=10)
    upstreams: list[UpstreamConfig] = Field(min_length=1)
    aliases: dict[str, AliasConfig] = {}
    workloads: dict[str, Tier] = {
        "interactive": "fast",
        "agent": "fast",
        "batch": "standard",
        "eval": "standard",
        "background": "standard",
    }
    limits: Limits = Limits()

    @model_validator(mode="after")
    def _cross_check(self) -> GatewayConfig:
        names = [u.name for u in self.upstreams]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"upstream names must be unique; repeated: {', '.join(dupes)}")
        served = {m for u in self.upstreams for m in u.models}
        for alias, target in self.aliases.items():
            if alias in served:
                raise ValueError(f"aliases.{alias}: the alias shadows a model an upstream serves")
            if target.model not in served:
                raise ValueError(f"aliases.{alias}.model: no upstream serves {target.model!r}")
            if target.tier and not any(target.model in u.models for u in self.upstreams if u.tier == target.tier):
                raise ValueError(f"aliases.{alias}: no {target.tier} upstream serves {target.model!r}")
        return self

    def model_names(self) -> list[str]:
        """Every client-facing model name: served models then aliases, sorted."""
        return sorted({m for u in self.upstreams for m in u.models} | set(self.aliases))


class LoadedConfig:
    """A validated config plus the upstream keys resolved from the environment.

    Attributes:
        path: the file it came from.
        config: the validated :class:`GatewayConfig`.
        keys: upstream name -> API key (absent when ``api_key_env`` is null).
    """

    def __init__(self, path: Path, config: GatewayConfig, keys: dict[str, SecretStr]) -> None:
        self.path = path
        self.config = config
        self.keys = keys


def load_config(path: Path, environ: Mapping[str, str] | None = None, *, require_keys: bool = True) -> LoadedConfig:
    """Read, validate and resolve a config file.

    Args:
        path: YAML file.
        environ: where ``api_key_env`` variables are looked up (``gateway.settings.environ()``).
        require_keys: when true, a named key variable that is unset or empty is an error.

    Raises:
        ConfigError: the file is missing, is not YAML, fails validation, or a key is missing; the message
            names the file, the field and the problem.
    """
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    try:
        config = GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid config:\n{_describe(exc)}") from exc
    keys: dict[str, SecretStr] = {}
    env = environ or {}
    for upstream in config.upstreams:
        if upstream.api_key_env is None:
            continue
        value = env.get(upstream.api_key_env, "")
        if value:
            keys[upstream.name] = SecretStr(value)
        elif require_keys:
            raise ConfigError(
                f"{path}: upstreams[{upstream.name}].api_key_env: environment variable "
                f"{upstream.api_key_env} is not set (it holds the API key of upstream {upstream.name!r})"
            )
    return LoadedConfig(path, config, keys)


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)
