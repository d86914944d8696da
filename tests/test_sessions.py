"""Agent sessions over real sockets, with the real ``openai`` SDK and the OpenAI Agents SDK: a run's steps stay on the
upstream whose prompt cache holds their prefix (weights do not move them; a spillover does, and the run goes back
once the upstream is free), replicas sharing Redis agree on it, a Responses conversation is one session through the
bridge, budgets refuse with ``session_budget_exceeded`` before anything reaches an upstream, and a run is seen at
``GET /v1/tiergate/sessions/{id}`` by its own key only.

The upstreams are in-process emulators (``EmulatorThread``: they record every request) with a prompt cache
(``gateway.tools.prompt_cache``): a warm prefix comes back as ``cached_tokens``.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tenancy.keys import digest, new_key
from gateway.tenancy.sessions import scope
from gateway.tools.emulator import EmulatorConfig, EmulatorThread, Plan, Received

from conftest import RedisServer, needs_redis, sample, scraped, start_gateway

KEYS = {name: new_key() for name in ("a", "b", "thrifty")}
PRICE = {"input": 2.0, "cached_input": 0.2, "output": 8.0}  # USD per million tokens


class World:
    """Three emulated upstreams (two on the fast tier, weighted 1:3, bridged for the Responses API; one standard) and
    a gateway with keys in front of them."""

    def __init__(self, tmp: Path, redis: RedisServer | None = None, replicas: int = 1) -> None:
        cfg = EmulatorConfig(dialect="openai", ttft=0.005, tps=5000.0, cache_ttl=300.0)
        self.ups = {name: EmulatorThread(config=cfg) for name in ("fast-a", "fast-b", "std")}
        self.gateways = [start_gateway(self.config(redis), tmp)[0] for _ in range(replicas)]

    def config(self, redis: RedisServer | None) -> dict[str, Any]:
        def up(name: str, tier: str, weight: int, models: dict[str, str], **kw: Any) -> dict[str, Any]:
            return {"name": name, "tier": tier, "base_url": self.ups[name].base_url, "weight": weight,
                    "models": models, "prices": PRICE, "timeouts": {"connect": 2, "idle": 5, "total": 30},
                    "health": {"cooldown_default": 1.0, "cooldown_max": 1.5}, **kw}
        cfg: dict[str, Any] = {
            "default_tier": "fast",
            "upstreams": [up("fast-a", "fast", 1, {"m": "m-a", "solo": "solo-a"}, responses="bridge"),
                          up("fast-b", "fast", 3, {"m": "m-b"}, responses="bridge"),
                          up("std", "standard", 1, {"m": "m-s", "solo": "solo-s"})],
            "auth": {"metrics": {"public": True}, "keys": [
                {"name": "a", "sha256": digest(KEYS["a"])}, {"name": "b", "sha256": digest(KEYS["b"])},
                {"name": "thrifty", "sha256": digest(KEYS["thrifty"]),
                 "session": {"budgets": {"max_usd": 1e-9, "on_usd": "standard"}}}]},
        }
        if redis is not None:
            cfg["state"] = {"redis_url": redis.url, "timeout": 0.5, "retry": 0.2}
        return cfg

    def url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.gateways[i].port}/v1"

    def client(self, session: str | None = None, key: str = "a", i: int = 0) -> openai.OpenAI:
        headers = {"x-tiergate-session": session} if session else {}
        return openai.OpenAI(base_url=self.url(i), api_key=KEYS[key], default_headers=headers, max_retries=0)

    def served(self) -> dict[str, int]:
        return {name: len(e.requests) for name, e in self.ups.items()}

    def stop(self) -> None:
        for g in self.gateways:
            g.stop()
        for e in self.ups.values():
            e.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("sessions"))
    yield w
    w.stop()


def _run(client: openai.OpenAI, steps: int, model: str = "m", between: Any = None) -> list[dict[str, Any]]:
    """An agent-like run: ``steps`` chat completions, each with the whole conversation so far (a growing shared
    prefix). Returns per step: its headers that say what served it, and its usage."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent. " * 20},
                                      {"role": "user", "content": "Plan the task."}]
    out = []
    for i in range(steps):
        if between is not None:
            between(i)
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=8)
        answer = raw.parse()
        out.append({"upstream": raw.headers["x-tiergate-upstream"], "affinity": raw.headers.get("x-tiergate-affinity"),
                    "step": raw.headers.get("x-tiergate-session-step"), "fallback": raw.headers.get(
                        "x-tiergate-fallback"), "cached": answer.usage.prompt_tokens_details.cached_tokens})
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": f"Step {i + 2}: go on."}]
    return out


def _session(world: World, sid: str, key: str = "a", i: int = 0) -> httpx.Response:
    return httpx.get(f"{world.url(i)}/tiergate/sessions/{sid}", headers={"authorization": f"Bearer {KEYS[key]}"},
                     timeout=5)


def test_a_runs_steps_stay_on_one_upstream_whatever_the_weights(world: World) -> None:
    alone = world.client()
    before = world.served()
    for _ in range(40):  # without a session, weights 1:3 spread requests over both fast upstreams
        alone.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    spread = {n: world.served()[n] - before[n] for n in ("fast-a", "fast-b")}
    assert spread["fast-a"] > 0 and spread["fast-b"] > 0, spread
    steps = _run(world.client("weights"), 10)
    assert len({s["upstream"] for s in steps}) == 1, steps
    assert [s["affinity"] for s in steps] == ["new"] + ["kept"] * 9
    assert [s["step"] for s in steps] == [str(i) for i in range(1, 11)]
    assert steps[0]["cached"] == 0 and all(s["cached"] > 100 for s in steps[1:])  # the prefix is warm there
    run = _session(world, "weights").json()
    assert run["steps"] == 10 and run["moves_total"] == 0 and run["last_upstream"] == steps[0]["upstream"]
    assert run["tokens"]["cached"] > 0.5 * run["tokens"]["prompt"] and run["cost_usd"] > 0
    assert run["steps_by_tier"] == {"fast": 10} and run["source"] == "header"
    m = scraped(world.gateways[0].port)
    assert sample(m, "tiergate_session_steps_total", tier="fast", upstream=steps[0]["upstream"]) >= 10
    assert sample(m, "tiergate_session_prompt_tokens_total", upstream=steps[0]["upstream"],
                  token_type="cached_input") > 0


def test_a_run_goes_back_to_its_warm_upstream_after_a_spillover(world: World) -> None:
    emu = world.ups["fast-a"]
    once = {"n": 0}

    def too_many(req: Received) -> Plan | None:  # fast-a says 429 once (retry after 1 s), then answers again
        once["n"] += 1
        if once["n"] == 1:
            return Plan(status=429, headers={"content-type": "application/json", "retry-after-ms": "1000"},
                        parts=[(0, b'{"error":{"message":"slow down","type":"requests","param":null,'
                                   b'"code":"rate_limit_exceeded"}}')], chunked=False)
        return None

    def between(i: int) -> None:
        if i == 2:
            emu.handler = too_many
        if i == 4:
            time.sleep(1.2)  # the cooldown ends

    try:
        steps = _run(world.client("spill"), 6, model="solo", between=between)  # solo: fast-a, then std
    finally:
        emu.handler = None
    assert [s["upstream"] for s in steps] == ["fast-a", "fast-a", "std", "std", "fast-a", "fast-a"], steps
    assert steps[2]["fallback"] == "upstream_429" and steps[3]["fallback"] == "spillover_cooldown"
    assert steps[4]["cached"] > steps[1]["cached"] > 0  # back where steps 1-2 left the prefix warm
    run = _session(world, "spill").json()
    assert [(m["from"], m["to"], m["reason"]) for m in run["moves"]] == [("fast-a", "std", "failover"),
                                                                          ("std", "fast-a", "return")]
    m = scraped(world.gateways[0].port)
    assert sample(m, "tiergate_session_affinity_breaks_total", reason="return") >= 1
    assert sample(m, "tiergate_session_affinity_breaks_total", reason="failover") >= 1


def test_a_responses_conversation_is_one_session_through_the_bridge(world: World) -> None:
    client = world.client()
    first = client.responses.create(model="m", input="Plan the task.", max_output_tokens=8)
    raw = client.responses.with_raw_response.create(model="m", input="Go on.", previous_response_id=first.id,
                                                    max_output_tokens=8)
    second = raw.parse()
    assert raw.headers["x-tiergate-affinity"] == "new"  # the chain's first continuation starts the session
    third = client.responses.with_raw_response.create(model="m", input="And on.", previous_response_id=second.id,
                                                      max_output_tokens=8)
    assert third.headers["x-tiergate-affinity"] == "kept"
    assert third.headers["x-tiergate-upstream"] == raw.headers["x-tiergate-upstream"]
    run = _session(world, first.id).json()  # the session is named by the chain's first response
    assert run["steps"] == 2 and run["source"] == "previous_response"
    sent = [orjson.loads(r.body) for r in world.ups[raw.headers["x-tiergate-upstream"]].requests[-2:]]
    keys = {s.get("prompt_cache_key") for s in sent}  # one derived key for the run, where the client sent none
    assert len(keys) == 1 and next(iter(keys)).startswith("tgs-")
    # keyed with the gateway key's own digest: another tenant who knows the key's name and the run's id cannot
    # compute it (to send it as its own prompt_cache_key and share this run's cache routing)
    assert next(iter(keys)) != "tgs-" + scope("a", first.id)


def test_budgets_refuse_before_anything_reaches_an_upstream(world: World) -> None:
    client = openai.OpenAI(base_url=world.url(), api_key=KEYS["a"], max_retries=2, default_headers={
        "x-tiergate-session": "budgeted", "x-tiergate-session-max-steps": "2"})
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    client.chat.completions.create(**ask)
    client.chat.completions.create(**ask)
    before = sum(world.served().values())
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**ask)
    assert sum(world.served().values()) == before  # nothing was sent, and the SDK did not retry (x-should-retry)
    err = info.value.body
    assert isinstance(err, dict) and (err["code"], err["param"]) == ("session_budget_exceeded", "max_steps")
    assert info.value.response.headers["x-should-retry"] == "false"
    late = world.client("late")
    late.with_options(default_headers={"x-tiergate-session": "late", "x-tiergate-session-deadline-ms": "300"}) \
        .chat.completions.create(**ask)
    time.sleep(0.35)
    with pytest.raises(openai.RateLimitError) as info:
        late.with_options(default_headers={"x-tiergate-session": "late", "x-tiergate-session-deadline-ms": "300"}) \
            .chat.completions.create(**ask)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "deadline"
    bad = httpx.post(world.url() + "/chat/completions", json=ask, headers={
        "authorization": f"Bearer {KEYS['a']}", "x-tiergate-session": "bad", "x-tiergate-session-max-steps": "1.5"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-tiergate-session-max-steps"
    m = scraped(world.gateways[0].port)
    assert sample(m, "tiergate_session_budget_refusals_total", budget="max_steps") >= 1


def test_a_spent_dollar_budget_moves_the_rest_of_the_run_to_the_standard_tier(world: World) -> None:
    client = world.client("frugal", key="thrifty")  # its key's runs may spend $1e-9, then go on standard
    first = client.chat.completions.with_raw_response.create(model="m", max_tokens=4,
                                                             messages=[{"role": "user", "content": "hi"}])
    assert first.headers["x-tiergate-tier"] == "fast"
    second = client.chat.completions.with_raw_response.create(model="m", max_tokens=4,
                                                              messages=[{"role": "user", "content": "hi"}])
    assert second.headers["x-tiergate-tier"] == "standard"
    assert second.headers["x-tiergate-session-budget"] == "usd"
    assert second.headers["x-tiergate-fallback"] == "session_budget"


def test_a_run_is_seen_by_its_own_key_only(world: World) -> None:
    world.client("mine").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert _session(world, "mine", key="a").status_code == 200
    other = _session(world, "mine", key="b")
    assert other.status_code == 404 and other.json()["error"]["code"] == "session_not_found"
    world.client("mine", key="b").chat.completions.create(model="m", max_tokens=2,
                                                          messages=[{"role": "user", "content": "x"}])
    assert _session(world, "mine", key="b").json()["steps"] == 1  # b's "mine" is its own run
    assert _session(world, "mine", key="a").json()["steps"] == 1


def test_the_route_endpoint_says_where_a_run_is_kept(world: World) -> None:
    steps = _run(world.client("explained"), 2)
    r = httpx.post(world.url() + "/tiergate/route", json={"model": "m", "messages": [{"role": "user",
                                                                                        "content": "x"}]},
                   headers={"authorization": f"Bearer {KEYS['a']}", "x-tiergate-session": "explained"}, timeout=5)
    session = r.json()["session"]
    assert (session["id"], session["source"], session["affinity"], session["step"]) == \
        ("explained", "header", steps[-1]["upstream"], 3)
    assert r.json()["candidates"][0]["upstream"] == steps[-1]["upstream"]
    assert _session(world, "explained").json()["steps"] == 2  # the look counted nothing


def test_an_agents_sdk_tool_loop_is_one_session_on_one_upstream(world: World) -> None:
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def lookup(city: str) -> str:
        """Look a city up."""
        calls.append(city)
        return f"{city}: sunny"

    async def main() -> Any:
        client = openai.AsyncOpenAI(base_url=world.url(), api_key=KEYS["a"], max_retries=0)
        agent = agents.Agent(name="planner", instructions="Use the tool.", tools=[lookup],
                             model=agents.OpenAIChatCompletionsModel("m", client),
                             model_settings=agents.ModelSettings(extra_headers={"x-tiergate-session": "agent-run"}))
        return await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)

    agents.set_tracing_disabled(True)
    before = world.served()
    result = asyncio.run(main())
    assert calls and result.final_output
    grew = {n: world.served()[n] - before[n] for n in world.ups}
    assert sum(grew.values()) >= 2 and sorted(grew.values())[-1] == sum(grew.values()), grew  # one upstream
    run = _session(world, "agent-run").json()
    assert run["steps"] == sum(grew.values()) and run["moves_total"] == 0


@needs_redis
def test_replicas_sharing_redis_keep_a_run_on_one_upstream(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    w = World(tmp_path, redis, replicas=2)
    try:
        deadline = time.monotonic() + 10
        while any(sample(scraped(g.port), "tiergate_shared_state_up") != 1 for g in w.gateways):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seen = []
        for i in range(6):  # the steps alternate between the replicas
            client = w.client("shared", i=i % 2)
            raw = client.chat.completions.with_raw_response.create(model="m", max_tokens=2, messages=[
                {"role": "user", "content": "The same long task, step by step. " * 10 + str(i)}])
            seen.append((raw.headers["x-tiergate-upstream"], raw.headers["x-tiergate-affinity"]))
            time.sleep(0.05)  # the step's record reaches Redis in the next loop turn of its replica
        assert len({u for u, _ in seen}) == 1, seen
        assert [a for _, a in seen] == ["new"] + ["kept"] * 5  # the second replica knew the first's step
        views = [_session(w, "shared", i=i).json() for i in (0, 1)]
        assert [v["steps"] for v in views] == [6, 6]
        # what the fast tier saved crosses Redis too: six fast steps, unpriced (non-streamed: no standard samples)
        assert views[0]["steps_by_tier"] == {"fast": 6}, views[0]
        assert [(v["fast_tier_saved"]["priced_steps"], v["fast_tier_saved"]["unpriced_steps"]) for v in views] == [
            (0, 6), (0, 6)]
    finally:
        w.stop()
        redis.kill()


def test_deadline_routing_keeps_a_warm_session_where_a_cold_request_would_move(tmp_path: Path) -> None:
    """Both tiers meet the budget; cold, the standard tier is the cheaper. A session warm on the fast tier holds most of
    its prompt in the fast upstream's cache (billed at its cached_input price): moving would throw that away, so its
    step stays; the same request without the session goes to the standard tier."""
    ups = {n: EmulatorThread(config=EmulatorConfig(dialect="openai", ttft=0.005, tps=5000.0, cache_ttl=300.0))
           for n in ("fast", "std")}
    gw, _ = start_gateway({
        "default_tier": "fast",
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": ups["fast"].base_url, "models": {"m": "m-f"},
             "prices": {"input": 2.0, "cached_input": 0.02, "output": 2.0}},
            {"name": "std", "tier": "standard", "base_url": ups["std"].base_url, "models": {"m": "m-s"},
             "prices": {"input": 1.0, "output": 1.0}}],
        "estimates": {"window": 60, "samples": 16, "explore": 0, "probe": 600},
    }, tmp_path)
    try:
        url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
        history = [{"role": "user", "content": "context " * 10_000}]  # ~20k prompt tokens

        def ask(headers: dict[str, str], content: str, tokens: int = 4) -> httpx.Response:
            body = {"model": "m", "max_tokens": tokens, "stream": True,
                    "messages": [*history, {"role": "user", "content": content}]}
            with httpx.stream("POST", url, json=body, headers=headers, timeout=20) as r:
                r.read()
            return r
        for _ in range(4):  # both tiers measured (32 tokens: a starved runner's reads never take them all at once)
            for tier in ("fast", "standard"):
                assert ask({"x-tiergate-tier": tier}, "warm up", 32).status_code == 200
        first = ask({"x-tiergate-session": "warm", "x-tiergate-tier": "fast"}, "step 1")
        assert first.headers["x-tiergate-upstream"] == "fast"
        budget = {"x-tiergate-deadline-ms": "20000"}
        cold = ask(budget, "step 2")
        assert cold.headers["x-tiergate-upstream"] == "std" and cold.headers["x-tiergate-deadline"] == "meets"
        warm = ask({**budget, "x-tiergate-session": "warm"}, "step 2")
        assert warm.headers["x-tiergate-upstream"] == "fast" and warm.headers["x-tiergate-deadline"] == "meets"
        assert warm.headers["x-tiergate-affinity"] == "kept"
    finally:
        gw.stop()
        for e in ups.values():
            e.stop()


def test_a_runs_deadline_gives_each_step_its_share_as_a_latency_budget(world: World) -> None:
    headers = {"authorization": f"Bearer {KEYS['a']}", "x-tiergate-session": "paced",
               "x-tiergate-session-deadline-ms": "60000", "x-tiergate-session-steps": "10"}
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(world.url() + "/chat/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 200 and "x-tiergate-deadline" in r.headers  # deadline routing ran for it
    route = httpx.post(world.url() + "/tiergate/route", json=body, headers=headers, timeout=10).json()
    budget = route["deadline"]
    assert budget["source"] == "session" and 5000 < budget["deadline_ms"] <= 60000 / 9  # what is left, over 9 steps


def test_a_key_made_for_one_run_is_bounded_by_that_runs_budgets(tmp_path: Path) -> None:
    """The attack: a key with ``session.id`` and budgets named a fresh session (or a ``prompt_cache_key``, or a
    harness header) for each request, so each was the first step of a new run and no budget ever held; the
    passthrough ignored the run; and a header raised the config's ``sessions.budgets``. Now a pinned key's every
    request is a step of its run, its passthrough ends with the run, and headers only tighten the operator's
    budgets."""
    up = EmulatorThread(config=EmulatorConfig(dialect="openai", ttft=0.002, tps=5000.0))
    one, anyone = new_key(), new_key()
    cfg = {"upstreams": [{"name": "std", "tier": "standard", "base_url": up.base_url, "models": {"m": "m-s"},
                          "prices": PRICE}],
           "sessions": {"budgets": {"max_steps": 3}},
           "auth": {"metrics": {"public": True}, "keys": [
               {"name": "one-run", "sha256": digest(one), "session": {"id": "run-7", "budgets": {"max_steps": 2}}},
               {"name": "anyone", "sha256": digest(anyone)}]}}
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        url = f"http://127.0.0.1:{gw.port}/v1"
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        def post(key: str, path: str = "/chat/completions", body: Any = ask, **headers: str) -> httpx.Response:
            return httpx.post(url + path, json=body, timeout=10, headers={"authorization": f"Bearer {key}", **headers})
        first = post(one, **{"x-tiergate-session": "evade-1"})
        second = post(one, body={**ask, "prompt_cache_key": "evade-2"}, **{"session-id": "evade-3"})
        assert [r.headers.get("x-tiergate-session-step") for r in (first, second)] == ["1", "2"]
        third = post(one, **{"x-tiergate-session": "evade-4"})
        assert third.status_code == 429 and third.json()["error"]["code"] == "session_budget_exceeded"
        seen = len(up.requests)
        late = post(one, "/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
        assert late.status_code == 429 and late.json()["error"]["param"] == "max_steps"
        assert len(up.requests) == seen  # the passthrough ended with the run
        assert httpx.get(f"{url}/tiergate/sessions/run-7", headers={"authorization": f"Bearer {one}"},
                         timeout=5).json()["steps"] == 2
        # a key without a pinned run: a header cannot raise the config's max_steps (3)
        codes = [post(anyone, **{"x-tiergate-session": "raised", "x-tiergate-session-max-steps": "1000"}).status_code
                 for _ in range(4)]
        assert codes == [200, 200, 200, 429]
    finally:
        gw.stop()
        up.stop()


@needs_redis
def test_one_keys_runs_are_bounded_in_redis_as_in_a_process(tmp_path: Path) -> None:
    """The attack: with shared state, one key's 150 one-step runs were all kept in Redis for an hour (the process's
    table kept 25). Each key's runs are indexed there too, its least recently used deleted past its share."""
    redis = RedisServer(tmp_path)
    up = EmulatorThread(config=EmulatorConfig(dialect="openai", ttft=0.002, tps=5000.0))
    flood, quiet = new_key(), new_key()
    cfg = {"upstreams": [{"name": "std", "tier": "standard", "base_url": up.base_url, "models": {"m": "m-s"}}],
           "sessions": {"max_items": 8, "key_share": 0.25},  # two runs per key
           "state": {"redis_url": redis.url, "timeout": 0.5, "retry": 0.2},
           "auth": {"metrics": {"public": True}, "keys": [{"name": "flood", "sha256": digest(flood)},
                                                           {"name": "quiet", "sha256": digest(quiet)}]}}
    gw, _ = start_gateway(cfg, tmp_path)
    try:
        deadline = time.monotonic() + 10
        while sample(scraped(gw.port), "tiergate_shared_state_up") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        url = f"http://127.0.0.1:{gw.port}/v1"
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        def step(key: str, session: str) -> None:
            r = httpx.post(url + "/chat/completions", json=ask, timeout=10,
                           headers={"authorization": f"Bearer {key}", "x-tiergate-session": session})
            assert r.status_code == 200, r.text
        step(quiet, "q-1")
        for i in range(30):
            step(flood, f"flood-{i}")

        def sessions() -> list[bytes]:
            out = subprocess.run(["redis-cli", "-p", str(redis.port), "--scan", "--pattern", "tiergate:session:*"],
                                 capture_output=True, check=True).stdout
            return [k for k in out.split() if not k.endswith(b":moves")]
        deadline = time.monotonic() + 10  # the last steps' records reach Redis in a later loop turn of the gateway
        while len(sessions()) != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sessions()) == 3  # the flood's two newest and the quiet key's one
        found = httpx.get(f"{url}/tiergate/sessions/q-1", headers={"authorization": f"Bearer {quiet}"}, timeout=5)
        assert found.status_code == 200 and found.json()["steps"] == 1
    finally:
        gw.stop()
        up.stop()
        redis.kill()
