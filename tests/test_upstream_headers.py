"""What the gateway's upstream client (``gateway.upstream.client.UpstreamPool``) puts in every request's head, over real
HTTP to the emulator: its own ``User-Agent`` (never aiohttp's), ``Accept-Encoding: identity`` and the request id, on the
hot path and on a passthrough request. The session sets no ``skip_auto_headers`` of its own (it sent every request
down aiohttp's slow header path), so each request must name its own, or aiohttp's would go."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.config.upstreams import UpstreamConfig
from gateway.tools.emulator import EmulatorThread, Plan, Received
from gateway.upstream.client import UpstreamPool
from gateway.upstream.headers import USER_AGENT

WHOLE = Plan(headers={"content-type": "application/json"}, chunked=False, parts=[(0, b"{}")])


@pytest.fixture(scope="module")
def fake() -> Iterator[EmulatorThread]:
    up = EmulatorThread(lambda req: WHOLE if b'"stream":true' not in req.body else Plan(parts=[(0, b"data: 1\n\n")]))
    yield up
    up.stop()


@pytest.fixture
async def pool(fake: EmulatorThread) -> AsyncIterator[tuple[UpstreamPool, UpstreamConfig]]:
    cfg = UpstreamConfig.model_validate({"name": "fake", "tier": "fast", "base_url": fake.base_url,
                                         "api_key_env": None, "models": {"m": "m"}})
    p = UpstreamPool([cfg], {})
    await p.start()
    yield p, cfg
    await p.stop()


def _head(req: Received) -> dict[str, str]:
    return {k: v for k, v in req.headers.items() if k in ("user-agent", "accept-encoding", "x-client-request-id")}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_routed_request_names_the_gateway(pool: tuple[UpstreamPool, UpstreamConfig], fake: EmulatorThread,
                                                  stream: bool) -> None:
    p, cfg = pool
    resp = await p.send(cfg, b'{"model":"m","stream":%s}' % (b"true" if stream else b"false"), stream=stream,
                        request_id="rid-1")
    await resp.read()
    resp.release()
    assert _head(fake.requests[-1]) == {"user-agent": USER_AGENT, "accept-encoding": "identity",
                                        "x-client-request-id": "rid-1"}


async def test_a_passthrough_request_names_the_gateway_not_the_client_or_aiohttp(
        pool: tuple[UpstreamPool, UpstreamConfig], fake: EmulatorThread) -> None:
    p, cfg = pool
    resp = await p.send(cfg, b"{}", stream=False, request_id="rid-2", path="/embeddings",
                        forward={"user-agent": "client/1.0", "content-type": "application/json"})
    await resp.read()
    resp.release()
    got = fake.requests[-1]
    assert _head(got) == {"user-agent": USER_AGENT, "accept-encoding": "identity", "x-client-request-id": "rid-2"}
    assert "python" not in got.headers.get("user-agent", "").lower()
