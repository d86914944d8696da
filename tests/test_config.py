"""Config validation at start-up: a bad file stops the process with a message naming file, field and problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.load import load_config
from gateway.errors import ConfigError
from gateway.routing.rules import default_rules

from conftest import ROOT

GOOD: dict[str, Any] = {
    "upstreams": [
        {"name": "f", "tier": "fast", "base_url": "http://127.0.0.1:1/v1", "api_key_env": "F_KEY",
         "models": {"m": "m-fast"}},
        {"name": "s", "tier": "standard", "base_url": "http://127.0.0.1:2/v1", "models": {"m": "m-std"}},
    ],
}


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "gw.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _with(**changes: Any) -> dict[str, Any]:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ("upstreams: [", "not valid YAML"),
        ("- a\n- b\n", "top level must be a mapping"),
        (_with(default_tier="turbo"), "default_tier"),
        (_with(upstreams=[]), "upstreams"),
        (_with(upstreams=[{**GOOD["upstreams"][0], "tier": "medium"}]), "upstreams.0.tier"),
        (_with(upstreams=[{**GOOD["upstreams"][0], "base_url": "ftp://x"}]), "upstreams.0.base_url"),
        (_with(upstreams=[{**GOOD["upstreams"][0], "models": {}}]), "upstreams.0.models"),
        (_with(upstreams=[{**GOOD["upstreams"][0], "timeouts": {"idle": -1}}]), "upstreams.0.timeouts.idle"),
        (_with(upstreams=[{**GOOD["upstreams"][0], "colour": "red"}]), "upstreams.0.colour"),
        (_with(upstreams=[GOOD["upstreams"][0], GOOD["upstreams"][0]]), "repeated: f"),
        (_with(aliases={"x": {"model": "nope"}}), "aliases.x.model"),
        (_with(aliases={"m": {"model": "m"}}), "shadows"),
        (_with(upstreams=[GOOD["upstreams"][1]], aliases={"x": {"model": "m", "tier": "fast"}}),
         "no fast upstream serves"),
        (_with(workloads={"batch": "slow"}), "workloads.batch"),
        (_with(max_attempts=0), "max_attempts"),
        (_with(state={"redis_url": "http://redis:6379"}), "state.redis_url"),
        (_with(state={"redis_url": "redis://r:6379", "timeout": 0}), "state.timeout"),
        (_with(state={"key_prefix": "a b"}), "state.key_prefix"),
        (_with(state={"redis_url_env": "X"}), "state.redis_url_env"),
    ],
)
def test_bad_config_names_file_field_and_problem(tmp_path: Path, data: Any, needle: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path, {"F_KEY": "k"})
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_missing_key_is_a_startup_error_naming_the_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match=r"F_KEY is not set.*upstream 'f'"):
        load_config(path, {})
    loaded = load_config(path, {"F_KEY": "sk-secret"})
    assert loaded.keys["f"].get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(loaded.keys)


def test_the_redis_url_comes_from_the_environment_first_then_the_file(tmp_path: Path) -> None:
    plain = load_config(_write(tmp_path, GOOD), {"F_KEY": "k"})
    assert plain.redis_url is None  # off: each process keeps its own state
    path = _write(tmp_path, _with(state={"redis_url": "redis://from-file:6379/0"}))
    assert load_config(path, {"F_KEY": "k"}).redis_url.get_secret_value() == "redis://from-file:6379/0"
    env = {"F_KEY": "k", "GATEWAY_REDIS_URL": "rediss://:secret@from-env:6380/1"}
    loaded = load_config(path, env)
    assert loaded.redis_url.get_secret_value() == "rediss://:secret@from-env:6380/1"
    assert "secret" not in repr(loaded.redis_url)  # a SecretStr: never printed
    with pytest.raises(ConfigError, match="GATEWAY_REDIS_URL"):
        load_config(path, {"F_KEY": "k", "GATEWAY_REDIS_URL": "redis-host:6379"})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml", {})


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_serve_with_bad_config_exits_2_before_serving(tmp_path: Path) -> None:
    path = _write(tmp_path, _with(default_tier="turbo"))
    proc = _cli("serve", "--config", str(path), "--port", "1")
    assert proc.returncode == 2
    assert str(path) in proc.stderr and "default_tier" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gateway_config_env_variable_is_used(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    proc = _cli("serve", "--port", "1", env={"GATEWAY_CONFIG": str(path)})
    assert proc.returncode == 2 and "F_KEY is not set" in proc.stderr


def test_check_config_prints_the_resolved_routes() -> None:
    proc = _cli("check-config", "config/demo.yaml")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "config/demo.yaml: valid" in out
    assert "model_alias    model in [gpt-5.6-sol-fast] -> fast" in out
    assert "fast/emulated-fast: gpt-5.6-wse" in out
    assert "standard/emulated-standard: gpt-5.6-2026-10-01" in out


def test_check_config_lists_a_keys_session_and_its_budgets(tmp_path: Path) -> None:
    """A key made for one agent run (``auth.keys[].session``) is listed with its session id and budgets, not as a key
    with "no limits"."""
    keys = [{"name": "agent", "sha256": "0" * 64,
             "session": {"id": "run-7", "budgets": {"max_steps": 20, "max_usd": 1.5, "on_usd": "standard"}}},
            {"name": "plain", "sha256": "1" * 64, "limits": {"requests_per_minute": 60}}]
    proc = _cli("check-config", str(_write(tmp_path, _with(auth={"keys": keys}))))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert ("  agent: tiers fast/standard; no limits; session id run-7; session budgets: max_steps 20, max_usd 1.5, "
            "on_usd standard") in lines
    assert "  plain: tiers fast/standard; requests_per_minute 60" in lines


def test_shipped_production_config_is_valid_and_names_its_key_variables() -> None:
    proc = _cli("check-config", "config/gateway.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "CEREBRAS_API_KEY" in proc.stdout and "OPENAI_API_KEY" in proc.stdout
    loaded = load_config(ROOT / "config" / "gateway.yaml", {"CEREBRAS_API_KEY": "a", "OPENAI_API_KEY": "b"})
    assert {u.tier for u in loaded.config.upstreams} == {"fast", "standard"}
    # both kinds of fast upstream: a model string on OpenAI's API (Responses native), a chat-only API (bridged)
    assert {u.responses_mode for u in loaded.config.upstreams if u.tier == "fast"} == {"native", "bridge"}
    # and gpt-5.6's fast tier both ways: OpenAI's fast model string, and OpenAI's ultrafast service tier of gpt-5.6
    fast = {u.name: u for u in loaded.config.upstreams if u.tier == "fast" and "gpt-5.6" in u.models}
    assert fast["openai-fast"].models["gpt-5.6"] == "gpt-5.6-sol-fast" and fast["openai-fast"].service_tier is None
    assert fast["openai-ultrafast"].models["gpt-5.6"] == "gpt-5.6" and fast["openai-ultrafast"].service_tier == \
        "ultrafast"
    assert fast["openai-ultrafast"].prices is not None and "ultrafast" in fast["openai-ultrafast"].prices.service_tiers
    # the rest of the API: to OpenAI's standard tier; the fast upstreams serve chat (and Responses) only
    assert loaded.config.passthrough_upstream is not None and loaded.config.passthrough_upstream.name == "openai"
    assert [u.name for u in loaded.config.upstreams if u.serves("embeddings")] == ["openai"]
    assert "passthrough: openai" in proc.stdout


def test_shipped_rules_are_the_default_policy_written_out() -> None:
    loaded = load_config(ROOT / "config" / "gateway.yaml", {"CEREBRAS_API_KEY": "a", "OPENAI_API_KEY": "b"})
    assert loaded.config.rules is not None
    without = loaded.config.model_copy(update={"rules": None})
    assert [r.model_dump() for r in loaded.config.rules] == [r.model_dump() for r in default_rules(without)]


def test_check_config_warnings_on_the_shipped_configs() -> None:
    """The production config serves every model on both tiers but the one with no fast variant; the demo's one model
    is on both tiers: nothing to warn about."""
    out = _cli("check-config", "config/gateway.yaml").stdout
    warnings = out.split("\nwarnings:\n", 1)[1].split("\n\n", 1)[0].strip().splitlines()
    assert len(warnings) == 1 and warnings[0].strip().startswith("model gpt-5.6-mini: served on the standard tier only")
    loaded = load_config(ROOT / "config" / "gateway.yaml", {"CEREBRAS_API_KEY": "a", "OPENAI_API_KEY": "b"})
    both = {m for m in loaded.config.model_names()
            if len({u.tier for u in loaded.config.upstreams if m in u.models}) == 2}
    assert {"gpt-5.6", "gpt-oss-120b"} <= both  # a model string on OpenAI's API, an open-weight model on Cerebras+vLLM
    fast = next(u for u in loaded.config.upstreams if u.name == "openai-fast")
    assert fast.models["gpt-5.6"] == "gpt-5.6-sol-fast" and fast.context_window and fast.prices
    assert "warnings:" not in _cli("check-config", "config/demo.yaml").stdout


def test_check_config_warns_about_rules_that_can_never_do_what_they_say(tmp_path: Path) -> None:
    cfg = _with(upstreams=[*GOOD["upstreams"], {"name": "f2", "tier": "fast", "base_url": "http://127.0.0.1:3/v1",
                                                "models": {"only-fast": "x"}}],
                rules=[{"name": "never", "match": {"n": {"gt": 5, "lt": 2}}, "route": {"tier": "standard"}},
                       {"name": "edge", "match": {"max_tokens": {"gt": 10, "lte": 10}}, "route": {"tier": "fast"}},
                       {"name": "typo", "match": {"model": ["gpt-5.6-sol-fsat"]}, "route": {"tier": "fast"}},
                       {"name": "nowhere", "match": {"model": ["only-*"]}, "route": {"tier": "standard"}},
                       {"name": "fine", "match": {"n": {"gte": 2, "lte": 2}},
                        "route": {"tier": "fast", "deadline_ms": 8000, "hedge": 0.5}}])
    proc = _cli("check-config", str(_write(tmp_path, cfg)))
    assert proc.returncode == 0, proc.stderr  # warnings, not errors: the config is valid
    out = proc.stdout
    assert "rule 1 'never': never matches: no n is > 5 and < 2" in out
    assert "rule 2 'edge': never matches: no max_tokens is > 10 and <= 10" in out
    assert "rule 3 'typo': never matches: no model the gateway serves matches ['gpt-5.6-sol-fsat']" in out
    assert ("rule 4 'nowhere': routes to the standard tier, but no standard upstream serves only-fast: those requests "
            "always fall back (model_not_on_standard_tier)") in out
    assert "model only-fast: served on the fast tier only" in out
    assert "'fine'" not in out.split("warnings:", 1)[1]
    assert "fine           n >= 2 and <= 2 -> fast, deadline 8000 ms, hedge after 0.5 s" in out  # the rule table
    off = _cli("check-config", str(_write(tmp_path, {**cfg, "fallback": False}))).stdout
    assert "served on the fast tier only" not in off  # no fallback: nothing was promised


def test_an_alias_pin_that_a_rules_table_drops_is_warned_about(tmp_path: Path) -> None:
    """rules: replaces the default policy, whose model_alias rule is what pins an alias to its tier: a table without a
    rule for the alias silently routed it elsewhere; check-config says so (and the gateway logs it at start)."""
    cfg = _with(aliases={"m-fast": {"model": "m", "tier": "fast"}},
                rules=[{"name": "agent", "match": {"metadata": {"workload": ["agent"]}}, "route": {"tier": "fast"}}])
    out = _cli("check-config", str(_write(tmp_path, cfg))).stdout
    assert "aliases.m-fast: pinned to the fast tier, but no rule of rules: matches it" in out
    kept = {**cfg, "rules": [*cfg["rules"], {"name": "model_alias", "match": {"model": ["m-fast"]},
                                             "route": {"tier": "fast"}}]}
    assert "aliases.m-fast" not in _cli("check-config", str(_write(tmp_path, kept))).stdout


def test_a_base_url_with_a_bad_port_is_refused_at_start_up(tmp_path: Path) -> None:
    cfg = _with(upstreams=[{**GOOD["upstreams"][0], "base_url": "http://127.0.0.1:99999/v1"}, GOOD["upstreams"][1]])
    proc = _cli("check-config", str(_write(tmp_path, cfg)))
    assert proc.returncode == 2 and "base_url" in proc.stderr and "bad port" in proc.stderr
