"""The classes' shares across two replicas sharing a real ``redis-server`` (``gateway.state.classes``,
docs/routing.md#scheduling-replicas), over real sockets: alice's interactive requests go to replica A while bob's
batch flood goes to replica B, in front of one fast upstream whose per-minute token budget counts for both. Without
Redis, B never learns that alice's class is active and its flood spills her; with it, B holds her share back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from test_scheduling import BUDGET, KEYS, _config, _post

from gateway.tools.emulator import EmulatorConfig, EmulatorThread

from conftest import Proc, RedisServer, needs_redis, sample, scraped, start_gateway

pytestmark = needs_redis


class Pair:
    """Two gateways, A and B, in front of one fast emulator (budget :data:`BUDGET`) and one standard one."""

    def __init__(self, tmp: Path, redis: RedisServer | None) -> None:
        self.fast = EmulatorThread(config=EmulatorConfig(dialect="openai", ttft=0.001, tps=50_000,
                                                         tokens_per_minute=BUDGET))
        self.std = EmulatorThread(config=EmulatorConfig(dialect="openai", ttft=0.001, tps=50_000))
        self.redis = redis
        cfg: dict[str, Any] = _config(self.fast.base_url, self.std.base_url)
        if redis is not None:
            cfg["state"] = {"redis_url": redis.url, "timeout": 0.25, "retry": 0.2}
        self.a: Proc = start_gateway(cfg, tmp)[0]
        self.b: Proc = start_gateway(cfg, tmp)[0]

    def url(self, p: Proc) -> str:
        return f"http://127.0.0.1:{p.port}/v1"

    def interactive_seen_by_b(self) -> bool:
        view = httpx.get(self.url(self.b) + "/tiergate/capacity", timeout=5,
                         headers={"authorization": f"Bearer {KEYS['bob']}"}).json()
        return any(c["class"] == "interactive" and c["active"] for u in view["upstreams"] for b in u["buckets"]
                   for c in b["classes"])

    async def flood(self, seconds: float, workers: int = 6) -> list[str]:
        """Alice on A, one request every 0.15 s, bob's ``workers`` on B at once; alice's tiers. First alice's two
        requests (the first teaches A the upstream's limits, the second makes her class active) and one of bob's,
        and with Redis until B sees her class (every ``SHARE_S``: a flood at 600 requests/s takes the budget in well
        under that)."""
        tiers: list[str] = []
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=32)) as client:
            for p, key in ((self.a, "alice"), (self.a, "alice"), (self.b, "bob")):
                first = await _post(client, self.url(p), key)
                assert first.status_code == 200, first.text
            deadline = time.monotonic() + 5
            while self.redis is not None and not self.interactive_seen_by_b():
                assert time.monotonic() < deadline, "B never learned of alice's class through Redis"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3 if self.redis is None else 0.0)
            until = time.monotonic() + seconds

            async def bob() -> None:
                while time.monotonic() < until:
                    resp = await _post(client, self.url(self.b), "bob")
                    assert resp.status_code == 200, resp.text

            async def alice() -> None:
                while time.monotonic() < until:
                    resp = await _post(client, self.url(self.a), "alice")
                    assert resp.status_code == 200, resp.text  # never a 429 while the standard tier serves
                    tiers.append(resp.headers["x-tiergate-tier"])
                    await asyncio.sleep(0.15)
            await asyncio.gather(*(bob() for _ in range(workers)), alice())
        return tiers

    def stop(self) -> None:
        for p in (self.a, self.b):
            p.stop()
        self.fast.stop()
        self.std.stop()


async def test_a_batch_flood_on_another_replica_cannot_push_an_interactive_key_off_the_fast_tier(
        tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    alone, shared = Pair(tmp_path, None), Pair(tmp_path, redis)
    try:
        share = {}
        for name, pair in (("alone", alone), ("shared", shared)):
            tiers = await pair.flood(4.0)
            share[name] = tiers.count("fast") / len(tiers)
        # each replica scheduling from its own traffic alone: B's flood takes the budget and alice is spilled
        assert share["alone"] < 0.5, share
        assert share["shared"] >= 0.9, share
        b = scraped(shared.b.port)
        assert sample(b, "tiergate_class_requests_total", missing_ok=False, **{"class": "batch"}, tier="standard",
                      reason="spillover_class_share") > 0
        assert sample(b, "tiergate_shared_state_errors_total", op="classes") == 0
        view = httpx.get(shared.url(shared.b) + "/tiergate/capacity", timeout=5,
                         headers={"authorization": f"Bearer {KEYS['bob']}"}).json()
        fast = view["upstreams"][0]
        assert fast["replicas"] == 2
        tokens = next(x for x in fast["buckets"] if x["bucket"] == "tokens")
        interactive = next(c for c in tokens["classes"] if c["class"] == "interactive")
        assert interactive["active"] and interactive["used"] > 0  # only replica A served her: B sees it through Redis
    finally:
        alone.stop()
        shared.stop()
        redis.kill()


WALL = 1_000_000.0  # the wall clock the test's link reads: a report written "now" stays fresh however late it runs


def _report(at: Any = None, **field: Any) -> bytes:
    """A report as another replica writes it, with ``field`` put in its one class (``b``, ``l`` or a bucket's)."""
    cls = {"b": 1.0, "l": 0.1, "s": None, "u": {"tokens": 10.0}, "a": {"tokens": 0.0}, "g": {"tokens": 0.0},
           "p": {"tokens": 0.0}}
    for k, v in field.items():
        cls[k] = {"tokens": v} if k in ("u", "a", "g", "p") else v
    return orjson.dumps({"at": WALL if at is None else at, "c": {"agent": cls}})


@pytest.mark.parametrize("garbage", [
    b"not json", b'{"at": "x", "c": {}}', b'{"at": 1e300, "c": {"agent": 3}}',
    # each would parse with float(): a negative use held every replica back, a NaN time was never stale
    _report(u=-1e300), _report(a="1e300"), _report(at="nan"), _report(b=-1.0),
    _report(g=True), _report(l="0.1"),
    None,  # the control: a report as the gateway writes it is read, and nothing counted
])
def test_a_report_the_gateway_never_writes_is_counted_and_skipped(garbage: bytes | None) -> None:
    from gateway.config.scheduling import SchedulingConfig
    from gateway.routing.scheduling import Scheduler
    from gateway.state.classes import SharedClasses

    class Link:  # what SharedClasses uses of the RedisLink
        prefix, replica, metrics, wall = "t", "me", None, staticmethod(lambda: WALL)

        def every(self, seconds: float, callback: Any) -> None: ...

    class Errors:
        n = 0

        def labels(self, op: str) -> Errors:
            assert op == "classes"
            return self

        def inc(self) -> None:
            Errors.n += 1

    class Health:
        by_name: dict[str, Any] = {}
        clock = staticmethod(time.monotonic)

    link: Any = Link()
    link.metrics = type("M", (), {"shared_errors": Errors()})()
    classes = SharedClasses(link)
    classes.scheduler = Scheduler(SchedulingConfig.model_validate(
        {"classes": [{"name": "agent", "share": 0.5}, {"name": "batch", "share": 0}], "default_class": "agent"}))
    classes.health = Health()
    classes._read("fast-1", "t:{fast-1}:classes", {b"other": garbage or _report(), b"me": b"mine is skipped"})
    if garbage is None:
        assert Errors.n == 0
        assert classes.scheduler.others["fast-1"]["agent"].used == {"tokens": 10.0}
    else:
        assert Errors.n == 1
        assert classes.scheduler.others["fast-1"] == {}
