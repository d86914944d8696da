"""A run's budgets under concurrency, over real sockets: steps sent at once to a fresh run share one record (created
once, each step added to it as a delta), and each step reserves one step and its estimated cost against the run
when it is admitted, atomically with the check (in this process's table, or in one Redis script shared by the
replicas), so that ``max_steps`` is exact and ``max_usd`` is passed by at most what docs/sessions.md says. A hold
whose replica died mid-step expires.

The attack these replay: a key pinned to a run with ``max_steps: 3`` sent 30 requests at once to a fresh run: 3
were admitted, the record said 1 step, and 2 more sequential steps were then admitted; 10 concurrent steps of a run
with ``max_usd: 0.02`` spent $0.40 and the session view said $0.04.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from gateway.config.schema import StateConfig
from gateway.observability.metrics import Metrics
from gateway.state.redis import SharedState
from gateway.state.sessions import SharedSessions
from gateway.tenancy.keys import digest, new_key
from gateway.tenancy.sessions import MemorySessions, SessionRecord, Step, scope
from gateway.tools.emulator import EmulatorConfig, EmulatorThread

from conftest import RedisServer, needs_redis, sample, scraped, start_gateway

PRICE = {"input": 2.0, "cached_input": 0.2, "output": 8.0}  # USD per million tokens
KEYS = {name: new_key() for name in ("steps", "usd")}
OUTPUT = 1000  # max_tokens of the dollar-budget steps: the emulator answers that many
BURST_STEPS = orjson.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "go on"}]})
BURST_USD = orjson.dumps({"model": "m", "max_tokens": OUTPUT, "messages": [{"role": "user", "content": "go on"}]})
# the gateway's estimate of a dollar-budget step (gateway.admission.reserve.estimated_cost): its body's bytes / 4
# at the input price, max_tokens at the output price; the emulator counts fewer prompt tokens (its messages' text / 4)
# and answers max_tokens, so that a step's real cost is at most its estimate
ESTIMATE = math.ceil(len(BURST_USD) / 4) * PRICE["input"] / 1e6 + OUTPUT * PRICE["output"] / 1e6
MAX_USD = 2.5 * ESTIMATE  # three steps are admitted: at $0, at one estimate reserved, at two


class Gateways:
    """One emulated upstream that answers after 0.5 s (so that a burst's steps are all in flight at once) and
    ``replicas`` gateways in front of it (sharing ``redis`` when given), with two keys each pinned to a run: ``steps``
    (``max_steps: 3``) and ``usd`` (``max_usd``: :data:`MAX_USD`)."""

    def __init__(self, tmp: Path, replicas: int = 1, redis: RedisServer | None = None) -> None:
        self.up = EmulatorThread(config=EmulatorConfig(dialect="openai", ttft=0.5, tps=20_000.0))
        cfg: dict[str, Any] = {
            "upstreams": [{"name": "std", "tier": "standard", "base_url": self.up.base_url, "models": {"m": "m-s"},
                           "prices": PRICE, "timeouts": {"connect": 2, "idle": 10, "total": 30}}],
            "auth": {"metrics": {"public": True}, "keys": [
                {"name": "steps", "sha256": digest(KEYS["steps"]),
                 "session": {"id": "burst", "budgets": {"max_steps": 3}}},
                {"name": "usd", "sha256": digest(KEYS["usd"]),
                 "session": {"id": "spend", "budgets": {"max_usd": MAX_USD}}}]},
        }
        if redis is not None:
            cfg["state"] = {"redis_url": redis.url, "timeout": 0.5, "retry": 0.2}
        self.gateways = [start_gateway(cfg, tmp)[0] for _ in range(replicas)]
        if redis is not None:
            deadline = time.monotonic() + 10
            while any(sample(scraped(g.port), "tiergate_shared_state_up") != 1 for g in self.gateways):
                assert time.monotonic() < deadline, "the replicas never reached Redis"
                time.sleep(0.05)

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{g.port}/v1" for g in self.gateways]

    def stop(self) -> None:
        for g in self.gateways:
            g.stop()
        self.up.stop()


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    g = Gateways(tmp_path_factory.mktemp("budgets"))
    yield g
    g.stop()


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[key]}", "content-type": "application/json"}


async def _burst(urls: list[str], key: str, n: int, body: bytes) -> list[httpx.Response]:
    """``n`` chat completions sent at once (each on its own connection), spread over ``urls`` in turn."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n + 5)) as client:
        return list(await asyncio.gather(*(client.post(urls[i % len(urls)] + "/chat/completions", content=body,
                                                       headers=_headers(key)) for i in range(n))))


def _view(url: str, key: str, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/tiergate/sessions/{sid}", headers=_headers(key), timeout=5)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _refused(responses: list[httpx.Response], budget: str) -> int:
    """How many of ``responses`` are the run's 429 for ``budget`` (every other one must be a 200)."""
    refused = [r for r in responses if r.status_code != 200]
    for r in refused:
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (429, "session_budget_exceeded", budget), r.text
    return len(refused)


async def _steps_are_exact(g: Gateways) -> None:
    urls = g.urls()
    served = len(g.up.requests)
    burst = await _burst(urls, "steps", 30, BURST_STEPS)
    assert _refused(burst, "max_steps") == 27  # exactly max_steps admitted, whichever replica each reached
    assert len(g.up.requests) - served == 3
    for url in urls:  # one record, three steps in it (each replica's view: Redis, or the one process's table)
        deadline = time.monotonic() + 5  # a step's record reaches Redis in a later loop turn of its replica
        while _view(url, "steps", "burst")["steps"] != 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _view(url, "steps", "burst")["steps"] == 3
    for url in urls:  # and the run is spent: a step after the burst is refused too
        late = httpx.post(url + "/chat/completions", content=BURST_STEPS, headers=_headers("steps"), timeout=10)
        assert _refused([late], "max_steps") == 1
    assert len(g.up.requests) - served == 3


async def _dollars_are_bounded(g: Gateways) -> None:
    urls = g.urls()
    burst = await _burst(urls, "usd", 10, BURST_USD)
    refused = _refused(burst, "max_usd")
    # each step reserved its estimate: admitted while what was spent plus what its steps in flight reserved was below
    # max_usd (0, 1 and 2 estimates), so the run passes its budget by at most the step admitted below it
    assert 10 - refused == math.ceil(MAX_USD / ESTIMATE) == 3
    spent = sum(sample(scraped(int(u.split(":")[2].split("/")[0])), "tiergate_key_cost_usd_total", key="usd")
                for u in urls)
    assert 0 < spent <= MAX_USD + ESTIMATE
    for url in urls:
        deadline = time.monotonic() + 5
        while _view(url, "usd", "spend")["steps"] != 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        view = _view(url, "usd", "spend")
        assert view["steps"] == 3 and view["cost_usd"] == pytest.approx(spent, abs=1e-8)  # every step counted once


async def test_concurrent_first_steps_of_a_run_take_exactly_its_max_steps(one: Gateways) -> None:
    await _steps_are_exact(one)


async def test_concurrent_steps_pass_a_runs_max_usd_by_at_most_the_step_admitted_below_it(one: Gateways) -> None:
    await _dollars_are_bounded(one)


@needs_redis
async def test_replicas_sharing_redis_hold_a_runs_budgets_across_them(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    g = Gateways(tmp_path, replicas=2, redis=redis)
    try:
        await _steps_are_exact(g)
        await _dollars_are_bounded(g)
    finally:
        g.stop()
        redis.kill()


# the tables themselves, with plain values (and a real redis-server for the shared one)


def test_a_runs_record_is_made_once_and_its_first_step_in_flight_is_never_swept() -> None:
    from gateway.tenancy.sessions import Bounds, Hold  # (imported here: the module runs on the code before them)
    table = MemorySessions(max_items=4, idle=10.0, hold_s=100.0)
    key = scope("k", "run")
    first, second = SessionRecord("k", "run", "header", 0.0), SessionRecord("k", "run", "header", 0.5)
    a = table.take(key, first, Hold("a", 0.01), Bounds(2, None), 0.0)
    b = table.take(key, second, Hold("b", 0.01), Bounds(2, None), 0.5)  # found no record when it was read
    assert a.refused is None and b.refused is None and a.record is b.record is first  # the one record of the run
    assert (a.number, b.number) == (1, 2)
    assert table.take(key, second, Hold("c", 0.0), Bounds(2, None), 0.6).refused == "max_steps"
    table.sweep(50.0, 8)  # idle past 10 s, but its steps are in flight: kept
    assert table.get(key, 50.0) is first
    table.settle(key, first, Hold("a", 0.01), Step("std", "standard", 1.0, 0.004, 10, 0, 5), 51.0, 8)
    table.settle(key, second, Hold("b", 0.01), None, 51.0, 8)  # no upstream answered: only its hold goes
    assert (first.steps, first.usd, first.in_flight(51.0)) == (1, 0.004, (0, 0.0))
    assert table.take(key, second, Hold("d", 0.0), Bounds(2, None), 52.0).number == 2
    assert table.get(key, 200.0) is None  # its last hold expired, and it was idle: gone


@pytest.fixture
async def linked(redis_server: RedisServer) -> AsyncIterator[list[SharedState]]:
    links = []
    for _ in range(2):
        url = redis_server.url
        link = SharedState(SecretStr(url), StateConfig(redis_url=url, timeout=0.5, retry=0.2),
                           Metrics(CollectorRegistry(), ["m"], []))
        await link.start()
        links.append(link)
    deadline = time.monotonic() + 5
    while not all(link.up for link in links):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    yield links
    for link in links:
        await link.stop()


@needs_redis
async def test_the_hold_of_a_replica_killed_mid_step_expires(linked: list[SharedState]) -> None:
    from gateway.tenancy.sessions import Bounds, Hold
    hold_s = 0.4
    a, b = (SharedSessions(MemorySessions(16, 60.0, hold_s=hold_s), link, 8) for link in linked)
    key, now = scope("k", "run"), time.time()
    assert await a.load(key, now) is None
    got = await a.begin(key, SessionRecord("k", "run", "header", now), Hold("a1", 0.5), Bounds(1, 1.0), now)
    assert got.refused is None and got.number == 1
    await linked[0].stop()  # replica a dies mid-step: its hold is never settled
    seen = await b.load(key, time.time())
    assert seen is not None and seen.steps == 0 and seen.in_flight(time.time()) == (1, 0.5)
    fresh = SessionRecord("k", "run", "header", time.time())
    refused = await b.begin(key, fresh, Hold("b1", 0.0), Bounds(1, None), time.time())
    assert refused.refused == "max_steps" and (refused.steps, refused.held) == (0, 1)
    holds = await linked[1].redis.zrange(b._key(key) + ":holds", 0, -1, withscores=True)
    assert [(m, round(at - now, 1)) for m, at in holds] == [(b"a1|0.5", hold_s)]  # expires with its ttl
    await asyncio.sleep(hold_s + 0.1)
    later = time.time()
    got = await b.begin(key, fresh, Hold("b2", 0.0), Bounds(1, None), later)
    assert got.refused is None and got.number == 1  # the dead replica's hold was dropped by the script
    b.settle(key, got.record, Hold("b2", 0.0), Step("std", "standard", 0.1, 0.25, 10, 0, 5), time.time(), 8)
    deadline = time.monotonic() + 3
    while (await linked[1].redis.hget(b._key(key), "n")) != b"1":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert await linked[1].redis.zcard(b._key(key) + ":holds") == 0
    spent = await b.load(key, time.time())
    assert spent is not None and (spent.steps, spent.usd) == (1, 0.25)
    assert (await b.begin(key, fresh, Hold("b3", 0.0), Bounds(1, None), time.time())).refused == "max_steps"


@needs_redis
async def test_while_redis_is_away_a_replica_counts_a_runs_steps_in_its_own_copy(
        redis_server: RedisServer, linked: list[SharedState]) -> None:
    from gateway.tenancy.sessions import Bounds, Hold
    a = SharedSessions(MemorySessions(16, 60.0), linked[0], 8)
    key, now = scope("k", "away"), time.time()
    fresh = SessionRecord("k", "away", "header", now)
    first = await a.begin(key, fresh, Hold("h1", 0.0), Bounds(2, None), now)
    assert first.refused is None and first.number == 1  # admitted in Redis, its hold mirrored here
    redis_server.kill()
    second = await a.begin(key, fresh, Hold("h2", 0.0), Bounds(2, None), time.time())
    assert not linked[0].up and second.refused is None and second.number == 2  # here: the first's hold counted
    assert (await a.begin(key, fresh, Hold("h3", 0.0), Bounds(2, None), time.time())).refused == "max_steps"
    a.settle(key, first.record, Hold("h1", 0.0), Step("std", "standard", 0.1, 0.0, 10, 0, 5), time.time(), 8)
    a.settle(key, second.record, Hold("h2", 0.0), None, time.time(), 8)
    seen = await a.load(key, time.time())  # the local copy answers
    assert seen is not None and seen.steps == 1 and seen.in_flight(time.time()) == (0, 0.0)
    assert (await a.begin(key, fresh, Hold("h4", 0.0), Bounds(2, None), time.time())).number == 2


async def test_a_step_cancelled_while_its_run_admits_it_leaves_no_hold() -> None:
    """The client leaves (or the drain cuts it) while Redis admits the step: its task is cancelled before admission
    hands the step to the request, so nothing would ever settle it; its hold is released there and then."""
    from gateway.admission.sessions import Sessions
    from gateway.config.schema import GatewayConfig
    from gateway.observability.estimates import Estimates
    from gateway.routing.facts import RequestFacts
    from gateway.routing.policy import Policy
    from gateway.routing.sessions import SessionId
    from gateway.tenancy.sessions import Bounds, Hold, Tally

    class Stalled(MemorySessions):
        """A table whose admissions take the hold and then never answer (a Redis slower than the client)."""

        async def begin(self, key: str, fresh: SessionRecord, hold: Hold, bounds: Bounds, now: float) -> Tally:
            self.take(key, fresh, hold, bounds, now)
            await asyncio.Event().wait()
            raise AssertionError("never")

    cfg = GatewayConfig.model_validate({"upstreams": [{"name": "std", "tier": "standard", "models": {"m": "m-s"},
                                                       "base_url": "http://127.0.0.1:1/v1", "prices": PRICE}]})
    table = Stalled(16, 60.0)
    sessions = Sessions(cfg, table, Estimates(60.0, 16), time.monotonic, time.time)
    facts = RequestFacts(orjson.loads(BURST_USD), {}, len(BURST_USD))
    task = asyncio.ensure_future(sessions.begin(None, None, SessionId("run", "header"), facts,  # type: ignore[arg-type]
                                                Policy(cfg).decide(facts), None))
    key = scope(None, "run")
    deadline = time.monotonic() + 3
    while table.get(key, time.time()) is None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    record = table.get(key, time.time())
    assert record is not None and record.in_flight(time.time())[0] == 1
    assert record.in_flight(time.time())[1] == pytest.approx(ESTIMATE)  # the step's estimated cost, reserved
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert record.in_flight(time.time()) == (0, 0.0)
