"""One way in (issue 32): every entrance (chat completions and the Responses API over HTTP, a WebSocket-mode message,
the passthrough) goes through the one admission sequence, so that a hostile gateway key meets the same limits, parse,
ownership and tier entitlement whichever door it tries. Each test is one trick of the attack that found the holes,
over real sockets (a gateway process in front of in-process emulators that record every request they get); each
failed on the gateway before admission was made one.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml
from websockets.sync.client import connect

from gateway.tenancy.keys import digest, new_key
from gateway.tools.emulator import EmulatorConfig, EmulatorThread

from conftest import ROOT, SCRAPE, Proc, sample, scraped, start_gateway

KEYS = {name: new_key() for name in ("alice", "bob", "plain")}
DEFAULT = {"input": 1.0, "output": 2.0}  # USD per million tokens
PRIORITY = {"input": 5.0, "output": 10.0}
FLEX = {"input": 0.5, "output": 1.0}
LIMIT = 64 * 1024  # limits.max_request_bytes here: a WebSocket message is held to it too
Upstreams = dict[str, EmulatorThread]


def _config(ups: Upstreams) -> dict[str, Any]:
    def up(name: str, tier: str, dialect: str, models: dict[str, str], prices: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "tier": tier, "base_url": ups[name].base_url, "dialect": dialect, "models": models,
                "prices": prices, "timeouts": {"connect": 2, "idle": 5, "total": 30}}
    return {
        "default_tier": "standard",
        "limits": {"max_request_bytes": LIMIT},
        "upstreams": [
            up("fast", "fast", "cerebras", {"m": "m-wse"}, DEFAULT),
            up("std", "standard", "openai", {"m": "m-std"}, {**DEFAULT, "service_tiers": {"priority": PRIORITY}}),
            up("vllm", "standard", "vllm", {"v": "v-vllm"}, {**DEFAULT, "service_tiers": {"flex": FLEX}}),
        ],
        "aliases": {"m-fast": {"model": "m", "tier": "fast"}},
        "passthrough": {"upstream": "std"},
        "auth": {"metrics": SCRAPE, "keys": [{"name": "alice", "sha256": digest(KEYS["alice"])},
                                             {"name": "bob", "sha256": digest(KEYS["bob"])},
                                             {"name": "plain", "sha256": digest(KEYS["plain"]),
                                              "tiers": ["standard"]}]},
    }


@pytest.fixture(scope="module")
def ups() -> Iterator[Upstreams]:
    quick = {"ttft": 0.005, "tps": 5000.0}
    made = {"fast": EmulatorThread(config=EmulatorConfig(dialect="cerebras", **quick)),
            "std": EmulatorThread(config=EmulatorConfig(dialect="openai", **quick)),
            "vllm": EmulatorThread(config=EmulatorConfig(dialect="vllm", **quick))}
    yield made
    for e in made.values():
        e.stop()


@pytest.fixture(scope="module")
def gw(ups: Upstreams, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc, _ = start_gateway(_config(ups), tmp_path_factory.mktemp("admission"))
    yield proc
    proc.stop()


def _h(name: str, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}", **more}


def _sdk(gw: Proc, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=KEYS[name], max_retries=0)


def _post(gw: Proc, path: str, body: bytes, name: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One POST with ``body`` and ``headers`` exactly as given (no client adds a content type)."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={**_h(name), **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _seen(ups: Upstreams) -> list[bytes]:
    return [r.body for e in ups.values() for r in e.requests]


def _files(gw: Proc) -> tuple[str, str]:
    """A file alice made and one bob made (each its key's: ``gateway.tenancy.objects``)."""
    line = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
    alice = _sdk(gw, "alice").files.create(file=("a.jsonl", line), purpose="batch").id
    bob = _sdk(gw, "bob").files.create(file=("b.jsonl", line), purpose="batch").id
    return alice, bob


def test_a_body_the_gateway_cannot_read_is_refused_never_forwarded(gw: Proc, ups: Upstreams) -> None:
    """Defect 2: the object check was skipped for any body the gateway did not parse as JSON, and that body was still
    forwarded: bob made a batch over alice's file with no content type, text/plain, octet-stream or a form type, or
    a JSON-typed body the parser refused (NaN, Infinity, 1e400), which the upstream reads as JSON; with duplicate
    keys the gateway kept the last and an upstream may keep the first."""
    alice, bob = _files(gw)
    batch = b'{"input_file_id": "%s", "endpoint": "/v1/chat/completions", "completion_window": "24h"}' % alice.encode()
    before = len(_seen(ups))
    for ctype in (None, "text/plain", "application/octet-stream", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"):
        status, answer = _post(gw, "/v1/batches", batch, "bob", {"content-type": ctype} if ctype else {})
        assert status == 415 and orjson.loads(answer)["error"]["code"] == "unsupported_media_type", (ctype, answer)
    for odd in (b"NaN", b"Infinity", b"1e400"):
        status, answer = _post(gw, "/v1/batches", batch[:-1] + b', "x": ' + odd + b"}", "bob",
                               {"content-type": "application/json"})
        assert status == 400 and orjson.loads(answer)["error"]["code"] == "invalid_json", (odd, answer)
    for read in (b"\xef\xbb\xbf" + batch, batch[:-1] + b', "note": "\\ud83d"}',
                 batch.replace(b'"input_file_id": "', b'"input_file_id": "%s", "input_file_id": "' % bob.encode())):
        status, answer = _post(gw, "/v1/batches", read, "bob", {"content-type": "application/json"})
        assert status == 404 and orjson.loads(answer)["error"]["code"] == "object_not_found", (read, answer)
    assert len(_seen(ups)) == before  # none of it reached an upstream
    hidden = (b'{"input_file_id": "%s", "input_file_id": "%s", "endpoint": "/v1/chat/completions", '
              b'"completion_window": "24h"}' % (alice.encode(), bob.encode()))
    status, _ = _post(gw, "/v1/batches", hidden, "bob", {"content-type": "application/json"})
    assert status == 200  # what was checked (bob's own file) is what went: alice's id never reached the upstream
    form = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\nContent-Disposition: '
            b'form-data; name="file_id"\r\n\r\n' + alice.encode() + b'\r\n--b\r\nContent-Disposition: form-data; '
            b'name="file"; filename="x.jsonl"\r\n\r\n{}\r\n--b--\r\n')
    status, answer = _post(gw, "/v1/files", form, "bob", {"content-type": "multipart/form-data; boundary=b"})
    assert status == 400 and orjson.loads(answer)["error"]["code"] == "object_reference_in_upload", answer
    assert not any(alice.encode() in body for body in _seen(ups)[before:])


def _deep(levels: int) -> bytes:
    """A JSON object ``levels`` deep (orjson writes 254 levels at most: built as text)."""
    return b'{"a":' * levels + b'"x"' + b"}" * levels


def test_a_body_nested_past_the_bound_is_a_400_on_every_entrance(gw: Proc, ups: Upstreams) -> None:
    """Defect 7: a 260-deep object inside a message was a 500 with a traceback, from the Cerebras dialect writing the
    body again (orjson writes 254 levels); the bound is read at the parse, the same on every entrance."""
    deep = _deep(260)
    before = len(_seen(ups))
    chat = b'{"model": "m-fast", "messages": [{"role": "user", "content": "hi", "extra": %s}]}' % deep
    resp = b'"model": "m-fast", "input": [{"role": "user", "content": "hi", "extra": %s}]}' % deep
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", b"{" + resp),
                       ("/v1/embeddings", b'{"model": "text-embedding-3-small", "input": "x", "extra": %s}' % deep)):
        status, answer = _post(gw, path, body, "alice", {"content-type": "application/json"})
        assert status == 400 and orjson.loads(answer)["error"]["code"] == "invalid_json", (path, answer)
    with connect(f"ws://127.0.0.1:{gw.port}/v1/responses", additional_headers=_h("alice")) as ws:
        ws.send((b'{"type": "response.create", ' + resp).decode())
        event = orjson.loads(ws.recv(timeout=10))
    assert event["type"] == "error" and event["status"] == 400 and event["error"]["code"] == "invalid_json"
    assert len(_seen(ups)) == before


def test_the_passthrough_drops_a_speed_tier_the_key_may_not_use_and_says_so(gw: Proc, ups: Upstreams) -> None:
    """Defect 5: ``POST /v1/completions`` with ``service_tier: priority`` from a ``tiers: [standard]`` key went to the
    standard upstream with priority forwarded, billed at default's prices; the chat path dropped it in silence."""
    for path, body in (("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4}),
                       ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4})):
        before = len(ups["std"].requests)
        r = httpx.post(f"http://127.0.0.1:{gw.port}{path}", headers=_h("plain"), timeout=10,
                       json={**body, "service_tier": "priority"})
        assert r.status_code == 200 and r.headers["x-tiergate-service-tier-dropped"] == "key_tier", (path, r.text)
        sent = orjson.loads(ups["std"].requests[before].body)
        assert "service_tier" not in sent and sent["model"] == "m-std", (path, sent)


def _std_cost(gw: Proc) -> float:
    m = scraped(gw.port)
    return sum(sample(m, "tiergate_cost_usd_total", upstream="std", usage=u) for u in ("reported", "estimated"))


def test_a_speed_tier_goes_to_a_standard_upstream_that_sells_it_and_is_billed_as_served(gw: Proc,
                                                                                      ups: Upstreams) -> None:
    """The wire contract: ``service_tier: priority`` routed to a standard upstream that honours it (OpenAI's priority
    processing) was dropped in silence: the client paid for, and got, something else than it asked. Where its key may
    use the fast tier it is forwarded, and billed at the tier the answer says served it."""
    before, cost = len(ups["std"].requests), _std_cost(gw)
    r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", timeout=10,
                   headers=_h("alice", **{"x-tiergate-tier": "standard"}),
                   json={"model": "m", "service_tier": "priority", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "std", r.text
    assert "x-tiergate-service-tier-dropped" not in r.headers
    assert orjson.loads(ups["std"].requests[before].body)["service_tier"] == "priority"
    usage = r.json()["usage"]
    assert r.json()["service_tier"] == "priority"
    priced = (usage["prompt_tokens"] * PRIORITY["input"] + usage["completion_tokens"] * PRIORITY["output"]) / 1e6
    assert _std_cost(gw) - cost == pytest.approx(priced, rel=1e-6)


def test_a_tier_the_upstream_ignores_is_billed_at_the_default_and_check_config_says_so(
        gw: Proc, ups: Upstreams, tmp_path: Path) -> None:
    """Defect 6: an OpenAI-compatible upstream that takes ``service_tier`` and ignores it (vLLM) was billed at the
    tier the client asked: ``flex``, half price."""
    m = scraped(gw.port)
    cost = sample(m, "tiergate_cost_usd_total", upstream="vllm")
    r = httpx.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", headers=_h("alice"), timeout=10,
                   json={"model": "v", "service_tier": "flex", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "vllm", r.text
    usage = r.json()["usage"]
    priced = (usage["prompt_tokens"] * DEFAULT["input"] + usage["completion_tokens"] * DEFAULT["output"]) / 1e6
    assert sample(scraped(gw.port), "tiergate_cost_usd_total", upstream="vllm") - cost == pytest.approx(priced)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(_config(ups)))
    out = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert "upstream vllm: prices for service tier(s) flex, which its dialect (vllm) does not act on" in (
        out.stdout + out.stderr), out


def test_paths_under_responses_that_are_no_ids_reach_the_upstream(gw: Proc, ups: Upstreams) -> None:
    """Also found: ``/v1/responses/compact`` and ``/v1/responses/input_tokens`` were taken for response ids and
    answered 405; they are endpoints of their own (the route table), passed through."""
    for path in ("/v1/responses/compact", "/v1/responses/input_tokens"):
        before = len(ups["std"].requests)
        status, _ = _post(gw, path, b'{"model": "m", "input": "hi"}', "alice", {"content-type": "application/json"})
        assert status != 405 and ups["std"].requests[before].path == path, (path, status)


def test_a_websocket_message_is_held_to_the_limit_of_the_same_body_over_http(gw: Proc, ups: Upstreams) -> None:
    """Also found: a WebSocket message was held to limits.websocket.max_message_bytes (16 MiB), the same body over
    HTTP to limits.max_request_bytes."""
    big = {"model": "m", "input": "x" * (LIMIT + 1024)}
    before = len(_seen(ups))
    status, answer = _post(gw, "/v1/responses", orjson.dumps(big), "alice", {"content-type": "application/json"})
    assert status == 413, answer
    with connect(f"ws://127.0.0.1:{gw.port}/v1/responses", additional_headers=_h("alice")) as ws:
        ws.send(orjson.dumps({"type": "response.create", **big}).decode())
        event = orjson.loads(ws.recv(timeout=10))
    assert event["type"] == "error" and event["status"] == 413, event
    assert len(_seen(ups)) == before


# --- the same hostile request through every entrance ---------------------------------------------------------------

def _entrances(alice: str) -> dict[str, tuple[str, dict[str, Any], str]]:
    """Each entrance's natural way to name alice's file: (path or "ws", body, the member that holds the id)."""
    return {
        "chat": ("/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "file", "file": {"file_id": alice}}]}]}, "file_id"),
        "responses": ("/v1/responses", {"model": "m", "max_output_tokens": 16, "input": [
            {"role": "user", "content": [{"type": "input_file", "file_id": alice}]}]}, "file_id"),
        "websocket": ("ws", {"model": "m", "max_output_tokens": 16, "input": [
            {"role": "user", "content": [{"type": "input_file", "file_id": alice}]}]}, "file_id"),
        "passthrough": ("/v1/batches", {"input_file_id": alice, "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h"}, "input_file_id"),
    }


def _tricks(raw: bytes, member: bytes, alice: bytes, bob: bytes) -> dict[str, bytes]:
    """The attack's tricks, each applied to a body that names alice's file under ``member``."""
    named = b'"' + member + b'":"' + alice + b'"'  # as orjson writes it
    assert named in raw
    return {
        "plain": raw,
        "escaped name": raw.replace(named, b'"' + member.replace(b"_", b"\\u005f") + b'":"' + alice + b'"'),
        "duplicate, hers last": raw.replace(named, b'"' + member + b'":"' + bob + b'",' + named),
        "duplicate, hers first": raw.replace(named, named + b',"' + member + b'":"' + bob + b'"'),
        "NaN beside it": raw[:-1] + b', "x": NaN}',
        "a number past a double": raw[:-1] + b', "x": 1e400}',
        "too deep": raw[:-1] + b', "x": ' + _deep(200) + b"}",
        "a byte order mark": b"\xef\xbb\xbf" + raw,
    }


def _through(gw: Proc, entrance: str, path: str, body: bytes) -> int:
    """The status the entrance answers ``body`` with (a WebSocket message: its error event's, or 200)."""
    if entrance != "websocket":
        return _post(gw, path, body, "bob", {"content-type": "application/json"})[0]
    with connect(f"ws://127.0.0.1:{gw.port}/v1/responses", additional_headers=_h("bob")) as ws:
        ws.send(b'{"type": "response.create", ' + body.lstrip(b"\xef\xbb\xbf")[1:])
        event = orjson.loads(ws.recv(timeout=10))
        return int(event["status"]) if event["type"] == "error" else 200


def test_the_same_hostile_request_meets_the_same_admission_through_every_entrance(gw: Proc, ups: Upstreams) -> None:
    """Every trick above, through every entrance: refused before any upstream is asked (the duplicate key whose last
    copy names bob's own file is served, as the gateway read it: alice's id never reaches an upstream)."""
    alice, bob = _files(gw)
    before = len(_seen(ups))
    outcomes: dict[str, set[int]] = {}
    for entrance, (path, body, member) in _entrances(alice).items():
        for trick, raw in _tricks(orjson.dumps(body), member.encode(), alice.encode(), bob.encode()).items():
            if entrance == "websocket" and trick == "a byte order mark":
                continue  # a WebSocket text frame is UTF-8 text: no byte order mark to send
            status = _through(gw, entrance, path, raw)
            outcomes.setdefault(trick, set()).add(status // 100)
            assert (status >= 400) != (trick == "duplicate, hers first"), (entrance, trick, status)
    assert all(len(seen) == 1 for seen in outcomes.values()), outcomes  # the same outcome, whatever the entrance
    assert not any(alice.encode() in sent for sent in _seen(ups)[before:])


def test_a_list_answer_the_gateway_cannot_scope_is_never_shown(gw: Proc, ups: Upstreams) -> None:
    """An answer to a list path (``GET /v1/files``) that is no list (an odd shape, or not JSON though it says so)
    was relayed as it came, unfiltered: every key's objects, had the upstream sent them so. It is a 502."""
    from gateway.tools.emulator import Plan
    handler = ups["std"].handler
    for odd in (b'{"object": "list", "data": "file-of-alice"}', b'{"files": [{"id": "file-of-alice"}]}', b"[1,"):
        ups["std"].handler = lambda got, odd=odd: Plan(headers={"content-type": "application/json"},
                                                       parts=[(0, odd)], chunked=False)
        try:
            r = httpx.get(f"http://127.0.0.1:{gw.port}/v1/files", headers=_h("bob"), timeout=10)
        finally:
            ups["std"].handler = handler
        assert r.status_code == 502 and b"file-of-alice" not in r.content, (odd, r.status_code, r.text)
