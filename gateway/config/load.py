"""Reading the config file: YAML in, a validated :class:`gateway.config.schema.GatewayConfig` and the upstream keys from
the environment out (:func:`load_config`), or a :class:`gateway.errors.ConfigError` naming the file, the field and the
problem."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import SecretStr, ValidationError

from gateway.config.schema import GatewayConfig, is_redis_url
from gateway.errors import ConfigError

REDIS_URL_VAR = "GATEWAY_REDIS_URL"


class LoadedConfig:
    """A validated config plus the upstream keys resolved from the environment.

    Attributes:
        path: the file it came from.
        config: the validated :class:`GatewayConfig`.
        keys: upstream name -> API key (absent when ``api_key_env`` is null).
        redis_url: where the shared state is (``GATEWAY_REDIS_URL``, else ``state.redis_url``), or None (each process
            keeps its own).
    """

    def __init__(self, path: Path, config: GatewayConfig, keys: dict[str, SecretStr],
                 redis_url: SecretStr | None = None) -> None:
        self.path = path
        self.config = config
        self.keys = keys
        self.redis_url = redis_url


def load_config(path: Path, environ: Mapping[str, str] | None = None, *, require_keys: bool = True) -> LoadedConfig:
    """Read, validate and resolve a config file.

    Args:
        path: YAML file.
        environ: where ``api_key_env`` variables are looked up (``gateway.config.settings.environ()``).
        require_keys: when true, a named key variable that is unset or empty is an error.

    Raises:
        ConfigError: the file is missing, is not YAML, fails validation, or a key is missing; the message
            names the file, the field and the problem.
    """
    raw = _read_yaml(path, path, "")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    _read_keys_file(path, raw)
    try:
        config = GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid config:\n{_describe(exc)}") from exc
    keys: dict[str, SecretStr] = {}
    env = environ or {}
    missing = []
    for upstream in config.upstreams:
        if upstream.api_key_env is None:
            continue
        value = env.get(upstream.api_key_env, "")
        if value:
            keys[upstream.name] = SecretStr(value)
        else:
            missing.append(f"  upstreams[{upstream.name}].api_key_env: environment variable {upstream.api_key_env} "
                           f"is not set (it holds the API key of upstream {upstream.name!r})")
    if missing and require_keys:
        raise ConfigError(f"{path}: missing API keys:\n" + "\n".join(missing))
    url = env.get(REDIS_URL_VAR) or config.state.redis_url  # the environment wins (12-factor), as for keys
    if url and not is_redis_url(url):
        raise ConfigError(f"{path}: {REDIS_URL_VAR}: expected a redis://, rediss:// or unix:// URL (it says where "
                          "the replicas share state)")
    return LoadedConfig(path, config, keys, SecretStr(url) if url else None)


def _read_yaml(path: Path, where: Path, field: str) -> object:
    """The YAML document in ``where`` (the config file ``path`` itself, or a file its ``field`` names).

    Raises:
        ConfigError: it cannot be read or is not YAML; the message names the config file and the field.
    """
    what = "config file" if where == path else str(where)
    try:
        return yaml.safe_load(where.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: {field}cannot read {what}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {field}{'' if where == path else f'{where} is '}not valid YAML: {exc}") from exc


def _read_keys_file(path: Path, raw: dict[str, object]) -> None:
    """Add the entries of ``auth.keys_file`` (relative to the config file's folder) to ``auth.keys`` in ``raw``, so that
    they are validated with the rest (their field paths then count on from the file's own keys)."""
    auth = raw.get("auth")
    if not isinstance(auth, dict) or not auth.get("keys_file"):
        return
    where = path.parent / str(auth["keys_file"])
    extra = _read_yaml(path, where, "auth.keys_file: ")
    if not isinstance(extra, list):
        raise ConfigError(f"{path}: auth.keys_file: {where} must hold a list of keys")
    auth["keys"] = [*(auth.get("keys") or []), *extra]


def _describe(exc: ValidationError) -> str:
    """One line per error: the field path (``rules.2.route.tier``; a rule also by its number from 1, as
    ``tiergate check-config`` lists them) and the problem."""
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        where = ".".join(str(p) for p in loc) or "(top level)"
        if len(loc) > 1 and loc[0] == "rules" and isinstance(loc[1], int):
            where = f"rule {loc[1] + 1} ({where})"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)
