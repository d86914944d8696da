"""Three gateway processes share one real ``redis-server`` (``state.redis_url``; ``gateway.state.redis``) in front of
one fast upstream whose rate-limit headers count one per-minute token budget for all of them (the emulator's
``--tokens-per-minute``, as OpenAI and Cerebras count per organisation), and a standard upstream beside it.

``max_attempts: 1``: a request the fast upstream refuses is answered with its 429, so a client sees every 429 the
gateways failed to spill over before. With Redis, none; the same run without Redis lets some through. Also: one
replica's 429 puts the others in cooldown, and Redis killed mid-run fails no request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Proc, RedisServer, default_config, emulator, needs_redis, sample, start_gateway

pytestmark = needs_redis
BUDGET = 20_000  # tokens per minute; each request reserves ~1,030 (max_tokens 1,000 plus its prompt)
BODY = {"model": "gpt-5.6-sol-fast", "max_tokens": 1000,
        "messages": [{"role": "user", "content": "[[emulate tokens=4]] hello"}]}


@dataclass
class World:
    redis: RedisServer
    fast: Proc
    standard: Proc
    gateways: list[Proc]
    tmp: Path

    def budget(self, tokens: int) -> None:
        """A new window of ``tokens`` per minute at the fast upstream."""
        r = httpx.post(f"http://127.0.0.1:{self.fast.port}/emulator/config", json={"tokens_per_minute": tokens})
        assert r.status_code == 200


def _config(world_fast: Proc, world_standard: Proc, redis_url: str | None) -> dict[str, Any]:
    cfg = default_config(f"http://127.0.0.1:{world_fast.port}/v1", f"http://127.0.0.1:{world_standard.port}/v1",
                         max_attempts=1)
    if redis_url is not None:
        cfg["state"] = {"redis_url": redis_url, "timeout": 0.25, "retry": 0.2}
    return cfg


def _gateways(fast: Proc, standard: Proc, tmp: Path, redis_url: str | None) -> list[Proc]:
    return [start_gateway(_config(fast, standard, redis_url), tmp)[0] for _ in range(3)]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("replicas")
    redis = RedisServer(tmp)
    fast = emulator("fast", tmp, extra=("--tokens-per-minute", str(10**6)))
    standard = emulator("standard", tmp, ttft=0.1)
    gateways = _gateways(fast, standard, tmp, redis.url)
    w = World(redis, fast, standard, gateways, tmp)
    yield w
    for p in [*gateways, fast, standard]:
        p.stop()
    redis.kill()


def _shared_up(gw: Proc) -> float:
    return sample(httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text, "tiergate_shared_state_up", missing_ok=False)


def _wait_shared(gateways: list[Proc], up: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_shared_up(g) != up for g in gateways):
        assert time.monotonic() < deadline, f"the gateways' shared state never became {up}"
        time.sleep(0.05)


async def _load(gateways: list[Proc], n: int, concurrency: int = 6,
                halfway: Any = None) -> list[tuple[int, str | None, str | None]]:
    """``n`` requests, ``concurrency`` at a time, round-robin over ``gateways``: (status, tier, fallback) each;
    ``halfway()`` is called once a third of them have been answered."""
    ports = itertools.cycle([g.port for g in gateways])
    out: list[tuple[int, str | None, str | None]] = []
    todo = iter(range(n))

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in todo:
            r = await client.post(f"http://127.0.0.1:{next(ports)}/v1/chat/completions", json=BODY)
            out.append((r.status_code, r.headers.get("x-tiergate-tier"), r.headers.get("x-tiergate-fallback")))
            if halfway is not None and len(out) == n // 3:
                halfway()

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), 120)
    return out


def test_one_replicas_429_puts_the_others_in_cooldown(world: World) -> None:
    _wait_shared(world.gateways, 1)
    g1, g2, g3 = world.gateways
    refused = {**BODY, "messages": [{"role": "user", "content": "[[emulate status=429 retry_after_ms=1500]]"}]}
    r = httpx.post(f"http://127.0.0.1:{g1.port}/v1/chat/completions", json=refused, timeout=10)
    assert r.status_code == 429  # max_attempts 1: the fast upstream's own 429
    for gw in (g2, g3):
        deadline = time.monotonic() + 1.0
        while True:
            got = httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=BODY, timeout=10)
            if got.headers.get("x-tiergate-fallback") == "spillover_cooldown" or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert got.status_code == 200
        assert (got.headers["x-tiergate-tier"], got.headers.get("x-tiergate-fallback")) == \
            ("standard", "spillover_cooldown")
    time.sleep(1.6)  # the cooldown ends everywhere


def test_redis_killed_mid_run_fails_no_request(world: World) -> None:
    _wait_shared(world.gateways, 1)
    results = asyncio.run(_load(world.gateways, 45, halfway=world.redis.kill))
    assert [s for s, _, _ in results] == [200] * 45
    assert sum(t == "fast" for _, t, _ in results) >= 30  # the budget is large: the fast tier served on
    _wait_shared(world.gateways, 0)
    for gw in world.gateways:
        assert gw.log.read_text().count("shared_state_unavailable") == 1  # logged once per replica
    world.redis.start()
    _wait_shared(world.gateways, 1)  # back without a restart of any gateway


def test_with_redis_no_client_sees_a_429_while_the_budget_allows_spillover(world: World) -> None:
    _wait_shared(world.gateways, 1)
    world.budget(BUDGET)
    results = asyncio.run(_load(world.gateways, 60))
    statuses = [s for s, _, _ in results]
    assert statuses.count(429) == 0, results
    fast = sum(t == "fast" for _, t, _ in results)
    assert 12 <= fast <= BUDGET // 1000  # the budget was used, not overshot
    spilled = [f for _, t, f in results if t == "standard"]
    assert len(spilled) == 60 - fast and set(spilled) == {"spillover_quota_tokens"}


def test_without_redis_the_same_run_lets_429s_through(world: World) -> None:
    alone = _gateways(world.fast, world.standard, world.tmp, None)
    try:
        world.budget(BUDGET)
        results = asyncio.run(_load(alone, 60))
    finally:
        for gw in alone:
            gw.stop()
    assert [s for s, _, _ in results].count(429) >= 1  # each replica's own estimate misses the others' requests
