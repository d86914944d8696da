"""Process settings from the environment (12-factor): the only module that reads ``os.environ``.

Variables (prefix ``GATEWAY_``):

=====================  ========================  ==============================================
variable               default                   meaning
=====================  ========================  ==============================================
GATEWAY_CONFIG         config/gateway.yaml       path of the YAML file with upstreams and routes
GATEWAY_HOST           127.0.0.1                 address to listen on
GATEWAY_PORT           8080                      TCP port to listen on
GATEWAY_LOG_LEVEL      info                      uvicorn/gateway log level (and the events' lowest,
                                                 gateway.observability.logs)
GATEWAY_LOG_FORMAT     json (serve), text (demo) the request log and events on stdout: json or text
GATEWAY_LOG_SAMPLE     1                         share (0-1) of successful requests written to the request log
GATEWAY_WORKERS        1                         worker processes (``tiergate serve --workers``)
GATEWAY_MAX_HEAD_BYTES 65536                     largest request line plus headers; larger -> 431
GATEWAY_HEAD_TIMEOUT   30                        seconds to send a request head; then the connection closes
GATEWAY_BODY_TIMEOUT   120                       seconds to send a request body; then 408
GATEWAY_KEEPALIVE_TIMEOUT 75                     seconds an idle client connection stays open
GATEWAY_DRAIN_TIMEOUT  60                        on SIGTERM, seconds in-flight requests may run on
GATEWAY_STATE_DIR      $XDG_STATE_HOME/tiergate  where the gateway keys' spend is kept across restarts
                       (~/.local/state/tiergate) (gateway.state.ledger_file); empty: nowhere (it lives as long as the
                       process)
GATEWAY_DRAIN_IDLE_GRACE 5                       on SIGTERM, seconds an idle kept-alive client connection stays
                                                 open (at most the drain timeout): a request on it is answered,
                                                 ``connection: close``, while a load balancer takes the endpoint
                                                 out of rotation
GATEWAY_REDIS_URL      (unset: state.redis_url)  Redis the replicas share state through (gateway.state.redis); read
                                                 with the API keys by the config loader, and wins over the file
OTEL_TRACES_EXPORTER   (unset: no traces)        otlp or console: OpenTelemetry traces
                                                 (gateway.observability.tracing; the otel extra); the exporter
                                                 reads the other OTEL_* variables
=====================  ========================  ==============================================

Upstream API keys are not settings: the YAML names the variable that holds each key
(``api_key_env``) and :func:`environ` hands the environment to the config loader once, at start-up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Process settings; CLI flags override them, the environment provides them."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    config: Path = Path("config/gateway.yaml")
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_format: Literal["json", "text"] | None = None  # None: json for serve, text for demo
    log_sample: float = Field(1.0, ge=0, le=1)
    workers: int = 1
    max_head_bytes: int = Field(64 * 1024, ge=1024)
    head_timeout: float = Field(30.0, gt=0)
    body_timeout: float = Field(120.0, gt=0)
    # above common client pools (httpx expires idle connections after 5 s) and load balancers (60 s), as
    # nginx's 75 s: a client that reuses a connection the server has just closed gets a connection error
    keepalive_timeout: float = Field(75.0, gt=0)
    drain_timeout: float = Field(60.0, ge=0)
    # the XDG Base Directory spec's place for state that should outlive a restart (its "state data")
    state_dir: Path | None = Field(default_factory=lambda: _xdg_state() / "tiergate")
    # a load balancer learns of the drain only from failed probes or its endpoint list (Kubernetes: seconds after
    # the pod began terminating) and sends requests on its pooled connections meanwhile; closing those at SIGTERM
    # lost each request that raced onto one. Bounded by drain_timeout (server.configure)
    drain_idle_grace: float = Field(5.0, ge=0)
    # the event loop's lag probes a second while requests are in flight (gateway.observability.looplag; 0: none). The
    # default gives 12,000 samples in a 5-minute rate window; a probe that wakes an idle loop costs ~40 us of CPU
    loop_lag_rate: float = Field(40.0, ge=0, le=2000)
    # OpenTelemetry's own variable (gateway.observability.tracing): otlp, console, or none/unset (no traces)
    otel_traces_exporter: str | None = Field(None, validation_alias="OTEL_TRACES_EXPORTER")
    # and for the GenAI metrics (gateway.observability.genai): otlp, console, or none/unset (none)
    otel_metrics_exporter: str | None = Field(None, validation_alias="OTEL_METRICS_EXPORTER")


    @field_validator("loop_lag_rate")
    @classmethod
    def _probe_rate(cls, value: float) -> float:
        if 0 < value < 0.01:
            raise ValueError("give 0 (no probe) or 0.01 to 2000 probes a second")
        return value

    @field_validator("state_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value


def _xdg_state() -> Path:
    """``$XDG_STATE_HOME``, else ``~/.local/state`` (XDG Base Directory Specification 0.8)."""
    found = os.environ.get("XDG_STATE_HOME")
    return Path(found) if found else Path.home() / ".local" / "state"


MULTIPROC_VAR = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """prometheus-client's multiprocess directory (set by ``tiergate serve --workers N``), or None."""
    return os.environ.get(MULTIPROC_VAR) or None


def set_worker_environment(config: Path, metrics_dir: Path, settings: Settings | None = None) -> None:
    """Before spawning workers: hand them the config path, the shared metrics directory and the log settings the
    command line chose (``--log-level``, the log format).

    prometheus-client reads ``PROMETHEUS_MULTIPROC_DIR`` when it is imported, so the variable must be in the
    environment the worker processes inherit (prometheus client_python docs, "Multiprocess Mode").
    """
    os.environ["GATEWAY_CONFIG"] = str(config.resolve())
    os.environ[MULTIPROC_VAR] = str(metrics_dir)
    if settings is not None:
        os.environ["GATEWAY_LOG_LEVEL"] = settings.log_level
        os.environ["GATEWAY_STATE_DIR"] = str(settings.state_dir) if settings.state_dir is not None else ""
        if settings.log_format is not None:
            os.environ["GATEWAY_LOG_FORMAT"] = settings.log_format


def environ() -> dict[str, str]:
    """A snapshot of the process environment, taken once so API keys can be resolved at start-up."""
    return dict(os.environ)
