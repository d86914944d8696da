"""``SIGHUP`` reloads the config without a restart, over real sockets: a stream in flight finishes byte for byte on
the old config while new requests use the new one, metrics keep counting, and a broken file is rejected with the
start-up message while the old config keeps serving."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.tools.emulator import EmulatorThread, Plan

from conftest import Proc, chunk, sample, sse, start_gateway

SLOW = [(0.0, b"data: " + chunk(role=True).encode() + b"\n\n")] + [
    (0.1, b"data: " + chunk(f"t{i} ").encode() + b"\n\n") for i in range(15)] + [
    (0.0, sse(chunk(finish="stop"), chunk(usage=True)))]  # ~1.5 s of tokens
OK = sse(chunk(role=True), chunk("new"), chunk(finish="stop"), chunk(usage=True))


@pytest.fixture
def ups() -> Iterator[dict[str, EmulatorThread]]:
    up = {"a": EmulatorThread(lambda req: Plan(parts=SLOW)), "b": EmulatorThread(lambda req: Plan(parts=[(0, OK)]))}
    yield up
    for u in up.values():
        u.stop()


def _config(up: EmulatorThread, name: str, models: list[str]) -> dict[str, Any]:
    return {"upstreams": [{"name": name, "tier": "standard", "base_url": up.base_url,
                           "timeouts": {"connect": 1, "idle": 5, "total": 10}, "models": {m: m for m in models}}]}


def _events(proc: Proc, name: str) -> list[dict[str, Any]]:
    return [e for e in (json.loads(x) for x in proc.log.read_text().splitlines() if x.startswith("{"))
            if e.get("event") == name]


def _wait(what: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_a_reload_swaps_the_config_while_a_stream_finishes_on_the_old_one(ups: dict[str, EmulatorThread],
                                                                         tmp_path: Path) -> None:
    proc, path = start_gateway(_config(ups["a"], "old-up", ["m"]), tmp_path, extra=("--log-level", "info"))
    try:
        base = f"http://127.0.0.1:{proc.port}"
        body = {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "x"}]}
        got: dict[str, Any] = {}

        def stream() -> None:
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=10) as r:
                got["headers"], got["body"] = r.headers, r.read()
        t = threading.Thread(target=stream)
        t.start()
        _wait(lambda: ups["a"].requests)  # the stream is in flight on the old upstream
        path.write_text(yaml.safe_dump(_config(ups["b"], "new-up", ["m", "m2"])))
        proc.popen.send_signal(signal.SIGHUP)
        _wait(lambda: [e for e in _events(proc, "config_loaded") if e.get("reload")])
        r = httpx.post(base + "/v1/chat/completions", timeout=5, json={**body, "model": "m2"})
        assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "new-up"  # new requests: the new one
        assert t.is_alive()  # ... while the old stream still runs
        assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=5).json()["data"]] == ["m", "m2"]
        t.join(10)
        assert got["headers"]["x-tiergate-upstream"] == "old-up"
        assert got["body"] == b"".join(part for _, part in SLOW)  # byte for byte, to its end
        assert proc.popen.poll() is None  # the process kept running (SIGHUP's default would end it)
        text = httpx.get(base + "/metrics", timeout=5).text
        assert sample(text, "tiergate_requests_total", upstream="old-up", outcome="success", missing_ok=False) == 1
        assert sample(text, "tiergate_requests_total", upstream="new-up", outcome="success", missing_ok=False) == 1
    finally:
        proc.stop()


def test_a_broken_file_is_rejected_and_the_old_config_serves(ups: dict[str, EmulatorThread], tmp_path: Path) -> None:
    proc, path = start_gateway(_config(ups["b"], "up", ["m"]), tmp_path, extra=("--log-level", "info"))
    try:
        path.write_text("upstreams: [{name: up, tier: turbo}]\n")
        proc.popen.send_signal(signal.SIGHUP)
        rejected = _wait(lambda: _events(proc, "config_rejected"))
        assert rejected[0]["level"] == "error" and rejected[0]["reload"] is True
        assert str(path) in rejected[0]["problem"] and "tier" in rejected[0]["problem"]
        r = httpx.post(f"http://127.0.0.1:{proc.port}/v1/chat/completions", timeout=5,
                       json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "up"  # the old config, still serving
        assert proc.popen.poll() is None
    finally:
        proc.stop()




def _workers(proc: Proc) -> set[str]:
    """The pids of the supervisor's worker processes (uvicorn spawns them: ``spawn_main`` in their command line)."""
    pid = proc.popen.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = set()
    for child in children:
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.add(child)
        except OSError:  # it exited meanwhile
            pass
    return found


def test_with_workers_a_reload_replaces_each_worker_and_the_port_keeps_serving(ups: dict[str, EmulatorThread],
                                                                              tmp_path: Path) -> None:
    """``--workers 2``: SIGHUP goes to the supervisor (tiergate's subclass of uvicorn's), which replaces each worker
    with one that read the file again; then every request is served by the new config, and SIGTERM still ends it."""
    proc, path = start_gateway(_config(ups["b"], "old-up", ["m"]), tmp_path, extra=("--workers", "2"))
    try:
        before = _wait(lambda: _workers(proc) if len(_workers(proc)) == 2 else None)
        path.write_text(yaml.safe_dump(_config(ups["b"], "new-up", ["m"])))
        proc.popen.send_signal(signal.SIGHUP)
        # each replacement starts and is ready before the worker it replaces stops: generous for a loaded runner
        _wait(lambda: len(now := _workers(proc)) == 2 and not now & before, timeout=60)
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        for _ in range(10):  # a new connection each time: the kernel spreads them over both workers
            r = httpx.post(f"http://127.0.0.1:{proc.port}/v1/chat/completions", json=body, timeout=5)
            assert r.status_code == 200 and r.headers["x-tiergate-upstream"] == "new-up"
        proc.popen.send_signal(signal.SIGTERM)
        proc.popen.wait(30)
    finally:
        proc.stop()
