"""Gateway keys (``auth:``; ``gateway.tenancy.keys``): 401s the SDK raises as ``AuthenticationError``, tiers per key,
limits and budgets under concurrency, the fast-tier allowance spilling to the standard tier, two replicas sharing one
key's limits through a real Redis, and the key never reaching an upstream or a log.

The unit tests drive :class:`MemoryLedger` with a fake wall clock; the rest run real gateway processes in front of
in-process emulators (``EmulatorThread``), which record every header they receive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.config.auth import AuthConfig, KeyConfig
from gateway.config.load import load_config
from gateway.config.schema import GatewayConfig
from gateway.errors import ConfigError, KeyOverBudget, RateLimited, Unauthorized
from gateway.tenancy.keys import Keys, digest, new_key
from gateway.tenancy.ledger import MemoryLedger, Refusal, Spend, windows
from gateway.tools.emulator import EmulatorConfig, EmulatorThread

from conftest import SCRAPE, Proc, RedisServer, needs_redis, sample, scraped, start_gateway

# --- pure: authentication and the ledger ----------------------------------------------------------------------------

SECRET = new_key()


def _key(name: str = "k", **kw: Any) -> KeyConfig:
    return KeyConfig.model_validate({"name": name, "sha256": digest(SECRET if name == "k" else name), **kw})


def test_a_key_is_read_from_bearer_or_api_key_and_compared_by_its_hash() -> None:
    keys = Keys(AuthConfig(keys=[_key()]))
    assert keys.authenticate([(b"authorization", f"Bearer {SECRET}".encode())]).name == "k"
    assert keys.authenticate([(b"api-key", SECRET.encode())]).name == "k"  # Azure-style clients
    for headers, reason in (([], "missing"), ([(b"authorization", b"Basic abc")], "malformed"),
                            ([(b"authorization", b"Bearer ")], "malformed"),
                            ([(b"authorization", b"Bearer tg-not-the-key-at-all")], "unknown")):
        with pytest.raises(Unauthorized) as info:
            keys.authenticate(headers)
        assert info.value.reason == reason and info.value.status == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(Unauthorized) as info:
        keys.authenticate([(b"authorization", f"Bearer {SECRET}x".encode())])
    assert SECRET not in info.value.message and SECRET[:6] in info.value.message  # masked, as OpenAI masks


def test_keys_are_validated_and_a_keys_file_adds_to_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="own name"):
        AuthConfig(keys=[_key("a"), _key("a")])
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump([{"name": "from-file", "sha256": digest("x")}]))
    cfg = {"upstreams": [{"name": "u", "tier": "fast", "base_url": "http://127.0.0.1:1/v1", "models": {"m": "m"}}],
           "auth": {"keys": [{"name": "inline", "sha256": digest("y")}], "keys_file": "keys.yaml"}}
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump(cfg))
    auth = load_config(tmp_path / "gw.yaml").config.auth
    assert auth is not None and [k.name for k in auth.keys] == ["inline", "from-file"]
    cfg["upstreams"][0]["pass_client_key"] = True  # the gateway key would reach the upstream: refused
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="pass_client_key"):
        load_config(tmp_path / "gw.yaml")


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def test_concurrent_reservations_never_overshoot_a_limit_and_a_new_minute_starts_afresh() -> None:
    wall = Clock(1_800_000_010.0)  # 10 s into a minute
    ledger = MemoryLedger(wall)
    key = Keys(AuthConfig(keys=[_key(limits={"requests_per_minute": 5, "tokens_per_minute": 10_000})])).by_hash[
        digest(SECRET)]
    held = await asyncio.gather(*(ledger.reserve(key, Spend(1, 100), False) for _ in range(12)))
    refused = [h for h in held if isinstance(h, Refusal)]
    assert len(refused) == 7 and {r.limit for r in refused} == {"requests_per_minute"}
    err = refused[0].error(key)
    assert isinstance(err, RateLimited) and err.headers["retry-after"] == "50"
    wall.t += 50  # the next minute
    assert not isinstance(await ledger.reserve(key, Spend(1, 100), False), Refusal)
    # a settlement replaces the estimate by the usage: tokens per minute count what was used
    hold = await ledger.reserve(key, Spend(1, 9_000), False)
    assert not isinstance(hold, Refusal)
    assert isinstance(await ledger.reserve(key, Spend(1, 1_000), False), Refusal)  # 100 + 9,000 + 1,000 > 10,000
    hold.settle(300, 0.0, "fast")
    assert not isinstance(await ledger.reserve(key, Spend(1, 1_000), False), Refusal)
    minute = windows(wall.t)["minute"][0]
    assert ledger.used("k", "all", "tokens", "minute", minute) == 100 + 300 + 1_000


async def test_a_budget_refuses_with_insufficient_quota_and_the_fast_allowance_is_given_back_elsewhere() -> None:
    ledger = MemoryLedger(Clock(1_800_000_000.0))
    key = Keys(AuthConfig(keys=[_key(limits={"usd_per_day": 1.0}, fast={"tokens_per_minute": 1500})])).by_hash[
        digest(SECRET)]
    fast = await ledger.reserve(key, Spend(1, 1000, 0.6), True)
    assert not isinstance(fast, Refusal)
    over = await ledger.reserve(key, Spend(1, 1000, 0.1), True)
    assert isinstance(over, Refusal) and (over.level, over.limit) == ("fast", "tokens_per_minute")
    broke = await ledger.reserve(key, Spend(1, 10, 0.5), False)
    assert isinstance(broke, Refusal) and broke.limit == "usd_per_day"
    assert isinstance(broke.error(key), KeyOverBudget) and broke.error(key).headers["x-should-retry"] == "false"
    fast.settle(900, 0.2, "standard")  # served by the standard tier after all: the fast allowance is given back
    assert not isinstance(await ledger.reserve(key, Spend(1, 1400, 0.1), True), Refusal)


# --- real gateway processes ------------------------------------------------------------------------------------------

KEYS = {name: new_key() for name in ("product", "batch", "rpm", "budget", "allowance", "shared", "shared-budget",
                                     "allowance-failover", "fast-only")}
PRICE = {"input": 1000.0, "output": 1000.0}  # USD per million tokens: a request costs cents, so budgets bite fast


def _config(fast: EmulatorThread, standard: EmulatorThread, **extra: Any) -> dict[str, Any]:
    def key(name: str, **kw: Any) -> dict[str, Any]:
        return {"name": name, "sha256": digest(KEYS[name]), **kw}
    return {
        "default_tier": "standard",
        "max_attempts": 1,
        "upstreams": [
            {"name": "emu-fast", "tier": "fast", "base_url": fast.base_url, "dialect": "cerebras",
             "models": {"gpt-5.6": "gpt-5.6-wse", "gpt-5.5": "gpt-5.5-wse"}, "prices": PRICE},
            {"name": "emu-standard", "tier": "standard", "base_url": standard.base_url, "dialect": "openai",
             "models": {"gpt-5.6": "gpt-5.6-2026-10-01", "gpt-5.4-mini": "gpt-5.4-mini", "gpt-5.5": "gpt-5.5"},
             "prices": PRICE},
        ],
        "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"}},
        "auth": {"metrics": SCRAPE, "keys": [
            key("product"),
            key("batch", tiers=["standard"], metadata={"workload": "batch"}),
            key("rpm", limits={"requests_per_minute": 5}),
            key("budget", limits={"usd_per_day": 0.25}),
            key("allowance", fast={"tokens_per_minute": 2500}),
            key("shared", limits={"requests_per_minute": 6}),
            key("shared-budget", limits={"usd_per_day": 0.3}),
            key("allowance-failover", fast={"requests_per_minute": 2}),
            key("fast-only", tiers=["fast"]),
        ]},
        **extra,
    }


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[EmulatorThread, EmulatorThread]]:
    quick = {"ttft": 0.01, "tps": 2000.0}
    fast = EmulatorThread(config=EmulatorConfig(dialect="cerebras", **quick))
    standard = EmulatorThread(config=EmulatorConfig(dialect="openai", **quick))
    yield fast, standard
    fast.stop()
    standard.stop()


@pytest.fixture(scope="module")
def gateway(upstreams: tuple[EmulatorThread, EmulatorThread],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc, _ = start_gateway(_config(*upstreams), tmp_path_factory.mktemp("keys"))
    yield proc
    proc.stop()


def _client(gw: Proc, name: str | None, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1",
                         api_key=KEYS[name] if name else "tg-wrong-key-0123456789", max_retries=0, **kw)


def _ask(client: openai.OpenAI, model: str = "gpt-5.6-sol-fast", max_tokens: int = 8, tokens: int = 3) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=model, max_tokens=max_tokens, messages=[{"role": "user", "content": f"[[emulate tokens={tokens}]] hi"}])


def _burst(ports: list[int], key: str, n: int, max_tokens: int = 4, content: str = "hi") -> list[httpx.Response]:
    """``n`` chat completions with gateway key ``key`` at once, round-robin over the gateways on ``ports``."""
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as c:
            return list(await asyncio.gather(*(c.post(
                f"http://127.0.0.1:{ports[i % len(ports)]}/v1/chat/completions",
                headers={"authorization": f"Bearer {KEYS[key]}"},
                json={"model": "gpt-5.6", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]})
                for i in range(n))))
    return asyncio.run(go())


def _fresh_minute() -> None:
    """Wait, if needed, until the current UTC minute has 20 s left, so that a limit test stays in one window."""
    left = 60 - time.time() % 60
    if left < 20:
        time.sleep(left + 0.1)


def test_no_key_a_wrong_key_or_a_malformed_header_is_a_401_the_sdk_raises(gateway: Proc) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        _ask(_client(gateway, None))
    assert info.value.code == "invalid_api_key" and "tg-wro***" in info.value.message
    url = f"http://127.0.0.1:{gateway.port}/v1"
    for headers in ({}, {"authorization": "Basic dXNlcjpwYXNz"}, {"authorization": f"Bearer {KEYS['product']}x"}):
        for method, path in (("POST", "/chat/completions"), ("GET", "/models"), ("POST", "/embeddings"),
                             ("POST", "/tiergate/route"), ("GET", "/files")):
            r = httpx.request(method, url + path, headers=headers, json={"model": "gpt-5.6", "messages": []})
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"http://127.0.0.1:{gateway.port}/healthz").status_code == 200  # probes need no key
    ok = httpx.post(url + "/chat/completions", headers={"api-key": KEYS["product"]},
                    json={"model": "gpt-5.6", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200  # Azure-style clients send api-key
    metrics = scraped(gateway.port)
    assert sample(metrics, "tiergate_auth_failures_total", reason="unknown", missing_ok=False) >= 6
    assert sample(metrics, "tiergate_auth_failures_total", reason="missing", missing_ok=False) >= 5


def test_a_standard_only_key_asking_for_the_fast_tier_is_served_by_the_standard_tier(gateway: Proc) -> None:
    raw = _ask(_client(gateway, "batch"))
    assert raw.http_response.status_code == 200
    assert raw.headers["x-tiergate-tier"] == "standard" and raw.headers["x-tiergate-fallback"] == "key_tier"
    route = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/tiergate/route",
                       headers={"authorization": f"Bearer {KEYS['product']}"},
                       json={"model": "gpt-5.6", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert route["tier"] == "standard"  # the product key sends no workload: the default tier
    plain = _ask(_client(gateway, "batch"), model="gpt-5.6")  # its metadata default: workload batch -> standard
    assert plain.headers["x-tiergate-rule"] == "workload" and plain.headers["x-tiergate-tier"] == "standard"
    fast = _ask(_client(gateway, "product"))
    assert fast.headers["x-tiergate-tier"] == "fast"


def test_the_route_endpoint_shows_what_the_key_allows_and_refuses_what_it_would_refuse(gateway: Proc) -> None:
    url = f"http://127.0.0.1:{gateway.port}/v1"
    body = {"model": "gpt-5.6-sol-fast", "messages": [{"role": "user", "content": "hi"}]}
    before = scraped(gateway.port)
    route = httpx.post(url + "/tiergate/route", headers={"authorization": f"Bearer {KEYS['batch']}"}, json=body).json()
    assert [c["tier"] for c in route["candidates"]] == ["standard"] and route["fallback"] == "key_tier", route
    assert route["key"] == {"name": "batch", "tiers": ["standard"]}
    assert route["tier"] == "fast"  # the rule's tier (the alias); the candidates are what the key lets serve it
    mine = httpx.post(url + "/tiergate/route", headers={"authorization": f"Bearer {KEYS['product']}"}, json=body).json()
    assert [c["tier"] for c in mine["candidates"]] == ["fast", "standard"] and mine["fallback"] is None, mine
    # a model only the standard tier serves, for a fast-only key: the request is a 403 the SDK raises, and the
    # route endpoint gives the same error
    with pytest.raises(openai.PermissionDeniedError) as info:
        _ask(_client(gateway, "fast-only"), model="gpt-5.4-mini")
    assert info.value.code == "tier_not_allowed" and "fast tier" in info.value.message
    refused = httpx.post(url + "/tiergate/route", headers={"authorization": f"Bearer {KEYS['fast-only']}"},
                         json={**body, "model": "gpt-5.4-mini"})
    assert refused.status_code == 403 and refused.json()["error"] == info.value.body
    assert info.value.body["param"] == "model" and info.value.body["type"] == "invalid_request_error"
    after = scraped(gateway.port)  # the route endpoint counted nothing
    assert sample(after, "tiergate_key_downgrades_total", key="batch", reason="key_tier") == \
        sample(before, "tiergate_key_downgrades_total", key="batch", reason="key_tier")


def test_the_route_endpoint_agrees_with_what_a_request_with_the_same_key_gets(gateway: Proc) -> None:
    # the key's default metadata (batch: workload batch) and the order serving applies deadline routing, then the
    # key's tiers: the route endpoint's rule, first candidate and fallback are the served request's headers. gpt-5.5
    # is unmeasured on the fast tier: the first deadline request probes it there (and the batch key then moves it to
    # the standard tier: key_tier); the second, its probe spent, is routed by deadline (deadline)
    url = f"http://127.0.0.1:{gateway.port}/v1"
    deadline = {"x-tiergate-tier": "fast", "x-tiergate-deadline-ms": "60000"}
    cases = [("batch", "gpt-5.6", {}), ("batch", "gpt-5.6-sol-fast", {}), ("product", "gpt-5.6", {}),
             ("batch", "gpt-5.6", deadline), ("product", "gpt-5.6", deadline),
             ("batch", "gpt-5.5", deadline), ("batch", "gpt-5.5", deadline)]
    fallbacks = []
    for name, model, extra in cases:
        headers = {"authorization": f"Bearer {KEYS[name]}", **extra}
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        route = httpx.post(url + "/tiergate/route", headers=headers, json=body).json()
        served = httpx.post(url + "/chat/completions", headers=headers, json=body)
        assert served.status_code == 200, served.text
        got = (route["rule"], route["candidates"][0]["upstream"], route["fallback"])
        assert got == (served.headers["x-tiergate-rule"], served.headers["x-tiergate-upstream"],
                       served.headers.get("x-tiergate-fallback")), (name, model, extra, route)
        fallbacks.append(route["fallback"])
    assert fallbacks[-2:] == ["key_tier", "deadline"], fallbacks
    route = httpx.post(url + "/tiergate/route", headers={"authorization": f"Bearer {KEYS['batch']}"},
                       json={"model": "gpt-5.6", "input": "hi"}).json()  # a Responses body: the same defaults
    assert route["api"] == "responses" and route["rule"] == "workload", route


def test_requests_per_minute_under_concurrency_admit_exactly_the_limit(gateway: Proc) -> None:
    _fresh_minute()
    answers = _burst([gateway.port], "rpm", 12)
    assert sorted(r.status_code for r in answers) == [200] * 5 + [429] * 7
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and 1 <= int(refused.headers["retry-after"]) <= 60
    with pytest.raises(openai.RateLimitError):
        _ask(_client(gateway, "rpm"))
    files = httpx.get(f"http://127.0.0.1:{gateway.port}/v1/files", headers={"authorization": f"Bearer {KEYS['rpm']}"})
    assert files.status_code == 429  # the rest of the API counts against the key too
    metrics = scraped(gateway.port)
    assert sample(metrics, "tiergate_key_refusals_total", key="rpm", limit="requests_per_minute") == 9
    assert sample(metrics, "tiergate_key_requests_total", key="rpm", outcome="key_limit") == 9


def test_a_budget_is_not_overshot_by_more_than_what_was_in_flight(gateway: Proc) -> None:
    answers = _burst([gateway.port], "budget", 10, max_tokens=40) + _burst([gateway.port], "budget", 10, max_tokens=40)
    codes = [r.status_code for r in answers]
    assert codes.count(200) >= 1 and codes.count(429) >= 1
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.json()["error"]["code"] == "insufficient_quota" and refused.headers["x-should-retry"] == "false"
    spent = sample(scraped(gateway.port), "tiergate_key_cost_usd_total",
                   key="budget", missing_ok=False)
    assert 0 < spent <= 0.25  # each request reserved its estimate (>= its cost) before it went: never over


def test_the_fast_tier_allowance_spills_to_the_standard_tier(gateway: Proc) -> None:
    _fresh_minute()
    client = _client(gateway, "allowance")
    # each reserves ~1,020 tokens and uses ~910; 2,500 a minute on the fast tier: two fit, the third would not
    served = [_ask(client, max_tokens=1000, tokens=900).headers for _ in range(4)]
    assert [h["x-tiergate-tier"] for h in served] == ["fast", "fast", "standard", "standard"]
    assert [h.get("x-tiergate-fallback") for h in served[2:]] == ["key_allowance"] * 2
    metrics = scraped(gateway.port)
    assert sample(metrics, "tiergate_key_downgrades_total", key="allowance", reason="key_allowance") == 2


def test_the_gateway_key_never_reaches_an_upstream_or_the_log(
        gateway: Proc, upstreams: tuple[EmulatorThread, EmulatorThread]) -> None:
    for name in ("product", "batch"):
        _ask(_client(gateway, name))
        _ask(_client(gateway, name), model="gpt-5.6")
    seen = [r for emu in upstreams for r in emu.requests]
    assert seen
    for received in seen:
        dump = repr(received.headers) + received.body.decode("utf-8", "replace")
        assert not any(k in dump for k in KEYS.values())
    log = gateway.log.read_text()
    assert not any(k in log for k in KEYS.values())
    assert '"key":"product"' in log and '"key":"batch"' in log  # the name is
    httpx.post(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", json={},
               headers={"authorization": "Bearer tg-planted-secret-0123456789", "x-request-id": "req-401"})
    deadline = time.monotonic() + 5
    while '"req-401"' not in gateway.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(x for x in gateway.log.read_text().splitlines() if '"req-401"' in x)
    assert '"status":401' in line and '"reason":"unknown"' in line and "planted-secret" not in line


@needs_redis
def test_two_replicas_share_one_keys_limit_through_redis(upstreams: tuple[EmulatorThread, EmulatorThread],
                                                         tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    cfg = _config(*upstreams, state={"redis_url": redis.url, "timeout": 0.5})
    gateways = [start_gateway(cfg, tmp_path)[0] for _ in range(2)]
    try:
        for gw in gateways:  # both connected to Redis
            deadline = time.monotonic() + 10
            while sample(scraped(gw.port), "tiergate_shared_state_up") != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        _fresh_minute()
        ports = [gw.port for gw in gateways]
        codes = [r.status_code for r in _burst(ports, "shared", 12)]
        assert codes.count(200) == 6 and codes.count(429) == 6  # 6 a minute for the key, whichever replica serves
        # ~0.04 USD reserved, ~0.03 spent each: one replica alone would pass 0.3
        spent_codes = [r.status_code for _ in range(2)
                       for r in _burst(ports, "shared-budget", 24, max_tokens=30, content="[[emulate tokens=25]] hi")]
        assert spent_codes.count(429) >= 1
        spent = sum(sample(scraped(gw.port), "tiergate_key_cost_usd_total",
                           key="shared-budget") for gw in gateways)
        assert 0.15 < spent <= 0.3  # one budget for both replicas
    finally:
        for gw in gateways:
            gw.stop()
        redis.kill()


def test_serve_on_a_public_address_without_auth_warns(tmp_path: Path) -> None:
    cfg = GatewayConfig.model_validate({"upstreams": [{"name": "u", "tier": "fast", "base_url": "http://127.0.0.1:9/v1",
                                                       "models": {"m": "m"}}]})
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True)))
    import subprocess
    import sys

    from conftest import ROOT, free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--host", "0.0.0.0",
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        out = b""
        while b"without auth" not in out and time.monotonic() < deadline:
            assert proc.stdout is not None
            out += proc.stdout.readline()
        assert b"without auth" in out
    finally:
        proc.terminate()
        proc.wait(10)


def test_failover_stays_on_the_tiers_a_key_may_use(upstreams: tuple[EmulatorThread, EmulatorThread],
                                                   tmp_path: Path) -> None:
    gw, _ = start_gateway(_config(*upstreams, max_attempts=2), tmp_path)
    try:
        failing = [{"role": "user", "content": "[[emulate status=500]] hi"}]
        for name, tier in (("product", "fast"), ("batch", "standard")):
            r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                           headers={"authorization": f"Bearer {KEYS[name]}"},
                           json={"model": "gpt-5.6", "max_tokens": 4, "messages": failing}, timeout=10)
            # product: standard's 500 fails over to the fast tier (which answers 500 too); batch: never the fast tier
            assert r.headers["x-tiergate-tier"] == tier, (name, r.headers)
        # a failover to the fast tier spends the fast allowance too (two a minute): the third stays on standard
        _fresh_minute()
        tiers = []
        for _ in range(3):
            r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                           headers={"authorization": f"Bearer {KEYS['allowance-failover']}"},
                           json={"model": "gpt-5.6", "max_tokens": 4, "messages": failing}, timeout=10)
            tiers.append((r.headers.get("x-tiergate-tier"), r.headers.get("x-tiergate-fallback")))
        assert [t for t, _ in tiers] == ["fast", "fast", "standard"], tiers  # the third: standard's own 500
        metrics = scraped(gw.port)
        assert sample(metrics, "tiergate_key_downgrades_total", key="allowance-failover", reason="key_allowance") == 1
    finally:
        gw.stop()
