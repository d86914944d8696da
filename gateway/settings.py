"""Process settings from the environment (12-factor): the only module that reads ``os.environ``.

Variables (prefix ``GATEWAY_``):

=====================  ========================  ==============================================
variable               default                   meaning
=====================  ========================  ==============================================
GATEWAY_CONFIG         config/gateway.yaml       path of the YAML file with upstreams and routes
GATEWAY_HOST           127.0.0.1                 address to listen on
GATEWAY_PORT           8080                      TCP port to listen on
GATEWAY_LOG_LEVEL      info                      uvicorn/gateway log level
GATEWAY_WORKERS        1                         worker processes (``tiergate serve --workers``)
=====================  ========================  ==============================================

Upstream API keys are not settings: the YAML names the variable that holds each key
(``api_key_env``) and :func:`environ` hands the environment to the config loader once, at start-up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Process settings; CLI flags override them, the environment provides them."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    config: Path = Path("config/gateway.yaml")
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    workers: int = 1


def environ() -> dict[str, str]:
    """A snapshot of the process environment, taken once so API keys can be resolved at start-up."""
    return dict(os.environ)
