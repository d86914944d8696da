"""State shared by replicas through a real ``redis-server`` (``gateway.state.redis``), in one process: two or three
:class:`SharedState` objects on one Redis play the replicas, each with its own :class:`Health`.

The three-gateway-process test against one rate-limited upstream is ``tests/test_replicas.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from redis.crc import key_slot

from gateway.config.auth import AuthConfig, KeyConfig
from gateway.config.schema import StateConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.observability.metrics import Metrics
from gateway.responses.store import OVERHEAD, Bridged, MemoryResponseStore, Native, encode
from gateway.routing.health import Health, UpstreamHealth
from gateway.state.quota import SharedVerdicts
from gateway.state.redis import Admission, SharedState
from gateway.state.store import SharedResponseStore
from gateway.tenancy.ledger import Refusal

from conftest import LoopLag, RedisServer, needs_redis, sample

pytestmark = needs_redis
FAST = UpstreamConfig.model_validate({"name": "fast", "tier": "fast", "base_url": "http://127.0.0.1:1/v1",
                                      "models": {"m": "m"}, "health": {"failures": 2, "open_seconds": 30}})


class Replica:
    """One replica's shared state, health and metrics."""

    def __init__(self, url: str, **state: Any) -> None:
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry, ["m"], [])
        self.health = Health([FAST])
        self.shared = SharedState(SecretStr(url), StateConfig(redis_url=url, **{"timeout": 0.2, "retry": 0.2,
                                                                                **state}), self.metrics)
        self.shared.attach(self.health)

    @property
    def h(self) -> UpstreamHealth:
        return self.health["fast"]

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client import generate_latest
        return sample(generate_latest(self.registry).decode(), name, **labels)


async def until(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """Wait (bounded) until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Callable[..., Awaitable[Replica]]]:
    made: list[Replica] = []

    async def make(**state: Any) -> Replica:
        r = Replica(redis_server.url, **state)
        await r.shared.start()
        await until(lambda: r.shared.up)
        made.append(r)
        return r
    yield make
    for r in made:
        await r.shared.stop()


def report(tokens: int, requests: int = 1000, reset: str = "30") -> dict[str, str]:
    """Cerebras-style rate-limit headers."""
    return {"x-ratelimit-remaining-tokens-minute": str(tokens), "x-ratelimit-reset-tokens-minute": reset,
            "x-ratelimit-remaining-requests-day": str(requests), "x-ratelimit-reset-requests-day": "3600"}


async def observed(r: Replica, headers: dict[str, str], admission: Admission | None = None) -> None:
    """Tell ``r`` an answer's headers as an attempt would, and wait for its writer to send them."""
    SharedVerdicts(r.h, r.shared, admission).observe_headers(headers, r.health.clock())
    await until(lambda: not r.shared._asks and not r.shared._flushes)
    await asyncio.sleep(0.05)


async def test_concurrent_admissions_of_three_replicas_never_overshoot_the_shared_estimate(
        replicas: Callable[..., Awaitable[Replica]]) -> None:
    a, b, c = await replicas(), await replicas(), await replicas()
    await observed(a, report(10_000))
    await until(lambda: b.h.reports_quota and c.h.reports_quota)  # the first report reaches the others
    admissions = await asyncio.gather(*(r.shared.admit(r.h, 1000) for r in (a, b, c) * 8))  # 24 at once
    assert all(x is not None for x in admissions)
    assert sum(x.ok for x in admissions if x is not None) == 10  # 10,000 tokens: exactly ten of 1,000
    refused = [x for x in admissions if x is not None and not x.ok]
    assert {x.refused for x in refused} == {"tokens"}
    keys = a.shared._quota_keys("fast")
    assert float(await a.shared.redis.get(keys[1])) == 0
    assert await a.shared.redis.zcard(keys[4]) == 10  # in flight until their answers report
    assert await a.shared.redis.hgetall(keys[5]) == {b"r": b"10", b"t": b"10000"}
    # a replica refused holds the shared estimate locally: its next plan spills over without asking Redis
    for r in (a, b, c):
        x = await r.shared.admit(r.h, 1000)
        assert x is not None and not x.ok and r.h.unavailable(r.health.clock(), 1000) == "quota_tokens"


async def test_a_report_is_taken_minus_what_was_reserved_after_it_and_what_was_in_flight_before(
        replicas: Callable[..., Awaitable[Replica]]) -> None:
    a, b = await replicas(), await replicas()
    await observed(a, report(10_000, requests=100))
    await until(lambda: b.h.reports_quota)
    first = await a.shared.admit(a.h, 500)
    assert first is not None and first.ok and first.mark is not None
    for _ in range(3):  # sent after a's request, not counted in the report its answer carries
        x = await b.shared.admit(b.h, 1000)
        assert x is not None and x.ok
    await observed(a, report(9_500, requests=99), first)
    raw = await a.shared.redis.get(a.shared._quota_keys("fast")[1])
    assert float(raw) == 9_500 - 3 * 1000
    assert float(await a.shared.redis.get(a.shared._quota_keys("fast")[0])) == 99 - 3
    # b's three are still in flight when a reserves again: they may reach the upstream after a's request, so a's
    # report is taken minus them too (the safe error; their own reports correct it)
    again = await a.shared.admit(a.h, 500)
    assert again is not None and again.ok and again.ahead == (3, 3000)
    await observed(a, report(5_000, requests=90), again)
    assert float(await a.shared.redis.get(a.shared._quota_keys("fast")[1])) == 5_000 - 3000
    # a report without a mark (its attempt reserved nothing) never overwrites a standing estimate
    await observed(b, report(50_000))
    assert float(await a.shared.redis.get(a.shared._quota_keys("fast")[1])) == 2_000


async def test_a_cooldown_an_opened_and_a_closed_breaker_reach_the_other_replicas(
        replicas: Callable[..., Awaitable[Replica]]) -> None:
    a, b = await replicas(), await replicas()
    now = a.health.clock()
    a.h.rate_limited({"retry-after": "20"}, now)
    await until(lambda: b.h.unavailable(b.health.clock(), 1) == "cooldown")
    assert b.h.cooldown_until - b.health.clock() == pytest.approx(20, abs=1)
    late = await replicas()  # started after the 429: reads the rest hash
    assert late.h.unavailable(late.health.clock(), 1) == "cooldown"
    a.h.failure(now)
    a.h.failure(now)  # failures: 2 -> open
    await until(lambda: b.h.state(b.health.clock()) == "open")
    assert b.h.open_until - b.health.clock() == pytest.approx(30, abs=1)
    a.h.success()
    await until(lambda: b.h.state(b.health.clock()) != "open")
    assert b.h.open_until == 0 and not b.h.half_open


async def test_a_rising_report_reaches_replicas_that_spilled_over_on_a_short_estimate(
        replicas: Callable[..., Awaitable[Replica]]) -> None:
    a, b = await replicas(), await replicas()
    await observed(a, report(100))
    await until(lambda: "tokens" in b.h.quota)
    assert b.h.unavailable(b.health.clock(), 1000) == "quota_tokens"
    x = await a.shared.admit(a.h, 50)
    assert x is not None and x.ok
    await observed(a, report(40_000), x)  # a new window: more than before
    await until(lambda: b.h.unavailable(b.health.clock(), 1000) is None)


async def test_redis_killed_then_back_the_replica_goes_on_locally_and_returns(
        replicas: Callable[..., Awaitable[Replica]], redis_server: RedisServer,
        caplog: pytest.LogCaptureFixture) -> None:
    a = await replicas()
    await observed(a, report(10_000))
    redis_server.kill()
    async with LoopLag() as lag:
        t0 = time.monotonic()
        assert await a.shared.admit(a.h, 100) is None  # refused connection: at once, no wait
        took = time.monotonic() - t0
    # at once: the refusal itself ended it, not the state.timeout (0.2 s) that bounds a silent Redis
    cause = next(r.args[1] for r in caplog.records if "shared state (Redis) unavailable" in r.message)
    assert isinstance(cause, redis.exceptions.ConnectionError), repr(cause)
    assert took < 0.2 / 2 + lag.seconds, (took, lag.seconds)
    assert not a.shared.up and a.metric("tiergate_shared_state_up") == 0
    assert a.metric("tiergate_shared_state_errors_total", op="admit") == 1
    assert await a.shared.admit(a.h, 100) is None  # away: not asked again
    assert a.metric("tiergate_shared_state_errors_total", op="admit") == 1
    a.h.rate_limited({"retry-after": "5"}, a.health.clock())  # dropped for the others, kept here
    assert a.h.unavailable(a.health.clock(), 1) == "cooldown"
    assert a.metric("tiergate_shared_state_dropped_total") >= 1
    assert sum("shared state (Redis) unavailable" in r.message for r in caplog.records) == 1  # logged once
    redis_server.start()
    await until(lambda: a.shared.up, timeout=5)
    assert a.metric("tiergate_shared_state_up") == 1
    x = await a.shared.admit(a.h, 100)  # Redis lost everything: no shared estimate, so admitted
    assert x is not None and x.ok


async def test_a_redis_that_answers_nothing_costs_a_request_at_most_the_timeout(
        replicas: Callable[..., Awaitable[Replica]], redis_server: RedisServer) -> None:
    timeout = 0.1
    a = await replicas(timeout=timeout)
    await observed(a, report(10_000))
    redis_server.pause()
    try:
        async with LoopLag() as lag:
            t0 = time.monotonic()
            results = await asyncio.gather(*(a.shared.admit(a.h, 100) for _ in range(5)))
            waited = time.monotonic() - t0
        assert results == [None] * 5 and not a.shared.up
        # one bounded wait for those in flight (five in turn would be 0.5 s), plus what the machine stalled this loop
        assert timeout <= waited < 2 * timeout + lag.seconds, (waited, lag.seconds)
        errors = a.metric("tiergate_shared_state_errors_total", op="admit")
        async with LoopLag() as lag:
            t1 = time.monotonic()
            assert await a.shared.admit(a.h, 100) is None
            took = time.monotonic() - t1
        # then none: Redis is away, not asked (asking would wait the timeout again and count a second failure)
        assert a.metric("tiergate_shared_state_errors_total", op="admit") == errors
        assert took < timeout / 2 + lag.seconds, (took, lag.seconds)
    finally:
        redis_server.resume()
    await until(lambda: a.shared.up, timeout=5)


async def test_the_responses_store_is_shared_and_a_delete_reaches_every_replica(
        replicas: Callable[..., Awaitable[Replica]], redis_server: RedisServer) -> None:
    a, b = await replicas(), await replicas()
    sa = SharedResponseStore(MemoryResponseStore(100, 10**6, 60), a.shared)
    sb = SharedResponseStore(MemoryResponseStore(100, 10**6, 60), b.shared)
    first = Bridged({"id": "resp_1", "output": [{"type": "message", "id": "m1"}]}, [{"type": "message", "id": "u1"}],
                    None, "k")
    second = Bridged({"id": "resp_2", "output": [{"type": "message", "id": "m2"}]}, [{"type": "message", "id": "u2"}],
                     "resp_1", "k")
    assert await sa.put("resp_1", first) and await sa.put("resp_2", second)
    assert await sa.put("resp_n", Native("openai", "k"))
    assert await sb.get("resp_n", "k") == Native("openai", "k")
    got = await sb.get("resp_2", "k")
    assert isinstance(got, Bridged) and got.previous == "resp_1"
    history = await sb.history("resp_2", "k")
    assert [i["id"] for i in history or []] == ["u1", "m1", "u2", "m2"]
    # another key finds none of them on either replica, and cannot delete them
    assert await sb.get("resp_2", "other") is None and await sb.history("resp_2", "other") is None
    assert await sb.get("resp_n", None) is None and not await sb.delete("resp_1", "other")
    assert await sa.get("resp_1", "k") == first
    assert await sb.delete("resp_1", "k")
    await until(lambda: len(sa.local) == 2)  # a's local copy dropped by b's message
    assert await sa.get("resp_1", "k") is None
    assert await sa.history("resp_2", "k") is None  # a link is gone: no silent fresh start
    redis_server.kill()  # away: each replica's own copy answers
    assert await sa.get("resp_2", "k") == second
    assert await sa.get("resp_2", "other") is None
    assert await sb.get("resp_2", "k") is None


async def test_which_key_made_an_object_is_known_to_every_replica(
        replicas: Callable[..., Awaitable[Replica]], redis_server: RedisServer) -> None:
    from gateway.state.owners import SharedOwners
    from gateway.tenancy.objects import MemoryOwners

    a, b = await replicas(), await replicas()
    oa = SharedOwners(MemoryOwners(100, 60), a.shared)
    ob = SharedOwners(MemoryOwners(100, 60), b.shared)
    await oa.claim("file-1", "k")
    assert await ob.owner("file-1") == "k" and await ob.owner("file-2") is None
    assert await ob.owned(["file-1", "file-2"], "k") == {"file-1"} and await ob.owned(["file-1"], "other") == set()
    redis_server.kill()  # away: each replica's own copy answers
    assert await oa.owner("file-1") == "k" and await ob.owner("file-1") is None


async def test_garbage_in_its_keys_or_on_its_channel_never_takes_shared_state_down(
        replicas: Callable[..., Awaitable[Replica]]) -> None:
    a, b = await replicas(), await replicas()
    keys = a.shared._quota_keys("fast")
    await a.shared.redis.set(keys[1], "abc")  # a string where a count belongs
    await a.shared.redis.hset(keys[0], "x", "1")  # a hash where a string does
    await a.shared.redis.set(a.shared._key("fast", "rest"), "garbage")
    await a.shared.redis.set(keys[3], "not-a-number")
    await a.shared.redis.set(keys[0], "1e999")  # reads as infinity in Lua: not a count either
    await observed(a, report(10_000))
    x = await a.shared.admit(a.h, 100)
    assert x is not None and x.ok and a.shared.up
    for junk in (b"not json", b"[1, 2]", b'{"r": "x", "u": "fast", "e": "cooldown"}', b'{"e": "quota", "u": "fast"}'):
        await a.shared.redis.publish(a.shared.channel, junk)
    a.h.rate_limited({"retry-after": "9"}, a.health.clock())  # the subscriber lives on: b still hears a
    await until(lambda: b.h.unavailable(b.health.clock(), 1) == "cooldown")
    assert b.shared.up and b.metric("tiergate_shared_state_errors_total", op="message") >= 3
    late = await replicas()  # reads the (repaired) hashes at start
    assert late.shared.up and late.h.unavailable(late.health.clock(), 1) == "cooldown"


async def test_a_key_reservation_redis_answers_too_late_counts_once_and_a_settlement_waits_for_redis(
        replicas: Callable[..., Awaitable[Replica]], redis_server: RedisServer) -> None:
    from gateway.state.ledger import SharedLedger
    from gateway.tenancy.keys import Keys, digest
    from gateway.tenancy.ledger import MemoryLedger, Spend, windows

    a = await replicas(timeout=0.1)
    key = Keys(AuthConfig(keys=[KeyConfig(name="k", sha256=digest("k"),
                                          limits={"usd_per_day": 10.0})])).by_hash[digest("k")]
    ledger = SharedLedger(a.shared, MemoryLedger(time.time))
    counter = ledger._counter(key, "all", "usd", "day", windows(time.time())["day"][0])
    await a.shared.redis.set(counter, "1e999")  # garbage that reads as infinity: not a count, so it counts nothing
    first = await ledger.reserve(key, Spend(1, 0, 1.0), False)
    assert not isinstance(first, Refusal) and not first.local
    first.settle(0, 0.0, "standard")
    await until_async(lambda: a.shared.redis.get(counter), b"0")
    redis_server.pause()
    try:
        held = await ledger.reserve(key, Spend(1, 0, 2.5), False)  # no answer in time: counted here
    finally:
        redis_server.resume()
    assert not isinstance(held, Refusal) and held.local and held.remote is not None
    await until(lambda: a.shared.up, timeout=5)
    await until_async(lambda: a.shared.redis.get(counter), b"2.5")  # the late reservation arrived after all
    held.settle(0, 1.0, "standard")  # its settlement replaces it there by what was used: counted once
    await until_async(lambda: a.shared.redis.get(counter), b"1")
    # a reservation made in Redis, settled while Redis is away: the settlement waits, then goes
    second = await ledger.reserve(key, Spend(1, 0, 3.0), False)
    assert not isinstance(second, Refusal) and not second.local
    redis_server.kill()
    assert await ledger.reserve(key, Spend(1, 0, 0.1), False) is not None  # locally, at once
    second.settle(0, 0.5, "standard")
    assert len(ledger.waiting) == 1
    redis_server.start()
    await until(lambda: a.shared.up, timeout=5)
    await until(lambda: not ledger.waiting)
    # Redis lost everything when it restarted: the counter is gone, and the settlement does not make it again
    await asyncio.sleep(0.2)
    assert await a.shared.redis.get(ledger._counter(key, "all", "usd", "day", second.at["day"])) is None


async def until_async(get: Callable[[], Awaitable[Any]], want: Any, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := await get()) != want:
        assert time.monotonic() < deadline, f"timed out: {got!r} != {want!r}"
        await asyncio.sleep(0.02)


# --- the Responses store's records in Redis: each key holds its share, and none evicts a counter ---------------------

def _turn(owner: str | None, size: int, previous: str | None = None) -> Bridged:
    """A bridged record of ``owner`` whose input is ``size`` bytes of text."""
    return Bridged({"id": "r", "output": [{"type": "message", "id": "m"}]},
                   [{"type": "message", "content": "x" * size}], previous, owner)


async def _held(store: SharedResponseStore, ids: list[str], owner: str | None) -> list[str]:
    """The ids of ``ids`` the store finds for ``owner`` (a store whose own copy holds none of them: Redis answers)."""
    return [i for i in ids if await store.get(i, owner) is not None]


async def test_one_keys_records_never_push_another_keys_out_of_redis_and_its_own_oldest_go(
        replicas: Callable[..., Awaitable[Replica]]) -> None:
    """The attack: one key's Responses records filled the shared Redis (a 1 MiB request is a 3.1 MB record) and pushed
    the other keys' out of it. In Redis too each key holds at most ``key_share`` of the store's records and bytes (its
    own oldest go), and records without a key at most the whole store."""
    a, b = await replicas(), await replicas()
    bounds: dict[str, Any] = {"max_items": 100, "max_bytes": 1_000_000, "ttl": 60, "key_share": 0.25}
    sa = SharedResponseStore(MemoryResponseStore(**bounds), a.shared)  # a key: 25 records, 250,000 bytes
    sb = SharedResponseStore(MemoryResponseStore(**bounds), b.shared)  # b's own copy holds none: Redis answers
    alice = _turn("alice", 100)
    assert await sa.put("resp_alice", alice)
    bob = [f"resp_bob_{i}" for i in range(40)]
    for rid in bob:  # 1.6 MB: six times bob's share of the bytes
        assert await sa.put(rid, _turn("bob", 40_000))
    assert await sb.get("resp_alice", "alice") == alice
    held = await _held(sb, bob, "bob")
    assert held == bob[-len(held):] and 4 <= len(held) <= 250_000 // 40_000  # his newest, within his share
    carol = [f"resp_carol_{i}" for i in range(40)]
    for rid in carol:  # small ones: the count bounds them
        assert await sa.put(rid, _turn("carol", 10))
    assert await _held(sb, carol, "carol") == carol[-25:]
    assert await sb.get("resp_alice", "alice") == alice and await _held(sb, bob, "bob") == held
    # a delete leaves the key's share: the next record pushes out none of its others
    assert await sb.delete(held[-1], "bob")
    assert await sa.put("resp_bob_more", _turn("bob", 40_000))
    assert await _held(sb, [*held[:-1], "resp_bob_more"], "bob") == [*held[:-1], "resp_bob_more"]
    # a conversation read (and continued) through Redis is still the key's, and its links stay counted
    assert await sa.put("resp_bob_next", _turn("bob", 10, previous="resp_bob_more"))
    assert [i.get("content", "")[:1] for i in await sb.history("resp_bob_next", "bob") or []] == ["x", "", "x", ""]
    # without keys (auth off; a gateway of its own on this Redis) the records are bounded by the whole store
    c, d = await replicas(key_prefix="open"), await replicas(key_prefix="open")
    sc = SharedResponseStore(MemoryResponseStore(**bounds), c.shared)
    sd = SharedResponseStore(MemoryResponseStore(**bounds), d.shared)
    nobody = [f"resp_anon_{i}" for i in range(120)]
    for rid in nobody:
        assert await sc.put(rid, _turn(None, 10))
    assert await _held(sd, nobody, None) == nobody[-100:]


async def test_the_store_s_accounting_in_redis_follows_puts_continuations_expiry_and_deletes(
        replicas: Callable[..., Awaitable[Replica]]) -> None:
    """The index of each key's records (``gateway.state.store``) counts what Redis holds: a continued record is counted
    while it lives, an expired one leaves the count, a deleted one too; garbage in its keys is repaired."""
    a = await replicas()
    store = SharedResponseStore(MemoryResponseStore(100, 1_000_000, 2.0, key_share=0.5), a.shared)
    r = a.shared.redis

    async def counted() -> dict[bytes, bytes]:
        return await r.hgetall(store.held)
    assert await store.put("resp_0", _turn("k", 100)) and await store.put("resp_1", _turn("k", 100))
    size = len(encode(_turn("k", 100))) + OVERHEAD
    assert await counted() == {b"n": b"2", b"b": str(2 * size).encode(), b"n:k": b"2", b"b:k": str(2 * size).encode()}
    await asyncio.sleep(1.0)
    assert await store.history("resp_1", "k") is not None  # continued: lives (and is counted) another 2 s
    await asyncio.sleep(1.3)
    assert await store.put("resp_2", _turn("k", 100))  # resp_0 expired meanwhile: it leaves the count
    assert await r.exists(store._key("resp_0")) == 0 and await r.exists(store._key("resp_1")) == 1
    assert (await counted())[b"n:k"] == b"2"
    assert await r.zrange(store._index("k"), 0, -1) == [b"resp_1", b"resp_2"]
    assert len({key_slot(k) for k in await r.keys("tiergate:*")}) == 1  # one Cluster slot: one script counts them
    assert await store.delete("resp_1", "k") and await store.delete("resp_2", "k")
    assert await counted() == {} and await r.exists(store._index("k"), store._sizes("k"), store.owners) == 0
    await r.set(store.held, "garbage")
    await r.set(store._index("k"), "garbage")
    assert await store.put("resp_3", _turn("k", 100)) and a.shared.up
    assert await store.get("resp_3", "k") is not None and (await counted())[b"n:k"] == b"1"


async def test_a_flood_of_records_under_maxmemory_evicts_no_counter_and_no_other_keys_record(
        tmp_path: Path) -> None:
    """The attack, under the replicas overlay's eviction (``volatile-ttl``, which evicts the keys nearest their expiry
    first): 90 of one key's requests evicted 26 keys, another key's response among them. Ordering the TTLs would not
    be enough (Redis samples the keys it evicts; measured: with counters living 2 h and records 1 h a flood evicted
    half the counters), so Redis never reaches its maxmemory for records: it holds at most the store's bounds of them
    in all, each key its share (here four keys flood, past the whole store), and the accounting has no TTL."""
    from gateway.state.ledger import SharedLedger
    from gateway.tenancy.keys import Keys, digest
    from gateway.tenancy.ledger import MemoryLedger, Spend, windows

    server = RedisServer(tmp_path, args=("--maxmemory", "10mb", "--maxmemory-policy", "volatile-ttl"))
    a, b = Replica(server.url), Replica(server.url)
    try:
        await a.shared.start()
        await b.shared.start()
        await until(lambda: a.shared.up and b.shared.up)
        names = ("alice", "bob", "carol", "dave", "erin")
        limits = {"requests_per_minute": 1000, "tokens_per_minute": 10**6, "usd_per_day": 10.0, "usd_per_month": 99.0}
        keys = Keys(AuthConfig(keys=[KeyConfig(name=n, sha256=digest(n), limits=limits) for n in names]))
        ledger = SharedLedger(a.shared, MemoryLedger(time.time))
        counters = []
        for n in names:
            key = keys.by_hash[digest(n)]
            hold = await ledger.reserve(key, Spend(1, 100, 0.01), False)
            assert not isinstance(hold, Refusal) and not hold.local
            at = windows(time.time())
            counters += [ledger._counter(key, "all", dim, w, at[w][0]) for dim, w, _ in
                         (("requests", "minute", 0), ("tokens", "minute", 0), ("usd", "day", 0), ("usd", "month", 0))]
        before = await a.shared.redis.mget(counters)
        assert all(v is not None for v in before)
        bounds: dict[str, Any] = {"max_items": 1000, "max_bytes": 4_000_000, "ttl": 3600, "key_share": 0.5}
        sa = SharedResponseStore(MemoryResponseStore(**bounds), a.shared)
        sb = SharedResponseStore(MemoryResponseStore(**bounds), b.shared)
        alice = _turn("alice", 1000)
        assert await sa.put("resp_alice", alice)
        floods = {n: [f"resp_{n}_{i}" for i in range(24)] for n in names[1:]}
        for i in range(24):  # 4 keys x 24 x 300 KB: 29 MB, three times the maxmemory
            for n in names[1:]:
                assert await sa.put(floods[n][i], _turn(n, 300_000))
        info, after = await a.shared.redis.info(), await a.shared.redis.mget(counters)
        found = await sb.get("resp_alice", "alice")  # through Redis: b's own copy never held it
        print(f"used_memory {info['used_memory'] / 1e6:.1f} MB, evicted {info['evicted_keys']} keys, "
              f"{sum(v is None for v in after)} of {len(counters)} counters lost, alice's kept: {found == alice}")
        assert info["evicted_keys"] == 0
        assert after == before and found == alice  # every key's counters as they were, and alice's record
        for n, ids in floods.items():  # each flooding key kept its newest in Redis, at most the store in all
            assert (await _held(sb, ids, n))[-1:] == ids[-1:]
        assert int((await a.shared.redis.hgetall(sa.held))[b"b"]) <= 4_000_000
    finally:
        for r in (a, b):
            await r.shared.stop()
        server.kill()
