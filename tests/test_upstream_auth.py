"""An upstream that refuses the gateway's own key (its 401 or 403) is the gateway's trouble, never the client's.

The attack this answers: an upstream's 401 relayed as it came made the ``openai`` SDK raise ``AuthenticationError``
against a valid gateway key, with the upstream's message, which quotes part of the gateway's own upstream credential
(OpenAI: "Incorrect API key provided: sk-abc***wxyz"). Now the client gets 502 ``upstream_auth_failed`` naming the
upstream and nothing of its words, the next candidate serves where one can, the refusal counts against that
upstream's breaker, in ``tiergate_upstream_errors_total`` and in a warning event with the key masked; only an
upstream that got the client's own key (``pass_client_key``) relays its 401 as the client's.

Real gateway processes in front of scripted upstreams on loopback: each answers as the emulator does, or, when the
test says so, refuses the key it received and quotes it whole in its message (worse than OpenAI's partial echo).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tools.emulator import EmulatorConfig, EmulatorThread, Plan, Received

from conftest import Proc, sample, sse, start_gateway

FAST_KEY = "sk-proj-ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789fastfast"  # planted: the gateway's own upstream keys
STD_KEY = "sk-proj-ZYXWVUTSRQPONMLKJIHGFEDCBA9876543210stdstd"
CLIENT_KEY = "sk-client-own-key-0123456789"
KEYS = {"TG_FAST_KEY": FAST_KEY, "TG_STD_KEY": STD_KEY}
JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "hi"}]


class Upstream:
    """A scripted upstream: the emulator's answer, or, with ``refuse`` set, a refusal of the key it got.

    ``refuse``: ``401`` / ``403`` (that status, OpenAI's error body), ``event`` (a 200 chat stream whose first event
    is an ``invalid_api_key`` error) or ``responses_event`` (the Responses API's ``event: error``); None: serve.
    """

    def __init__(self, dialect: str) -> None:
        self.refuse: str | None = None
        self.up = EmulatorThread(self._answer, EmulatorConfig(dialect=dialect, tps=2000.0, ttft=0.002))

    def _answer(self, req: Received) -> Plan | None:
        if self.refuse is None:
            return None
        key = req.headers.get("authorization", "none").removeprefix("Bearer ")
        message = (f"Incorrect API key provided: {key}. You can find your API key at "
                   "https://platform.openai.com/account/api-keys.")
        if self.refuse == "event":
            error = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                               "code": "invalid_api_key"}}
            return Plan(parts=[(0, sse(orjson.dumps(error)))])
        if self.refuse == "responses_event":
            error = {"type": "error", "code": "invalid_api_key", "message": message, "param": None,
                     "sequence_number": 0}
            return Plan(parts=[(0, b"event: error\ndata: " + orjson.dumps(error) + b"\n\n")])
        status = int(self.refuse)
        error = {"error": {"message": message if status == 401 else f"Key {key} may not use this model.",
                           "type": "invalid_request_error" if status == 401 else "permission_error", "param": None,
                           "code": "invalid_api_key" if status == 401 else "model_access_denied"}}
        return Plan(status=status, headers=JSON, parts=[(0, orjson.dumps(error))], chunked=False)


@pytest.fixture(scope="module")
def ups() -> Iterator[dict[str, Upstream]]:
    made = {"fast": Upstream("cerebras"), "std": Upstream("openai"), "byo": Upstream("openai")}
    yield made
    for u in made.values():
        u.up.stop()


@pytest.fixture(autouse=True)
def serving(ups: dict[str, Upstream]) -> Iterator[None]:
    """Every upstream serves unless the test says otherwise, before and after it."""
    for u in ups.values():
        u.refuse = None
    yield
    for u in ups.values():
        u.refuse = None


def _config(ups: dict[str, Upstream], failures: int = 1000, **top: Any) -> dict[str, Any]:
    timeouts = {"connect": 1, "idle": 3, "total": 5}
    return {
        "upstreams": [
            {"name": "u-fast", "tier": "fast", "base_url": ups["fast"].up.base_url, "dialect": "cerebras",
             "api_key_env": "TG_FAST_KEY", "timeouts": timeouts, "health": {"failures": failures},
             "models": {"m": "m-fast"}},
            {"name": "u-std", "tier": "standard", "base_url": ups["std"].up.base_url, "dialect": "openai",
             "api_key_env": "TG_STD_KEY", "timeouts": timeouts, "health": {"failures": 1000},
             "models": {"m": "m-std"}},
            {"name": "u-byo", "tier": "standard", "base_url": ups["byo"].up.base_url, "dialect": "openai",
             "pass_client_key": True, "timeouts": timeouts, "health": {"failures": 1000},
             "models": {"byo": "byo"}},
        ],
        "aliases": {"m-fast": {"model": "m", "tier": "fast"}},
        "passthrough": {"upstream": "u-std"},
        **top,
    }


def _start(cfg: dict[str, Any], tmp: Path) -> Proc:
    proc, _ = start_gateway(cfg, tmp, env={**KEYS, "GATEWAY_LOG_FORMAT": "json"})
    return proc


@pytest.fixture(scope="module")
def alone(ups: dict[str, Upstream], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """No fallback: each request has one candidate (``m-fast``: u-fast; ``m``: u-std; ``byo``: u-byo)."""
    proc = _start(_config(ups, fallback=False), tmp_path_factory.mktemp("auth-alone"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def both(ups: dict[str, Upstream], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """Fallback on: ``m-fast`` tries u-fast, then u-std."""
    proc = _start(_config(ups), tmp_path_factory.mktemp("auth-both"))
    yield proc
    proc.stop()


def _url(gw: Proc) -> str:
    return f"http://127.0.0.1:{gw.port}/v1"


def _metrics(gw: Proc) -> str:
    return httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text


def _client(gw: Proc, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(gw), api_key=CLIENT_KEY, max_retries=retries, timeout=10)


def _events(gw: Proc, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in gw.log.read_text(errors="replace").splitlines() if line.startswith("{")]
    return [x for x in lines if x.get("event") == name]


def _leaks(resp: httpx.Response) -> list[str]:
    """Whatever of the gateway's upstream keys the client's answer shows (body or headers), in any length."""
    seen = resp.text + json.dumps(dict(resp.headers))
    return [key[i:i + 8] for key in (FAST_KEY, STD_KEY) for i in range(len(key) - 7) if key[i:i + 8] in seen]


def _is_the_gateways_502(exc: openai.APIStatusError, upstream: str) -> None:
    assert isinstance(exc, openai.InternalServerError), type(exc)
    assert not isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError)
    assert exc.status_code == 502 and exc.code == "upstream_auth_failed" and exc.type == "server_error"
    assert set(exc.response.json()["error"]) == {"message", "type", "param", "code"}
    assert f"'{upstream}'" in exc.message and "Incorrect API key" not in exc.message
    assert not _leaks(exc.response)


def _create(client: openai.OpenAI, api: str, model: str, stream: bool) -> None:
    """One request through the SDK, read to its end (a stream is iterated)."""
    if api == "chat":
        answer: Any = client.chat.completions.create(model=model, messages=MESSAGES, stream=stream)  # type: ignore
    else:
        answer = client.responses.create(model=model, input="hi", stream=stream)  # type: ignore[call-overload]
    if stream:
        list(answer)


@pytest.mark.parametrize(("api", "stream", "model", "upstream", "refuse"), [
    ("chat", True, "m-fast", "u-fast", "401"),
    ("chat", False, "m", "u-std", "403"),
    ("responses", True, "m", "u-std", "401"),  # native
    ("responses", False, "m-fast", "u-fast", "401"),  # bridged to Cerebras' chat completions
    ("responses", True, "m-fast", "u-fast", "403"),
])
def test_the_only_upstream_refusing_its_key_is_a_502_never_the_clients_401(
        ups: dict[str, Upstream], alone: Proc, api: str, stream: bool, model: str, upstream: str,
        refuse: str) -> None:
    ups["fast" if upstream == "u-fast" else "std"].refuse = refuse
    before = _metrics(alone)
    with pytest.raises(openai.APIStatusError) as info:
        _create(_client(alone), api, model, stream)
    _is_the_gateways_502(info.value, upstream)
    assert info.value.response.headers["x-tiergate-upstream"] == upstream
    assert "x-should-retry" not in info.value.response.headers  # one upstream tried: the SDK may retry it
    after = _metrics(alone)
    grew = sample(after, "tiergate_upstream_errors_total", upstream=upstream, reason="upstream_auth_failed") - \
        sample(before, "tiergate_upstream_errors_total", upstream=upstream, reason="upstream_auth_failed")
    assert grew == 1
    assert sample(after, "tiergate_requests_total", upstream=upstream, outcome="upstream_error") > \
        sample(before, "tiergate_requests_total", upstream=upstream, outcome="upstream_error")


@pytest.mark.parametrize(("api", "model", "refuse"), [("chat", "m", "event"), ("responses", "m", "responses_event")])
def test_a_refusal_as_the_first_event_of_a_200_stream_is_a_502(ups: dict[str, Upstream], alone: Proc, api: str,
                                                                model: str, refuse: str) -> None:
    ups["std"].refuse = refuse
    with pytest.raises(openai.APIStatusError) as info:
        _create(_client(alone), api, model, True)
    _is_the_gateways_502(info.value, "u-std")


def test_the_next_tier_serves_when_the_first_refuses_its_key_and_its_breaker_counts_it(
        ups: dict[str, Upstream], tmp_path: Path) -> None:
    """Failover to the standard tier, named by ``x-tiergate-fallback``; two refusals open u-fast's breaker
    (``failures: 2``), as two 5xx would; the event names the upstream and its status, its key masked."""
    gw = _start(_config(ups, failures=2), tmp_path)
    try:
        ups["fast"].refuse = "401"
        for _ in range(2):
            raw = _client(gw).chat.completions.with_raw_response.create(model="m-fast", messages=MESSAGES,
                                                                        stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            assert raw.headers["x-tiergate-upstream"] == "u-std"
            assert raw.headers["x-tiergate-fallback"] == "upstream_auth_failed"
        assert sample(_metrics(gw), "tiergate_upstream_errors_total", upstream="u-fast",
                      reason="upstream_auth_failed") == 2
        n = len(ups["fast"].up.requests)
        third = httpx.post(_url(gw) + "/chat/completions", json={"model": "m-fast", "messages": MESSAGES}, timeout=5)
        assert third.status_code == 200 and third.headers["x-tiergate-fallback"] == "spillover_circuit_open"
        assert len(ups["fast"].up.requests) == n  # u-fast rests: not asked again
        deadline = time.monotonic() + 3
        while not (refused := _events(gw, "upstream_auth_failed")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused and all(x["level"] == "warning" and x["upstream"] == "u-fast" and x["status"] == 401
                               and x["code"] == "invalid_api_key" for x in refused)
        assert "Incorrect API key provided: sk-proj-***" in refused[0]["message"]
        assert _events(gw, "breaker_opened")[-1]["upstream"] == "u-fast"
        assert FAST_KEY not in gw.log.read_text(errors="replace")
    finally:
        gw.stop()


def test_every_candidate_refusing_is_a_502_that_the_sdk_does_not_retry(ups: dict[str, Upstream], both: Proc) -> None:
    ups["fast"].refuse, ups["std"].refuse = "401", "403"
    asked = len(ups["fast"].up.requests) + len(ups["std"].up.requests)
    with pytest.raises(openai.APIStatusError) as info:
        _create(_client(both, retries=2), "chat", "m-fast", True)
    _is_the_gateways_502(info.value, "u-std")  # the last one tried
    headers = info.value.response.headers
    assert headers["x-should-retry"] == "false" and headers["x-tiergate-fallback"] == "upstream_auth_failed"
    assert len(ups["fast"].up.requests) + len(ups["std"].up.requests) == asked + 2  # one each; no SDK retry


@pytest.mark.parametrize(("method", "path", "body", "refuse"), [
    ("POST", "/embeddings", {"model": "text-embedding-3-small", "input": "x"}, "401"),
    ("GET", "/files/file-1", None, "403"),
])
def test_a_passthrough_refusal_is_a_502(ups: dict[str, Upstream], alone: Proc, method: str, path: str,
                                        body: dict[str, Any] | None, refuse: str) -> None:
    ups["std"].refuse = refuse
    before = _metrics(alone)
    resp = httpx.request(method, _url(alone) + path, json=body, timeout=5,
                         headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "upstream_auth_failed" and resp.json()["error"]["type"] == "server_error"
    assert "'u-std'" in resp.json()["error"]["message"] and not _leaks(resp)
    after = _metrics(alone)
    assert sample(after, "tiergate_upstream_errors_total", upstream="u-std", reason="upstream_auth_failed") == \
        sample(before, "tiergate_upstream_errors_total", upstream="u-std", reason="upstream_auth_failed") + 1
    if method == "POST":  # through the SDK: never AuthenticationError
        with pytest.raises(openai.APIStatusError) as info:
            _client(alone).embeddings.create(model="text-embedding-3-small", input="x")
        _is_the_gateways_502(info.value, "u-std")


@pytest.mark.parametrize("api", ["chat", "embeddings"])
def test_only_a_pass_client_key_upstreams_401_is_the_clients(ups: dict[str, Upstream], alone: Proc, api: str) -> None:
    """The same refusal from two upstreams: the one that got the client's own key (``pass_client_key``) relays it as
    the client's 401, as it came; the one that got the gateway's key is the gateway's 502."""
    ups["byo"].refuse = ups["std"].refuse = "401"
    before = _metrics(alone)
    client = _client(alone)
    for model in ("byo", "m"):
        with pytest.raises(openai.APIStatusError) as info:
            if api == "chat":
                client.chat.completions.create(model=model, messages=MESSAGES)
            else:
                client.embeddings.create(model=model, input="x")
        if model == "m":
            _is_the_gateways_502(info.value, "u-std")
            continue
        assert type(info.value) is openai.AuthenticationError
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        assert CLIENT_KEY in info.value.message  # the client's own key, echoed to the client as the upstream said it
        assert ups["byo"].up.requests[-1].headers["authorization"] == f"Bearer {CLIENT_KEY}"
    after = _metrics(alone)
    for upstream, grew in (("u-byo", 0), ("u-std", 1)):
        assert sample(after, "tiergate_upstream_errors_total", upstream=upstream, reason="upstream_auth_failed") == \
            sample(before, "tiergate_upstream_errors_total", upstream=upstream, reason="upstream_auth_failed") + grew
