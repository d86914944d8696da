"""``tiergate serve --workers 2``: the workers share the port, and /metrics (answered by either worker)
merges their samples so every request is counted exactly once; start-up warns that bridged Responses conversations
are per worker only when no Redis shares them."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import RedisServer, default_config, emulator, fast_directive, needs_redis, sample, start_gateway

PER_WORKER = "each worker keeps its own store of bridged Responses API conversations"


def test_two_workers_count_every_request_once(tmp_path: Path) -> None:
    fast = emulator("fast", tmp_path)
    standard = emulator("standard", tmp_path)
    cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1")
    gw, _ = start_gateway(cfg, tmp_path, extra=("--workers", "2"))
    children = Path(f"/proc/{gw.popen.pid}/task/{gw.popen.pid}/children").read_text().split()
    workers = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(workers) == 2, children  # uvicorn's supervisor spawned two worker processes
    try:
        base = f"http://127.0.0.1:{gw.port}"
        body = {"model": "gpt-5.6-sol-fast", "stream": True,
                "messages": [{"role": "user", "content": fast_directive(tokens=3, tps=3000, ttft_ms=1)}]}
        rids = set()
        for _ in range(40):
            # a new connection each time, so the kernel spreads them over both workers' accept queue
            with httpx.Client(timeout=10) as client:
                resp = client.post(base + "/v1/chat/completions", json=body)
                assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
                rids.add(resp.headers["x-request-id"])
        assert len(rids) == 40
        for _ in range(5):  # whichever worker answers the scrape, the merged counts are the same
            text = httpx.get(base + "/metrics", timeout=5).text
            assert sample(text, "tiergate_requests_total", missing_ok=False, tier="fast", outcome="success") == 40
            assert sample(text, "tiergate_time_to_first_token_seconds_count", missing_ok=False, tier="fast") == 40
            assert sample(text, "tiergate_tokens_total", missing_ok=False, tier="fast", token_type="output") == 120
            assert sample(text, "tiergate_in_flight_requests", missing_ok=False) == 0
    finally:
        gw.stop()
        fast.stop()
        standard.stop()


@needs_redis
def test_the_per_worker_conversations_warning_is_given_only_without_redis(tmp_path: Path,
                                                                          redis_server: RedisServer) -> None:
    """The fast upstream bridges the Responses API (Cerebras dialect). Without Redis each worker keeps its own
    conversations, and start-up says so; with ``state.redis_url`` every worker reads the shared store (a follow-up
    works on any worker), so it does not (it used to warn either way)."""
    fast = emulator("fast", tmp_path)
    standard = emulator("standard", tmp_path)
    cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1")
    assert cfg["upstreams"][0]["dialect"] == "cerebras"  # bridged by default
    logs = {}
    try:
        for name, extra in (("alone", {}), ("redis", {"state": {"redis_url": redis_server.url}})):
            gw, _ = start_gateway({**cfg, **extra}, tmp_path, extra=("--workers", "2"))
            gw.stop()
            logs[name] = gw.log.read_text()
    finally:
        fast.stop()
        standard.stop()
    assert PER_WORKER in logs["alone"], logs["alone"]
    assert PER_WORKER not in logs["redis"], logs["redis"]
